"""Time the engine's own kernels (edgerun/model/kernels.c) where they run: one quantized matrix product at several
column counts against ggml's mul_mat, or the ggml engine's decode step of 1 and of B sequences.

    python scripts/bench_kernels.py product --type Q4_0 --rows 8192 --k 2048 --columns 1,8,64,256
    python scripts/bench_kernels.py step --batch 8 --position 50

`product`: seeded weights of --type (Q4_0 is repacked as ggml repacks it on x86, as the engine loads it), seeded
float columns; each count the best of --repeats runs of a one-product graph, kernels.c's op and ggml's mul_mat,
with their ratio and kernels.c's GMAC/s. Where the engine would use ggml's product (a type or column count the op
does not take, no build, no AVX2, or a load check that found other bits than ggml's) the row has ggml's alone.
A product run again and again keeps a matrix that fits in the CPU's caches there, so these are the kernels' own
speeds, not a step's, whose weights stream from memory: one column of the shipped model's Q4_1 matrices times
0.76-0.83x ggml's here hot, yet its whole one-sequence step is as fast or faster with the op (`step`).
`step`: the shipped model (or --model) on the ggml engine, --batch sequences prefilled to --position tokens each,
then --steps decode steps of one sequence and of --batch sequences at positions --position.. (each step a token
further on): the median milliseconds of a step and the batch's step against one sequence's (what a batch of that
size costs over one). Pin it to a core (taskset -c 1 python ...) for figures that repeat.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from edgerun.model import ggml_lib, kernels
from edgerun.model.quant import quantize


def counts(text: str) -> list[int]:
    try:
        out = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of column counts like 1,8,64") from None
    if not out or any(c < 1 for c in out):
        raise argparse.ArgumentTypeError("column counts are at least 1")
    return out


def best_ms(gc: ggml_lib.GraphContext, repeats: int) -> float:
    gc.compute()  # the first run allocates the op's work space
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.compute()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def product(args: argparse.Namespace) -> None:
    qtype = int(kernels.GGMLQuantizationType[args.type])
    built = kernels._kernels()
    ours_here = built is not None and qtype in built.checked
    rng = np.random.default_rng(0)
    w = quantize(rng.standard_normal((args.rows, args.k)).astype(np.float32), args.type)
    backend = ggml_lib.GgmlBackend(threads=args.threads)
    store = ggml_lib.WeightStore(backend)
    wi = store.add("w", w, repack=qtype in kernels.REPACKED)
    store.upload()
    print(f"{args.type} {args.rows} x {args.k} rows, {args.threads} thread(s); kernels.c's op "
          f"{'runs here' if ours_here else 'does not run here: ggml alone'}")
    print(f"{'columns':>8} {'ours ms':>9} {'ggml ms':>9} {'ggml/ours':>9} {'ours GMAC/s':>12}")
    for cols in args.columns:
        x = rng.standard_normal((cols, args.k)).astype(np.float32)
        ms = {}
        for name in ("ours", "ggml"):
            gc = ggml_lib.GraphContext(backend, 8)
            xt = gc.input(ggml_lib.F32, args.k, cols)
            # the engine's own choice of product: kernels.c's op where it takes this type and column count
            t = kernels.product(gc.ctx, store.tensor(wi), xt) if name == "ours" else \
                ggml_lib.lib().ggml_mul_mat(gc.ctx, store.tensor(wi), xt)
            if name == "ours" and ggml_lib.lib().ggml_op_desc(t).decode() != "CUSTOM":
                continue  # ggml's own product here
            gc.expand(t)
            gc.allocate()
            gc.set(xt, x)
            ms[name] = best_ms(gc, args.repeats)
        if "ours" in ms:
            print(f"{cols:>8} {ms['ours']:>9.3f} {ms['ggml']:>9.3f} {ms['ggml'] / ms['ours']:>8.2f}x "
                  f"{args.rows * args.k * cols / ms['ours'] / 1e6:>12.0f}")
        else:
            print(f"{cols:>8} {'(ggml)':>9} {ms['ggml']:>9.3f}")


def step(args: argparse.Namespace) -> None:
    from edgerun.model.ggml_engine import GgmlEngine
    from edgerun.model.loader import default_model_path, load_model

    model = load_model(args.model or default_model_path())
    max_len = args.position + args.steps + 1
    engine = GgmlEngine(model, max_len=max_len, threads=args.threads, slots=args.batch)
    prompt = list(range(300, 300 + args.position))
    for slot in range(args.batch):
        engine.prefill(slot, prompt, 0)
    medians = {}
    for rows in (1, args.batch):
        engine.decode([(s, args.position, 7) for s in range(rows)])  # builds the step's graph
        times = []
        for k in range(args.steps):
            t = time.perf_counter()
            engine.decode([(s, args.position + k, 7) for s in range(rows)])
            times.append(time.perf_counter() - t)
        medians[rows] = statistics.median(times) * 1e3
    print(f"{Path(model.path).name}, {args.threads} thread(s), positions {args.position}-"
          f"{args.position + args.steps - 1}: a step of 1 sequence {medians[1]:.2f} ms, of {args.batch} "
          f"{medians[args.batch]:.2f} ms ({medians[args.batch] / medians[1]:.2f}x one; "
          f"{args.batch * medians[1] / medians[args.batch]:.2f}x its tokens a second)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("product", help="one matrix product, kernels.c's op against ggml's mul_mat",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--type", default="Q4_0", choices=["Q4_0", "Q4_1", "Q8_0", "Q6_K"],
                   help="the weights' quantization (Q4_0 repacked as ggml repacks it on x86)")
    p.add_argument("--rows", type=int, default=8192, help="the matrix's rows (outputs), a multiple of 8")
    p.add_argument("--k", type=int, default=2048, help="the matrix's columns (inputs), whole blocks of the type")
    p.add_argument("--columns", type=counts, default=[1, 8, 64, 256], help="activation columns, each timed")
    p.add_argument("--threads", type=int, default=1, help="ggml's threads")
    p.add_argument("--repeats", type=int, default=8, help="runs of each graph; the best is printed")
    s = sub.add_parser("step", help="the ggml engine's decode step of 1 and of --batch sequences",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--model", default=None, help="a GGUF file (default: the shipped model)")
    s.add_argument("--batch", type=int, default=8, help="sequences in the batched step")
    s.add_argument("--position", type=int, default=50, help="tokens each sequence holds before the first step")
    s.add_argument("--steps", type=int, default=30, help="steps timed of each size")
    s.add_argument("--threads", type=int, default=1, help="ggml's threads")
    args = parser.parse_args(argv)
    block = 256 if args.what == "product" and args.type == "Q6_K" else 32
    if args.what == "product" and (args.rows % 8 or args.k % block or args.threads < 1 or args.repeats < 1):
        parser.error(f"--rows is a multiple of 8, --k of {block} (a {args.type} block), --threads and --repeats "
                     "at least 1")
    if args.what == "step" and (args.batch < 1 or args.position < 1 or args.steps < 1 or args.threads < 1):
        parser.error("--batch, --position, --steps and --threads are at least 1")
    product(args) if args.what == "product" else step(args)


if __name__ == "__main__":
    main()
