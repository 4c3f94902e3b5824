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

from edgerun.model.config import ModelConfig
from edgerun.model.kernel_stage import LAYER_MATRICES, unsupported
from edgerun.model.quant import AffineBlocks, to_affine_blocks
from edgerun.model.reference import rope_tables
from edgerun.model.weights import ModelWeights

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
                       | {"attn_norm": layer.attn_norm.astype(np.float64),
                          "ffn_norm": layer.ffn_norm.astype(np.float64)} for layer in weights.layers]
        self.embedding = weights.token_embd
        self.head = _Matrix.of(to_affine_blocks(weights.output))
        self.output_norm = weights.output_norm.astype(np.float64)
        cos, sin = rope_tables(config.head_dim, config.rope_base, np.arange(max_len), weights.rope_freqs)
        self.cos, self.sin = cos.astype(np.float64), sin.astype(np.float64)
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
            hidden = self.embedding.dequantize_rows(np.array([token]))[0]
            for i in range(self.config.n_layers):
                hidden = self._layer(i, hidden)
            self.position += 1
        return product(self.head, self._norm(hidden, self.output_norm))

    def _norm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        x64 = x.astype(np.float64)
        return (x64 * (1 / np.sqrt(np.dot(x64, x64) / len(x) + self.config.norm_eps)) * weight).astype(np.float32)

    def _rope(self, x: np.ndarray) -> np.ndarray:
        """x (heads, head_dim) float32, pairs (i, i + head_dim/2), in float64 and back to float32."""
        half = x.shape[1] // 2
        a, b = x[:, :half].astype(np.float64), x[:, half:].astype(np.float64)
        c, s = self.cos[self.position], self.sin[self.position]
        return np.concatenate([a * c - b * s, b * c + a * s], axis=1).astype(np.float32)

    def _layer(self, i: int, hidden: np.ndarray) -> np.ndarray:
        c, layer, p = self.config, self.layers[i], self.position
        x = self._norm(hidden, layer["attn_norm"])
        q = self._rope(product(layer["wq"], x).reshape(c.n_heads, c.head_dim))
        self.keys[i, :, p] = self._rope(product(layer["wk"], x).reshape(c.n_kv_heads, c.head_dim))
        self.values[i, :, p] = product(layer["wv"], x).reshape(c.n_kv_heads, c.head_dim)
        group = c.n_heads // c.n_kv_heads
        keys = np.repeat(self.keys[i, :, :p + 1], group, axis=0).astype(np.float64)  # (heads, positions, head_dim)
        values = np.repeat(self.values[i, :, :p + 1], group, axis=0).astype(np.float64)
        scores = np.einsum("hd,htd->ht", q.astype(np.float64), keys) / np.sqrt(c.head_dim)
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        attention = np.einsum("ht,htd->hd", weights, values).astype(np.float32).reshape(-1)
        hidden = hidden + product(layer["wo"], attention)
        x = self._norm(hidden, layer["ffn_norm"])
        gate, up = product(layer["w_gate"], x).astype(np.float64), product(layer["w_up"], x)
        act = (gate / (1 + np.exp(-gate)) * up).astype(np.float32)
        return hidden + product(layer["w_down"], act)
