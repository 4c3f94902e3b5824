"""Matrix products ggml lacks a fast kernel for, as a custom op in ggml graphs (kernels.c, compiled by the install
into `_kernels*.so` beside this file).

Q4_1 and Q8_0 weights (the shipped model's layers and LM head, Gemma's head) times one or several columns: ggml
multiplies Q4_1 one column at a time and Q8_0 little better, and on x86 repacks neither; kernels.c loads each
weight block once for every column, dots with AVX-512 VNNI, and gives ggml's results bit for bit. A decode
step's one column gains too: the shipped model's step 16-19 ms against 20-25 on ggml's dot products, Gemma 3
270M's (its 262144-row Q8_0 head) 31 against 41 ms, one thread on a 2-core Xeon. Q6_K weights (a Q4_K_M file's
LM head, some attn_v and ffn_down) times up to 7 columns, in 512-bit registers with the next rows prefetched:
32768 x 2048 rows times one column 6.7-6.9 ms against ggml's 9.4-9.6, times four 8.5-9.4 against 17-18 (one
thread, this machine). `product` uses it only where it
is built, the CPU has its instructions (AVX-512 VNNI) and a check against ggml's own product on this machine gave
the same bits, per weight type; anywhere else a product is ggml's mul_mat.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from edgerun.model import ggml_lib

Q4_1, Q8_0, Q8_1, Q6_K, Q8_K = (int(GGMLQuantizationType[t]) for t in ("Q4_1", "Q8_0", "Q8_1", "Q6_K", "Q8_K"))
# weight type: (kernels.c's number for it, the type ggml quantizes the activations to for its dot product)
WEIGHTS = {Q4_1: (0, Q8_1), Q8_0: (1, Q8_0), Q6_K: (2, Q8_K)}
# Columns up to which ggml takes its one-row dot products, per weight type: it computes Q6_K times 8 or more columns
# another way (other bits), so there the op would not give its bits and its product is ggml's own.
MOST_COLUMNS = {Q6_K: 7}
ALL_THREADS = -1  # GGML_N_TASKS_MAX: the op runs on every thread of the graph's computation


class _Params(ctypes.Structure):
    _fields_ = (("weights", ctypes.c_int32), ("quantize", ctypes.c_void_p))


class TypeTraitsCpu(ctypes.Structure):
    """struct ggml_type_traits_cpu: a type's conversion from float, its dot product and the type it dots with."""

    _fields_ = (("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64))


def library_path() -> Path | None:
    found = sorted(glob.glob(str(Path(__file__).with_name("_kernels")) + "*.so"))
    return Path(found[0]) if found else None


class _Kernels:
    """The library, its op and the parameters the op is given per weight type (kept alive for as long as graphs may
    call it)."""

    def __init__(self, path: Path) -> None:
        self.dll = ctypes.CDLL(str(path))
        self.dll.er_product_available.restype = ctypes.c_int
        self.dll.er_tensor_data_offset.restype = ctypes.c_size_t
        self.op = ctypes.cast(self.dll.er_product, ctypes.c_void_p).value
        g = ggml_lib.lib()
        self.params = {qtype: _Params(number, TypeTraitsCpu.from_address(g.ggml_get_type_traits_cpu(acts)).from_float)
                       for qtype, (number, acts) in WEIGHTS.items()}
        self.checked: set[int] = set()  # the weight types whose products matched ggml's here

    def product(self, ctx: int, w: int, x: int) -> int:
        g = ggml_lib.lib()
        n_rows, n_cols = ggml_lib.head(w).ne[1], ggml_lib.head(x).ne[1]
        args = (ctypes.c_void_p * 2)(w, x)
        return g.ggml_custom_4d(ctx, ggml_lib.F32, n_rows, n_cols, 1, 1, args, 2, self.op, ALL_THREADS,
                                ctypes.addressof(self.params[ggml_lib.head(w).type]))


_LOADING = threading.Lock()


def _kernels() -> _Kernels | None:
    """The kernels where they are built, this CPU runs them, and for the weight types whose products give ggml's
    bits here (`checked`); else None. Made once, under a lock: graphs hold the address of its parameters, so an
    instance made by a second thread at the same time and then dropped would leave them pointing at freed memory
    (a worker warming a stage up while a pass builds another stage's graph)."""
    with _LOADING:
        return _load()


@functools.cache
def _load() -> _Kernels | None:
    path = library_path()
    if path is None:
        return None
    kernels = _Kernels(path)
    if not kernels.dll.er_product_available() or not _layout_matches(kernels):
        return None
    kernels.checked = {qtype for qtype in WEIGHTS if _same_as_ggml(kernels, qtype)}
    return kernels


def _layout_matches(kernels: _Kernels) -> bool:
    """Whether ggml's tensor struct keeps its data pointer where kernels.c reads it (the llama.cpp version pinned)."""
    ctx = ggml_lib.new_context(1)
    try:
        t = ggml_lib.lib().ggml_new_tensor_1d(ctx, ggml_lib.F32, 1)
        offset = kernels.dll.er_tensor_data_offset()
        ctypes.c_void_p.from_address(t + offset).value = 0x5EED0
        return ggml_lib.lib().ggml_get_data(t) == 0x5EED0
    finally:
        ggml_lib.lib().ggml_free(ctx)


def _same_as_ggml(kernels: _Kernels, qtype: int) -> bool:
    """A product of seeded rows of `qtype` with 1-17 columns (Q6_K: up to MOST_COLUMNS) on 2 threads, by kernels.c
    and by ggml's mul_mat: the same bits."""
    k = 512 if qtype == Q6_K else 96  # whole blocks: 256 values a Q6_K block, 32 the others'
    columns = [c for c in (1, 2, 5, 7, 16, 17) if c <= MOST_COLUMNS.get(qtype, c)]
    return all(np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
               for ours, theirs in compare(kernels, qtype, k, 24, columns, threads=2))


def compare(kernels: _Kernels, qtype: int, k: int, n: int, columns: Sequence[int], threads: int,
            seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Seeded rows (n, k) of `qtype` times seeded columns, each count of `columns`: (kernels.c's product,
    ggml's), each (columns, n)."""
    from edgerun.model.quant import quantize

    rng = np.random.default_rng(seed)
    w = quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType(qtype).name)
    backend = ggml_lib.GgmlBackend(threads=threads)
    store = ggml_lib.WeightStore(backend)
    wi = store.add("w", w, repack=False)
    store.upload()
    out = []
    for cols in columns:
        x = rng.standard_normal((cols, k)).astype(np.float32)
        gc = ggml_lib.GraphContext(backend, 8)
        xt = gc.input(ggml_lib.F32, k, cols)
        ours, theirs = kernels.product(gc.ctx, store.tensor(wi), xt), \
            ggml_lib.lib().ggml_mul_mat(gc.ctx, store.tensor(wi), xt)
        gc.expand(ours)
        gc.expand(theirs)
        gc.allocate()
        gc.set(xt, x)
        gc.compute()
        out.append(tuple(gc.get(t, np.empty((cols, n), np.float32)) for t in (ours, theirs)))
    return out


def available(qtype: int) -> bool:
    """Whether products of `qtype` rows take kernels.c's op in this process."""
    kernels = _kernels()
    return kernels is not None and qtype in kernels.checked


def usable_here() -> bool:
    """Whether this CPU runs kernels.c's op (where the install built it)."""
    path = library_path()
    return path is not None and bool(ctypes.CDLL(str(path)).er_product_available())


def product(ctx: int, w: int, x: int) -> int:
    """w (k, n) times x (k, m): ggml's mul_mat, or kernels.c's op where w is Q4_1, Q8_0 or Q6_K (up to
    MOST_COLUMNS) in plain host memory (not repacked), x is contiguous float columns and the kernels are usable here
    (the same bits either way)."""
    g = ggml_lib.lib()
    hw, hx = ggml_lib.head(w), ggml_lib.head(x)
    if hw.type in WEIGHTS and hx.type == ggml_lib.F32 and hx.ne[2] == 1 and hx.ne[3] == 1 \
            and hx.ne[1] <= MOST_COLUMNS.get(hw.type, hx.ne[1]) \
            and hx.nb[0] == 4 and hx.nb[1] == 4 * hx.ne[0] \
            and hw.buffer and g.ggml_backend_buffer_is_host(hw.buffer):  # a repacking buffer is not a host one
        kernels = _kernels()
        if kernels is not None and hw.type in kernels.checked:
            return kernels.product(ctx, w, x)
    return g.ggml_mul_mat(ctx, w, x)
