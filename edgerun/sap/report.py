"""Shared by the scripts that reproduce HALO's accuracy tables: predictors made on demand, results
written as CSV, markdown and a PNG plot."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from edgerun.model.loader import Model
from edgerun.net.model_files import model_sha256
from edgerun.sap.calibrate import calibrate
from edgerun.sap.evaluate import EvalResult, eval_json, eval_table
from edgerun.sap.predictor import PredictorSet, train
from edgerun.sap.text import calibration_text
from edgerun.tables import write_csv


def predictors_for(model: Model, out: Path, group_size: int, tokens: int, kind: str, reads: str,
                   progress: Callable[[str], None]) -> PredictorSet:
    """The predictors in `out` for this model, group size, kind and input, calibrated and trained if missing."""
    path = out / f"{model.path.name}.g{group_size}.{kind}.{reads}.sap.npz"
    sha = model_sha256(model.path)
    if path.exists():
        predictors = PredictorSet.load(path)
        if predictors.model_sha256 == sha and predictors.reads == reads:
            return predictors
    progress(f"calibrating on {tokens} tokens")
    calibration = calibrate(model, sha, calibration_text(), group_size, tokens,
                            progress=lambda done, total: progress(f"calibrated {done}/{total} tokens"))
    predictors, _ = train(calibration, kind, reads=reads, progress=progress)
    out.mkdir(parents=True, exist_ok=True)
    predictors.save(path)
    return predictors


def write_results(results: Sequence[EvalResult], out: Path, name: str, title: str) -> str:
    """name.csv and name.md in `out`; returns the markdown."""
    write_csv(eval_json(results), out / f"{name}.csv")
    summary = f"# {title}\n\n```\n{eval_table(results)}\n```\n"
    (out / f"{name}.md").write_text(summary)
    return summary
