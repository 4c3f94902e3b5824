"""Synthetic models: `edgerun model synth` written as GGUF or as a Hugging Face directory, read back."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from edgerun.cli import main
from edgerun.model.config import ModelConfig
from edgerun.model.generate import generate, make_engine
from edgerun.model.loader import Model, load_model
from edgerun.model.quant import QuantTensor
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.model.synth import CHAT_TOKENS, SynthSpec, byte_symbols, custom_shape, synth_vocabulary, synth_weights
from edgerun.model.tokenizer import Tokenizer
from edgerun.model.weights import ModelWeights

TEXTS = [
    "Hello, world!",
    "Crème brûlée à la façon de Zoë",
    "emoji 😀 🎉 👨‍👩‍👧 done",
    "日本語のテキストと中文",
    "def f(x):\n\treturn x + 1\n",
    "  spaces   and\r\nnewlines\n\n",
    "\x00\x01 control \x7f",
    "",
]
BOS, IM_START, EOS = 256, 257, 258  # "<|endoftext|>", "<|im_start|>", "<|im_end|>"


def _synth(tmp_path: Path, *args: str, name: str = "model.gguf") -> Path:
    out = tmp_path / name
    assert main(["model", "synth", *args, "--out", str(out)]) == 0
    return out


def _tiny(arch: str = "llama", tied: bool = True) -> ModelConfig:
    return custom_shape("tiny", architecture=arch, qkv_bias=arch == "qwen2", tied_embeddings=tied)


def _assert_config(got: ModelConfig, want: ModelConfig, gguf: bool) -> None:
    if gguf:  # GGUF stores the norm epsilon as float32
        assert got.norm_eps == pytest.approx(want.norm_eps, rel=1e-6)
        got = replace(got, norm_eps=want.norm_eps)
    assert got == want


def _assert_tensor(got: QuantTensor, want: QuantTensor, name: str) -> None:
    assert (got.qtype, got.shape) == (want.qtype, want.shape), name
    assert np.array_equal(np.asarray(got.raw), want.raw), f"{name}: raw bytes differ"


def _assert_weights(got: ModelWeights, want: ModelWeights, tied: bool) -> None:
    assert len(got.layers) == len(want.layers)
    for i, (g, w) in enumerate(zip(got.layers, want.layers, strict=True)):
        for (name, gt), (_, wt) in zip(g.matrices(), w.matrices(), strict=True):
            _assert_tensor(gt, wt, f"layer {i} {name}")
        np.testing.assert_array_equal(g.attn_norm, w.attn_norm)
        np.testing.assert_array_equal(g.ffn_norm, w.ffn_norm)
        for bias in ("bq", "bk", "bv"):
            gb, wb = getattr(g, bias), getattr(w, bias)
            assert (gb is None) == (wb is None), bias
            if wb is not None:
                np.testing.assert_array_equal(gb, wb)
    _assert_tensor(got.token_embd, want.token_embd, "token_embd")
    np.testing.assert_array_equal(got.output_norm, want.output_norm)
    if tied:
        assert got.output is got.token_embd
    else:
        _assert_tensor(got.output, want.output, "output")


# --- GGUF round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["F32", "BF16", "Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_synth_gguf_round_trip(arch: str, qtype: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _synth(tmp_path, "--arch", arch, "--quant", qtype, "--seed", "7")
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    assert f"{arch} model ({qtype})" in captured.err
    spec = SynthSpec(_tiny(arch), qtype, 7)
    model = load_model(out)
    assert model.format == "gguf"
    _assert_config(model.config, spec.config, gguf=True)
    _assert_weights(model.weights, synth_weights(spec), tied=True)
    # 4-bit layers keep an 8-bit embedding, as llama.cpp does.
    assert model.weights.token_embd.qtype == ("Q8_0" if qtype in ("Q4_1", "Q4_K", "Q6_K") else qtype)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_synth_gguf_untied_round_trip(arch: str, tmp_path: Path) -> None:
    out = _synth(tmp_path, "--arch", arch, "--quant", "Q4_0", "--no-tied", "--seed", "2")
    spec = SynthSpec(_tiny(arch, tied=False), "Q4_0", 2)
    model = load_model(out)
    _assert_config(model.config, spec.config, gguf=True)
    assert model.config.tied_embeddings is False
    _assert_weights(model.weights, synth_weights(spec), tied=False)


def test_synth_seed_changes_weights(tmp_path: Path) -> None:
    a = load_model(_synth(tmp_path, "--seed", "1", name="a.gguf")).weights
    b = load_model(_synth(tmp_path, "--seed", "2", name="b.gguf")).weights
    c = load_model(_synth(tmp_path, "--seed", "1", name="c.gguf")).weights
    assert not np.array_equal(a.layers[0].wq.raw, b.layers[0].wq.raw)
    np.testing.assert_array_equal(a.layers[0].wq.raw, c.layers[0].wq.raw)


def test_synth_custom_dimensions(tmp_path: Path) -> None:
    out = _synth(tmp_path, "--layers", "3", "--hidden", "512", "--heads", "8", "--kv-heads", "2", "--ffn", "768",
                 "--quant", "Q8_0")
    model = load_model(out)
    c = model.config
    assert (c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.ffn) == (3, 512, 8, 2, 768)
    assert (c.head_dim, c.vocab_size, c.architecture) == (64, 512, "llama")
    layer = model.weights.layers[2]
    assert {n: t.shape for n, t in layer.matrices()} == {
        "wq": (512, 512), "wk": (128, 512), "wv": (128, 512), "wo": (512, 512),
        "w_gate": (768, 512), "w_up": (768, 512), "w_down": (512, 768)}
    assert {t.qtype for _, t in layer.matrices()} == {"Q8_0"}
    prompt = [1, 2, 3, 4]
    a = make_engine("onnx-f32", model, 8).step(prompt).copy()
    b = make_engine("numpy", model, 8).step(prompt)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * np.abs(b).max())


def test_synth_custom_qwen2_head_dim_and_vocab(tmp_path: Path) -> None:
    out = _synth(tmp_path, "--arch", "qwen2", "--head-dim", "32", "--heads", "8", "--kv-heads", "4", "--vocab", "300",
                 "--quant", "F16")
    model = load_model(out)
    c = model.config
    assert (c.architecture, c.qkv_bias, c.head_dim, c.q_dim, c.kv_dim, c.vocab_size) == \
        ("qwen2", True, 32, 256, 128, 300)
    assert model.weights.layers[0].bq is not None and model.weights.layers[0].bq.shape == (256,)
    assert model.tokenizer.vocab_size == 300


@pytest.mark.parametrize(("args", "message"), [
    (["--quant", "Q4_K", "--hidden", "320"], "Q4_K needs rows of a multiple of 256 values, not 320"),
    (["--quant", "Q6_K", "--ffn", "640"], "Q6_K needs rows of a multiple of 256 values, not 640"),
    (["--quant", "Q4_0", "--hidden", "272"], "32"),
])
def test_synth_block_shape_constraints(args: list[str], message: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bad.gguf"
    assert main(["model", "synth", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("edgerun: error:")]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--quant", "Q5_1"], "unknown quant type Q5_1"),
    (["--quant", "Q4_0", "--format", "hf"], "F32, F16 or BF16"),
    (["--shape", "13b"], "unknown shape '13b'"),
    (["--heads", "5"], "do not divide"),
    (["--head-dim", "63"], "must be even"),
    (["--vocab", "100"], "too small"),
])
def test_synth_rejects_bad_options(args: list[str], message: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "synth", *args, "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_synth_rejects_zero_kv_heads(tmp_path: Path) -> None:
    assert main(["model", "synth", "--kv-heads", "0", "--out", str(tmp_path / "bad.gguf")]) == 2


def test_synth_rejects_negative_layers(tmp_path: Path) -> None:
    assert main(["model", "synth", "--layers", "-1", "--out", str(tmp_path / "bad.gguf")]) == 2


def test_zero_layer_model_is_rejected(tmp_path: Path) -> None:
    out = tmp_path / "zero.gguf"
    code = main(["model", "synth", "--layers", "0", "--out", str(out)])
    if code == 0:
        assert main(["generate", "hi", "--model", str(out), "--max-tokens", "2", "--quiet"]) == 2
    else:
        assert code == 2


# --- Hugging Face directories ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["F16", "F32", "BF16"])
def test_synth_hf_dir_round_trip(arch: str, qtype: str, tmp_path: Path) -> None:
    out = _synth(tmp_path, "--format", "hf", "--arch", arch, "--quant", qtype, "--seed", "4", name="hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert json.loads((out / "config.json").read_text())["model_type"] == arch
    spec = SynthSpec(_tiny(arch), qtype, 4)
    model = load_model(out)
    assert model.format == "hf"
    _assert_config(model.config, spec.config, gguf=False)
    _assert_weights(model.weights, synth_weights(spec), tied=True)
    if qtype == "BF16":  # safetensors' bf16: the top half of a float32
        raw = np.asarray(model.weights.layers[0].wq.raw)
        as_f32 = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        np.testing.assert_array_equal(as_f32, model.weights.layers[0].wq.dequantize())


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    out = tmp_path_factory.mktemp("hf") / "model"
    assert main(["model", "synth", "--format", "hf", "--quant", "F16", "--out", str(out)]) == 0
    return load_model(out)


@pytest.fixture(scope="module")
def gguf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    out = tmp_path_factory.mktemp("gguf") / "model.gguf"
    assert main(["model", "synth", "--quant", "Q8_0", "--out", str(out)]) == 0
    return load_model(out).tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_hf_tokenizer_round_trip(text: str, hf_model: Model, gguf_tokenizer: Tokenizer) -> None:
    tok = hf_model.tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) == len(text.encode("utf-8"))  # byte-level, no merges
    assert ids == gguf_tokenizer.encode(text)


def test_hf_tokenizer_specials_and_chat_template(hf_model: Model, gguf_tokenizer: Tokenizer) -> None:
    for tok in (hf_model.tokenizer, gguf_tokenizer):
        assert (tok.bos_id, tok.eos_id, tok.add_bos) == (BOS, EOS, False)
        assert tok.stop_ids == frozenset({BOS, EOS})
        assert tok.vocab_size == 512
        text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hi"}])
        assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                        "<|im_start|>assistant\n")
        ids = tok.encode(text)
        assert ids.count(IM_START) == 3 and ids.count(EOS) == 2
        assert ids[:1] == [IM_START] and tok.decode(ids) == text
        assert tok.decode(ids, skip_special=True) == "system\nBe brief.\nuser\nHi\nassistant\n"


def test_hf_and_gguf_give_the_same_logits(tmp_path: Path) -> None:
    hf = load_model(_synth(tmp_path, "--format", "hf", "--quant", "F32", "--no-tied", "--seed", "3", name="hf"))
    gg = load_model(_synth(tmp_path, "--quant", "F32", "--no-tied", "--seed", "3"))
    prompt = [72, 105, 33, 10]
    a = make_engine("numpy", hf, 8).step(prompt)
    b = make_engine("numpy", gg, 8).step(prompt)
    # Same weights; only the norm epsilon differs (float32 in GGUF).
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["F16", "F32", "BF16"])
def test_hf_dir_onnx_matches_numpy(arch: str, qtype: str, tmp_path: Path) -> None:
    out = _synth(tmp_path, "--format", "hf", "--arch", arch, "--quant", qtype, "--no-tied", name="hf")
    model = load_model(out)
    greedy = Sampler(SamplingParams())
    prompt = model.tokenizer.encode("Hello there")
    onnx = generate(make_engine("onnx-f32", model, 32), prompt, 16, greedy)
    ref = generate(make_engine("numpy", model, 32), prompt, 16, greedy)
    assert onnx.tokens == ref.tokens
    assert len(set(ref.tokens)) > 4


# --- the synthetic tokenizer -------------------------------------------------------------------


@pytest.fixture(scope="module")
def synth_tokenizer() -> Tokenizer:
    return Tokenizer.from_vocabulary(synth_vocabulary(512))


@pytest.mark.parametrize("text", TEXTS)
def test_synth_tokenizer_round_trip_examples(text: str, synth_tokenizer: Tokenizer, gguf_tokenizer: Tokenizer) -> None:
    ids = synth_tokenizer.encode(text)
    assert synth_tokenizer.decode(ids) == text
    assert gguf_tokenizer.encode(text) == ids
    assert all(0 <= i < 256 for i in ids)


@settings(max_examples=300, deadline=None)
@given(text=st.text())
def test_synth_tokenizer_round_trips_any_text(text: str, synth_tokenizer: Tokenizer) -> None:
    assume("<|" not in text)  # chat tokens written as text become single special ids
    ids = synth_tokenizer.encode(text)
    assert synth_tokenizer.decode(ids) == text
    assert len(ids) == len(text.encode("utf-8"))
    stream = synth_tokenizer.stream_decoder()
    assert "".join(stream.push(i) for i in ids) + stream.flush() == text


def test_synth_vocabulary_layout() -> None:
    vocab = synth_vocabulary(300)
    assert len(vocab.tokens) == len(vocab.token_types) == 300
    assert vocab.tokens[256:259] == list(CHAT_TOKENS)
    assert len(set(vocab.tokens)) == 300
    # one merge, of two bytes UTF-8 never holds (llama.cpp needs a merge): every text is still tokenized byte by byte
    assert vocab.merges == [f"{byte_symbols()[0xFE]} {byte_symbols()[0xFF]}"]
    assert vocab.tokens[259] == byte_symbols()[0xFE] + byte_symbols()[0xFF]
    with pytest.raises(ValueError, match="too small"):
        synth_vocabulary(258)
