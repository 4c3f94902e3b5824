"""The browser kernels' arithmetic in numpy: the oracle a tab on edgerun's WebAssembly kernels (browser/kernels.js)
is checked against.

Int8 activations are not float32 ones: each product's input is rounded to 8 bits per block of 32, so a stage on the
kernels computes what onnxruntime's MatMulNBits computes natively with int8 activations, not what the float
reference computes, and its tokens may part from either reference's at a near-tie (the native engine's own batched
and one-token passes differ by as much). This engine takes the kernels' steps (kernels.wat's quantization, integer
block sums, attention scores and weighted values; kernels.js's norms, rotary embedding and softmax): the int8 codes
are the same, and only float sums run in another order (float64 here, four float32 lanes there), so a tab's tokens
must be its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgerun.model.config import Activation, ModelConfig
from edgerun.model.kernel_stage import LAYER_MATRICES, LAYER_VECTORS, unsupported
from edgerun.model.quant import AffineBlocks, to_affine_blocks
from edgerun.model.reference import rope_tables
from edgerun.model.weights import ModelWeights, embed_rows

BLOCK = 32


@dataclass(frozen=True)
class _Matrix:
    codes: np.ndarray  # float32 (blocks, rows, 32): exact integers, block-major for one batched product a block
    scales: np.ndarray  # float64 (rows, blocks)
    offsets: np.ndarray | None  # float64 (rows, blocks)
    mid: int  # the code of zero

    @classmethod
    def of(cls, form: AffineBlocks) -> _Matrix:
        rows, cols = form.codes.shape
        offsets = None if form.offsets is None else form.offsets.astype(np.float64)
        codes = np.ascontiguousarray(form.codes.reshape(rows, cols // BLOCK, BLOCK).transpose(1, 0, 2), np.float32)
        return cls(codes, form.scales.astype(np.float64), offsets, 2 ** (form.bits - 1))


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (n,) float32 -> (codes (blocks, 32) float32, scales (blocks,), float sums (blocks,)) as kernels.js
    quantizes: scale = max|x| / 127, codes x * (127 / max|x|) rounded to nearest even, all in float32."""
    blocks = x.astype(np.float32).reshape(-1, BLOCK)
    amax = np.abs(blocks).max(axis=1)
    scale = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    codes = np.clip(np.rint(blocks * inverse[:, None]), -127, 127).astype(np.float32)
    return codes, scale.astype(np.float64), blocks.astype(np.float64).sum(axis=1)


def product(m: _Matrix, x: np.ndarray) -> np.ndarray:
    """W x as kernels.wat computes it: exact integer block sums, scaled per block."""
    codes, scale, sums = quantize(x)
    # Per block, (rows, 32) @ (32,): sums of 32 products below 2**15 each, exact in float32.
    dots = np.matmul(m.codes, codes[:, :, None])[:, :, 0].T.astype(np.float64) - m.mid * codes.sum(axis=1,
                                                                                               dtype=np.float64)
    y = (dots * m.scales * scale[None]).sum(axis=1)
    if m.offsets is not None:
        y += (m.offsets * sums[None]).sum(axis=1)
    return y.astype(np.float32)


class KernelReference:
    """The whole model on the kernels' arithmetic, behind the Engine interface (one token at a time, as a tab runs
    a prefill)."""

    name = "kernels-numpy"

    def __init__(self, config: ModelConfig, weights: ModelWeights, max_len: int) -> None:
        reason = unsupported(config, weights)
        if reason is not None:
            raise ValueError(f"the browser kernels cannot run this model: {reason}")
        self.config, self.max_len = config, max_len
        self.layers = [{name: _Matrix.of(to_affine_blocks(getattr(layer, name))) for name in LAYER_MATRICES}
                       | {name: getattr(layer, name) for name in LAYER_VECTORS}
                       | {"attn_norm": layer.attn_norm.astype(np.float64),
                          "ffn_norm": layer.ffn_norm.astype(np.float64)} for layer in weights.layers]
        self.weights = weights
        self.head = _Matrix.of(to_affine_blocks(weights.output))
        self.output_norm = weights.output_norm.astype(np.float64)
        # Per layer, its rotation's (cos, sin) over every position (Gemma's layers have two rotations)
        tables = {}
        self.rotations = []
        for i in range(config.n_layers):
            key = config.rotation_of(i)
            if key not in tables:
                cos, sin = rope_tables(config.head_dim, key[0], np.arange(max_len) * key[1], weights.rope_freqs)
                tables[key] = (cos.astype(np.float64), sin.astype(np.float64))
            self.rotations.append(tables[key])
        shape = (config.n_layers, config.n_kv_heads, max_len, config.head_dim)
        self.keys, self.values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        self.position = 0

    def reset(self) -> None:
        self.position = 0

    def release(self) -> None:
        """Nothing to let go of between requests."""

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        if self.position + len(tokens) > self.max_len:
            raise ValueError(f"context of {self.max_len} tokens exceeded")
        for token in tokens:
            hidden = embed_rows(self.config, self.weights, [token])[0]
            for i in range(self.config.n_layers):
                hidden = self._layer(i, hidden)
            self.position += 1
        return product(self.head, self._norm(hidden, self.output_norm))

    def _norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """x's last axis RMS-normalized (a vector, or Qwen3's heads one by one)."""
        x64 = x.astype(np.float64)
        mean = (x64 * x64).sum(axis=-1, keepdims=True) / x.shape[-1]
        return (x64 * (1 / np.sqrt(mean + self.config.norm_eps)) * weight).astype(np.float32)

    def _rope(self, i: int, x: np.ndarray) -> np.ndarray:
        """x (heads, head_dim) float32 rotated by layer i's rotation, pairs (i, i + head_dim/2), in float64 and
        back to float32."""
        half = x.shape[1] // 2
        a, b = x[:, :half].astype(np.float64), x[:, half:].astype(np.float64)
        cos, sin = self.rotations[i]
        c, s = cos[self.position], sin[self.position]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=1).astype(np.float32)

    def _added(self, hidden: np.ndarray, out: np.ndarray, norm: np.ndarray | None) -> np.ndarray:
        """hidden + out, normalized first where the layer has a norm after it (Gemma)."""
        return hidden + (out if norm is None else self._norm(out, norm))

    def _layer(self, i: int, hidden: np.ndarray) -> np.ndarray:
        c, layer, p = self.config, self.layers[i], self.position
        x = self._norm(hidden, layer["attn_norm"])
        q, k, v = (product(layer[name], x) for name in ("wq", "wk", "wv"))
        if layer["bq"] is not None:  # Qwen2
            q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
        q, k = q.reshape(c.n_heads, c.head_dim), k.reshape(c.n_kv_heads, c.head_dim)
        if layer["q_norm"] is not None:  # Qwen3
            q, k = self._norm(q, layer["q_norm"]), self._norm(k, layer["k_norm"])
        q = self._rope(i, q)
        if c.query_scale:  # Gemma, after the rotation
            q = q * np.float32(c.query_scale)
        self.keys[i, :, p] = self._rope(i, k)
        self.values[i, :, p] = v.reshape(c.n_kv_heads, c.head_dim)
        first = max(0, p + 1 - c.window(i)) if c.window(i) else 0
        group = c.n_heads // c.n_kv_heads
        # (heads, positions, head_dim)
        keys = np.repeat(self.keys[i, :, first:p + 1], group, axis=0).astype(np.float64)
        values = np.repeat(self.values[i, :, first:p + 1], group, axis=0).astype(np.float64)
        scores = np.einsum("hd,htd->ht", q.astype(np.float64), keys) * c.score_scale
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        attention = np.einsum("ht,htd->hd", weights, values).astype(np.float32).reshape(-1)
        hidden = self._added(hidden, product(layer["wo"], attention), layer["attn_post_norm"])
        x = self._norm(hidden, layer["ffn_norm"])
        gate, up = product(layer["w_gate"], x).astype(np.float64), product(layer["w_up"], x)
        if c.activation == Activation.GELU_TANH:
            act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate * gate * gate))) * up
        else:
            act = gate / (1 + np.exp(-gate)) * up
        return self._added(hidden, product(layer["w_down"], act.astype(np.float32)), layer["ffn_post_norm"])
