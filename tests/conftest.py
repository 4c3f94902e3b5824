"""Shared fixtures: a per-session onnx graph cache, the shipped model loaded once, tiny synthetic models.

edgerun itself is imported inside the fixtures, not at the top of this file, so that the BLAS
setting below is in place before anything imports numpy.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from edgerun.model.generate import Engine
    from edgerun.model.loader import Model
    from edgerun.model.synth import SynthSpec

# OpenBLAS's threaded matrix-vector products are ~100x slower than single-threaded ones for the
# small products of a decode step on a 2-core machine (measured: 8 ms against 0.07 ms for a
# 1536x576 gemv), which makes the numpy reference three times slower. Single-threaded BLAS gives
# the same results; an explicit setting in the environment still wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

QWEN_ENV = "EDGERUN_QWEN_GGUF"

TinySpec = Callable[..., "SynthSpec"]
SynthGguf = Callable[["SynthSpec"], Path]


def _fresh_directory(factory: pytest.TempPathFactory, variable: str, name: str) -> Iterator[Path]:
    """A fresh directory named in the environment variable for the test session; the variable as it was after."""
    path = factory.mktemp(name)
    previous = os.environ.get(variable)
    os.environ[variable] = str(path)
    yield path
    if previous is None:
        os.environ.pop(variable, None)
    else:
        os.environ[variable] = previous


@pytest.fixture(scope="session", autouse=True)
def edgerun_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """onnx graphs are cached under EDGERUN_CACHE: a fresh directory per test session."""
    yield from _fresh_directory(tmp_path_factory, "EDGERUN_CACHE", "edgerun-cache")


@pytest.fixture(scope="session", autouse=True)
def edgerun_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """edgerun's settings (the cluster key `edgerun serve` makes on first use) under EDGERUN_CONFIG: a fresh
    directory per test session, so that no test reads or writes the user's ~/.config/edgerun (whether a key was
    there decided whether a command's error came alone or after the no-key warning)."""
    yield from _fresh_directory(tmp_path_factory, "EDGERUN_CONFIG", "edgerun-config")


@pytest.fixture(scope="session")
def shipped_path() -> Path:
    from edgerun.errors import EdgerunError
    from edgerun.model.loader import default_model_path

    try:
        return default_model_path()
    except EdgerunError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def shipped_model(shipped_path: Path) -> Model:
    """SmolLM2-135M-Instruct Q4_1, loaded once for the whole session."""
    from edgerun.model.loader import load_model

    return load_model(shipped_path)


@pytest.fixture(scope="session")
def shipped_onnx(shipped_model: Model) -> Engine:
    """One onnx engine on the shipped model, as users run it (int8 activations); users call reset() (generate()
    does) before use."""
    from edgerun.model.onnx_engine import OnnxEngine

    return OnnxEngine(shipped_model, max_len=256)


@pytest.fixture(scope="session")
def shipped_ggml(shipped_model: Model) -> Engine:
    """The default engine on the shipped model (ggml: llama.cpp's kernels), what generate and serve run."""
    from edgerun.model.generate import make_engine

    return make_engine("ggml", shipped_model, 256)


@pytest.fixture(scope="session")
def shipped_onnx_f32(shipped_model: Model) -> Engine:
    """The onnx engine with float32 activations: the numpy reference's numbers, to rounding."""
    from edgerun.model.onnx_engine import OnnxEngine
    from edgerun.model.onnx_graph import Activations

    return OnnxEngine(shipped_model, max_len=256, activations=Activations.F32)


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    value = os.environ.get(QWEN_ENV)
    if not value:
        pytest.skip(f"{QWEN_ENV} is not set (path of a Qwen2.5-Coder-0.5B GGUF)")
    path = Path(value)
    if not path.is_file():
        pytest.skip(f"{QWEN_ENV}={value} does not exist")
    return path


@pytest.fixture(scope="session")
def tiny_spec() -> TinySpec:
    """SynthSpec of the "tiny" shape: tiny_spec(arch="llama", qtype="Q4_0", *, tied=True, seed=0, std=0.02).

    Note: with tied embeddings (the tiny default) the scaled-up embedding dominates the random
    layers and greedy decoding repeats the last input token; tests that need a non-trivial greedy
    sequence use tied=False.
    """
    from dataclasses import replace

    from edgerun.model.synth import SHAPES, SynthSpec

    def make(arch: str = "llama", qtype: str = "Q4_0", *, tied: bool = True, seed: int = 0,
             std: float = 0.02) -> SynthSpec:
        config = replace(SHAPES["tiny"], architecture=arch, qkv_bias=arch == "qwen2", tied_embeddings=tied)
        return SynthSpec(config, qtype, seed, std)

    return make


@pytest.fixture(scope="session")
def synth_gguf(tmp_path_factory: pytest.TempPathFactory) -> SynthGguf:
    """Path of a synthetic GGUF for a SynthSpec, written once per session (treat it as read-only)."""
    from edgerun.model.synth import write_synthetic

    root = tmp_path_factory.mktemp("synth")
    written: dict[SynthSpec, Path] = {}

    def make(spec: SynthSpec) -> Path:
        if spec not in written:
            c = spec.config
            tied = "tied" if c.tied_embeddings else "untied"
            path = root / f"{len(written)}-{c.architecture}-{spec.qtype}-{tied}.gguf"
            write_synthetic(spec, path, "gguf")
            written[spec] = path
        return written[spec]

    return make


Mutate = Callable[[object, random.Random], object]


def _mutate(value: object, rng: random.Random) -> object:
    """value with one leaf or container replaced by something of another shape."""
    wild = [None, True, -1, 2 ** 40, 1.5, "x", [], {}, [1, [2]], {"a": 1}]
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        if rng.random() < 0.15:
            return {k: v for k, v in value.items() if k != key}
        return {**value, key: _mutate(value[key], rng)}
    if isinstance(value, list) and value and rng.random() < 0.8:
        i = rng.randrange(len(value))
        return [*value[:i], _mutate(value[i], rng), *value[i + 1:]]
    return rng.choice(wild)


@pytest.fixture(scope="session")
def mutate() -> Mutate:
    """Structural mutation of a message's JSON, for the protocols' fuzz tests."""
    return _mutate
