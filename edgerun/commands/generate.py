"""`edgerun generate`: text from a prompt on this machine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from edgerun.errors import EdgerunError

if TYPE_CHECKING:
    pass
from edgerun.commands.common import model_arg, sampling_args, sampling_params, threads_arg


def cmd_generate(args: argparse.Namespace) -> None:
    from edgerun.model.generate import default_engine, generate, make_engine
    from edgerun.model.loader import load_model
    from edgerun.model.sampling import Sampler

    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    if not args.prompt.strip():
        raise EdgerunError("the prompt is empty")
    if args.max_tokens < 1:
        raise EdgerunError("--max-tokens must be at least 1")
    params = sampling_params(args)
    model = load_model(args.model)
    if args.adapter is not None:
        from edgerun.tune.lora import apply_adapter

        model = apply_adapter(model, args.adapter)
    tok = model.tokenizer
    text = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": args.prompt}]
        try:
            text = tok.apply_chat_template(messages)
        except ValueError as e:
            raise EdgerunError(f"--chat: {e}") from e
    prompt = tok.encode(text)
    if len(prompt) + args.max_tokens > model.config.context_length:
        raise EdgerunError(f"prompt ({len(prompt)} tokens) plus --max-tokens {args.max_tokens} exceeds the model's "
                           f"context of {model.config.context_length} tokens")
    max_len = len(prompt) + args.max_tokens + 1
    args.engine = args.engine or default_engine(model)
    engine = make_engine(args.engine, model, max_len, threads=args.threads, device=args.device)
    stream = tok.stream_decoder()

    def emit(token: int) -> None:
        sys.stdout.write(stream.push(token))
        sys.stdout.flush()

    if not args.chat:
        sys.stdout.write(args.prompt)
    result = generate(engine, prompt, args.max_tokens, Sampler(params), tok.stop_ids, on_token=emit)
    sys.stdout.write(stream.flush() + "\n")
    sys.stdout.flush()
    if not args.quiet:
        print(f"[{args.engine}] {result.prompt_tokens} prompt tokens at "
              f"{result.prompt_tokens / result.prefill_s:.1f} tok/s, {len(result.tokens)} generated at "
              f"{result.decode_tok_s:.1f} tok/s, stopped by {result.stop_reason.value}", file=sys.stderr)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from edgerun.model.generate import ENGINES

    p = sub.add_parser("generate", help="generate text on this machine",
                       description="Generate text from a prompt on this machine, streaming tokens to stdout.")
    p.add_argument("prompt", help="the prompt text; - reads it from standard input (a multi-line prompt, such as "
                   "the held-out prompt `edgerun tune` writes)")
    model_arg(p)
    p.add_argument("--adapter", type=Path, default=None,
                   help="a LoRA adapter directory written by `edgerun tune` (its adapter/), added to the model's "
                        "projections; refused if it was trained on another model (default: none)")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    sampling_args(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat (default: the template's own)")
    p.add_argument("--engine", choices=ENGINES, default=None,
                   help="ggml: llama.cpp's kernels on the file's blocks as stored, activations quantized as "
                        "llama.cpp quantizes them (its answers; dense models without adapters); onnx: onnxruntime "
                        "with int8 activations; onnx-f32: float32 activations (3-4x slower, the reference's numbers "
                        "to rounding); numpy: the reference forward pass (default: ggml, or onnx where ggml does not "
                        "run the model: mixtures of experts, --adapter)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the ggml engine computes: cuda builds ggml's CUDA backend once with nvcc (minutes) "
                        "and runs the model on the first GPU (default: cpu)")
    threads_arg(p)
    p.add_argument("--quiet", action="store_true", help="do not print speed on stderr (default: print it)")
    p.set_defaults(func=cmd_generate)
