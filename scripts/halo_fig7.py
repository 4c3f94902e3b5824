"""HALO Table V / Fig. 7's analogue: perplexity under loss with semantic-aware placement (sap)
against random placement, over PLR × NGLR, with no importance (none) and the low-norm bound
(oracle) beside them. Predictors are calibrated and trained into --out if missing there.
Writes fig7.csv, fig7.md and fig7.png.

    python scripts/halo_fig7.py --out out/fig7
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from edgerun.model.loader import load_model
from edgerun.sap.evaluate import evaluate
from edgerun.sap.report import predictors_for, write_results
from edgerun.sap.text import evaluation_text


def shares(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: the shipped SmolLM2-135M)")
    p.add_argument("--plr", default="0.01,0.02,0.05")
    p.add_argument("--nglr", default="0.25,0.5,0.75,0.875")
    p.add_argument("--policy", default="none,random,sap,oracle")
    p.add_argument("--group-size", type=int, default=256)
    p.add_argument("--calibration-tokens", type=int, default=4096)
    p.add_argument("--kind", choices=("linear", "mlp"), default="linear", help="predictor kind (default: linear)")
    p.add_argument("--reads", choices=("same", "ahead"), default="same",
                   help="what the predictors read: the block's own input, or the attention input one layer ahead "
                        "(HALO's) (default: same)")
    p.add_argument("--tokens", type=int, default=1024, help="evaluation tokens (default: 1024)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    model = load_model(args.model)
    predictors = predictors_for(model, args.out, args.group_size, args.calibration_tokens, args.kind, args.reads,
                                log)
    plrs, nglrs, policies = shares(args.plr), shares(args.nglr), args.policy.split(",")
    results = evaluate(model, evaluation_text(), plrs, nglrs, policies, predictors, args.group_size, args.tokens,
                       progress=log)
    print(write_results(results, args.out, "fig7", f"Perplexity under loss by placement policy ({model.name}, "
                        f"{args.kind} predictors reading {args.reads})"))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(plrs), figsize=(4 * len(plrs), 3.5), sharey=True, squeeze=False)
    for ax, plr in zip(axes[0], plrs, strict=True):
        for policy in policies:
            rows = [r for r in results if r.plr == plr and r.policy == policy]
            ax.plot([100 * r.nglr for r in rows], [100 * r.perplexity_increase for r in rows], marker="o",
                    label=policy)
        ax.set_title(f"PLR {plr:.0%}")
        ax.set_xlabel("NGLR (%)")
    axes[0][0].set_ylabel("perplexity increase over lossless (%)")
    axes[0][-1].legend()
    fig.tight_layout()
    fig.savefig(args.out / "fig7.png", dpi=120)


if __name__ == "__main__":
    main()
