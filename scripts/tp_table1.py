"""HALO Table I's analogue: time per output token of strict TCP against UDP with a timeout, at several
packet-loss rates, for several cluster sizes, on a local cluster (master + node processes on loopback).

Loss is real kernel loss (nftables drops on loopback, so TCP retransmits) where this process may
change nftables, in-process loss otherwise (which TCP does not feel: the table then says so).
Writes table1.csv (every measurement) and table1.md (the table and the ratios) into --out.

    python scripts/tp_table1.py --nodes 2,4 --plr 0,1%,2%,5% --out out/table1
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import asdict
from pathlib import Path

from edgerun.bench.tp import bench_tp, tp_ratios, tp_table
from edgerun.net.kernel_loss import loss_supported


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: the shipped SmolLM2-135M)")
    p.add_argument("--nodes", default="2", help="node processes besides the master, comma-separated")
    p.add_argument("--plr", default="0,1%,2%,5%", help="loss rates, comma-separated")
    p.add_argument("--transport", default="udp,tcp")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--codec", choices=("f32", "f16", "q8"), default="f32")
    p.add_argument("--timeout-ms", type=float, default=None, help="fixed UDP timeout (default: adaptive)")
    p.add_argument("--timeout-deviations", type=float, default=4.0, help="adaptive timeout's k (default: 4)")
    p.add_argument("--parity", action=argparse.BooleanOptionalAction, default=True,
                   help="an XOR parity fragment after every UDP vector (default: on)")
    p.add_argument("--out", type=Path, required=True, help="folder for table1.csv and table1.md")
    args = p.parse_args()
    reason = loss_supported()
    loss_at = "kernel" if reason is None else "process"
    if reason:
        print(f"no kernel loss ({reason}): using in-process loss, which TCP does not feel", file=sys.stderr)
    results = bench_tp(args.model, [int(n) for n in args.nodes.split(",")], args.plr.split(","),
                       args.transport.split(","), loss_at, tokens=args.tokens, timeout_ms=args.timeout_ms,
                       codec=args.codec, timeout_deviations=args.timeout_deviations,
                       parity=args.parity, progress=lambda m: print(f"{m}...", file=sys.stderr, flush=True))
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "table1.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(results[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in results)
    model = args.model.name if args.model else "SmolLM2-135M-Instruct Q4_1"
    summary = (f"# Time per output token, tcp against udp with a timeout ({model}, {loss_at} loss, codec "
               f"{args.codec}, timeout {results[0].timeout}, parity {'on' if args.parity else 'off'})\n\n"
               f"```\n{tp_table(results)}\n```\n\n"
               f"```\n{tp_ratios(results)}\n```\n")
    (args.out / "table1.md").write_text(summary)
    print(summary)


if __name__ == "__main__":
    main()
