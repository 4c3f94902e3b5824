"""HALO Fig. 9's analogue: heterogeneous devices. For each node count, random device configurations whose
average speed is 2/3 of the fastest (HALO: CPU frequencies of 0.6-1.8 GHz in 0.1 GHz steps averaging 1.2 GHz),
emulated with cgroup CPU quotas on a testbed's nodes (each node reports its quota's share of the master's
speed to the planner). Every planner runs each configuration at 100 Mbit/s and 1 Gbit/s links; the result is
the time per output token and the speedup over Galaxy. Writes fig9.csv, fig9.md and fig9.png into --out.

    sudo python scripts/halo_fig9.py --nodes 4,6,8 --scenarios 3 --out out/fig9
"""

from __future__ import annotations

import argparse
import random

import numpy as np

from edgerun.bench.report import add_experiment_args, best_loss_at, model_for, model_label, progress
from edgerun.bench.tp import TpBenchConfig, TpResult, bench_tp, tp_json
from edgerun.tables import write_csv

FASTEST_GHZ = 1.8
BASE_SPEED = 1e9  # the master's speed as the planner sees it; a node reports its share of it


def frequencies(nodes: int, rng: random.Random) -> list[float]:
    """`nodes` frequencies in 0.6..1.8 GHz, 0.1 GHz steps, averaging exactly 1.2 GHz (drawn until they do)."""
    while True:
        tenths = [rng.randint(6, 18) for _ in range(nodes - 1)]
        last = 12 * nodes - sum(tenths)
        if 6 <= last <= 18:
            return [t / 10 for t in [*tenths, last]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shipped", help="shipped, a synthetic shape (1b) or a GGUF file")
    p.add_argument("--nodes", default="4", help="node counts besides the master (default: 4; HALO: 4,6,8)")
    p.add_argument("--scenarios", type=int, default=2, help="random configurations per node count (default: 2)")
    p.add_argument("--plans", default="minmax,greedy,galaxy,even", help="planners; the first two are HALO's "
                   "Min-Max and Comp-Greedy, even is vanilla tensor parallelism (default: %(default)s)")
    p.add_argument("--rates", default="100,1000", help="link rates in Mbit/s (default: 100,1000)")
    p.add_argument("--plr", default="0", help="loss rate on every link (default: 0)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--codec", choices=("f32", "f16", "q8"), default="f16")
    p.add_argument("--seed", type=int, default=0)
    add_experiment_args(p, loss_at=False, plan=False)  # it compares planners (--plans)
    args = p.parse_args()
    if best_loss_at() != "testbed":
        raise SystemExit("Fig. 9 needs a testbed (root, nftables, cgroups): CPU quotas and link rates are the "
                         "experiment")
    rng = random.Random(args.seed)
    plans, rates = args.plans.split(","), [float(r) for r in args.rates.split(",")]
    model = model_for(args.model, args.synth_dir or args.out)
    rows: list[tuple[int, list[float], TpResult]] = []
    for nodes in (int(n) for n in args.nodes.split(",")):
        for scenario in range(args.scenarios):
            ghz = frequencies(nodes, rng)
            quotas = tuple(f / FASTEST_GHZ for f in ghz)
            for rate in rates:
                config = TpBenchConfig(model, tokens=args.tokens, codec=args.codec, timeout_ms=None,
                                       loss_at="testbed", rate_mbit=rate, cpu_quotas=quotas,
                                       node_speeds=tuple(BASE_SPEED * q for q in quotas),
                                       rebalance=False)  # each planner's own split (it may leave a node out)
                tag = f"{nodes} nodes, scenario {scenario + 1} ({' '.join(f'{f:.1f}' for f in ghz)} GHz)"
                results = bench_tp(config, [nodes], [args.plr], ["udp"], plans=plans,
                                   progress=lambda m, tag=tag: progress(f"{tag}: {m}"))
                rows += [(scenario + 1, ghz, r) for r in results]

    def key(scenario: int, r: TpResult) -> tuple[int, int, float | None]:
        return r.setup.nodes, scenario, r.setup.rate_mbit

    baseline = {key(scenario, r): r.timing.ms_per_token for scenario, _, r in rows if r.setup.plan == "galaxy"}
    over_galaxy = [baseline[key(scenario, r)] / r.timing.ms_per_token if key(scenario, r) in baseline
                   else float("nan") for scenario, _, r in rows]
    write_csv([{"scenario": scenario, "ghz": " ".join(map(str, ghz)), "speedup_over_galaxy": speedup} | row
               for (scenario, ghz, _), speedup, row in zip(rows, over_galaxy, tp_json([r for *_, r in rows]),
                                                           strict=True)], args.out / "fig9.csv")
    groups = sorted({(r.setup.nodes, r.setup.rate_mbit) for *_, r in rows})
    lines = [f"{'nodes':>5} {'link':>10} " + " ".join(f"{plan:>9}" for plan in plans)]
    means: dict[tuple[int, float, str], float] = {}
    for nodes, rate in groups:
        for plan in plans:
            values = [speedup for (*_, r), speedup in zip(rows, over_galaxy, strict=True)
                      if (r.setup.nodes, r.setup.rate_mbit, r.setup.plan) == (nodes, rate, plan)]
            means[(nodes, rate, plan)] = float(np.mean(values))
        lines.append(f"{nodes:>5} {f'{rate:g} Mbit':>10} " +
                     " ".join(f"{means[(nodes, rate, plan)]:>8.2f}x" for plan in plans))
    summary = (f"# Average speedup over Galaxy on heterogeneous nodes ({model_label(args.model)}, {args.scenarios} "
               f"configurations per node count, average speed 2/3 of the fastest, loss {args.plr})\n\n"
               f"```\n" + "\n".join(lines) + "\n```\n")
    (args.out / "fig9.md").write_text(summary)
    print(summary)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(plans)
    for i, plan in enumerate(plans):
        ax.bar([g + i * width for g in range(len(groups))], [means[(n, r, plan)] for n, r in groups], width,
               label=plan)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))],
                  [f"{n} nodes\n{r:g} Mbit/s" for n, r in groups])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("speedup over Galaxy (x)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "fig9.png", dpi=120)


if __name__ == "__main__":
    main()
