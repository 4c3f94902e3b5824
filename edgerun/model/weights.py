"""A model's weights in one canonical layout, whatever file they came from.

Q and K rows are in Hugging Face order (each head's rotary pairs are (i, i + head_dim/2));
GGUF's interleaved Llama rows are put into this order on load and back on save.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from edgerun.model.config import Activation, ModelConfig
from edgerun.model.quant import QuantTensor

# What a model's block may hold beyond Llama's and Qwen2's (the names an engine that lacks one refuses it by).
QK_NORM, GELU_GATE, EMBED_SCALE, POST_NORMS, SLIDING_WINDOW, ROPE_FACTORS, ROPE_SCALING = (
    "query/key norms", "a GELU gate", "a scaled embedding", "post-attention/MLP norms", "sliding-window layers",
    "RoPE frequency factors", "linear RoPE scaling")


@dataclass(frozen=True)
class ExpertWeights:
    """One SwiGLU expert (or a qwen2moe shared expert)."""

    w_gate: QuantTensor  # (expert_ffn, hidden)
    w_up: QuantTensor  # (expert_ffn, hidden)
    w_down: QuantTensor  # (hidden, expert_ffn)

    def matrices(self) -> tuple[QuantTensor, QuantTensor, QuantTensor]:
        return self.w_gate, self.w_up, self.w_down

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.matrices())


@dataclass(frozen=True)
class MoeWeights:
    """A layer's mixture of experts: the router, the experts, and qwen2moe's shared expert with its gate."""

    router: QuantTensor  # (n_experts, hidden): each token's expert logits
    experts: tuple[ExpertWeights, ...]
    shared: ExpertWeights | None = None
    shared_gate: np.ndarray | None = None  # float32 (hidden,): sigmoid(x . shared_gate) scales the shared expert


@dataclass(frozen=True)
class LayerWeights:
    attn_norm: np.ndarray  # float32 (hidden,)
    wq: QuantTensor  # (q_dim, hidden)
    wk: QuantTensor  # (kv_dim, hidden)
    wv: QuantTensor  # (kv_dim, hidden)
    wo: QuantTensor  # (hidden, q_dim)
    bq: np.ndarray | None  # float32 biases, Qwen2 only
    bk: np.ndarray | None
    bv: np.ndarray | None
    ffn_norm: np.ndarray
    w_gate: QuantTensor | None  # (ffn, hidden); None in a mixture-of-experts layer
    w_up: QuantTensor | None  # (ffn, hidden)
    w_down: QuantTensor | None  # (hidden, ffn)
    moe: MoeWeights | None = None
    q_norm: np.ndarray | None = None  # float32 (head_dim,), qwen3moe: each head's query and key normalized
    k_norm: np.ndarray | None = None
    attn_post_norm: np.ndarray | None = None  # float32 (hidden,), gemma3: attention's output normalized again
    ffn_post_norm: np.ndarray | None = None  # float32 (hidden,), gemma3: the MLP's output normalized again
    # LoRA additions (edgerun tune): field name ("wq", ...) -> (A (rank, in), B (out, rank) times alpha/rank).
    # Engines add ((x @ A.T) @ B.T) beside the quantized product; nothing folds them into the matrix.
    lora: tuple[tuple[str, np.ndarray, np.ndarray], ...] = ()

    def matrices(self) -> Iterator[tuple[str, QuantTensor]]:
        yield from (("wq", self.wq), ("wk", self.wk), ("wv", self.wv), ("wo", self.wo))
        if self.moe is None:
            yield from (("w_gate", self.w_gate), ("w_up", self.w_up), ("w_down", self.w_down))
            return
        yield "router", self.moe.router
        for e, expert in enumerate(self.moe.experts):
            yield from ((f"expert{e}.w_gate", expert.w_gate), (f"expert{e}.w_up", expert.w_up),
                        (f"expert{e}.w_down", expert.w_down))
        if self.moe.shared is not None:
            yield from (("shared.w_gate", self.moe.shared.w_gate), ("shared.w_up", self.moe.shared.w_up),
                        ("shared.w_down", self.moe.shared.w_down))


@dataclass(frozen=True)
class ModelWeights:
    token_embd: QuantTensor  # (vocab, hidden)
    layers: tuple[LayerWeights, ...]
    output_norm: np.ndarray
    output: QuantTensor  # (vocab, hidden); the same object as token_embd when tied
    # The LoRA adapter on the layers (LayerWeights.lora), if any: part of a built graph's identity.
    adapter_sha256: str = ""
    # Llama 3.1/3.2: each rotary pair's frequency divided by its factor (head_dim/2 floats, the file's rope_freqs)
    rope_freqs: np.ndarray | None = None

    def matrix_bytes(self) -> int:
        """Bytes of every matrix a decode step reads (the embedding table is only indexed)."""
        layers = sum(t.nbytes for layer in self.layers for _, t in layer.matrices())
        return layers + self.output.nbytes


def rope_rows_from_interleaved(n_heads: int, rows: int) -> np.ndarray:
    """Row index that turns GGUF's interleaved Q/K rows into Hugging Face order.

    llama.cpp's converter stores, per head, row 2j+s for Hugging Face row s*(head_dim/2)+j.
    """
    half = rows // n_heads // 2
    return np.arange(rows).reshape(n_heads, half, 2).transpose(0, 2, 1).reshape(-1)


def rope_rows_to_interleaved(n_heads: int, rows: int) -> np.ndarray:
    """The inverse of `rope_rows_from_interleaved`."""
    return np.argsort(rope_rows_from_interleaved(n_heads, rows))


def features(config: ModelConfig, weights: ModelWeights) -> list[str]:
    """What this model's blocks hold beyond Llama's and Qwen2's (Qwen3's query/key norms, Gemma's GELU gate, scaled
    embedding, post norms and windowed layers, Llama 3's RoPE factors)."""
    present = {QK_NORM: config.qk_norm, GELU_GATE: config.activation != Activation.SILU,
               EMBED_SCALE: config.embed_scale != 1.0 or config.query_scale != 0.0, POST_NORMS: config.post_norms,
               SLIDING_WINDOW: config.sliding_window > 0, ROPE_FACTORS: weights.rope_freqs is not None,
               ROPE_SCALING: config.rope_scale != 1.0}
    return [name for name, held in present.items() if held]


def embed_rows(config: ModelConfig, weights: ModelWeights, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids -> their rows of the embedding, float32, times the model's embedding scale (Gemma's sqrt(hidden),
    in float32 as llama.cpp scales them)."""
    rows = weights.token_embd.dequantize_rows(np.asarray(tokens, np.int64))
    return rows * np.float32(config.embed_scale) if config.embed_scale != 1.0 else rows


def lacking(config: ModelConfig, weights: ModelWeights, what: str, has: frozenset[str] = frozenset()) -> str | None:
    """One line saying why `what` does not run this model (the features it lacks of those the model holds), or
    None where it lacks none."""
    missing = [f for f in features(config, weights) if f not in has]
    if not missing:
        return None
    return f"{what} does not compute {', '.join(missing)} ({config.architecture})"
