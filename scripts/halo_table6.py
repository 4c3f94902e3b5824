"""HALO Table VI's analogue: the overlap ablation of dynamic mapping. Time per output token without the
overlap and with Pred overlapped with Comm (the master ranks the next layer while this layer's partials
travel); beside them the upper bound without Pred at all (index mapping: fixed shares). HALO's Load row has no
counterpart: a dynamic share here holds every unit's weights in its kernels' packed form and a step selects its
units inside the graph, so there is nothing to load. Predictors are calibrated and trained into --out if missing
there. Writes table6.csv, table6.md and table6.png into --out.

    sudo python scripts/halo_table6.py --nodes 4 --out out/table6
"""

from __future__ import annotations

import argparse

from edgerun.bench.report import add_experiment_args, best_loss_at, model_for, model_label, progress
from edgerun.bench.tp import TpBenchConfig, TpResult, bench_tp, tp_json
from edgerun.model.loader import load_model
from edgerun.sap.report import predictors_for
from edgerun.tables import Column, text_table, write_csv

ROWS = (("baseline (no overlap)", "dynamic", ()), ("pred-comm overlap", "dynamic", ("pred",)),
        ("upper bound (no pred)", "index", ()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shipped", help="shipped, a synthetic shape (1b) or a GGUF file")
    p.add_argument("--nodes", type=int, default=4, help="nodes besides the master (default: 4)")
    p.add_argument("--plr", default="0", help="loss rate on every link (default: 0)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--codec", choices=("f32", "f16", "q8"), default="f32",
                   help="f32 (default) gives nodes the master's exact input, so their own predictions match")
    p.add_argument("--calibration-tokens", type=int, default=1024)
    add_experiment_args(p)
    args = p.parse_args()
    loss_at = args.loss_at or best_loss_at()
    path = model_for(args.model, args.synth_dir or args.out)
    predictors = predictors_for(load_model(path), args.out, 256, args.calibration_tokens, "linear", "ahead",
                                progress)
    sap = args.out / "table6.sap.npz"
    predictors.save(sap)
    rows: list[tuple[str, TpResult]] = []
    for label, mapping, overlap in ROWS:
        config = TpBenchConfig(path, args.plan, tokens=args.tokens, codec=args.codec, timeout_ms=None,
                               loss_at=loss_at,
                               mapping=mapping, sap=sap if mapping != "index" else None, overlap=overlap,
                               rebalance=False, every_device=True)  # every design on every device
        (result,) = bench_tp(config, [args.nodes], [args.plr], ["udp"],
                             progress=lambda m, label=label: progress(f"{label}: {m}"))
        rows.append((label, result))
    base = rows[0][1].timing.ms_per_token
    speedups = [base / r.timing.ms_per_token for _, r in rows]
    write_csv([{"design": label, "speedup": speedup} | row
               for (label, _), speedup, row in zip(rows, speedups, tp_json([r for _, r in rows]), strict=True)],
              args.out / "table6.csv")
    lines = text_table((Column("design", lambda r: r[0], width=32, left=True),
                        Column("ms/token", lambda r: r[1].timing.ms_per_token, ".1f", width=9),
                        Column("pred ms", lambda r: r[1].time.pred_ms, ".2f", width=8),
                        Column("speedup", lambda r: f"{r[2]:.2f}x", width=8),
                        Column(" computed on", lambda r: " " + ", ".join(r[1].split.computed_on), left=True)),
                       [(label, r, speedup) for (label, r), speedup in zip(rows, speedups, strict=True)])
    summary = (f"# Overlap ablation of dynamic mapping ({model_label(args.model)}, master + {args.nodes} nodes, "
               f"{loss_at} loss {args.plr}, codec {args.codec})\n\n```\n" + "\n".join(lines) + "\n```\n")
    (args.out / "table6.md").write_text(summary)
    print(summary)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.barh([label for label, _ in rows][::-1], speedups[::-1])
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("speedup over no overlap (x)")
    fig.tight_layout()
    fig.savefig(args.out / "table6.png", dpi=120)


if __name__ == "__main__":
    main()
