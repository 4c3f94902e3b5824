"""Quantise float32 matrices to ggml's Q4_K and Q6_K block formats.

The bytes are laid out exactly as ggml's block_q4_K and block_q6_K, so
``gguf.quants.dequantize(raw, GGMLQuantizationType.Q4_K)`` (or ``Q6_K``) turns them back
into floats. Each row is cut into super-blocks of 256 values that are quantised
independently; a row of ``cols`` values becomes ``cols // 256`` consecutive blocks.

The quantisers are one-pass min/max quantisers, not ggml's iterative error search:

* Q4_K: 8 sub-blocks of 32, ``w = d * sc * q - dmin * m`` with 4-bit ``q`` and 6-bit ``sc``, ``m``.
* Q6_K: 16 sub-blocks of 16, ``w = d * sc * (q - 32)`` with 6-bit ``q`` and int8 ``sc``.

Sub-block scales and offsets are rounded up rather than to nearest, so that the quantisation
grid of every sub-block still spans all of its values; each value is then off by at most half
a (slightly enlarged) step, never by a clipped overshoot.
"""

from __future__ import annotations

import numpy as np

QK_K = 256
Q4_K_BLOCK_BYTES = 144
Q6_K_BLOCK_BYTES = 210

# Largest finite float16: d and dmin are stored as float16, so larger values cannot be encoded.
_F16_MAX = 65504.0


def _check_input(x: np.ndarray) -> np.ndarray:
    """Return ``x`` as a C-contiguous float32 matrix, or raise ValueError if it cannot be quantised."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"expected a 2-D [rows, cols] array, got shape {x.shape}")
    cols = x.shape[1]
    if cols == 0 or cols % QK_K != 0:
        raise ValueError(f"cols must be a positive multiple of {QK_K}, got {cols}")
    if not np.isfinite(x).all():
        raise ValueError("cannot quantise NaN or infinite values")
    return x


def _f16_round_up(v: np.ndarray, what: str) -> np.ndarray:
    """Round non-negative float32 values up to the nearest float16.

    Rounding up (not to nearest) guarantees ``63 * d`` (or ``127 * d``) still reaches the
    largest sub-block scale, so the 6-/8-bit sub-scales never need to exceed their range.
    """
    if v.size and float(v.max()) > _F16_MAX:
        raise ValueError(f"values too large for Q-K quantisation: {what} {float(v.max())} exceeds float16")
    h = v.astype(np.float16)
    low = h.astype(np.float32) < v
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return h


def _f16_bytes(h: np.ndarray) -> np.ndarray:
    """Little-endian bytes of a [n] float16 vector, as uint8 [n, 2]."""
    return h.astype("<f2").view(np.uint8).reshape(-1, 2)


def _safe_divisor(v: np.ndarray) -> np.ndarray:
    """Replace zeros by one: wherever the divisor is zero the numerator is zero too."""
    return np.where(v > 0, v, np.float32(1.0)).astype(np.float32)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Quantise float32 ``x`` [rows, cols] to Q4_K bytes, uint8 [rows, cols // 256 * 144].

    ``cols`` must be a multiple of 256; raises ValueError otherwise, or for values float16 scales cannot hold.
    """
    x = _check_input(x)
    rows, cols = x.shape
    blocks = x.reshape(-1, 8, 32)
    n_blocks = blocks.shape[0]

    # The offset is stored as an unsigned 6-bit multiple of a shared dmin and subtracted, so it can
    # only move the grid down: like ggml, a sub-block's minimum is clamped to at most zero.
    lo = np.minimum(blocks.min(axis=2), np.float32(0.0))
    hi = blocks.max(axis=2)
    offset = -lo  # >= 0

    dmin = _f16_round_up(offset.max(axis=1) / np.float32(63.0), "dmin")
    dmin32 = dmin.astype(np.float32)[:, None]
    # Rounding m up keeps the bottom of the grid (-dmin * m) at or below the sub-block minimum.
    m = np.clip(np.ceil(offset / _safe_divisor(dmin32)), 0, 63)
    offset_q = dmin32 * m

    # The scale is chosen after the offset so that it absorbs the offset's rounding error and
    # the top of the grid still reaches the sub-block maximum.
    scale = (hi + offset_q) / np.float32(15.0)
    d = _f16_round_up(scale.max(axis=1) / np.float32(63.0), "d")
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.ceil(scale / _safe_divisor(d32)), 0, 63)
    step = d32 * sc

    shifted = blocks + offset_q[:, :, None]
    q = np.clip(np.rint(shifted / _safe_divisor(step)[:, :, None]), 0, 15).astype(np.uint8)

    sc_u8 = sc.astype(np.uint8)
    m_u8 = m.astype(np.uint8)
    scales = np.empty((n_blocks, 12), dtype=np.uint8)
    # Bytes 0-3 and 4-7 hold the low 6 bits of scales/mins 0-3, with bits 4-5 of scales/mins 4-7
    # in their top two bits; bytes 8-11 hold the low nibbles of scales 4-7 (low) and mins 4-7 (high).
    scales[:, 0:4] = (sc_u8[:, 0:4] & 0x3F) | ((sc_u8[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m_u8[:, 0:4] & 0x3F) | ((m_u8[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc_u8[:, 4:8] & 0x0F) | ((m_u8[:, 4:8] & 0x0F) << 4)

    # Each group of 32 bytes carries two sub-blocks: the even one in the low nibbles, the odd one high.
    qs = (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(n_blocks, 128)

    out = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qs], axis=1)
    return out.reshape(rows, cols // QK_K * Q4_K_BLOCK_BYTES)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Quantise float32 ``x`` [rows, cols] to Q6_K bytes, uint8 [rows, cols // 256 * 210].

    ``cols`` must be a multiple of 256; raises ValueError otherwise, or for values float16 scales cannot hold.
    """
    x = _check_input(x)
    rows, cols = x.shape
    blocks = x.reshape(-1, 16, 16)
    n_blocks = blocks.shape[0]

    # Symmetric grid: q - 32 in [-31, 31] covers [-amax, amax] without clipping either end.
    amax = np.abs(blocks).max(axis=2)
    scale = amax / np.float32(31.0)
    d = _f16_round_up(scale.max(axis=1) / np.float32(127.0), "d")
    d32 = d.astype(np.float32)[:, None]
    # Rounding the sub-scale up keeps 31 * step >= amax, so no value falls off the grid.
    sc = np.clip(np.ceil(scale / _safe_divisor(d32)), 0, 127)
    step = d32 * sc

    q_signed = np.clip(np.rint(blocks / _safe_divisor(step)[:, :, None]), -32, 31)
    q = (q_signed + 32).astype(np.uint8).reshape(n_blocks, 2, 128)

    # Each 128-value half uses 64 ql bytes (values k and 64 + k in the low/high nibble of byte k)
    # and 32 qh bytes (the top two bits of values k, 32 + k, 64 + k, 96 + k in bits 0-1, 2-3, 4-5, 6-7).
    low = q & 0x0F
    ql = (low[:, :, 0:64] | (low[:, :, 64:128] << 4)).reshape(n_blocks, 128)
    high = (q >> 4).reshape(n_blocks, 2, 4, 32)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    qh = qh.reshape(n_blocks, 64)

    scales = sc.astype(np.int8).view(np.uint8)

    out = np.concatenate([ql, qh, scales, _f16_bytes(d)], axis=1)
    return out.reshape(rows, cols // QK_K * Q6_K_BLOCK_BYTES)
