"""Planning time of every planner: tensor-parallel strategies for 8 devices on a Llama-3.1-8B shape
(32 layers), the exact ILP, priced by HALO's Eq. (1) and as edgerun's master pays synchronizations (star), and
the pipeline DP with worker-order search for 5 and 12 workers.

    python scripts/bench_planners.py [--out out/planners]

Writes planners.csv and planners.md.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

from edgerun.model.synth import SHAPES, shape_only_weights
from edgerun.sched.pp_plan import CostParams, plan_pp
from edgerun.sched.profiles import Compute, DeviceProfile, Link, Memory, model_profile
from edgerun.sched.tp_plan import STRATEGIES, SyncModel, plan_tp

# (name, decode speed in weight bytes/s, memory budget MB): a heterogeneous edge cluster.
CLUSTER = [("rpi5-a", 4.5e9, 900), ("rpi5-b", 4.5e9, 900), ("rpi4-a", 2e9, 1200), ("rpi4-b", 2e9, 600),
           ("jetson", 20e9, 700), ("laptop", 12e9, 1000), ("rpi3", 1e9, 500), ("desktop", 30e9, 400)]


def device(name: str, speed: float, budget_mb: float) -> DeviceProfile:
    return DeviceProfile(name=name, kind="x86", cores=4, compute=Compute(50.0, speed),
                         memory=Memory(8000.0, 8000.0, budget_mb, 10.0), link=Link(0.3, 1000.0, 1000.0, 0.0))


def timed(fn, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/planners"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    config = SHAPES["8b"]
    model = model_profile("llama-8b-Q4_0", config, shape_only_weights(config, "Q4_0"))
    devices = [device(*d) for d in CLUSTER]
    rows = []
    for strategy in STRATEGIES:
        # HALO's Eq. (1), as the paper prices plans (edgerun's master plans with SyncModel.STAR).
        seconds, plan = timed(lambda s=strategy: plan_tp(model, devices, s, sync=SyncModel.PER_DEVICE),
                              1 if strategy == "ilp" else 5)
        rows.append({"planner": f"tp {strategy}", "devices": len(devices), "layers": config.n_layers,
                     "seconds": seconds, "predicted_ms_per_token": plan.time_per_token_s * 1e3,
                     "note": plan.ilp_status or ("OOM" if plan.oom_devices else "")})
    for strategy in ("halo", "minmax", "ilp"):  # as edgerun's master prices them (the ILP stops at its time limit)
        seconds, plan = timed(lambda s=strategy: plan_tp(model, devices, s, sync=SyncModel.STAR),
                              1 if strategy == "ilp" else 5)
        rows.append({"planner": f"tp {strategy} (star)", "devices": len(devices), "layers": config.n_layers,
                     "seconds": seconds, "predicted_ms_per_token": plan.time_per_token_s * 1e3,
                     "note": plan.ilp_status or ""})
    big = [device(f"w{i}", (1 + i % 4) * 3e9, 1500 + 500 * (i % 3)) for i in range(12)]
    for n in (5, 12):
        workers = big[:n]
        seconds, plan = timed(lambda w=workers: plan_pp(model, w, params=CostParams(include_init=False)), 3)
        rows.append({"planner": "pp dp + order search", "devices": n, "layers": config.n_layers, "seconds": seconds,
                     "predicted_ms_per_token": plan.exec_s_per_token * 1e3, "note": plan.method})
    with (args.out / "planners.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| planner | devices | layers | time (ms) | predicted ms/token | note |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['planner']} | {r['devices']} | {r['layers']} | {r['seconds'] * 1e3:.1f} | "
              f"{r['predicted_ms_per_token']:.1f} | {r['note']} |" for r in rows]
    (args.out / "planners.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
