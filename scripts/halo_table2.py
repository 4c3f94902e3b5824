"""HALO Table II's analogue: which activations are lost matters. Every layer after the first loses,
at 10 % PLR, the output of a quarter of its units (NGLR 25 %): randomly chosen ones, the
highest-norm ones, or the lowest-norm ones (`oracle`). Writes table2.csv, table2.md and table2.png.

    python scripts/halo_table2.py --out out/table2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgerun.model.loader import load_model
from edgerun.sap.evaluate import evaluate
from edgerun.sap.report import write_results
from edgerun.sap.text import evaluation_text

POLICIES = {"random": "random", "high-norm": "high-norm loss", "oracle": "low-norm loss"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: the shipped SmolLM2-135M)")
    p.add_argument("--plr", type=float, default=0.10)
    p.add_argument("--nglr", type=float, default=0.25)
    p.add_argument("--group-size", type=int, default=256)
    p.add_argument("--tokens", type=int, default=1024, help="evaluation tokens (default: 1024)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    model = load_model(args.model)
    results = evaluate(model, evaluation_text(), [args.plr], [args.nglr], list(POLICIES), None, args.group_size,
                       args.tokens, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(write_results(results, args.out, "table2", f"Loss of random, high-norm and low-norm units ({model.name}, "
                        f"PLR {args.plr:.0%}, NGLR {args.nglr:.0%})"))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([POLICIES[r.policy] for r in results], [100 * r.perplexity_increase for r in results],
           color=["tab:gray", "tab:red", "tab:green"])
    ax.set_ylabel("perplexity increase over lossless (%)")
    ax.set_title(f"{model.name}: PLR {args.plr:.0%}, NGLR {args.nglr:.0%}")
    fig.tight_layout()
    fig.savefig(args.out / "table2.png", dpi=120)


if __name__ == "__main__":
    main()
