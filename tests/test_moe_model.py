"""Mixture-of-experts models: GGUF files in llama.cpp's layout (qwen3moe, qwen2moe, llama with experts), the
numpy reference's routing, and the onnx engine and a pipeline giving the reference's numbers and tokens."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edgerun.model.config import ModelConfig
from edgerun.model.generate import ReferenceEngine, generate
from edgerun.model.loader import load_model
from edgerun.model.onnx_engine import OnnxEngine
from edgerun.model.onnx_graph import Activations
from edgerun.model.reference import ReferenceModel, route
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.model.synth import SHAPES, SynthSpec, write_synthetic

GREEDY = Sampler(SamplingParams())
MOE = SHAPES["moe-tiny"]
# The three layouts: Qwen3-MoE (query/key norms, renormalized gates), Qwen2-MoE (biases, gates as the softmax
# gave them, a shared expert behind a sigmoid gate), Mixtral (llama's interleaved RoPE rows, 8 experts, 2 used).
VARIANTS = {
    "qwen3moe": MOE,
    "qwen2moe": replace(MOE, architecture="qwen2moe", qkv_bias=True, qk_norm=False, norm_gates=False,
                        shared_expert_ffn=512),
    "mixtral": replace(MOE, architecture="llama", qk_norm=False, n_experts=8, n_experts_used=2),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def moe_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moe") / f"{request.param}.gguf"
    write_synthetic(SynthSpec(VARIANTS[request.param], "Q4_0", seed=3), path, "gguf")
    return path


def test_routing_keeps_the_top_k_of_the_softmax_and_renormalizes_where_the_model_does() -> None:
    logits = np.log(np.array([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.4, 0.1]], np.float32))
    chosen, weights = route(logits, 2, renormalize=False)
    assert chosen.tolist() == [[1, 3], [2, 0]]  # a tie goes to the lower index
    np.testing.assert_allclose(weights, [[0.4, 0.3], [0.4, 0.25]], rtol=1e-6)
    _, renormalized = route(logits, 2, renormalize=True)
    np.testing.assert_allclose(renormalized, [[0.4 / 0.7, 0.3 / 0.7], [0.4 / 0.65, 0.25 / 0.65]], rtol=1e-6)


def test_the_real_qwen3_30b_a3b_shape_counts_its_parameters() -> None:
    """30.5B parameters in all, 3.3B of them active per token (8 of 128 experts), as Qwen publishes."""
    shape = SHAPES["qwen3-30b-a3b"]
    assert shape.n_params() == pytest.approx(30.5e9, rel=0.01)
    assert replace(shape, n_experts=shape.n_experts_used).n_params() == pytest.approx(3.3e9, rel=0.02)


def test_a_moe_gguf_reads_back_what_was_written(moe_path: Path) -> None:
    model = load_model(moe_path)
    name = moe_path.stem
    assert model.config.norm_eps == pytest.approx(VARIANTS[name].norm_eps)  # stored as float32
    assert replace(model.config, norm_eps=VARIANTS[name].norm_eps) == VARIANTS[name]
    layer = model.weights.layers[1]
    assert layer.w_gate is None and layer.moe is not None and len(layer.moe.experts) == model.config.n_experts
    assert (layer.moe.shared is not None) == (name == "qwen2moe") and (layer.q_norm is not None) == (name == "qwen3moe")
    # Each expert is its own matrix: distinct weights, the declared shapes.
    e0, e1 = layer.moe.experts[:2]
    assert e0.w_down.shape == (model.config.hidden, model.config.expert_ffn)
    assert not np.array_equal(e0.w_gate.dequantize(), e1.w_gate.dequantize())


def test_the_onnx_engine_computes_the_references_mixture(moe_path: Path) -> None:
    """Float32 activations: the reference's logits to rounding over a prefill and decode steps that route to
    many experts; int8 activations (the default engine): the reference's greedy tokens."""
    model = load_model(moe_path)
    reference = ReferenceModel(model.config, model.weights)
    prompt = model.tokenizer.encode("Experts take turns: each token picks its own.")
    x = reference.embed(prompt)
    chosen, _ = route(x @ reference.layers[0].moe.router.T, model.config.n_experts_used, model.config.norm_gates)
    assert len(np.unique(chosen)) > model.config.n_experts_used  # the prompt's tokens disagree on their experts

    numpy_engine = ReferenceEngine(model, 256)
    f32 = OnnxEngine(model, 256, threads=1, activations=Activations.F32)
    want, got = numpy_engine.step(prompt), f32.step(prompt)
    for i in range(12):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
        token = int(np.argsort(want)[-1 - i % 3])  # not only the greedy path
        want, got = numpy_engine.step([token]), f32.step([token])

    expected = generate(ReferenceEngine(model, 256), prompt, 32, GREEDY).tokens
    assert len(set(expected)) > 3  # a sequence worth comparing
    assert generate(OnnxEngine(model, 256, threads=1), prompt, 32, GREEDY).tokens == expected


def test_a_dense_only_engine_refuses_a_mixture_of_experts(tmp_path: Path) -> None:
    from edgerun.errors import EdgerunError
    from edgerun.tp.config import MasterConfig
    from edgerun.tp.master import Master

    path = tmp_path / "moe.gguf"
    write_synthetic(SynthSpec(MOE, "Q4_0"), path, "gguf")
    with pytest.raises(EdgerunError, match="mixture of experts"):
        Master(load_model(path), b"k" * 32, MasterConfig(host="127.0.0.1"))


def test_synth_writes_each_moe_layout_and_refuses_a_moe_without_experts(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture) -> None:
    from edgerun.cli import main

    out = tmp_path / "q2.gguf"
    assert main(["model", "synth", "--shape", "moe-tiny", "--arch", "qwen2moe", "--layers", "1", "--experts", "6",
                 "--experts-used", "2", "--out", str(out)]) == 0
    config = load_model(out).config
    assert (config.architecture, config.n_layers, config.n_experts, config.n_experts_used) == ("qwen2moe", 1, 6, 2)
    assert config.shared_expert_ffn == 2 * config.expert_ffn and config.qkv_bias and not config.norm_gates
    capsys.readouterr()
    assert main(["model", "synth", "--shape", "moe-tiny", "--experts", "0", "--out", str(tmp_path / "x.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs experts" in err


def test_moe_config_checks_its_experts() -> None:
    with pytest.raises(ValueError, match="used per token"):
        ModelConfig("qwen3moe", 1, 64, 64, 2, 1, 32, 300, 1e4, 1e-6, 64, True, False, n_experts=4, n_experts_used=5,
                    expert_ffn=64)


def test_a_pipeline_of_native_workers_runs_a_mixture_of_experts(tmp_path: Path) -> None:
    """Stages of a mixture of experts (their experts in If branches, each stage's weights copied, not linked,
    on the worker: onnxruntime refuses linked weights in subgraphs) give the single engine's greedy tokens."""
    from edgerun.bench.pp import local_pipeline

    path = tmp_path / "moe.gguf"
    write_synthetic(SynthSpec(MOE, "Q4_0", seed=3), path, "gguf")
    model = load_model(path)
    prompt = model.tokenizer.encode("A pipeline of experts")
    expected = generate(OnnxEngine(model, 256, threads=1), prompt, 24, GREEDY).tokens
    logs: list[str] = []
    with local_pipeline(model, [2.5, 2.5], 256, logs.append) as (master, _):
        assert master.generate(prompt, 24, SamplingParams()) == expected
    assert any("w0 layers 0-0" in line or "w1 layers 0-0" in line for line in logs), logs  # two stages


def test_a_dropped_expert_gives_its_gate_to_the_others(moe_path: Path) -> None:
    """Keeping only each token's first choice: its output is that expert's times the gates' full sum."""
    from edgerun.model.reference import BlockHooks

    class FirstOnly(BlockHooks):
        def expert_kept(self, layer: int, chosen: np.ndarray) -> np.ndarray:
            return np.arange(chosen.shape[1])[None, :] == 0

    model = load_model(moe_path)
    reference = ReferenceModel(model.config, model.weights)
    layer = reference.layers[0]
    x = np.random.default_rng(0).standard_normal((5, model.config.hidden)).astype(np.float32)
    chosen, weights = route(x @ layer.moe.router.T, model.config.n_experts_used, model.config.norm_gates)
    want = np.stack([weights[t].sum() * layer.moe.experts[chosen[t, 0]](x[t:t + 1])[0] for t in range(5)])
    if layer.moe.shared is not None:
        want += layer.moe.shared(x) / (1.0 + np.exp(-(x @ layer.moe.shared_gate)[:, None]))
    np.testing.assert_allclose(reference.experts(layer.moe, x, 0, FirstOnly()), want, rtol=1e-4, atol=1e-5)


def test_eval_prices_experts_missing_their_deadline(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import json

    from edgerun.cli import main

    path = tmp_path / "moe.gguf"
    write_synthetic(SynthSpec(MOE, "Q4_0"), path, "gguf")
    assert main(["eval", "--model", str(path), "--policy", "experts", "--nglr", "0.5", "--plr", "0.2", "--tokens",
                 "128", "--chunk", "64", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["policy"] == "experts" and 0.05 < row["units_lost"] < 0.15  # about half the experts, a fifth of the time
    assert row["top1_agreement"] < 1.0 or row["kl"] > 0  # dropping experts changes the output
    assert main(["eval", "--policy", "experts", "--tokens", "64", "--chunk", "64"]) == 2  # the shipped model: dense
    assert "needs a mixture-of-experts model" in capsys.readouterr().err


def test_ggml_experts_compute_what_onnxruntimes_do(moe_path: Path) -> None:
    """An expert on ggml (int8 activations, llama.cpp's kernels: what a worker runs by default) gives gates *
    SwiGLU(x) within int8 rounding of onnxruntime's float32 graph, for one token and for several, and refuses an
    expert it does not hold."""
    from edgerun.moe.experts import ExpertRunner, GgmlExperts, expert_runner

    model = load_model(moe_path)
    c = model.config
    layer = next(i for i, w in enumerate(model.weights.layers) if w.moe is not None)
    expert = model.weights.layers[layer].moe.experts[1]
    ggml, onnx = expert_runner(c, 1, Activations.INT8), expert_runner(c, 1, Activations.F32)
    assert isinstance(ggml, GgmlExperts) and isinstance(onnx, ExpertRunner)
    for runner in (ggml, onnx):
        runner.load(layer, 1, expert)
        assert (layer, 1) in runner and (layer, 0) not in runner
    rng = np.random.default_rng(3)
    for tokens in (1, 5, 1):
        x = rng.standard_normal((tokens, c.hidden)).astype(np.float32)
        gates = rng.uniform(0.1, 1.0, tokens).astype(np.float32)
        want, got = onnx.run(layer, 1, x, gates), ggml.run(layer, 1, x, gates)
        assert got.shape == want.shape == (tokens, c.hidden)
        assert np.abs(got - want).max() < 0.05 * np.abs(want).max(), np.abs(got - want).max()
    ggml.keep_only(set())
    with pytest.raises(KeyError, match="not held"):
        ggml.run(layer, 1, x, gates)
