"""Result tables written for other tools: CSV files of rows of one shape (benchmarks, experiments, predictor
evaluations)."""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path


def write_csv(rows: Sequence[Mapping[str, object]], path: Path) -> None:
    """Rows of one shape as CSV, the first row's keys as the header; the folder is made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
