"""Writing experiment results: CSV rows, a markdown summary, and choosing where a tensor-parallel experiment's
loss comes from."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from edgerun.bench.tp import LOSS_AT, TpResult, tp_json
from edgerun.tables import write_csv


def write_tp_results(results: Sequence[TpResult], path: Path) -> None:
    write_csv(tp_json(results), path)


def add_experiment_args(p: argparse.ArgumentParser, loss_at: bool = True, plan: bool = True) -> None:
    """--loss-at (unless the experiment needs a testbed), --plan (unless it compares planners), --synth-dir and
    --out, as every tensor-parallel experiment script takes them."""
    if plan:
        # An experiment on loss or transport runs every device on every row: minmax splits by the declared speeds
        # (even, on equal devices, as HALO's planner does); halo, which weighs each device's synchronizations
        # against its compute, rightly leaves devices out of a small model, and such rows would measure the
        # master alone.
        p.add_argument("--plan", default="minmax", help="the tensor-parallel planner of every row; it must give "
                       "every device units (default: minmax)")
    if loss_at:
        p.add_argument("--loss-at", choices=LOSS_AT, default=None,
                       help="where loss happens (default: testbed where possible, else process)")
    p.add_argument("--synth-dir", type=Path, default=None, help="where synthetic models are written (default: --out)")
    p.add_argument("--out", type=Path, required=True, help="folder for the CSV, markdown and PNG")


def best_loss_at() -> str:
    """The most faithful loss this process can apply: a testbed (kernel loss on links between namespaces),
    else in-process loss (which TCP does not feel); says why on stderr when it falls back."""
    from edgerun.net.testbed import missing_support

    reason = missing_support()
    if reason is None:
        return "testbed"
    print(f"no testbed ({reason}): using in-process loss, which TCP does not feel", file=sys.stderr)
    return "process"


def progress(message: str) -> None:
    print(f"{message}...", file=sys.stderr, flush=True)


def model_for(name: str, folder: Path) -> Path | None:
    """`shipped` (None: the shipped model), a synthetic shape (`1b`, ...: written into `folder` once, Q4_0 with
    seeded weights), or a model file's path."""
    from edgerun.model.synth import SHAPES, SynthSpec, custom_shape, write_synthetic

    if name == "shipped":
        return None
    if name in SHAPES:
        path = folder / f"synthetic-{name}-q4_0.gguf"
        if not path.exists():
            progress(f"writing a synthetic {name} model to {path}")
            write_synthetic(SynthSpec(custom_shape(name), "Q4_0", 0), path, "gguf")
        return path
    return Path(name)


def model_label(name: str) -> str:
    return "SmolLM2-135M" if name == "shipped" else Path(name).name
