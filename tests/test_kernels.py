"""The batched products of Q4_1, Q8_0, Q6_K and repacked Q4_0 weights (edgerun/model/kernels.c), a custom op in ggml
graphs: ggml's own products bit for bit, on any count of columns (Q6_K: up to 7) and threads, so a batch of sequences
and a prompt's chunk give the tokens they gave before (and llama.cpp's)."""

from __future__ import annotations

import itertools
import platform

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from edgerun.model import kernels


def test_the_install_builds_the_kernels() -> None:
    assert kernels.library_path() is not None, "the install builds edgerun/model/_kernels*.so (setup.py)"


@pytest.fixture(scope="module")
def built() -> kernels._Kernels:
    path = kernels.library_path()
    assert path is not None
    if platform.machine() != "x86_64" or not kernels.usable_here():
        pytest.skip("this CPU lacks AVX2: products stay ggml's")
    loaded = kernels._kernels()
    assert loaded is not None
    runs = kernels.runs_here(loaded)
    # every x86-64 CPU with AVX2 runs the Q4_1, Q8_0 and repacked Q4_0 products; AVX-512 VNNI adds Q6_K
    assert {kernels.Q4_1, kernels.Q8_0, kernels.Q4_0} <= set(runs)
    for qtype in runs:
        assert kernels.available(qtype), f"the op runs here but its check against ggml's {qtype} product failed"
    return loaded


@pytest.fixture(scope="module")
def q6_k(built) -> kernels._Kernels:
    if kernels.Q6_K not in kernels.runs_here(built):
        pytest.skip("Q6_K products take AVX-512 VNNI: here they stay ggml's")
    return built


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("k", "n"), [(576, 200), (1536, 67), (64, 5)])
def test_the_batched_product_is_ggmls_bit_for_bit(built, qtype: str, threads: int, k: int, n: int) -> None:
    """Shapes of the shipped model's matrices (and odd ones: rows that do not split evenly among threads, a row
    count below the thread count), 2 to 40 columns: column pairs (2, 3, 6: odd counts leave half a pair), sets of 8
    columns across the lanes from 7 on (7 and 9 leave sets part empty, 15 and 16 take two), more than one pass of 16
    (17, 40)."""
    number = int(GGMLQuantizationType[qtype])
    columns = (2, 3, 6, 7, 8, 9, 15, 16, 17, 40)
    for cols, (ours, theirs) in zip(columns, kernels.compare(built, number, k, n, columns, threads, seed=k + n),
                                    strict=True):
        assert ours.shape == (cols, n)
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), (cols, k, n, threads)
        assert np.isfinite(ours).all() and np.abs(ours).max() > 0


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("k", "n"), [(2048, 200), (576, 64), (64, 8)])
def test_the_repacked_q4_0_product_is_ggmls_bit_for_bit(built, amx: bool, threads: int, k: int, n: int) -> None:
    """Q4_0 rows as ggml's CPU_REPACK buffer holds them (8 rows' blocks interleaved, where llama.cpp and the engine
    put a Q4_0 file's matrices on x86) times 1 to 100 columns: a decode step, a batch, a prompt's chunk (several
    passes of 16, odd counts leaving half a pair), with row groups of 8 that do not split evenly among threads, or
    fewer groups than threads. On a CPU with AMX, from 16 columns the tiles take the products (tiles of 16 columns
    part empty at 17, 40 and 100, more than one pass of 64 at 100, a thread's last group of 8 alone where its count
    is odd); and without them (er_force_no_amx) the AVX-512 kernel does."""
    if amx and not built.dll.er_amx_available():
        pytest.skip("this CPU has no AMX int8 tiles (or Linux does not let this process use them)")
    columns = (1, 2, 3, 8, 15, 16, 17, 40, 64, 100)
    built.dll.er_force_no_amx(0 if amx else 1)
    try:
        for cols, (ours, theirs) in zip(columns, kernels.compare(built, kernels.Q4_0, k, n, columns, threads,
                                                                 seed=k + n), strict=True):
            assert ours.shape == (cols, n)
            assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), (cols, k, n, threads)
            assert np.isfinite(ours).all() and np.abs(ours).max() > 0
    finally:
        built.dll.er_force_no_amx(0)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_avx2_products_are_ggmls_bit_for_bit(built, qtype: str, threads: int) -> None:
    """The AVX2 kernels (a laptop's or an older server's CPU, without AVX-512), run here whatever this CPU has
    (er_force_avx2): ggml's products bit for bit, as the AVX-512 ones, at every column count."""
    number = int(GGMLQuantizationType[qtype])
    columns = (1, 2, 3, 8, 9, 16, 17, 40)
    built.dll.er_force_avx2(1)
    try:
        for k, n in ((2048, 200), (576, 64), (64, 8)):
            for cols, (ours, theirs) in zip(columns, kernels.compare(built, number, k, n, columns, threads,
                                                                     seed=k + n + 1), strict=True):
                assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), (cols, k, n, threads)
                assert np.isfinite(ours).all() and np.abs(ours).max() > 0
    finally:
        built.dll.er_force_avx2(0)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("k", "n"), [(2048, 200), (256, 67), (768, 5)])
def test_the_q6_k_product_is_ggmls_bit_for_bit(q6_k, threads: int, k: int, n: int) -> None:
    """Q6_K rows (a Q4_K_M file's LM head, some attn_v and ffn_down) times 1 to 7 columns, the decode steps and
    small batches ggml computes with its one-row dot product: its bits; 8 columns stay ggml's own product."""
    columns = (1, 2, 3, 7)
    for cols, (ours, theirs) in zip(columns, kernels.compare(q6_k, kernels.Q6_K, k, n, columns, threads,
                                                             seed=k + n), strict=True):
        assert ours.shape == (cols, n)
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), (cols, k, n, threads)
        assert np.isfinite(ours).all() and np.abs(ours).max() > 0


def test_a_product_the_op_does_not_take_is_ggmls(built) -> None:
    """Weights of another type or layout, or columns that are not contiguous floats: ggml's mul_mat, which the
    engine's graphs then hold (no custom op); one or several Q4_1 or Q8_0 columns take the op, Q6_K up to 7 columns,
    Q4_0 where ggml repacked it (rows a multiple of 8)."""
    from edgerun.model import ggml_lib

    backend = ggml_lib.GgmlBackend(threads=1)
    store = ggml_lib.WeightStore(backend)
    rng = np.random.default_rng(1)
    from edgerun.model.quant import quantize

    q41 = store.add("a", quantize(rng.standard_normal((32, 64)).astype(np.float32), "Q4_1"), repack=False)
    q80 = store.add("b", quantize(rng.standard_normal((32, 64)).astype(np.float32), "Q8_0"), repack=False)
    q40 = store.add("c", quantize(rng.standard_normal((32, 64)).astype(np.float32), "Q4_0"), repack=False)
    q6k = store.add("d", quantize(rng.standard_normal((32, 256)).astype(np.float32), "Q6_K"), repack=False)
    repacked = store.add("e", quantize(rng.standard_normal((32, 64)).astype(np.float32), "Q4_0"))
    uneven = store.add("f", quantize(rng.standard_normal((36, 64)).astype(np.float32), "Q4_0"))  # not repacked
    store.upload()
    gc = ggml_lib.GraphContext(backend, 8)
    one, many = gc.input(ggml_lib.F32, 64, 1), gc.input(ggml_lib.F32, 64, 4)
    seven, eight = gc.input(ggml_lib.F32, 256, 7), gc.input(ggml_lib.F32, 256, 8)
    g = ggml_lib.lib()
    wide = gc.input(ggml_lib.F32, 128, 4)
    strided = g.ggml_view_2d(gc.ctx, wide, 64, 4, 128 * 4, 0)  # half of each column: columns 512 bytes apart
    ops = {name: g.ggml_op_desc(kernels.product(gc.ctx, store.tensor(w), x)).decode()
           for name, w, x in (("one", q41, one), ("q4_0", q40, many), ("q4_1", q41, many), ("q8_0", q80, many),
                              ("strided", q41, strided), ("q6_k 7", q6k, seven), ("q6_k 8", q6k, eight),
                              ("q4_0 repacked", repacked, many), ("q4_0 36 rows", uneven, many))}
    q6_k = "CUSTOM" if kernels.Q6_K in kernels.runs_here(built) else "MUL_MAT"
    assert ops == {"one": "CUSTOM", "q4_0": "MUL_MAT", "q4_1": "CUSTOM", "q8_0": "CUSTOM", "strided": "MUL_MAT",
                   "q6_k 7": q6_k, "q6_k 8": "MUL_MAT", "q4_0 repacked": "CUSTOM", "q4_0 36 rows": "MUL_MAT"}


@pytest.fixture(scope="module")
def attends(built) -> kernels._Kernels:
    if not built.dll.er_attention_available():
        pytest.skip("the attention op takes AVX2 or AVX-512: here attention stays ggml's")
    if built.attention_variant is None:
        pytest.fail("the attention op runs here but no rounding variant gave ggml's flash attention's bits")
    return built


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(9, 3), (14, 2), (4, 4), (32, 4), (32, 8)])
def test_the_attention_is_ggmls_flash_attention_bit_for_bit(attends, threads: int, n_heads: int,
                                                           n_kv_heads: int) -> None:
    """Decode tokens of several sequences, each over its own cache: ggml's flash attention's bits, for the head
    groupings of the shipped model (9 query heads to 3), Qwen2.5-0.5B (14 to 2), none (4 to 4), 8 to 1 and Llama
    3.2 1B's 4 to 1 (kernels.c builds 3 and 4 apart, their accumulators in registers), at short views, at the edge
    of a view (255, 256) and at views ggml splits among its threads (512 rows on)."""
    positions = (0, 1, 37, 255, 256, 600, 1023)
    for seed in range(2):
        pairs = kernels.compare_attention(attends, n_heads, n_kv_heads, positions, threads, seed)
        for position, (ours, theirs) in zip(positions, pairs, strict=True):
            assert ours.shape == (64 * n_heads,)
            assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), (position, threads, seed)
            assert np.isfinite(ours).all() and np.abs(ours).max() > 0


def test_the_engines_decode_steps_give_the_same_bits_with_the_attention_op(attends, monkeypatch) -> None:
    """The shipped model's batched decode step and one sequence's decode step: the logits with kernels.c's attention
    (the default here) are those with ggml's flash attention, bit for bit."""
    from edgerun.model.ggml_engine import GgmlEngine
    from edgerun.model.loader import load_model

    model = load_model()
    tokens = model.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")

    def run() -> tuple[np.ndarray, np.ndarray]:
        engine = GgmlEngine(model, 320, threads=2, slots=3)
        for slot in range(3):  # three sequences of different lengths, one past a 256-row view
            engine.prefill(slot, tokens * (1 + 11 * slot), 0)
        batch = engine.decode([(slot, len(tokens) * (1 + 11 * slot), 42 + slot) for slot in range(3)])
        engine.prefill(0, tokens, 0)
        alone = engine.prefill(0, [7], len(tokens))
        return batch, alone

    assert len(tokens) * 23 > 256  # the third sequence's view is 320 rows
    assert kernels.attention_available(64, model.config.n_heads, model.config.n_kv_heads, 3)
    ours = run()
    monkeypatch.setattr(kernels, "attention_available", lambda *args: False)
    theirs = run()
    for a, b in zip(ours, theirs, strict=True):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_prompt_chunks_under_ggmls_tile_give_the_same_bits_with_the_attention_op(attends, monkeypatch) -> None:
    """A prompt prefilled in chunks of fewer than 64 tokens (each token over the positions up to its own, which
    ggml computes row by row) and then a chunk of 64 (ggml's tiles: its own attention): the logits after each, and
    a decode step's after them, with kernels.c's attention are those with ggml's flash attention, bit for bit."""
    from edgerun.model.ggml_engine import GgmlEngine
    from edgerun.model.loader import load_model

    model = load_model()
    tokens = model.tokenizer.encode("Tell me about the history of the lighthouse on the northern cape, " * 14)
    cuts = (0, 2, 41, 104, 168)  # chunks of 2, 39, 63 and 64 tokens
    assert len(tokens) > cuts[-1] + 1

    def run() -> list[np.ndarray]:
        engine = GgmlEngine(model, 256, threads=2, slots=2)
        out = [engine.prefill(1, tokens[a:b], a) for a, b in itertools.pairwise(cuts)]
        return [*out, engine.decode([(1, cuts[-1], tokens[cuts[-1]])])]

    ours = run()
    monkeypatch.setattr(kernels, "attention_available", lambda *args: False)
    theirs = run()
    for a, b in zip(ours, theirs, strict=True):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_the_checks_verdicts_are_kept_per_build_and_cpu(built, tmp_path) -> None:
    """A process that loads the kernels takes the checks' verdicts kept for this build of ggml and kernels.c on this
    CPU, and runs the checks where none is kept for them (a rebuild, another machine)."""
    import json
    import os
    import subprocess
    import sys

    loaded = kernels._kernels()
    assert loaded is not None
    key = kernels._build_key(kernels.library_path())
    kept = kernels._verdicts()[key]  # this process's own checks, remembered
    assert (set(kept["checked"]), kept["attention"]) == (
        loaded.checked, None if loaded.attention_variant is None else list(loaded.attention_variant))
    show = "from edgerun.model import kernels; k = kernels._kernels(); print(sorted(k.checked), k.attention_variant)"

    def verdict_read(verdicts: dict) -> str:
        cache = tmp_path / "cache"
        cache.mkdir(exist_ok=True)
        (cache / kernels.VERDICTS_FILE).write_text(json.dumps(verdicts))
        return subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, check=True, timeout=120,
                              env={**os.environ, "EDGERUN_CACHE": str(cache)}).stdout.strip()

    # a verdict kept for this build is taken as it is (no weight type, no attention: the checks did not run)
    assert verdict_read({key: {"checked": [], "attention": None}}) == "[] None"
    # one kept for another build is not: the checks run and give this machine's
    other = json.dumps([*json.loads(key)[:-1], "another cpu"])
    ours = f"{sorted(loaded.checked)} {loaded.attention_variant}"
    assert verdict_read({other: {"checked": [], "attention": None}}) == ours
    assert json.loads((tmp_path / "cache" / kernels.VERDICTS_FILE).read_text())[key] == kept


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"])
def test_a_batchs_products_give_each_column_its_bits_alone(qtype: str) -> None:
    """The weight types whose products ggml computes another way from some column count on (ALONE_COLUMNS: repacked
    Q4_K from 4 columns, Q6_K from 8 on this Xeon) and those it never does: checked against ggml's own product of one
    column, at 2 to 24 columns. Under each_column_alone the engine's products give every column its bits alone at any
    count."""
    from edgerun.model import ggml_lib
    from edgerun.model.quant import quantize

    number = int(GGMLQuantizationType[qtype])
    rng = np.random.default_rng(number)
    k, n = 512, 64
    backend = ggml_lib.GgmlBackend(threads=2)
    store = ggml_lib.WeightStore(backend)
    w = store.add("w", quantize(rng.standard_normal((n, k)).astype(np.float32), qtype))
    store.upload()
    x = rng.standard_normal((24, k)).astype(np.float32)
    g = ggml_lib.lib()

    def first_column(cols: int, make) -> np.ndarray:
        gc = ggml_lib.GraphContext(backend, 64)
        xt = gc.input(ggml_lib.F32, k, cols)
        out = make(gc.ctx, store.tensor(w), xt)
        gc.expand(out)
        gc.allocate()
        gc.set(xt, x[:cols])
        gc.compute()
        return gc.get(out, np.empty((cols, n), np.float32))[0].view(np.uint32)

    alone = first_column(1, g.ggml_mul_mat)
    differs = [cols for cols in range(2, 25) if not np.array_equal(first_column(cols, g.ggml_mul_mat), alone)]
    most = kernels.ALONE_COLUMNS.get(number, 24)  # the table may only be safe: a column differs only beyond it
    assert all(cols > most for cols in differs), differs
    with kernels.each_column_alone():
        assert all(np.array_equal(first_column(cols, kernels.product), alone) for cols in (2, 4, 7, 8, 9, 17, 24))
