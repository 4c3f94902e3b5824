"""Synthetic models: any Llama or Qwen2 shape with seeded random weights, written as GGUF or as a
Hugging Face directory, for tests and for speed benchmarks at real sizes.

The vocabulary is byte-level (every byte is a token; its one merge, which llama.cpp's loader needs, joins two
bytes UTF-8 never holds), plus the chat tokens and unused filler tokens up to the vocabulary size, so any text
encodes and the chat template works.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from edgerun.model import gguf_file, hf_dir
from edgerun.model.config import Activation, ModelConfig
from edgerun.model.quant import quantize
from edgerun.model.tokenizer import Tokenizer, Vocabulary
from edgerun.model.weights import ExpertWeights, LayerWeights, ModelWeights, MoeWeights

# Llama 3.2 1B / 3B and Llama 3.1 8B shapes; "tiny" is for tests (every dimension a multiple of
# 256, so K-quants apply).
SHAPES: dict[str, ModelConfig] = {
    "tiny": ModelConfig("llama", 2, 256, 512, 4, 2, 64, 512, 10000.0, 1e-5, 512, True, False),
    # The shipped model's shape, for machines where the shipped file is absent.
    "smollm2": ModelConfig("llama", 30, 576, 1536, 9, 3, 64, 49152, 100000.0, 1e-5, 8192, True, False),
    "1b": ModelConfig("llama", 16, 2048, 8192, 32, 8, 64, 128256, 500000.0, 1e-5, 8192, True, False),
    "3b": ModelConfig("llama", 28, 3072, 8192, 24, 8, 128, 128256, 500000.0, 1e-5, 8192, True, False),
    "8b": ModelConfig("llama", 32, 4096, 14336, 32, 8, 128, 128256, 500000.0, 1e-5, 8192, False, False),
    # Mixtures of experts. moe-tiny is for tests: Qwen3-MoE's layout (per-head query/key norms, top-k routing
    # with renormalized gates) at 16 experts, 4 per token. qwen3-30b-a3b is the real shape of the MoEx paper's model
    # family (48 layers, hidden 2048, 128 experts of width 768, 8 per token): cut it with --layers to benchmark.
    "moe-tiny": ModelConfig("qwen3moe", 2, 256, 512, 4, 2, 64, 512, 10000.0, 1e-6, 512, False, False,
                            n_experts=16, n_experts_used=4, expert_ffn=256, qk_norm=True),
    "qwen3-30b-a3b": ModelConfig("qwen3moe", 48, 2048, 6144, 32, 4, 128, 151936, 1000000.0, 1e-6, 40960, False,
                                 False, n_experts=128, n_experts_used=8, expert_ffn=768, qk_norm=True),
    # The dense families of small devices, at their real shapes (cut them with --layers).
    "qwen3-0.6b": ModelConfig("qwen3", 28, 1024, 3072, 16, 8, 128, 151936, 1000000.0, 1e-6, 40960, True, False,
                              qk_norm=True),
    "qwen3-4b": ModelConfig("qwen3", 36, 2560, 9728, 32, 8, 128, 151936, 1000000.0, 1e-6, 40960, True, False,
                            qk_norm=True),
    "gemma3-270m": ModelConfig("gemma3", 18, 640, 2048, 4, 1, 256, 262144, 1000000.0, 1e-6, 32768, True, False,
                               qk_norm=True, activation=Activation.GELU_TANH, post_norms=True, sliding_window=512,
                               window_pattern=6),
    "gemma3-1b": ModelConfig("gemma3", 26, 1152, 6912, 4, 1, 256, 262144, 1000000.0, 1e-6, 32768, True, False,
                             qk_norm=True, activation=Activation.GELU_TANH, post_norms=True, sliding_window=512,
                             window_pattern=6),
    # Gemma 3 4B: a 1024-position window, and linear RoPE scaling (factor 8) on its global layers
    "gemma3-4b": ModelConfig("gemma3", 34, 2560, 10240, 8, 4, 256, 262208, 1000000.0, 1e-6, 131072, True, False,
                             qk_norm=True, activation=Activation.GELU_TANH, post_norms=True, sliding_window=1024,
                             window_pattern=6, rope_scale=0.125),
    "llama3.2-1b": ModelConfig("llama", 16, 2048, 8192, 32, 8, 64, 128256, 500000.0, 1e-5, 131072, True, False),
    "llama3.1-8b": ModelConfig("llama", 32, 4096, 14336, 32, 8, 128, 128256, 500000.0, 1e-5, 131072, False, False),
    "phi3-mini": ModelConfig("phi3", 32, 3072, 8192, 32, 32, 96, 32064, 10000.0, 1e-5, 4096, False, False),
}
# Llama 3's RoPE frequency factors (Meta's rule, as converters write rope_freqs): the shape's scaling factor, with
# low/high frequency factors 1 and 4 over an original context of 8192.
LLAMA3_ROPE_SCALING = {"llama3.2-1b": 32.0, "llama3.1-8b": 8.0}
CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_UNUSED = 1, 3, 5


@dataclass(frozen=True)
class SynthSpec:
    config: ModelConfig
    qtype: str = "Q4_0"
    seed: int = 0
    std: float = 0.02  # weight scale, as in common initializations
    embedding_qtype: str | None = None  # None: as llama.cpp's quantizer picks for `qtype` (Q8_0 for 4-bit ones)
    rope_scaling: float = 0.0  # Llama 3's RoPE scaling factor, written as rope_freqs (0: none)

    @property
    def embedding(self) -> str:
        return self.embedding_qtype or _embedding_qtype(self.qtype)


def byte_symbols() -> list[str]:
    """Byte-level BPE's printable stand-in for each byte value (GPT-2's byte-to-unicode table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def synth_vocabulary(vocab_size: int) -> Vocabulary:
    if vocab_size < 256 + len(CHAT_TOKENS):
        raise ValueError(f"vocabulary of {vocab_size} is too small: needs {256 + len(CHAT_TOKENS)} or more")
    tokens = byte_symbols() + list(CHAT_TOKENS)
    types = [TOKEN_NORMAL] * 256 + [TOKEN_CONTROL] * len(CHAT_TOKENS)
    # One merge, of the bytes 0xFE and 0xFF, which UTF-8 text never holds: llama.cpp refuses a BPE vocabulary
    # without merges, and this one changes no tokenization of any text.
    first, second = byte_symbols()[0xFE], byte_symbols()[0xFF]
    merged = [first + second] if vocab_size > len(tokens) else []
    tokens += merged
    types += [TOKEN_NORMAL] * len(merged)
    fill = vocab_size - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(fill)]
    types += [TOKEN_UNUSED] * fill
    return Vocabulary(tokens=tokens, token_types=types, merges=[f"{first} {second}"] if merged else [],
                      pre="default", bos_id=256, eos_id=258, chat_template=CHAT_TEMPLATE)


# Mixes of types, as llama.cpp's quantizer writes them: the base type for most matrices, more bits for the LM head
# and, in some layers, attn_v and ffn_down (the first and last eighth of the layers and every third between).
MIXES = {"Q4_K_M": ("Q4_K", "Q6_K")}
# A K-quant's 256-wide blocks need rows of a multiple of 256: llama.cpp's quantizer falls back to these.
K_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}


def llama3_rope_freqs(head_dim: int, base: float, factor: float, low: float = 1.0, high: float = 4.0,
                      original_context: int = 8192) -> np.ndarray:
    """Llama 3's per-pair RoPE frequency divisors: 1 for short wavelengths, `factor` for long ones, a smooth blend
    between."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (original_context / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    factors = np.where(wavelen < original_context / high, 1.0,
                       np.where(wavelen > original_context / low, factor, blended))
    return factors.astype(np.float32)


def more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down a _M mix keeps in its larger type."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def synth_weights(spec: SynthSpec) -> ModelWeights:
    c = spec.config
    rng = np.random.default_rng(spec.seed)
    base, more = MIXES.get(spec.qtype, (spec.qtype, spec.qtype))

    def matrix(rows: int, cols: int, qtype: str = base):
        if cols % 256 and spec.qtype in MIXES:  # a mix, as llama.cpp's quantizer; one named type is taken as asked
            qtype = K_FALLBACK.get(qtype, qtype)
        return quantize(rng.standard_normal((rows, cols), dtype=np.float32) * spec.std, qtype)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def bias(n: int) -> np.ndarray | None:
        return (0.1 * rng.standard_normal(n)).astype(np.float32) if c.qkv_bias else None

    def expert(width: int) -> ExpertWeights:
        return ExpertWeights(matrix(width, c.hidden), matrix(width, c.hidden), matrix(c.hidden, width))

    def moe() -> MoeWeights:
        # The router in float32, as converters keep it: a quantized router flips near-tied expert choices.
        router = quantize(rng.standard_normal((c.n_experts, c.hidden), dtype=np.float32) * 0.5, "F32")
        experts = tuple(expert(c.expert_ffn) for _ in range(c.n_experts))
        if not c.shared_expert_ffn:
            return MoeWeights(router, experts)
        return MoeWeights(router, experts, expert(c.shared_expert_ffn),
                          (0.1 * rng.standard_normal(c.hidden)).astype(np.float32))

    def layer(i: int) -> LayerWeights:
        wide = more if more_bits(i, c.n_layers) else base
        fused = c.architecture == "phi3"  # Q, K and V in one matrix: one type
        attn = dict(attn_norm=norm(c.hidden), wq=matrix(c.q_dim, c.hidden), wk=matrix(c.kv_dim, c.hidden),
                    wv=matrix(c.kv_dim, c.hidden, base if fused else wide), wo=matrix(c.hidden, c.q_dim),
                    bq=bias(c.q_dim), bk=bias(c.kv_dim), bv=bias(c.kv_dim), ffn_norm=norm(c.hidden))
        if c.qk_norm:
            attn |= dict(q_norm=norm(c.head_dim), k_norm=norm(c.head_dim))
        if c.post_norms:
            attn |= dict(attn_post_norm=norm(c.hidden), ffn_post_norm=norm(c.hidden))
        if c.is_moe:
            return LayerWeights(**attn, w_gate=None, w_up=None, w_down=None, moe=moe())
        return LayerWeights(**attn, w_gate=matrix(c.ffn, c.hidden), w_up=matrix(c.ffn, c.hidden),
                            w_down=matrix(c.hidden, c.ffn, wide))

    layers = tuple(layer(i) for i in range(c.n_layers))
    embedding = K_FALLBACK.get(spec.embedding, spec.embedding) if c.hidden % 256 and spec.qtype in MIXES \
        else spec.embedding
    # Scaled up so that random logits are not flat.
    embd = quantize(rng.standard_normal((c.vocab_size, c.hidden), dtype=np.float32), embedding)
    output = embd if c.tied_embeddings else matrix(c.vocab_size, c.hidden, more)
    rope_freqs = None
    if spec.rope_scaling:
        rope_freqs = llama3_rope_freqs(c.head_dim, c.rope_base, spec.rope_scaling)
    return ModelWeights(token_embd=embd, layers=layers, output_norm=norm(c.hidden), output=output,
                        rope_freqs=rope_freqs)


def shape_only_weights(config: ModelConfig, qtype: str) -> ModelWeights:
    """Weights with the right types and sizes but no data (zero-stride views): enough for planning
    and memory arithmetic at shapes too large to generate, such as 8B."""
    from edgerun.model.quant import QuantTensor, block_shape

    def matrix(rows: int, cols: int, t: str = qtype) -> QuantTensor:
        block, size = block_shape(t)
        return QuantTensor(t, (rows, cols), np.broadcast_to(np.zeros(1, np.uint8), (rows, cols // block * size)))

    c = config
    ones = np.ones(c.hidden, np.float32)
    bias = (lambda n: np.zeros(n, np.float32)) if c.qkv_bias else (lambda n: None)
    layer = LayerWeights(attn_norm=ones, wq=matrix(c.q_dim, c.hidden), wk=matrix(c.kv_dim, c.hidden),
                         wv=matrix(c.kv_dim, c.hidden), wo=matrix(c.hidden, c.q_dim), bq=bias(c.q_dim),
                         bk=bias(c.kv_dim), bv=bias(c.kv_dim), ffn_norm=ones, w_gate=matrix(c.ffn, c.hidden),
                         w_up=matrix(c.ffn, c.hidden), w_down=matrix(c.hidden, c.ffn))
    embd = matrix(c.vocab_size, c.hidden, _embedding_qtype(qtype))
    output = embd if c.tied_embeddings else matrix(c.vocab_size, c.hidden)
    return ModelWeights(token_embd=embd, layers=(layer,) * c.n_layers, output_norm=ones, output=output)


def _embedding_qtype(qtype: str) -> str:
    if qtype in MIXES:  # the LM head's type, which a tied embedding is
        return MIXES[qtype][1]
    # As llama.cpp does, the embedding of a 4-bit model keeps more precision.
    return "Q8_0" if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K") else qtype


def write_synthetic(spec: SynthSpec, out: Path, fmt: str) -> None:
    """Write a synthetic model as "gguf" (one file) or "hf" (a directory, float types only)."""
    vocab = synth_vocabulary(spec.config.vocab_size)
    weights = synth_weights(spec)
    # The architecture is in the file's metadata, not in its name: llama.cpp gives a Phi-3 by name ("phi3") token
    # attributes that a byte-level vocabulary's missing "</s>" fails.
    name = f"synthetic-{spec.config.n_layers}L-{spec.config.hidden}-{spec.qtype}"
    if fmt == "gguf":
        out.parent.mkdir(parents=True, exist_ok=True)
        gguf_file.write_gguf(out, spec.config, weights, vocab, name)
    elif fmt == "hf":
        hf_dir.write_hf_dir(out, spec.config, weights)
        Tokenizer.from_vocabulary(vocab).backend.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": vocab.tokens[vocab.bos_id], "eos_token": vocab.tokens[vocab.eos_id],
            "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
        }, indent=2) + "\n")
    else:
        raise ValueError(f"unknown output format {fmt!r} (gguf or hf)")


def custom_shape(base: str, **overrides: object) -> ModelConfig:
    """A named shape with some dimensions replaced (None values are ignored); Gemma's scales follow its hidden
    size and head size."""
    if base not in SHAPES:
        raise ValueError(f"unknown shape {base!r} (choose from {', '.join(SHAPES)})")
    config = replace(SHAPES[base], **{k: v for k, v in overrides.items() if v is not None})
    if config.architecture == "gemma3":
        config = replace(config, embed_scale=float(np.sqrt(np.float32(config.hidden))),
                         query_scale=1.0 / float(np.sqrt(config.head_dim)))
    return config


# Small files of each model family beside Llama/Qwen2 (and Gemma 3 4B's linear RoPE scaling), for the quality
# checks against llama.cpp (its greedy ids after FAMILY_PROMPTS are fixtures, scripts/llamacpp_fixtures.py
# --synthetic): 4 layers of hidden 256, an untied head (a tied one of random weights mostly repeats the last token),
# Q4_K_M; Gemma's window is 6 positions on every other layer, so that short prompts cross it.
_SMALL = dict(n_layers=4, hidden=256, ffn=512, n_heads=4, head_dim=64, vocab_size=1024, tied_embeddings=False)
FAMILIES: dict[str, SynthSpec] = {
    "qwen3": SynthSpec(custom_shape("qwen3-0.6b", n_kv_heads=2, **_SMALL), "Q4_K_M", seed=1),
    "gemma3": SynthSpec(custom_shape("gemma3-270m", n_kv_heads=1, sliding_window=6, window_pattern=2, **_SMALL),
                        "Q4_K_M", seed=1),
    # weights large enough that attention, and so its rotation's scale, sways the tokens
    "gemma3-4b": SynthSpec(custom_shape("gemma3-4b", n_kv_heads=2, sliding_window=6, window_pattern=2, **_SMALL),
                           "Q4_K_M", seed=1, std=0.1),
    "llama3": SynthSpec(custom_shape("llama3.2-1b", n_kv_heads=2, **_SMALL), "Q4_K_M", seed=1,
                        rope_scaling=LLAMA3_ROPE_SCALING["llama3.2-1b"]),
    "phi3": SynthSpec(custom_shape("phi3-mini", n_kv_heads=4, **_SMALL), "Q4_K_M", seed=1),
}
FAMILY_PROMPTS = (tuple(range(40, 60)), (72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33))


def write_family(family: str, out: Path) -> Path:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (choose from {', '.join(FAMILIES)})")
    write_synthetic(FAMILIES[family], out, "gguf")
    return out
