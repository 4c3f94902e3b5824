"""Where edgerun keeps what it builds and fetches: $EDGERUN_CACHE, else ~/.cache/edgerun."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("EDGERUN_CACHE", Path.home() / ".cache" / "edgerun"))
