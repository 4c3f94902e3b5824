"""`edgerun sap calibrate|train`: the semantic-aware predictors."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from edgerun.errors import EdgerunError

if TYPE_CHECKING:
    pass
from edgerun.commands.common import DEFAULT_THREADS, blas_threads_arg, limit_blas_threads, model_arg, progress_line


def cmd_sap_calibrate(args: argparse.Namespace) -> None:
    from edgerun.model.loader import load_model
    from edgerun.net.model_files import model_sha256
    from edgerun.sap.calibrate import calibrate, default_calibration_path
    from edgerun.sap.text import calibration_text

    limit_blas_threads(args.threads)
    model = load_model(args.model)
    out = args.out or default_calibration_path(model.path)
    calibration = calibrate(model, model_sha256(model.path), calibration_text(), args.group_size, args.tokens,
                            args.chunk, lambda done, total: progress_line(f"calibrated {done}/{total} tokens"))
    calibration.save(out)
    print(f"{calibration.tokens} tokens of {model.config.n_layers} layers -> {out}")


def cmd_sap_train(args: argparse.Namespace) -> None:
    import numpy as np

    from edgerun.model.loader import resolve_model_path
    from edgerun.sap.calibrate import Calibration, default_calibration_path
    from edgerun.sap.predictor import default_path, train

    limit_blas_threads(args.threads)
    model_path = resolve_model_path(args.model)
    source = args.calibration or default_calibration_path(model_path)
    if not source.exists():
        raise EdgerunError(f"no calibration at {source}: run `edgerun sap calibrate` first")
    predictors, qualities = train(Calibration.load(source), args.kind, args.width, args.validation, args.seed,
                                  args.reads, progress=progress_line)
    out = args.out or default_path(model_path)
    predictors.save(out)
    for block in ("attention", "mlp"):
        q = [x for x in qualities if x.block == block]
        print(f"{block:9}: mean relative error {np.mean([x.relative_error for x in q]):.1%}, top-{q[0].k} of "
              f"{q[0].units} recall {np.mean([x.recall for x in q]):.1%} (chance {q[0].k / q[0].units:.0%})")
    per_token = predictors.cost_per_token_s()
    print(f"predictors ({args.kind}, reading {'one layer ahead' if predictors.ahead else 'the block input'}) -> {out}; "
          f"{per_token * 1e3:.2f} ms per token for all layers on this machine")


def add_parser(sub: argparse._SubParsersAction) -> None:
    sap = sub.add_parser("sap", help="semantic-aware predictors: which neuron groups matter").add_subparsers(
        dest="sap_command", required=True, metavar="SUBCOMMAND")
    p = sap.add_parser("calibrate", help="record block inputs and group output norms over calibration text",
                       description="Run the reference model over calibration text (standard-library docstrings, "
                                   "present on every machine with Python) and record, per layer and token, the "
                                   "attention input and the L2 norm of each attention head's and MLP neuron "
                                   "group's output. Written beside the model unless --out says otherwise.")
    model_arg(p)
    p.add_argument("--tokens", type=int, default=4096, help="calibration tokens (default: 4096)")
    p.add_argument("--chunk", type=int, default=256, help="tokens per independent sequence (default: 256)")
    p.add_argument("--group-size", type=int, default=256, help="MLP neuron-group size (default: 256, as master)")
    p.add_argument("--out", type=Path, default=None, help="calibration file (default: MODEL.calib.npz)")
    blas_threads_arg(p, DEFAULT_THREADS)
    p.set_defaults(func=cmd_sap_calibrate)
    p = sap.add_parser("train", help="train the per-layer predictors on a calibration",
                       description="Per layer and block, fit a regressor from a normalized hidden state to the "
                                   "log norms of the layer's heads or neuron groups; hold out the last "
                                   "--validation share of tokens and report the relative error and the top-k "
                                   "recall of the truly most important units.")
    model_arg(p)
    p.add_argument("--calibration", type=Path, default=None, help="calibration file (default: MODEL.calib.npz)")
    p.add_argument("--kind", choices=("linear", "mlp"), default="linear",
                   help="ridge regression, or an MLP with one hidden layer of --width (default: linear)")
    p.add_argument("--width", type=int, default=256, help="hidden width of the mlp kind (default: 256)")
    p.add_argument("--reads", choices=("same", "ahead"), default="same",
                   help="what a predictor reads: the block's own input (same: ranks on the critical path, "
                        "a fifth less loss on the shipped model) or the attention input one layer ahead (ahead, "
                        "HALO's design: lets the master rank while partials travel, the pred overlap) "
                        "(default: same)")
    p.add_argument("--validation", type=float, default=0.2, help="held-out share of tokens (default: 0.2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the training split and initialization (default: 0)")
    p.add_argument("--out", type=Path, default=None, help="predictor file (default: MODEL.sap.npz)")
    blas_threads_arg(p, DEFAULT_THREADS)
    p.set_defaults(func=cmd_sap_train)
