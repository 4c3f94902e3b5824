"""Result tables: CSV files of rows of one shape for other tools, and text tables for people (benchmarks,
experiments, predictor evaluations)."""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

Row = TypeVar("Row")


def write_csv(rows: Sequence[Mapping[str, object]], path: Path) -> None:
    """Rows as CSV, a column for every key of any row (in the order they first come; a row without one leaves
    its cell empty), nested objects flattened (`flat`); the folder is made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flats = [flat(row) for row in rows]
    names = list(dict.fromkeys(k for row in flats for k in row))
    # an object absent from one row (None) and present in another: its columns alone
    nested = {name[:i] for name in names for i, c in enumerate(name) if c == "."}
    names = [name for name in names if name not in nested]
    flats = [{k: v for k, v in row.items() if k not in nested} for row in flats]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        writer.writerows(flats)


def flat(row: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    """A row's nested objects as columns of their own, named by their path ("timing.ms_per_token"); lists and
    other values stay as they are."""
    out: dict[str, object] = {}
    for key, value in row.items():
        if isinstance(value, Mapping):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


@dataclass(frozen=True)
class Column(Generic[Row]):
    """A text table's column: its title, its cell of a row, and how the cell is written."""

    title: str
    cell: Callable[[Row], object]
    spec: str = ""  # the cell's format spec (".1f", ".0%"); "": as str() writes it
    width: int = 0  # at least the title's
    left: bool = False  # aligned left (else right)

    def text(self, row: Row) -> str:
        return format(self.cell(row), self.spec)


def text_table(columns: Sequence[Column[Row]], rows: Iterable[Row]) -> list[str]:
    """The header and one line per row, every column as wide as its title, its width or its widest cell (the
    benchmarks' tables for people, one shape for all of them)."""
    rows = list(rows)
    cells = [[c.text(r) for c in columns] for r in rows]
    widths = [max([len(c.title), c.width, *(len(line[i]) for line in cells)]) for i, c in enumerate(columns)]

    def line(texts: Sequence[str]) -> str:
        return " ".join(f"{t:{'<' if c.left else '>'}{w}}" for t, c, w in zip(texts, columns, widths, strict=True))

    return [line([c.title for c in columns]), *(line(texts) for texts in cells)]
