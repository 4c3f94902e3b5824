"""Weight tensors that stay in their file's quantized format until a kernel needs them.

A `QuantTensor` holds the raw bytes of a GGML-typed tensor (memory-mapped where the file allows),
row-major: one row is one output feature, the blocks run along the input dimension. Rows can be
selected and reordered without touching the blocks, which is how heads and neuron groups are cut
out of a matrix and how GGUF's interleaved Q/K rows are put back in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from edgerun.model import kquants

# Types a model file may hold; every one is dequantized by the gguf package.
SUPPORTED_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# Types `quantize` can write (synthetic models).
WRITABLE_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K")


def check_qtype(name: str) -> GGMLQuantizationType:
    if name not in SUPPORTED_QTYPES:
        raise ValueError(f"unsupported quant type {name} (supported: {', '.join(SUPPORTED_QTYPES)})")
    return GGMLQuantizationType[name]


def block_shape(qtype: str) -> tuple[int, int]:
    """(elements per block, bytes per block)."""
    return GGML_QUANT_SIZES[check_qtype(qtype)]


@dataclass(frozen=True)
class QuantTensor:
    qtype: str
    shape: tuple[int, ...]  # numpy order: (rows, cols) for matrices, (n,) for vectors
    stored: np.ndarray  # uint8, (rows, bytes per row) for matrices, (bytes,) for vectors: memory-mapped where it can be
    # Rows of `stored` in this tensor's order, when it is a reordering (llama.cpp's RoPE rows): kept as an index so
    # the file's pages stay mapped, not copied, until a share takes the rows it needs.
    row_order: np.ndarray | None = None

    def __post_init__(self) -> None:
        block, size = block_shape(self.qtype)
        cols = self.shape[-1]
        if cols % block:
            raise ValueError(f"{self.qtype} row length {cols} is not a multiple of its block size {block}")
        expected = (*self.shape[:-1], cols // block * size)
        stored = self.stored.shape if self.row_order is None else (len(self.row_order), *self.stored.shape[1:])
        if self.stored.dtype != np.uint8 or stored != expected:
            raise ValueError(f"raw bytes {self.stored.dtype}{stored} do not match {self.qtype}{self.shape}")

    @property
    def raw(self) -> np.ndarray:
        """The bytes in this tensor's row order (a copy for a reordering: take what you need with take_rows)."""
        return self.stored if self.row_order is None else self.stored[self.row_order]

    @property
    def nbytes(self) -> int:
        if self.row_order is None:
            return int(self.stored.nbytes)
        return len(self.row_order) * int(self.stored.shape[1])

    @property
    def rows(self) -> int:
        return self.shape[0]

    def dequantize(self) -> np.ndarray:
        qtype = check_qtype(self.qtype)
        if self.qtype == "F32":
            return np.ascontiguousarray(self.raw).view(np.float32).reshape(self.shape)
        if self.qtype == "F16":
            return np.ascontiguousarray(self.raw).view(np.float16).reshape(self.shape).astype(np.float32)
        return quants.dequantize(np.asarray(self.raw), qtype).reshape(self.shape).astype(np.float32, copy=False)

    def take_rows(self, index: np.ndarray | slice) -> QuantTensor:
        if self.row_order is not None:
            return self.reorder_rows(index)
        raw = self.stored[index]
        return QuantTensor(self.qtype, (raw.shape[0], *self.shape[1:]), raw)

    def reorder_rows(self, index: np.ndarray | slice) -> QuantTensor:
        """These rows, in this order, without copying them: the bytes are gathered when `raw` is read."""
        order = (np.arange(self.rows) if self.row_order is None else self.row_order)[index]
        return QuantTensor(self.qtype, (len(order), *self.shape[1:]), self.stored, order)

    def dequantize_rows(self, index: np.ndarray) -> np.ndarray:
        """Dequantize only some rows (embedding lookups). Q8_0's and Q4_0's rows directly, as the gguf package
        computes them: its general path cost ~50 µs a token's row (~150 on a tensor-parallel master's loop
        between steps), most of it in splitting and reshaping."""
        rows = self.take_rows(np.asarray(index))
        if self.qtype not in _DIRECT or rows.stored.ndim != 2:
            return rows.dequantize()
        return _DIRECT[self.qtype](np.asarray(rows.raw)).reshape(rows.shape)


def _q8_0_rows(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 34)  # a float16 scale, then 32 int8
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    return scale * blocks[:, 2:].view(np.int8).astype(np.float32)


def _q4_0_rows(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 18)  # a float16 scale, then 16 bytes: values j and j + 16 in byte j's low and high half
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    nibbles = blocks[:, 2:]
    q = np.concatenate([nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)], axis=1).astype(np.int8) - np.int8(8)
    return scale * q.astype(np.float32)


_DIRECT = {"Q8_0": _q8_0_rows, "Q4_0": _q4_0_rows}


def quantize(x: np.ndarray, qtype: str) -> QuantTensor:
    """Quantize float data row-wise into a GGML type."""
    if qtype not in WRITABLE_QTYPES:
        raise ValueError(f"cannot write quant type {qtype} (writable: {', '.join(WRITABLE_QTYPES)})")
    x = np.ascontiguousarray(x, dtype=np.float32)
    block = block_shape(qtype)[0]
    if x.shape[-1] % block:
        raise ValueError(f"{qtype} needs rows of a multiple of {block} values, not {x.shape[-1]}")
    if qtype == "F32":
        raw = x.view(np.uint8)
    elif qtype == "F16":
        raw = x.astype(np.float16).view(np.uint8)
    elif qtype == "Q4_K":
        raw = kquants.quantize_q4_k(x.reshape(-1, x.shape[-1]))
    elif qtype == "Q6_K":
        raw = kquants.quantize_q6_k(x.reshape(-1, x.shape[-1]))
    else:
        raw = quants.quantize(x, GGMLQuantizationType[qtype])
    size = block_shape(qtype)[1]
    return QuantTensor(qtype, x.shape, raw.reshape(*x.shape[:-1], x.shape[-1] // block * size))


@dataclass(frozen=True)
class AffineBlocks:
    """A matrix as integer codes with a scale and an offset per block along each row:
    w[r, c] = scales[r, b] * (codes[r, c] - 2**(bits-1)) + offsets[r, b], with b = c // block.

    Symmetric codes around the midpoint are what onnxruntime's fast MatMulNBits kernels take; the
    per-block offset (Q4_1, Q4_K) is a separate, 32 times smaller product (see onnx_graph).
    `offsets` is None where every block's offset is zero.
    """

    bits: int
    block: int
    codes: np.ndarray  # uint8 (rows, cols), values below 2**bits
    scales: np.ndarray  # float32 (rows, cols // block)
    offsets: np.ndarray | None  # float32 (rows, cols // block)


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    """Read the little-endian f16 at byte `start` of every block as float32."""
    return np.ascontiguousarray(raw[..., start : start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _codes(values: np.ndarray, scales: np.ndarray, offsets: np.ndarray, block: int, mid: int) -> np.ndarray:
    """Recover the codes from values = scale * (code - mid) + offset, block by block."""
    rows, cols = values.shape
    v = values.reshape(rows, cols // block, block)
    safe = np.where(scales == 0, 1.0, scales)[..., None]
    q = np.rint((v - offsets[..., None]) / safe) + mid
    # A zero scale makes the block constant (its offset); any code will do.
    q = np.where(scales[..., None] == 0, mid, q)
    return q.reshape(rows, cols).astype(np.uint8)


AFFINE_CHUNK_VALUES = 1 << 22  # rows are converted this many values at a time: float32 temporaries stay ~16 MB


def to_affine_blocks(t: QuantTensor) -> AffineBlocks | None:
    """The exact affine-block form of a quantized matrix, or None when it has none
    (float types; Q5_1 and Q5_K, whose 5-bit codes have offsets no 8-bit kernel takes).
    Large matrices go a chunk of rows at a time, so the float32 values the codes are recovered from never
    exist for the whole matrix at once (an LM head's would be hundreds of MB)."""
    if len(t.shape) != 2:
        raise ValueError("only matrices have an affine-block form")
    rows_per_chunk = max(1, AFFINE_CHUNK_VALUES // t.shape[1])
    if t.shape[0] > rows_per_chunk:
        parts = [_affine_rows(t.take_rows(slice(r, r + rows_per_chunk))) for r in range(0, t.shape[0], rows_per_chunk)]
        return None if parts[0] is None else concat_affine(parts, axis=0)
    return _affine_rows(t)


def _affine_rows(t: QuantTensor) -> AffineBlocks | None:
    rows, cols = t.shape
    nblocks = cols // block_shape(t.qtype)[0]
    values = t.dequantize()
    if t.qtype in ("Q4_0", "Q4_1", "Q8_0", "Q5_0"):
        raw = t.raw.reshape(rows, nblocks, -1)
        d = _f16(raw, 0)
        if t.qtype == "Q4_1":  # w = d*q + m = d*(q - 8) + (m + 8d)
            offsets = _f16(raw, 2) + 8 * d
            return AffineBlocks(4, 32, _codes(values, d, offsets, 32, 8), d, offsets)
        # Symmetric types: w = d * (q - mid); 5-bit codes go to the 8-bit kernel.
        bits = 4 if t.qtype == "Q4_0" else 8
        zero = np.zeros_like(d)
        return AffineBlocks(bits, 32, _codes(values, d, zero, 32, 2 ** (bits - 1)), d, None)
    if t.qtype == "Q4_K":  # w = d*sc*q - dmin*m per 32-element sub-block
        raw = t.raw.reshape(rows, nblocks, 144)
        d, dmin = _f16(raw, 0), _f16(raw, 2)
        sc, m = _q4_k_scales_mins(raw[..., 4:16])
        scales = (d[..., None] * sc).reshape(rows, nblocks * 8)
        offsets = 8 * scales - (dmin[..., None] * m).reshape(rows, nblocks * 8)
        return AffineBlocks(4, 32, _codes(values, scales, offsets, 32, 8), scales, offsets)
    if t.qtype == "Q6_K":  # w = d*sc*(q - 32) per 16-element sub-block
        raw = t.raw.reshape(rows, nblocks, 210)
        d = _f16(raw, 208)
        sc = raw[..., 192:208].view(np.int8).astype(np.float32)
        scales = (d[..., None] * sc).reshape(rows, nblocks * 16)
        return AffineBlocks(8, 16, _codes(values, scales, np.zeros_like(scales), 16, 128), scales, None)
    return None


def _q4_k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack Q4_K's twelve bytes of 6-bit sub-block scales and mins (8 each)."""
    p = packed.astype(np.uint8)
    sc = np.empty((*p.shape[:-1], 8), np.float32)
    m = np.empty_like(sc)
    sc[..., :4] = p[..., 0:4] & 63
    m[..., :4] = p[..., 4:8] & 63
    sc[..., 4:] = (p[..., 8:12] & 0xF) | ((p[..., 0:4] >> 6) << 4)
    m[..., 4:] = (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)
    return sc, m


MIN_KERNEL_BLOCK = 16  # the smallest block onnxruntime's MatMulNBits takes


def _refine(form: AffineBlocks, block: int) -> AffineBlocks:
    """The same matrix with blocks of `block` (a divisor of form.block): each block's scale and offset repeated."""
    r = form.block // block
    return AffineBlocks(form.bits, block, form.codes, np.repeat(form.scales, r, axis=1),
                        None if form.offsets is None else np.repeat(form.offsets, r, axis=1))


def concat_affine(forms: list[AffineBlocks], axis: int) -> AffineBlocks:
    """Matrices of one code width stacked (axis 0: rows) or side by side (axis 1: columns), in blocks of the
    smallest block among them; a matrix without offsets takes zero offsets beside one with them."""
    block = min(f.block for f in forms)
    forms = [_refine(f, block) if f.block != block else f for f in forms]
    offsets = None
    if any(f.offsets is not None for f in forms):
        offsets = np.concatenate([np.zeros_like(f.scales) if f.offsets is None else f.offsets for f in forms],
                                 axis=axis)
    return AffineBlocks(forms[0].bits, block, np.concatenate([f.codes for f in forms], axis=axis),
                        np.concatenate([f.scales for f in forms], axis=axis), offsets)


def _column_blocks(t: QuantTensor, start: int, stop: int) -> tuple[QuantTensor, int]:
    """The file blocks of every row that cover columns [start, stop), as a matrix of their own, and where
    `start` falls in it: a column range of a quantized matrix touches only these bytes."""
    if not 0 <= start < stop <= t.shape[1]:
        raise ValueError(f"column range [{start}, {stop}) is outside 0..{t.shape[1]}")
    block, size = block_shape(t.qtype)
    first, last = start // block, -(-stop // block)
    part = QuantTensor(t.qtype, (t.shape[0], (last - first) * block),
                       np.ascontiguousarray(t.raw[:, first * size:last * size]))
    return part, start - first * block


def dequantize_columns(t: QuantTensor, ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """Columns [start, stop) of each range of a quantized matrix, side by side, as float32.

    Each row's quant blocks run along the columns, so only the blocks covering a range are
    dequantized; a range that does not start or end on a block boundary (a 128-column head in a
    256-wide K-quant block) is trimmed after dequantizing its end blocks.
    """
    parts = []
    for start, stop in ranges:
        part, a = _column_blocks(t, start, stop)
        parts.append(part.dequantize()[:, a:a + stop - start])
    if not parts:
        return np.zeros((t.shape[0], 0), np.float32)
    return np.ascontiguousarray(np.concatenate(parts, axis=1), dtype=np.float32)


def slice_affine(t: QuantTensor, rows: np.ndarray | None = None,
                 col_ranges: list[tuple[int, int]] | None = None) -> AffineBlocks | np.ndarray:
    """Some rows, or some column ranges side by side, of a quantized matrix, in the affine-block form a
    quantized kernel runs, touching only the file blocks that cover them. A column range that does not start
    and end on a block boundary re-expresses its blocks as smaller ones (a 32-block cut at 16 is two 16-blocks
    with the same scale and offset), exactly; only where that would take blocks below MIN_KERNEL_BLOCK, or the
    type has no affine form (float types, Q5_1, Q5_K), is the slice float32 (rows, cols)."""
    if rows is not None:
        t = t.take_rows(np.asarray(rows))
    if col_ranges is None:
        return to_affine_blocks(t) or t.dequantize()
    forms: list[AffineBlocks] = []
    for start, stop in col_ranges:
        part, a = _column_blocks(t, start, stop)
        b = a + stop - start
        form = to_affine_blocks(part)
        block = np.gcd.reduce([form.block, a, b]) if form is not None else 0
        if form is None or block < MIN_KERNEL_BLOCK or block & (block - 1):
            return dequantize_columns(t, col_ranges)
        form = _refine(form, int(block)) if block != form.block else form
        cut = slice(a // form.block, b // form.block)
        forms.append(AffineBlocks(form.bits, form.block, form.codes[:, a:b], form.scales[:, cut],
                                  None if form.offsets is None else form.offsets[:, cut]))
    return concat_affine(forms, axis=1)
