"""The kernel ceiling of tensor-parallel mode: how fast N devices could be if synchronization cost nothing.

The model's units are dealt evenly over N devices (`split_spec`); each device is a process that builds its share
(`QuantShard`, the engine TP nodes run) and runs one-token steps of its blocks, every layer's attention and MLP and
its LM-head rows, with every block started on all N at once and no exchange at all (edgerun.bench.ceiling, what
`edgerun bench tp --ceiling` runs beside a cluster): they compete for the machine's memory bandwidth and caches as a
real cluster on one host does, block by block. Summed over the blocks, the slowest device's time in each is the best
decoding any data path could give ("in step"); "mean" is the devices' own kernels per token, averaged. The baseline
is the single-process engine (same model, threads, context), timed in the same run: its one-token steps (`decode`,
what the shares run) and its whole request with the prompt's prefill (`request`, what `bench tp` compares). "alone"
is device 0's share run by itself: the split's own cost (more, smaller kernel calls) without the other devices'
contention.

    python scripts/tp_ceiling.py --model 1b.gguf --devices 1,2,4,8 [--tokens 64] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path


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

    from edgerun.bench.ceiling import kernel_ceiling
    from edgerun.bench.tp import CONTEXT, TpBenchConfig, single_baseline
    from edgerun.model.loader import load_model
    from edgerun.model.onnx_graph import Activations
    from edgerun.tables import Column, text_table

    model = load_model(args.model)
    args.model = model.path
    with threadpool_limits(args.threads):  # timed as `bench tp --baseline` times it
        single = single_baseline(model, TpBenchConfig(model.path, tokens=args.tokens, threads=args.threads))
    rows = []
    for n in counts:
        shares = functools.partial(kernel_ceiling, args.model, n, args.threads, Activations.INT8.value, args.tokens,
                                   CONTEXT)
        together = shares()
        alone = together.device_ms_per_token[0] if n == 1 else shares(which=[0]).device_ms_per_token[0]
        slowest = together.decode_ms_per_token
        rows.append({"devices": n, "slowest_ms": slowest, "mean_ms": statistics.mean(together.device_ms_per_token),
                     "alone_ms": alone, "single_decode_ms": single.decode_ms_per_token,
                     "single_request_ms": single.ms_per_token, "ceiling": single.decode_ms_per_token / slowest})
        print(f"tp_ceiling: {n} device(s) done", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"single-process engine, {args.threads} thread(s): decode {single.decode_ms_per_token:.1f} ms/token, "
          f"whole request {single.ms_per_token:.1f} ms/token")
    print("\n".join(text_table((Column("devices", lambda r: r["devices"]),
                                 Column("in step ms", lambda r: r["slowest_ms"], ".1f"),
                                 Column("mean ms", lambda r: r["mean_ms"], ".1f", width=8),
                                 Column("alone ms", lambda r: r["alone_ms"], ".1f"),
                                 Column("ceiling", lambda r: f"{r['ceiling']:.2f}x", width=8)), rows)))


if __name__ == "__main__":
    main()
