"""The lean GGUF reader against the `gguf` package's: the same metadata and tensors, and clear errors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from edgerun.errors import EdgerunError
from edgerun.model.gguf_reader import GgufReader
from edgerun.model.loader import default_model_path, load_model


def assert_same(path: Path) -> None:
    theirs, ours = gguf.GGUFReader(path), GgufReader(path)
    assert [k for k in theirs.fields if not k.startswith("GGUF.")] == list(ours.fields)
    for key, field in ours.fields.items():
        assert field.contents() == theirs.fields[key].contents(), key
    assert [t.name for t in theirs.tensors] == [t.name for t in ours.tensors]
    for a, b in zip(theirs.tensors, ours.tensors, strict=True):
        assert a.tensor_type.name == b.tensor_type.name and a.shape.tolist() == b.shape.tolist(), a.name
        assert np.array_equal(np.asarray(a.data).reshape(-1).view(np.uint8), b.data), a.name


def test_the_shipped_model_reads_as_the_gguf_package_reads_it() -> None:
    assert_same(default_model_path())


@pytest.mark.parametrize("arch,qtype", [("llama", "Q4_0"), ("qwen2", "Q8_0"), ("llama", "Q4_K")])
def test_synthetic_models_read_as_the_gguf_package_reads_them(tiny_spec, synth_gguf, arch: str, qtype: str) -> None:
    assert_same(synth_gguf(tiny_spec(arch, qtype)))


def test_a_model_is_loaded_without_decoding_its_vocabulary(tiny_spec, synth_gguf) -> None:
    model = load_model(synth_gguf(tiny_spec()))
    assert "tokenizer" not in model.__dict__  # built on first use
    assert model.tokenizer.decode(model.tokenizer.encode("hello world")) == "hello world"


def test_truncated_and_foreign_files_are_refused(tmp_path: Path, tiny_spec, synth_gguf) -> None:
    data = synth_gguf(tiny_spec()).read_bytes()
    for n in (100, 2000, len(data) - 10):
        (tmp_path / "cut.gguf").write_bytes(data[:n])
        with pytest.raises(ValueError, match=r"ends inside|truncated"):
            GgufReader(tmp_path / "cut.gguf")
        with pytest.raises(EdgerunError, match="cannot load model"):
            load_model(tmp_path / "cut.gguf")
    # Cut in the tensor data: the expected and the actual size, for a user to compare with the download's.
    (tmp_path / "cut.gguf").write_bytes(data[:-10])
    with pytest.raises(ValueError, match=rf"the file is {len(data) - 10} bytes but its tensors need {len(data)}"):
        GgufReader(tmp_path / "cut.gguf")
    (tmp_path / "other.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="wrong magic"):
        GgufReader(tmp_path / "other.gguf")
