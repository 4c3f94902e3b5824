"""The kernel ceiling of tensor-parallel mode: how fast N devices could be if synchronization cost nothing.

The model's units are dealt evenly over N devices (`split_spec`); each device is a process that builds its share
(`QuantShard`, the engine TP nodes run) and then runs its blocks back to back, every layer's attention and MLP and
its LM-head rows, for one-token steps, with no exchange at all. All N start together, so they compete for the
machine's memory bandwidth and caches as a real cluster on one host does. The slowest device's ms/token is the best
decoding any data path could give. The baseline is the single-process engine (same model, threads, context), timed
in the same run: its one-token steps (`decode`, what the shares run) and its whole request with the prompt's
prefill (`request`, what `bench tp` compares). "alone" is device 0's share run by itself: the split's own cost
(more, smaller kernel calls) without the other devices' contention.

    python scripts/tp_ceiling.py --model 1b.gguf --devices 1,2,4,8 [--tokens 64] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

WARMUP_STEPS = 8  # one-token steps before timing: sessions' first-run allocations


def share_steps(model_path: str, devices: int, device: int, threads: int, tokens: int, ready, start, results) -> None:
    """One device: build its share, say so, wait for the start, then time `tokens` one-token steps."""
    import numpy as np

    from edgerun.bench.tp import CONTEXT
    from edgerun.model.loader import load_model
    from edgerun.model.onnx_graph import Activations
    from edgerun.tp.shard import QuantShard, split_spec

    model = load_model(Path(model_path))
    c = model.config
    spec = split_spec(c, devices)[device]
    shard = QuantShard(c, model.weights, spec, CONTEXT, threads, Activations.INT8, mapped_files=[model.path])
    x = np.random.default_rng(device).standard_normal((1, c.hidden)).astype(np.float32)
    ready.put(device)
    start.wait()
    times = []
    for position in range(WARMUP_STEPS + tokens):
        began = time.perf_counter()
        for layer in range(c.n_layers):
            shard.attention(layer, x, position)
            shard.mlp(layer, x)
        shard.logits(x)
        times.append(time.perf_counter() - began)
    results.put((device, statistics.median(times[WARMUP_STEPS:]) * 1e3))


def run_shares(model_path: Path, devices: int, which: list[int], threads: int, tokens: int) -> dict[int, float]:
    """Median ms/token of each device in `which`, all running at once."""
    ctx = mp.get_context("spawn")
    ready, results, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=share_steps, args=(str(model_path), devices, d, threads, tokens, ready, start, results))
             for d in which]
    for p in procs:
        p.start()
    for _ in which:
        ready.get(timeout=1800)
    start.set()
    out = dict(results.get(timeout=1800) for _ in which)
    for p in procs:
        p.join()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the shipped SmolLM2-135M)")
    p.add_argument("--devices", default="1,2,4,8", help="device counts, comma-separated (default: 1,2,4,8)")
    p.add_argument("--tokens", type=int, default=64, help="one-token steps timed per device (default: 64)")
    p.add_argument("--threads", type=int, default=1, help="onnxruntime threads per device (default: 1)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args()
    try:
        counts = [int(n) for n in args.devices.split(",")]
    except ValueError:
        sys.exit(f"tp_ceiling: --devices takes numbers like 1,2,4,8, not {args.devices!r}")
    if min(counts) < 1 or args.tokens < 1 or args.threads < 1:
        sys.exit("tp_ceiling: --devices, --tokens and --threads must be at least 1")

    from threadpoolctl import threadpool_limits

    from edgerun.bench.tp import TpBenchConfig, single_baseline
    from edgerun.model.loader import load_model

    model = load_model(args.model)
    args.model = model.path
    with threadpool_limits(args.threads):  # timed as `bench tp --baseline` times it
        single = single_baseline(model, TpBenchConfig(model.path, tokens=args.tokens, threads=args.threads))
    rows = []
    for n in counts:
        together = run_shares(args.model, n, list(range(n)), args.threads, args.tokens)
        alone = together[0] if n == 1 else run_shares(args.model, n, [0], args.threads, args.tokens)[0]
        slowest = max(together.values())
        rows.append({"devices": n, "slowest_ms": slowest, "mean_ms": statistics.mean(together.values()),
                     "alone_ms": alone, "single_decode_ms": single.decode_ms_per_token,
                     "single_request_ms": single.ms_per_token, "ceiling": single.decode_ms_per_token / slowest})
        print(f"tp_ceiling: {n} device(s) done", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"single-process engine, {args.threads} thread(s): decode {single.decode_ms_per_token:.1f} ms/token, "
          f"whole request {single.ms_per_token:.1f} ms/token")
    print(f"{'devices':>7} {'slowest ms':>10} {'mean ms':>8} {'alone ms':>8} {'ceiling':>8}")
    for r in rows:
        print(f"{r['devices']:>7} {r['slowest_ms']:>10.1f} {r['mean_ms']:>8.1f} {r['alone_ms']:>8.1f} "
              f"{r['ceiling']:>7.2f}x")


if __name__ == "__main__":
    main()
