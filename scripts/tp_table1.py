"""HALO Table I's analogue: time per output token of strict TCP against UDP with a timeout, at several
packet-loss rates and cluster sizes, with real kernel loss on the links of a testbed (every node in a network
namespace of its own; in-process loss where this process may not make one, which TCP does not feel).
Writes table1.csv (every measurement), table1.md (the table and the ratios) and table1.png into --out.

    sudo python scripts/tp_table1.py --nodes 2,4 --plr 0,1%,2%,5% --out out/table1
"""

from __future__ import annotations

import argparse

from edgerun.bench.report import add_experiment_args, best_loss_at, model_for, model_label, progress, write_tp_results
from edgerun.bench.tp import TpBenchConfig, bench_tp, kernel_rate, tp_ratios, tp_table
from edgerun.commands.common import parity_arg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shipped", help="shipped, a synthetic shape (1b) or a GGUF file")
    p.add_argument("--nodes", default="2", help="node processes besides the master, comma-separated")
    p.add_argument("--plr", default="0,1%,2%,5%", help="loss rates, comma-separated")
    p.add_argument("--transport", default="udp,tcp")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--codec", choices=("f32", "f16", "q8"), default="f16")
    p.add_argument("--rate", type=float, default=1000.0, help="testbed link rate in Mbit/s (default: 1000, "
                   "HALO's gigabit switch)")
    p.add_argument("--timeout-ms", type=float, default=None, help="fixed UDP timeout (default: adaptive)")
    p.add_argument("--timeout-deviations", type=float, default=4.0, help="adaptive timeout's k (default: 4)")
    parity_arg(p)
    add_experiment_args(p)
    args = p.parse_args()
    loss_at = args.loss_at or best_loss_at()
    config = TpBenchConfig(model_for(args.model, args.synth_dir or args.out), args.plan, tokens=args.tokens,
                           codec=args.codec,
                           timeout_ms=args.timeout_ms, timeout_deviations=args.timeout_deviations,
                           parity=args.parity, loss_at=loss_at,
                           rate_mbit=args.rate if loss_at == "testbed" else None,
                           rebalance=False, every_device=True)  # every row on the same devices, all computing
    results = bench_tp(config, [int(n) for n in args.nodes.split(",")], args.plr.split(","),
                       args.transport.split(","), progress=progress)
    write_tp_results(results, args.out / "table1.csv")
    link = f", links {args.rate:g} Mbit/s" if loss_at == "testbed" else ""
    title = (f"Time per output token, tcp against udp with a timeout ({model_label(args.model)}, {loss_at} loss{link}, "
             f"codec {args.codec}, timeout {results[0].setup.timeout}, parity fragments {args.parity})")
    summary = f"# {title}\n\n```\n{tp_table(results)}\n```\n\n```\n{tp_ratios(results)}\n```\n"
    (args.out / "table1.md").write_text(summary)
    print(summary)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for nodes in sorted({r.setup.nodes for r in results}):
        for transport in sorted({r.setup.transport for r in results}):
            rows = [r for r in results if (r.setup.nodes, r.setup.transport) == (nodes, transport)]
            ax.plot([100 * kernel_rate(r.setup.loss) for r in rows], [r.timing.ms_per_token for r in rows], marker="o",
                    linestyle="-" if transport == "udp" else "--", label=f"{transport}, {nodes} nodes")
    ax.set_xlabel("packet loss rate (%)")
    ax.set_ylabel("time per output token (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "table1.png", dpi=120)


if __name__ == "__main__":
    main()
