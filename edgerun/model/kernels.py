"""Matrix products ggml lacks a fast kernel for, as a custom op in ggml graphs (kernels.c, compiled by the install
into `_kernels*.so` beside this file).

Q4_1 and Q8_0 weights (the shipped model's layers and LM head, Gemma's head) times one or several columns: ggml
multiplies Q4_1 one column at a time and Q8_0 little better, and on x86 repacks neither; kernels.c loads each
weight block once for every column, dots with AVX-512 VNNI, and gives ggml's results bit for bit. A decode
step's one column gains too: the shipped model's step 16-19 ms against 20-25 on ggml's dot products, Gemma 3
270M's (its 262144-row Q8_0 head) 31 against 41 ms, one thread on a 2-core Xeon. Q6_K weights (a Q4_K_M file's
LM head, some attn_v and ffn_down) times up to 7 columns, in 512-bit registers with the next rows prefetched:
32768 x 2048 rows times one column 6.7-6.9 ms against ggml's 9.4-9.6, times four 8.5-9.4 against 17-18 (one
thread, this machine). On a CPU with AVX2 and no AVX-512 (an older server's or a laptop's) the Q4_1 and Q8_0
products run in 256-bit registers, one column to a register: the shipped model's step of 8 sequences 35.5 ms against
74 on ggml's dot products, one sequence's 10.6 against 11.4 (one thread, 2-core AMD EPYC VM with AVX2; its own
prefetching of the next rows made it slower there, so that kernel leaves it to the CPU). `product` uses it only
where it is built, the CPU has its instructions (er_product_types) and a check against ggml's own product on this
machine gave the same bits, per weight type; anywhere else a product is ggml's mul_mat.

Q4_0 weights (the commonest 4-bit files' matrices) are taken where ggml put them: in its CPU_REPACK buffer, 8 rows
interleaved, as llama.cpp does on x86. ggml's kernels for that layout take 4 columns a pass (16 where there are 16),
unpacking every weight again each pass; kernels.c takes 16 in one, its integer dots with AVX-512 VNNI, and adds each
block into each output as ggml's kernels do (one fused multiply-add a block, in order), so every output is theirs
bit for bit. A 8192 x 2048 matrix times 8 columns 0.94 ms against 2.75, times 64 (a prompt's chunk) 6.3 against 16.5,
times one 0.46 against 0.58 (one thread, 2-core Xeon): a synthetic 1B's 40-token prompt 345 against 667 ms, its step
of 8 sequences 153 against 230, one sequence's 79 against 124. On AVX2 without VNNI, a column at a time against the
8 rows' unpacked block (ggml's AVX2 integer dot: bytes to 16-bit pairs, pairs to 32 bits): on the same Xeon, 8 columns
1.55 ms and 64 12.3, against its ggml's AVX-512 build's 2.62 and 16.8.

Attention of decode tokens and of prompt chunks under 64 tokens (heads of 64 values) too: there ggml's flash
attention takes ~110 ns a cache row and query head on an AVX-512 Xeon (a function call per score, a scalar loop per
value row), a third of a batched step of 8 sequences; kernels.c runs every sequence's in one op, the query heads of
a key-value head together, in registers, with ggml's arithmetic in its order (AVX-512's or AVX2's: the two builds
add a score's products in different orders). On the AVX2 EPYC the shipped model's step of 8 sequences took 35.7
against 37.3 ms with it (one thread), 18.9 against 20.7 (two). Its rows go in tiles, scores first, with the next
rows prefetched: on a 2-core AVX-512 EPYC, 150 steps of 8 sequences from position 76 took 26.0-31.0 ms a step
against 35.2-38.3 row by row without prefetching, where the step waited on its cache rows; with 3 or 4 query heads
to a key-value head (the shipped model's, Llama 3.2 1B's) their accumulators stay in registers, and the attention's
share of such a step fell from 10.6% to 8.1% of its samples (perf, positions 51-80). `attention` is used
where a check against ggml's flash attention gave its bits (the check also finds which of ggml's multiply-adds its
compiler fused).

The checks' verdicts are kept in the cache folder per build of ggml and of kernels.c and per CPU: the first process
runs them, the rest read them.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import glob
import hashlib
import itertools
import json
import os
import platform
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from edgerun.cache import cache_root
from edgerun.model import ggml_lib

Q4_0, Q4_1, Q8_0, Q8_1, Q6_K, Q8_K = (int(GGMLQuantizationType[t])
                                     for t in ("Q4_0", "Q4_1", "Q8_0", "Q8_1", "Q6_K", "Q8_K"))
# weight type: (kernels.c's number for it, the type ggml quantizes the activations to for its dot product). Q4_0 is
# taken as ggml's CPU_REPACK buffer holds it (its q4_0_8x8 layout on x86), where llama.cpp's rule puts it.
WEIGHTS = {Q4_1: (0, Q8_1), Q8_0: (1, Q8_0), Q6_K: (2, Q8_K), Q4_0: (3, Q8_0)}
REPACKED = {Q4_0}  # weight types the op reads in a CPU_REPACK buffer (rows a multiple of 8), the others in host memory
REPACK_BUFFER = b"CPU_REPACK"
# Columns up to which the op takes a product, per weight type: ggml computes Q6_K times 8 or more columns another way
# (other bits), so there the op would not give its bits and its product is ggml's own.
MOST_COLUMNS = {Q6_K: 7}
ALL_THREADS = -1  # GGML_N_TASKS_MAX: the op runs on every thread of the graph's computation
# Weight types whose products ggml computes another way from more columns than this on (repacked Q4_K in tiles of 4
# columns, Q6_K from 8), a column's bits then unlike its bits alone; every other type's product gives each column
# its bits alone at any count (tests/test_kernels.py checks both here). Where a product's columns are separate
# sequences (each_column_alone), these go in groups of at most that many.
ALONE_COLUMNS = {int(GGMLQuantizationType.Q4_K): 3, Q6_K: 7}
_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("each_column_alone", default=False)


@contextlib.contextmanager
def each_column_alone() -> Iterator[None]:
    """Products made meanwhile (product) give every column the bits it gets alone: for a batched decode step, whose
    columns are sequences that must each get the tokens they get alone. A prompt's products stay ggml's own (those
    llama.cpp computes)."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


def columns_alone() -> bool:
    """Whether products made now give each column its bits alone (each_column_alone)."""
    return _ALONE.get()


class _Params(ctypes.Structure):
    _fields_ = (("weights", ctypes.c_int32), ("quantize", ctypes.c_void_p))


ATTENTION_HEAD = 64  # kernels.c's attention takes heads of 64 values (ATTN_HEAD)
ATTENTION_MAX_GROUP = 8  # and at most this many query heads to a key-value head (ATTN_MAX_GROUP)
ATTENTION_MAX_TOKENS = 256  # tokens in one op (ATTN_MAX_TOKENS)
# ggml's flash attention computes this many query rows of a sequence or more in tiles (GGML_FA_TILE_Q), in another
# order: prompt chunks that long keep ggml's
FA_TILE_Q = 64


class _AttentionParams(ctypes.Structure):
    """struct er_attention_params: the heads, the scores' scale, how ggml's compiler rounded its multiply-adds
    (_attention_variant) and the rows each token's view of its cache spans in ggml's graph (which decide how ggml
    splits them among threads)."""

    _fields_ = (("n_heads", ctypes.c_int32), ("n_kv_heads", ctypes.c_int32), ("scale", ctypes.c_float),
                ("fused_mad", ctypes.c_int32), ("fused_sum", ctypes.c_int32), ("fused_merge", ctypes.c_int32),
                ("n_kv", ctypes.c_int32 * ATTENTION_MAX_TOKENS))


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
        self.dll.er_product_types.restype = ctypes.c_int
        self.dll.er_attention_available.restype = ctypes.c_int
        self.dll.er_tensor_data_offset.restype = ctypes.c_size_t
        self.op = ctypes.cast(self.dll.er_product, ctypes.c_void_p).value
        g = ggml_lib.lib()
        self.params = {qtype: _Params(number, TypeTraitsCpu.from_address(g.ggml_get_type_traits_cpu(acts)).from_float)
                       for qtype, (number, acts) in WEIGHTS.items()}
        self.checked: set[int] = set()  # the weight types whose products matched ggml's here
        self.attention_op = ctypes.cast(self.dll.er_attention, ctypes.c_void_p).value
        # (fused_mad, fused_sum, fused_merge) where the attention gave ggml's flash attention's bits here, else None
        self.attention_variant: tuple[int, int, int] | None = None

    def product(self, ctx: int, w: int, x: int) -> int:
        g = ggml_lib.lib()
        n_rows, n_cols = ggml_lib.head(w).ne[1], ggml_lib.head(x).ne[1]
        args = (ctypes.c_void_p * 2)(w, x)
        return g.ggml_custom_4d(ctx, ggml_lib.F32, n_rows, n_cols, 1, 1, args, 2, self.op, ALL_THREADS,
                                ctypes.addressof(self.params[ggml_lib.head(w).type]))

    def attention(self, gc: ggml_lib.GraphContext, q: int, k_cache: int, v_cache: int, pos: int, rows: int,
                  n_kv_heads: int, scale: float, n_kv: Sequence[int]) -> int:
        g = ggml_lib.lib()
        hq = ggml_lib.head(q)
        assert self.attention_variant is not None and len(n_kv) == hq.ne[2] <= ATTENTION_MAX_TOKENS
        params = _AttentionParams(int(hq.ne[1]), n_kv_heads, scale, *self.attention_variant,
                                  (ctypes.c_int32 * ATTENTION_MAX_TOKENS)(*n_kv))
        gc.keep(params)  # the graph holds it by address
        args = (ctypes.c_void_p * 5)(q, k_cache, v_cache, pos, rows)
        return g.ggml_custom_4d(gc.ctx, ggml_lib.F32, hq.ne[0] * hq.ne[1], hq.ne[2], 1, 1, args, 5,
                                self.attention_op, ALL_THREADS, ctypes.addressof(params))


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
    if not kernels.dll.er_product_types() or not _layout_matches(kernels):
        return None
    key = _build_key(path)
    known = _verdicts().get(key)
    if known is not None:
        kernels.checked = set(known["checked"])
        kernels.attention_variant = None if known["attention"] is None else tuple(known["attention"])
        return kernels
    kernels.checked = {qtype for qtype in runs_here(kernels) if _same_as_ggml(kernels, qtype)}
    kernels.attention_variant = _attention_variant(kernels) if kernels.dll.er_attention_available() else None
    _remember(key, {"checked": sorted(kernels.checked), "attention": kernels.attention_variant})
    return kernels


# The checks' verdicts per build of ggml and of kernels.c and per CPU: every process that loads the kernels would
# otherwise run them again (~0.3 s here; 1-2 s where no way of rounding gives ggml's attention bits).
VERDICTS_FILE = "kernels.json"


def _build_key(path: Path) -> str:
    """What the verdicts depend on: the libraries' files (a rebuild changes their size or time) and the CPU's
    model and instruction set."""
    files = [Path(p) for p in ggml_lib.lib().paths] + [path]
    try:
        cpu = "\n".join(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                        if line.startswith(("model name", "flags")))
    except OSError:
        cpu = platform.processor() or platform.machine()
    return json.dumps([[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in files] +
                      [hashlib.sha256(cpu.encode()).hexdigest()[:16]])


def _verdicts() -> dict:
    try:
        known = json.loads((cache_root() / VERDICTS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _remember(key: str, verdict: dict) -> None:
    """Kept beside the other verdicts, written whole and then renamed in: processes that load at once (a cluster's
    nodes) never read half a file."""
    index = cache_root() / VERDICTS_FILE
    known = _verdicts()
    known[key] = verdict
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        partial = index.with_name(f".{index.name}.{os.getpid()}.{threading.get_ident()}")
        partial.write_text(json.dumps(known))
        os.replace(partial, index)
    except OSError:
        pass  # a read-only cache: the checks run again in the next process


def runs_here(kernels: _Kernels) -> list[int]:
    """The weight types whose products this CPU runs: all four with AVX-512 VNNI, all but Q6_K with AVX2."""
    types = kernels.dll.er_product_types()
    return [qtype for qtype, (number, _) in WEIGHTS.items() if types >> number & 1]


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
    wi = store.add("w", w, repack=qtype in REPACKED)
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


def _attention_variant(kernels: _Kernels) -> tuple[int, int, int] | None:
    """The way of rounding (fused_mad, fused_sum, fused_merge) in which kernels.c's attention gives ggml's flash
    attention's bits on this machine (ggml's compiler may fuse its scalar multiply-adds or not, and which product of
    a sum of two): each tried on seeded queries and caches, short and long (split among threads), for 3 query heads
    to a key-value head and for the other groupings kernels.c builds apart (4) or not (7); None where none does."""
    checks = [(9, 3, seed) for seed in range(4)] + [(8, 2, 0), (14, 2, 0)]
    for variant in itertools.product((1, 0), (1, 0), (0, 1, 2)):
        kernels.attention_variant = variant
        if all(np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
               for heads, kv_heads, seed in checks
               for ours, theirs in compare_attention(kernels, heads, kv_heads, seed=seed)):
            return variant
    return None


def compare_attention(kernels: _Kernels, n_heads: int = 9, n_kv_heads: int = 3,
                      positions: Sequence[int] = (5, 200, 300, 700, 1000), threads: int = 2, seed: int = 0,
                      slot: int = 1024, kv_step: int = 256) -> list[tuple[np.ndarray, np.ndarray]]:
    """Decode tokens at `positions`, each of its own sequence (a slot of `slot` cache rows, read through a view of
    the next multiple of kv_step), through seeded queries and F16 caches: (kernels.c's attention, ggml's flash
    attention as the engine builds it), (64 * n_heads,) each."""
    g = ggml_lib.lib()
    rng = np.random.default_rng(seed)
    hd, b = ATTENTION_HEAD, len(positions)
    scale = float(1 / np.sqrt(hd))
    backend = ggml_lib.GgmlBackend(threads=threads)
    store = ggml_lib.WeightStore(backend)
    caches = [store.cache(name, hd * n_kv_heads, slot * b) for name in ("k", "v")]
    store.upload()
    for cache in caches:  # keys and values of every row, with a large spread as a model's have
        values = (rng.standard_normal((slot * b, hd * n_kv_heads)) * rng.uniform(0.1, 4.0)).astype(np.float16)
        g.ggml_backend_tensor_set(store.tensor(cache), values.ctypes.data, 0, values.nbytes)
    kc, vc = (store.tensor(c) for c in caches)
    gc = ggml_lib.GraphContext(backend, 64 + 12 * b)
    q = gc.input(ggml_lib.F32, hd * n_heads, b)
    pos, rows = gc.input(ggml_lib.I32, b), gc.input(ggml_lib.I64_TYPE, b)
    q3 = g.ggml_reshape_3d(gc.ctx, q, hd, n_heads, b)
    views = [min(slot, -(-(position + 1) // kv_step) * kv_step) for position in positions]
    ours = kernels.attention(gc, q3, kc, vc, pos, rows, n_kv_heads, scale, views)
    row, per_head = ggml_lib.head(kc).nb[1], g.ggml_row_size(ggml_lib.F16, hd)
    masks, outs = [], []
    for i, (position, n_kv) in enumerate(zip(positions, views, strict=True)):
        mask = gc.input(ggml_lib.F16, n_kv, 1)
        masks.append((mask, n_kv, position))
        qs = g.ggml_view_3d(gc.ctx, q3, hd, n_heads, 1, ggml_lib.head(q3).nb[1], ggml_lib.head(q3).nb[2],
                            i * ggml_lib.head(q3).nb[2])
        keys, values = (g.ggml_permute(gc.ctx, g.ggml_view_3d(gc.ctx, c, hd, n_kv_heads, n_kv, per_head, row,
                                                               i * slot * row), 0, 2, 1, 3) for c in (kc, vc))
        out = g.ggml_flash_attn_ext(gc.ctx, g.ggml_permute(gc.ctx, qs, 0, 2, 1, 3), keys, values, mask, scale, 0.0,
                                    0.0)
        g.ggml_prec_set_acc(out, ggml_lib.PREC_F32)
        outs.append(g.ggml_reshape_2d(gc.ctx, out, hd * n_heads, 1))
    theirs = functools.reduce(lambda x, y: g.ggml_concat(gc.ctx, x, y, 1), outs)
    gc.expand(ours)
    gc.expand(theirs)
    gc.allocate()
    gc.set(q, (rng.standard_normal((b, hd * n_heads)) * 3).astype(np.float32))
    gc.set(pos, np.asarray(positions, np.int32))
    gc.set(rows, np.asarray(positions, np.int64) + np.arange(b, dtype=np.int64) * slot)
    for mask, n_kv, position in masks:
        m = np.full((1, n_kv), -np.inf, np.float16)
        m[0, :position + 1] = 0
        gc.set(mask, m)
    gc.compute()
    shape = (b, hd * n_heads)
    return [(gc.get(ours, np.empty(shape, np.float32))[i], gc.get(theirs, np.empty(shape, np.float32))[i])
            for i in range(b)]


def attention_available(head_dim: int, n_heads: int, n_kv_heads: int, tokens: int) -> bool:
    """Whether attention of `tokens` tokens with these heads takes kernels.c's op in this process."""
    kernels = _kernels()
    return kernels is not None and kernels.attention_variant is not None and head_dim == ATTENTION_HEAD \
        and n_heads % n_kv_heads == 0 and n_heads // n_kv_heads <= ATTENTION_MAX_GROUP \
        and tokens <= ATTENTION_MAX_TOKENS


def attention(gc: ggml_lib.GraphContext, q: int, k_cache: int, v_cache: int, pos: int, rows: int, n_kv_heads: int,
              scale: float, n_kv: Sequence[int]) -> int:
    """Attention of n tokens, each over every position of its own sequence up to its own: q (64, n_heads, n) F32
    after rope, the caches (64 * n_kv_heads, cache rows) F16 with this step's rows set (pass ggml_set_rows'
    results), token t at position pos[t] (I32) having written cache row rows[t] (I64). Gives (64 * n_heads, n): the
    bits of ggml's flash attention (the heads of each token in order) of a decode token over a view of n_kv[t] cache
    rows from its sequence's first, masked to its positions, or where n_kv[t] is 0 of a token of a prompt chunk
    under FA_TILE_Q tokens; only where attention_available."""
    kernels = _kernels()
    assert kernels is not None
    return kernels.attention(gc, q, k_cache, v_cache, pos, rows, n_kv_heads, scale, n_kv)


def available(qtype: int) -> bool:
    """Whether products of `qtype` rows take kernels.c's op in this process."""
    kernels = _kernels()
    return kernels is not None and qtype in kernels.checked


def invariant_products(qtypes: Iterable[str]) -> bool:
    """Whether every product of weights of these types (GGUF names) takes kernels.c's op here at any column count,
    so that a column's bits are those it gets in a product of any other columns (Q4_0, Q4_1 and Q8_0, where the op
    passed its check): a step may then run several sequences' prompt chunks and decode tokens as one."""
    kernels = _kernels()
    names = set(qtypes)
    return kernels is not None and all(name in ("Q4_0", "Q4_1", "Q8_0") and int(GGMLQuantizationType[name]) in
                                       kernels.checked for name in names)


def usable_here() -> bool:
    """Whether this CPU runs kernels.c's op for some weight type (where the install built it)."""
    path = library_path()
    return path is not None and bool(ctypes.CDLL(str(path)).er_product_types())


def product(ctx: int, w: int, x: int) -> int:
    """w (k, n) times x (k, m): ggml's mul_mat, or kernels.c's op where w is Q4_1, Q8_0 or Q6_K in plain host memory
    or Q4_0 repacked (up to MOST_COLUMNS), x is contiguous float columns and the kernels are usable here (the same
    bits either way). Under each_column_alone, an ALONE_COLUMNS type's columns go in groups that ggml multiplies as
    it multiplies one."""
    g = ggml_lib.lib()
    hw, hx = ggml_lib.head(w), ggml_lib.head(x)
    most = ALONE_COLUMNS.get(hw.type)
    if most is not None and hx.ne[1] > most and _ALONE.get():
        if hx.ne[2] != 1 or hx.ne[3] != 1:
            raise ValueError("a product whose columns are each alone takes a matrix of columns")
        parts = [product(ctx, w, g.ggml_view_2d(ctx, x, hx.ne[0], min(most, hx.ne[1] - c), hx.nb[1], c * hx.nb[1]))
                 for c in range(0, hx.ne[1], most)]
        return functools.reduce(lambda a, b: g.ggml_concat(ctx, a, b, 1), parts)
    if hw.type in WEIGHTS and hx.type == ggml_lib.F32 and hx.ne[2] == 1 and hx.ne[3] == 1 \
            and hx.ne[1] <= MOST_COLUMNS.get(hw.type, hx.ne[1]) \
            and hx.nb[0] == 4 and hx.nb[1] == 4 * hx.ne[0] and _laid_out(hw):
        kernels = _kernels()
        if kernels is not None and hw.type in kernels.checked:
            return kernels.product(ctx, w, x)
    return g.ggml_mul_mat(ctx, w, x)


def _laid_out(hw: ggml_lib.TensorHead) -> bool:
    """Whether a weight tensor is laid out as the op reads its type: in host memory (a repacking buffer is not a host
    one), or for a REPACKED type in a CPU_REPACK buffer (ggml repacks rows in groups of 8, a view at such a row)."""
    g = ggml_lib.lib()
    if not hw.buffer:
        return False
    if hw.type not in REPACKED:
        return bool(g.ggml_backend_buffer_is_host(hw.buffer))
    return hw.ne[1] % 8 == 0 and g.ggml_backend_buft_name(g.ggml_backend_buffer_get_type(hw.buffer)) == REPACK_BUFFER
