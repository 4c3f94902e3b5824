"""A model's weights in one canonical layout, whatever file they came from.

Q and K rows are in Hugging Face order (each head's rotary pairs are (i, i + head_dim/2));
GGUF's interleaved Llama rows are put into this order on load and back on save.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from edgerun.model.quant import QuantTensor


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
    w_gate: QuantTensor  # (ffn, hidden)
    w_up: QuantTensor  # (ffn, hidden)
    w_down: QuantTensor  # (hidden, ffn)

    def matrices(self) -> Iterator[tuple[str, QuantTensor]]:
        yield from (("wq", self.wq), ("wk", self.wk), ("wv", self.wv), ("wo", self.wo),
                    ("w_gate", self.w_gate), ("w_up", self.w_up), ("w_down", self.w_down))


@dataclass(frozen=True)
class ModelWeights:
    token_embd: QuantTensor  # (vocab, hidden)
    layers: tuple[LayerWeights, ...]
    output_norm: np.ndarray
    output: QuantTensor  # (vocab, hidden); the same object as token_embd when tied

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
