"""`edgerun eval`: what packet loss does to the model's output."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edgerun.commands.common import (
    DEFAULT_THREADS,
    blas_threads_arg,
    limit_blas_threads,
    model_arg,
    progress_line,
    shares,
)
from edgerun.errors import EdgerunError


def cmd_eval(args: argparse.Namespace) -> None:
    from edgerun.model.loader import load_model
    from edgerun.sap.evaluate import POLICIES, eval_json, eval_table, evaluate
    from edgerun.sap.predictor import PredictorSet, default_path
    from edgerun.sap.text import evaluation_text

    limit_blas_threads(args.threads)
    policies = [x.strip() for x in args.policy.split(",") if x.strip()]
    for policy in policies:
        if policy not in POLICIES:
            raise EdgerunError(f"unknown policy {policy!r} ({', '.join(POLICIES)})")
    plrs, nglrs = shares(args.plr, "--plr"), shares(args.nglr, "--nglr")  # before the model and predictors load
    model = load_model(args.model)
    predictors = None
    if "sap" in policies:
        path = args.sap or default_path(model.path)
        if not path.exists():
            raise EdgerunError(f"no predictors at {path}: run `edgerun sap calibrate` and `edgerun sap train`, "
                               "or leave out policy sap")
        predictors = PredictorSet.load(path)
    if args.text is None:
        texts = evaluation_text()
    else:
        try:
            texts = [args.text.read_text()]
        except (OSError, UnicodeDecodeError) as e:
            raise EdgerunError(f"cannot read {args.text}: {e}") from e
    group_size = predictors.group_size if predictors is not None else args.group_size
    results = evaluate(model, texts, plrs, nglrs, policies, predictors,
                       group_size, args.tokens, args.chunk, seed=args.seed, parity=args.parity,
                       progress=progress_line)
    print(json.dumps(eval_json(results), indent=2) if args.json else eval_table(results))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="what packet loss does to the model's output",
                       description="Inject deterministic loss at the level of the neuron groups a tensor-parallel "
                                   "cluster would lose (NGLR: share of groups on lossy devices; PLR: chance that "
                                   "such a device loses a block) and report perplexity, top-1 agreement with the "
                                   "lossless model, mean KL divergence to it and the exact-match rate of greedy "
                                   "continuations, per policy for placing groups on lossy devices. The default "
                                   "text (Python's language reference) is not the calibration text.")
    model_arg(p)
    p.add_argument("--text", type=Path, default=None, help="evaluation text file (default: Python's language "
                   "reference topics)")
    p.add_argument("--plr", default="0.01,0.02,0.05", help="packet loss rates (default: 0.01,0.02,0.05)")
    p.add_argument("--nglr", default="0.25,0.5,0.75,0.875", help="neuron-group loss ratios (default: "
                   "0.25,0.5,0.75,0.875)")
    p.add_argument("--policy", default="none,random,sap,oracle",
                   help="none, random, sap, oracle, high-norm, comma-separated; for a mixture-of-experts model also "
                        "experts: a share NGLR of each layer's experts on workers that miss the expert deadline with "
                        "chance PLR, their gates given to the others (default: none,random,sap,oracle)")
    p.add_argument("--sap", type=Path, default=None, help="predictor file (default: MODEL.sap.npz)")
    p.add_argument("--group-size", type=int, default=256, help="MLP neuron-group size without predictors "
                   "(default: 256; with them, theirs)")
    p.add_argument("--tokens", type=int, default=1024, help="evaluation tokens (default: 1024)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per independent sequence (default: 256)")
    p.add_argument("--seed", type=int, default=0, help="seed of the loss events (default: 0)")
    p.add_argument("--parity", type=int, default=2, metavar="FRAGMENTS",
                   help="parity fragments after every partial, as the engine sends them (default: 2, the engine's): "
                        "those of a one-packet partial are copies of it, so it is lost with chance "
                        "PLR^(1 + FRAGMENTS); 0 is HALO's setting, one packet per partial")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    blas_threads_arg(p, DEFAULT_THREADS)
    p.set_defaults(func=cmd_eval)
