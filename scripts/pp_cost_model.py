"""The pipeline cost model's accuracy (the partitioning thesis §7.3): predicted against measured time per output token
over several worker configurations on a local cluster, as MAPE, for the initial estimate (speeds from
before the plan ran) and the running one (re-priced before each request with what was measured so
far). Writes cost_model.csv and .md.

    python scripts/pp_cost_model.py --out out/cost_model
"""

from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import asdict
from pathlib import Path

from edgerun.bench.pp import cost_model_accuracy, cost_table
from edgerun.model.loader import load_model

# Memory budgets (MB) per worker: one to four stages of the shipped model (126 MB by the planner's count).
CONFIGS = "400;200,60;80,80;120,50;60,50,50;70,50,50;40,40,40,40"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: the shipped SmolLM2-135M)")
    p.add_argument("--configs", default=CONFIGS, help=f"worker budgets, configurations separated by ';' "
                   f"(default: {CONFIGS})")
    p.add_argument("--tokens", type=int, default=32, help="tokens per request (default: 32)")
    p.add_argument("--requests", type=int, default=5, help="requests per configuration, each priced by the "
                   "running estimate beforehand (default: 5, as the partitioning thesis)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    configs = [[float(b) for b in c.split(",")] for c in args.configs.split(";")]
    results = cost_model_accuracy(load_model(args.model), configs, args.tokens, args.requests,
                                  progress=lambda m: print(m, file=sys.stderr, flush=True))
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "cost_model.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*asdict(results[0]), "error", "running_error"])
        writer.writeheader()
        writer.writerows({**asdict(r), "budgets": " ".join(f"{b:g}" for b in r.budgets),
                          "running_predicted_ms": " ".join(f"{x:.2f}" for x in r.running_predicted_ms),
                          "running_measured_ms": " ".join(f"{x:.2f}" for x in r.running_measured_ms),
                          "error": r.error, "running_error": r.running_error} for r in results)
    summary = f"# Pipeline cost model: predicted against measured ms per token\n\n```\n{cost_table(results)}\n```\n"
    (args.out / "cost_model.md").write_text(summary)
    print(summary)


if __name__ == "__main__":
    main()
