"""The numpy reference forward pass: the oracle every distributed mode is checked against.

Weights are dequantized to float32 once at start-up, so the arithmetic is plain and easy to read.
Each block can report its input and its output split into the parts that tensor-parallel nodes
compute: one part per attention head (that head's slice of the output projection) and one part
per MLP neuron group (`group_size` intermediate rows of gate/up with the matching columns of
down). The parts sum to the block's output.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgerun.model.config import Activation, ModelConfig
from edgerun.model.weights import ExpertWeights, LayerWeights, ModelWeights, MoeWeights, embed_rows


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rms_norm_fast(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """rms_norm in a third of the time for one row (a decode step, on a tensor-parallel master's per-block path):
    one dot product and two multiplies instead of five array operations. It rounds differently, by about one
    ulp. Each numpy call counts: right after a block's kernel has streamed megabytes of weights through the
    caches, one costs 10-20 µs, not 1-2 (this function: 61 µs there against 9 in a loop, on a 2-vCPU
    virtual machine), so the sum of squares is one vdot of the row and its square root a float's."""
    if x.shape[0] != 1:
        return rms_norm(x, weight, eps)
    return x * (weight * np.float32(1.0 / math.sqrt(float(np.vdot(x, x)) / x.shape[1] + eps)))


def rope_tables(head_dim: int, base: float, positions: np.ndarray,
                factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin, (len(positions), head_dim/2), for rotate-half RoPE; `factors` divide each pair's frequency
    (Llama 3's rope_freqs)."""
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors is not None:
        inv_freq = inv_freq / factors.astype(np.float64)
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: (seq, heads, head_dim), pairs (i, i + head_dim/2) rotate together."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (Gemma's gelu_pytorch_tanh), in float32."""
    c = np.float32(np.sqrt(2.0 / np.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


ACTIVATIONS = {Activation.SILU: silu, Activation.GELU_TANH: gelu_tanh}


def causal_mask(positions: np.ndarray, end: int, window: int) -> np.ndarray:
    """(len(positions), end) booleans, True where a query at that position must not see that key: a later one, or
    (a windowed layer's) one `window` or more positions back."""
    keys = np.arange(end)[None, :]
    masked = keys > positions[:, None]
    return masked | (positions[:, None] - keys >= window) if window else masked


def n_groups(ffn: int, group_size: int) -> int:
    return -(-ffn // group_size)


class BlockHooks:
    """Receives what each block sees and produces; subclass and override what you need.

    Partial outputs are only computed when `wants_partials` is true: they cost a matmul per part.
    """

    wants_partials = False

    def attention_input(self, layer: int, x_norm: np.ndarray) -> None:
        """The normalized hidden state entering attention, (seq, hidden)."""

    def mlp_input(self, layer: int, x_norm: np.ndarray) -> None:
        """The normalized hidden state entering the MLP, (seq, hidden)."""

    def head_outputs(self, layer: int, parts: np.ndarray) -> np.ndarray | None:
        """Each attention head's contribution to the block output, (n_heads, seq, hidden). Return an
        output to use instead of the full one (to model lost parts), or None."""

    def group_outputs(self, layer: int, parts: np.ndarray) -> np.ndarray | None:
        """Each MLP neuron group's contribution to the block output, (n_groups, seq, hidden). Return
        an output to use instead of the full one, or None."""

    def expert_kept(self, layer: int, chosen: np.ndarray) -> np.ndarray | None:
        """Which of each token's chosen experts (seq, k) count (False: it missed its deadline; the gates of those
        that count are scaled to the full sum, as a MoEx hub does). None: all of them."""


@dataclass
class DenseExpert:
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray

    @classmethod
    def from_weights(cls, w: ExpertWeights) -> DenseExpert:
        return cls(w.w_gate.dequantize(), w.w_up.dequantize(), w.w_down.dequantize())

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return (silu(x @ self.w_gate.T) * (x @ self.w_up.T)) @ self.w_down.T


@dataclass
class DenseMoe:
    router: np.ndarray  # (n_experts, hidden)
    experts: list[DenseExpert]
    shared: DenseExpert | None
    shared_gate: np.ndarray | None

    def shared_output(self, x: np.ndarray) -> np.ndarray | float:
        """qwen2moe's shared expert, scaled by its sigmoid gate; 0 where the model has none."""
        if self.shared is None:
            return 0.0
        return self.shared(x) / (1.0 + np.exp(-(x @ self.shared_gate)[:, None]))

    @classmethod
    def from_weights(cls, w: MoeWeights, experts: bool = True) -> DenseMoe:
        """`experts=False`: the router and the shared expert only (a MoEx hub, whose experts are on workers)."""
        return cls(w.router.dequantize(), [DenseExpert.from_weights(e) for e in w.experts] if experts else [],
                   None if w.shared is None else DenseExpert.from_weights(w.shared), w.shared_gate)


def kept_gate_scale(weights: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Per token, the factor that brings the gates of its kept experts (`kept`, (seq, k) booleans) up to the full
    sum of its gates: the experts that count stand in for those dropped (a missed expert deadline). 0 for a token
    none of whose experts was kept: it keeps only its residual."""
    part = np.where(kept, weights, 0).sum(axis=1)
    return np.where(part > 0, weights.sum(axis=1) / np.maximum(part, 1e-30), 0).astype(np.float32)


def route(logits: np.ndarray, k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each token's k experts and their weights, (seq, k) each: the softmax over all experts' logits, the k
    largest kept (ties to the lower index, as a stable sort), renormalized to sum to one where the model says so."""
    probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, chosen, axis=-1)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return chosen, weights.astype(np.float32)


@dataclass
class DenseLayer:
    """One layer's weights dequantized to float32."""

    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    ffn_norm: np.ndarray
    w_gate: np.ndarray | None
    w_up: np.ndarray | None
    w_down: np.ndarray | None
    moe: DenseMoe | None = None
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    attn_post_norm: np.ndarray | None = None
    ffn_post_norm: np.ndarray | None = None

    @classmethod
    def from_weights(cls, w: LayerWeights, experts: bool = True) -> DenseLayer:
        dense = w.moe is None
        layer = cls(
            attn_norm=w.attn_norm, wq=w.wq.dequantize(), wk=w.wk.dequantize(), wv=w.wv.dequantize(),
            wo=w.wo.dequantize(), bq=w.bq, bk=w.bk, bv=w.bv, ffn_norm=w.ffn_norm,
            w_gate=w.w_gate.dequantize() if dense else None, w_up=w.w_up.dequantize() if dense else None,
            w_down=w.w_down.dequantize() if dense else None,
            moe=None if dense else DenseMoe.from_weights(w.moe, experts), q_norm=w.q_norm, k_norm=w.k_norm,
            attn_post_norm=w.attn_post_norm, ffn_post_norm=w.ffn_post_norm,
        )
        for name, a, b in w.lora:  # the reference folds a LoRA adapter in: W + B @ A (B carries alpha/rank)
            setattr(layer, name, getattr(layer, name) + b @ a)
        return layer


class KVCache:
    """Keys and values per layer, (n_kv_heads, max_len, head_dim), filled up to `length`."""

    def __init__(self, config: ModelConfig, max_len: int) -> None:
        shape = (config.n_layers, config.n_kv_heads, max_len, config.head_dim)
        self.k = np.zeros(shape, np.float32)
        self.v = np.zeros(shape, np.float32)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


class ReferenceModel:
    """Prefill and decode with a KV cache, in numpy."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, group_size: int = 256,
                 experts: bool = True) -> None:
        """`experts=False`: a mixture of experts' experts stay undequantized (they run elsewhere)."""
        self.config = config
        self.group_size = group_size
        self.layers = [DenseLayer.from_weights(layer, experts) for layer in weights.layers]
        self.weights = weights
        self.output_norm = weights.output_norm
        self.output = weights.output.dequantize()
        self.rope_freqs = weights.rope_freqs
        self.act = ACTIVATIONS[config.activation]

    @property
    def weight_bytes(self) -> int:
        """Bytes of float32 matrices one decode step reads (a mixture of experts: its router and the experts
        one token takes)."""
        first = self.layers[0]
        per_layer = sum(getattr(first, f).nbytes for f in ("wq", "wk", "wv", "wo"))
        if first.moe is None:
            per_layer += first.w_gate.nbytes + first.w_up.nbytes + first.w_down.nbytes
        else:
            c = self.config
            per_layer += first.moe.router.nbytes + c.n_experts_used * 3 * c.hidden * c.expert_ffn * 4
            if first.moe.shared is not None:
                shared = first.moe.shared
                per_layer += shared.w_gate.nbytes + shared.w_up.nbytes + shared.w_down.nbytes
        return per_layer * len(self.layers) + self.output.nbytes

    def new_cache(self, max_len: int) -> KVCache:
        return KVCache(self.config, max_len)

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        return embed_rows(self.config, self.weights, tokens)

    def forward(self, tokens: Sequence[int], cache: KVCache, hooks: BlockHooks | None = None,
                all_logits: bool = False) -> np.ndarray:
        """Run `tokens` after what the cache holds; return logits for the last token, (vocab,),
        or for every token, (seq, vocab), with `all_logits`."""
        start = cache.length
        if start + len(tokens) > cache.max_len:
            raise ValueError(f"context of {cache.max_len} tokens exceeded")
        x = self.embed(tokens)
        c = self.config
        positions = np.arange(start, start + len(tokens))
        rotations = {c.rotation_of(i) for i in range(len(self.layers))}
        tables = {(base, scale): rope_tables(c.head_dim, base, positions * scale, self.rope_freqs)
                  for base, scale in rotations}
        for i, layer in enumerate(self.layers):
            cos, sin = tables[c.rotation_of(i)]
            out = self.attention(i, layer, rms_norm(x, layer.attn_norm, c.norm_eps), cache, cos, sin, hooks)
            x = x + (out if layer.attn_post_norm is None else rms_norm(out, layer.attn_post_norm, c.norm_eps))
            out = self.mlp(i, layer, rms_norm(x, layer.ffn_norm, c.norm_eps), hooks)
            x = x + (out if layer.ffn_post_norm is None else rms_norm(out, layer.ffn_post_norm, c.norm_eps))
        cache.length = start + len(tokens)
        if not all_logits:
            x = x[-1:]
        logits = rms_norm(x, self.output_norm, self.config.norm_eps) @ self.output.T
        return logits if all_logits else logits[0]

    def attention(self, index: int, layer: DenseLayer, x: np.ndarray, cache: KVCache,
                  cos: np.ndarray, sin: np.ndarray, hooks: BlockHooks | None) -> np.ndarray:
        c = self.config
        seq = x.shape[0]
        if hooks:
            hooks.attention_input(index, x)
        q, k, v = x @ layer.wq.T, x @ layer.wk.T, x @ layer.wv.T
        if layer.bq is not None:
            q, k, v = q + layer.bq, k + layer.bk, v + layer.bv
        q, k = q.reshape(seq, c.n_heads, c.head_dim), k.reshape(seq, c.n_kv_heads, c.head_dim)
        if layer.q_norm is not None:  # Qwen3: each head's query and key RMS-normalized before RoPE
            q, k = rms_norm(q, layer.q_norm, c.norm_eps), rms_norm(k, layer.k_norm, c.norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if c.query_scale:
            q = q * np.float32(c.query_scale)
        start = cache.length
        end = start + seq
        cache.k[index, :, start:end] = k.transpose(1, 0, 2)
        cache.v[index, :, start:end] = v.reshape(seq, c.n_kv_heads, c.head_dim).transpose(1, 0, 2)
        keys, values = cache.k[index, :, :end], cache.v[index, :, :end]
        # Heads h = kv * heads_per_kv + g share KV head kv.
        qg = q.reshape(seq, c.n_kv_heads, c.heads_per_kv, c.head_dim).transpose(1, 2, 0, 3)
        # A float32 scale: a numpy float64 scalar would turn everything after it into float64.
        scores = qg @ keys[:, None].transpose(0, 1, 3, 2) * np.float32(c.score_scale)
        scores = np.where(causal_mask(start + np.arange(seq), end, c.window(index)), -np.inf, scores)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        heads = (probs @ values[:, None]).reshape(c.n_heads, seq, c.head_dim)  # (head, seq, dim)
        out = heads.transpose(1, 0, 2).reshape(seq, c.q_dim) @ layer.wo.T
        if hooks and hooks.wants_partials:
            wo = layer.wo.reshape(c.hidden, c.n_heads, c.head_dim)
            replaced = hooks.head_outputs(index, np.einsum("hsd,ohd->hso", heads, wo))
            if replaced is not None:
                return replaced
        return out

    def mlp(self, index: int, layer: DenseLayer, x: np.ndarray, hooks: BlockHooks | None) -> np.ndarray:
        if hooks:
            hooks.mlp_input(index, x)
        if layer.moe is not None:
            return self.experts(layer.moe, x, index, hooks)
        act = self.act(x @ layer.w_gate.T) * (x @ layer.w_up.T)
        out = act @ layer.w_down.T
        if hooks and hooks.wants_partials:
            g = self.group_size
            parts = [act[:, j:j + g] @ layer.w_down[:, j:j + g].T for j in range(0, self.config.ffn, g)]
            replaced = hooks.group_outputs(index, np.stack(parts))
            if replaced is not None:
                return replaced
        return out

    def experts(self, moe: DenseMoe, x: np.ndarray, index: int = 0, hooks: BlockHooks | None = None) -> np.ndarray:
        """A mixture of experts: each token through its chosen experts, weighted by their gates (and through
        the shared expert, scaled by its sigmoid gate). Tokens are grouped per expert, one product each."""
        chosen, weights = route(x @ moe.router.T, self.config.n_experts_used, self.config.norm_gates)
        kept = None if hooks is None else hooks.expert_kept(index, chosen)
        if kept is not None:
            weights = np.where(kept, weights, np.float32(0)) * kept_gate_scale(weights, kept)[:, None]
        out = np.zeros_like(x)
        for e in np.unique(chosen):
            tokens, slot = np.nonzero(chosen == e)
            out[tokens] += weights[tokens, slot, None] * moe.experts[e](x[tokens])
        return out + moe.shared_output(x)
