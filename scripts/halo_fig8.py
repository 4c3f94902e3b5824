"""HALO Fig. 8's analogue: speedup of HALO (udp with a timeout) over strict tcp in time per output token, for
clusters of 4 and 8 nodes besides the master, on the shipped model and a synthetic 1b shape, at several loss
rates, with real kernel loss on the links of a testbed. Writes fig8.csv (every measurement, with its model),
fig8.md and fig8.png into --out.

    sudo python scripts/halo_fig8.py --nodes 4,8 --models shipped,1b --out out/fig8
"""

from __future__ import annotations

import argparse

from edgerun.bench.report import add_experiment_args, best_loss_at, model_for, model_label, progress
from edgerun.bench.tp import TpBenchConfig, bench_tp, kernel_rate, tp_json
from edgerun.tables import Column, text_table, write_csv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="shipped,1b", help="shipped, synthetic shapes or GGUF files, comma-separated")
    p.add_argument("--nodes", default="4,8", help="node counts besides the master (default: 4,8)")
    p.add_argument("--plr", default="0,1%,2%,5%", help="loss rates, comma-separated")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--codec", choices=("f32", "f16", "q8"), default="f16")
    p.add_argument("--rate", type=float, default=1000.0, help="link rate in Mbit/s (default: 1000)")
    add_experiment_args(p)
    args = p.parse_args()
    loss_at = args.loss_at or best_loss_at()
    losses = args.plr.split(",")
    rows, speedups = [], []
    for name in args.models.split(","):
        model = model_for(name, args.synth_dir or args.out)
        config = TpBenchConfig(model, args.plan, tokens=args.tokens, codec=args.codec, timeout_ms=None,
                               loss_at=loss_at,
                               rate_mbit=args.rate if loss_at == "testbed" else None,
                               rebalance=False, every_device=True)  # udp and tcp on the same devices, all computing
        results = bench_tp(config, [int(n) for n in args.nodes.split(",")], losses, ["udp", "tcp"],
                           progress=lambda m, name=name: progress(f"{model_label(name)}: {m}"))
        rows += [{"model": model_label(name)} | row for row in tp_json(results)]
        by = {(r.setup.nodes, r.setup.loss, r.setup.transport): r.timing.ms_per_token for r in results}
        speedups += [(model_label(name), nodes, loss, by[(nodes, loss, "tcp")] / by[(nodes, loss, "udp")])
                     for (nodes, loss, transport) in by if transport == "udp"]
    write_csv(rows, args.out / "fig8.csv")
    table = "\n".join(text_table((Column("model", lambda r: r[0], width=28, left=True),
                                   Column("nodes", lambda r: r[1]), Column("loss", lambda r: r[2], width=6),
                                   Column("speedup", lambda r: f"{r[3]:.2f}x", width=8)), speedups))
    summary = (f"# Speedup of HALO (udp, adaptive timeout) over tcp, time per output token ({loss_at} loss, links "
               f"{args.rate:g} Mbit/s, codec {args.codec})\n\n```\n{table}\n```\n")
    (args.out / "fig8.md").write_text(summary)
    print(summary)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for model, nodes in sorted({(m, n) for m, n, _, _ in speedups}):
        points = [(100 * kernel_rate(loss), s) for m, n, loss, s in speedups if (m, n) == (model, nodes)]
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=f"{nodes} nodes, {model}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("packet loss rate (%)")
    ax.set_ylabel("speedup over tcp (x)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "fig8.png", dpi=120)


if __name__ == "__main__":
    main()
