"""Q4_K / Q6_K quantisers, checked by decoding their bytes with gguf's own dequantize."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from edgerun.model.kquants import quantize_q4_k, quantize_q6_k

Q4 = GGMLQuantizationType.Q4_K
Q6 = GGMLQuantizationType.Q6_K

# d and dmin are rounded up to float16: at most one float16 ulp above the ideal value, which is
# a relative 2**-10 for normal float16 numbers and an absolute 2**-24 for subnormal ones.
F16_REL = 2.0**-10
F16_ABS = 2.0**-24

# Sub-blocks per 256-value super-block.
QK_SUBS = {Q4: 8, Q6: 16}

SHAPES = [(1, 256), (3, 512), (17, 768), (64, 1024), (5, 256 * 3)]


def _roundtrip(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    quantize = quantize_q4_k if qtype == Q4 else quantize_q6_k
    raw = quantize(x)
    return dequantize(raw, qtype).reshape(x.shape)


def _q4_k_bound(x: np.ndarray) -> np.ndarray:
    """Largest error the Q4_K quantiser may make on each 32-value sub-block of ``x``.

    The grid of a sub-block spans [lo, hi] (lo = min(x_min, 0), as offsets only move down), so
    every value is within half a step. The step is (R + offset rounding) / 15 rounded up to a
    multiple of d: below (R + dmin) / 15 + d, with R = hi - lo. dmin is the largest offset / 63
    and d the largest scale / 63, each rounded up to float16.
    """
    b = x.reshape(-1, 8, 32).astype(np.float64)
    lo = np.minimum(b.min(axis=2), 0.0)
    hi = b.max(axis=2)
    r = hi - lo
    amax = np.abs(b).max(axis=(1, 2))[:, None]
    dmin = amax / 63 * (1 + F16_REL) + F16_ABS
    d = (r.max(axis=1, keepdims=True) + dmin) / (15 * 63) * (1 + F16_REL) + F16_ABS
    tol = 1e-6 * amax + 1e-12  # float32 arithmetic in the quantiser
    return r / 30 + dmin / 30 + d / 2 + tol


def _q6_k_bound(x: np.ndarray) -> np.ndarray:
    """Largest error the Q6_K quantiser may make on each 16-value sub-block of ``x``.

    The symmetric grid q - 32 in [-31, 31] has step amax / 31 rounded up to a multiple of d, below
    amax / 31 + d, and every value is within half a step. d is the largest step / 127, rounded up.
    """
    b = x.reshape(-1, 16, 16).astype(np.float64)
    amax_sub = np.abs(b).max(axis=2)
    amax = amax_sub.max(axis=1, keepdims=True)
    d = amax / (31 * 127) * (1 + F16_REL) + F16_ABS
    tol = 1e-6 * amax + 1e-12
    return amax_sub / 62 + d / 2 + tol


def _check_sub_block_error(x: np.ndarray, y: np.ndarray, qtype: GGMLQuantizationType) -> None:
    sub = 32 if qtype == Q4 else 16
    err = np.abs(y.astype(np.float64) - x).reshape(-1, QK_SUBS[qtype], sub).max(axis=2)
    bound = _q4_k_bound(x) if qtype == Q4 else _q6_k_bound(x)
    worst = float((err / bound).max())
    assert worst <= 1.0, f"{qtype.name}: sub-block error reaches {worst:.3f} of the bound"


def _rel_rms(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.sqrt(np.mean((y.astype(np.float64) - x) ** 2) / np.mean(x.astype(np.float64) ** 2)))


@pytest.mark.parametrize("qtype", [Q4, Q6])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sigma", [1.0, 0.02])
def test_random_normal_roundtrip(qtype: GGMLQuantizationType, shape: tuple[int, int], sigma: float) -> None:
    rng = np.random.default_rng(shape[0] * 10_000 + shape[1] + int(sigma * 100))
    x = (sigma * rng.standard_normal(shape)).astype(np.float32)
    y = _roundtrip(x, qtype)
    _check_sub_block_error(x, y, qtype)
    # Measured: about 0.080 (Q4_K) and 0.0196 (Q6_K), with spread for the 256-value tensors.
    assert _rel_rms(x, y) < (0.095 if qtype == Q4 else 0.023)


@pytest.mark.parametrize("qtype", [Q4, Q6])
def test_shifted_and_scaled_rows(qtype: GGMLQuantizationType) -> None:
    # Rows with a mean far from zero and rows of very different magnitude share super-blocks'
    # neighbours but not their scales.
    rng = np.random.default_rng(7)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    x *= np.logspace(-3, 3, 8, dtype=np.float32)[:, None]
    x[::2] += 5 * np.abs(x[::2]).max(axis=1, keepdims=True)
    y = _roundtrip(x, qtype)
    _check_sub_block_error(x, y, qtype)


@pytest.mark.parametrize("qtype", [Q4, Q6])
def test_all_zero_rows_are_exact(qtype: GGMLQuantizationType) -> None:
    x = np.zeros((3, 512), dtype=np.float32)
    y = _roundtrip(x, qtype)
    assert np.array_equal(y, x)


@pytest.mark.parametrize("qtype", [Q4, Q6])
@pytest.mark.parametrize("c", [0.25, 1.0, -1.0, 3.7, -2.5, 123.0, -1000.0])
def test_constant_rows(qtype: GGMLQuantizationType, c: float) -> None:
    # The largest value lands on the top grid point, which float16 rounding of d (or dmin) can
    # move up by at most one relative ulp.
    x = np.full((2, 512), c, dtype=np.float32)
    y = _roundtrip(x, qtype)
    assert np.abs(y - x).max() <= F16_REL * abs(c) * 1.001


@pytest.mark.parametrize("qtype", [Q4, Q6])
@pytest.mark.parametrize("c", [1e-3, -1e-3])
def test_tiny_constant_rows(qtype: GGMLQuantizationType, c: float) -> None:
    # Here d is a float16 subnormal, so the step is coarser than 2**-10 relative but still small.
    x = np.full((1, 256), c, dtype=np.float32)
    y = _roundtrip(x, qtype)
    assert np.abs(y - x).max() <= abs(c) / 30


@pytest.mark.parametrize("qtype", [Q4, Q6])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_one_signed_blocks(qtype: GGMLQuantizationType, sign: float) -> None:
    rng = np.random.default_rng(11)
    x = (sign * np.abs(rng.standard_normal((6, 768)))).astype(np.float32)
    y = _roundtrip(x, qtype)
    _check_sub_block_error(x, y, qtype)
    assert _rel_rms(x, y) < (0.06 if qtype == Q4 else 0.023)


@pytest.mark.parametrize("qtype", [Q4, Q6])
def test_sub_scales_use_their_range(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 1024)).astype(np.float32)
    if qtype == Q4:
        blocks = quantize_q4_k(x).reshape(-1, 144)
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        assert (sc.max(axis=1) == 63).all()
        assert (m.max(axis=1) == 63).all()
    else:
        blocks = quantize_q6_k(x).reshape(-1, 210)
        sc = blocks[:, 192:208].view(np.int8)
        assert (sc.max(axis=1) == 127).all()


@pytest.mark.parametrize("qtype", [Q4, Q6])
@pytest.mark.parametrize("shape", [(1, 256), (7, 512), (2, 4096), (0, 256)])
def test_output_size_matches_ggml(qtype: GGMLQuantizationType, shape: tuple[int, int]) -> None:
    quantize = quantize_q4_k if qtype == Q4 else quantize_q6_k
    raw = quantize(np.ones(shape, dtype=np.float32))
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    assert raw.dtype == np.uint8
    assert raw.shape == (shape[0], shape[1] // block_values * block_bytes)
    assert raw.shape == gguf.quants.quant_shape_to_byte_shape(shape, qtype)


@pytest.mark.parametrize("quantize", [quantize_q4_k, quantize_q6_k])
@pytest.mark.parametrize("shape", [(2, 100), (1, 300), (4, 0), (256,), (2, 2, 256)])
def test_bad_shapes_raise(quantize, shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError):
        quantize(np.zeros(shape, dtype=np.float32))


@pytest.mark.parametrize("quantize", [quantize_q4_k, quantize_q6_k])
@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e9])
def test_unencodable_values_raise(quantize, bad: float) -> None:
    x = np.zeros((1, 256), dtype=np.float32)
    x[0, 5] = bad
    with pytest.raises(ValueError):
        quantize(x)
