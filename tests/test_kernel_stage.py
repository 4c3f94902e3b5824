"""stage.bin for the browser node's WebAssembly kernels (model/kernel_stage.py), the numpy replica of their arithmetic
(model/kernel_reference.py), and which tabs the pipeline master gives them to. The kernels themselves run in
Chromium in test_browser_node.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from edgerun.model.generate import ReferenceEngine
from edgerun.model.kernel_reference import KernelReference, _Matrix, product, quantize
from edgerun.model.kernel_stage import KERNEL_STAGE_FILE, expansion, read_kernel_stage, unsupported
from edgerun.model.loader import Model, load_model
from edgerun.model.onnx_graph import Activations, StageSpec, cached_stage
from edgerun.model.quant import to_affine_blocks
from edgerun.net.wire import WorkerKind
from edgerun.pp.config import PipelineConfig, Route
from edgerun.pp.deployment import Deployment
from edgerun.pp.master import PipelineState
from edgerun.pp.messages import Capabilities, Init, TabWeights
from edgerun.pp.workers import WorkerConn, Workers


def _matrix(header: dict, data: memoryview, name: str) -> np.ndarray:
    """A matrix of stage.bin as float32 values, from its codes, scales and offsets."""
    info = header["matrices"][name]
    rows, cols, bits = info["rows"], info["cols"], info["bits"]

    def tensor(part: str, dtype: str) -> np.ndarray:
        t = header["tensors"][f"{name}.{part}"]
        return np.frombuffer(data[t["offset"]:t["offset"] + t["bytes"]], dtype)

    raw = tensor("codes", "u1").reshape(rows, cols // 32, -1)
    if bits == 4:  # byte j: column j (low nibble), column j + 16 (high nibble)
        codes = np.concatenate([raw & 15, raw >> 4], axis=2).astype(np.float32) - 8
    else:
        codes = raw.view(np.int8).astype(np.float32)
    scales = tensor("scales", "<f4").reshape(rows, -1, 1)
    values = codes * scales
    if info["offsets"]:
        values = values + tensor("offsets", "<f4").reshape(rows, -1, 1)
    return values.reshape(rows, cols)


def test_a_kernel_stage_holds_the_files_matrices_exactly(shipped_model: Model) -> None:
    """The first and last stages of the shipped model (Q4_1 layers, a tied Q8_0 embedding and head): every matrix
    read back from stage.bin is the file's, dequantized, to the float32 rounding of its scales and offsets."""
    model = shipped_model
    c, w = model.config, model.weights
    first = cached_stage(model.path, c, w, StageSpec(0, 2, lm_head=False, accuracy_level=4, embed=True, kernels=True))
    last = cached_stage(model.path, c, w, StageSpec(c.n_layers - 1, c.n_layers, lm_head=True, accuracy_level=4,
                                                    kernels=True))
    header, data = read_kernel_stage(first / KERNEL_STAGE_FILE)
    assert (header["first_layer"], header["end_layer"], header["embed"], header["lm_head"]) == (0, 2, True, False)
    assert set(header["matrices"]) == {"token_embd"} | {f"{i}.{m}" for i in (0, 1) for m in
                                                         ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
    for name, t in (("0.wq", w.layers[0].wq), ("1.w_down", w.layers[1].w_down), ("token_embd", w.token_embd)):
        np.testing.assert_allclose(_matrix(header, data, name), t.dequantize(), rtol=1e-6, atol=1e-6)
    assert header["matrices"]["0.wq"]["bits"] == 4 and header["matrices"]["token_embd"]["bits"] == 8
    norm = header["tensors"]["1.ffn_norm"]
    np.testing.assert_array_equal(np.frombuffer(data[norm["offset"]:norm["offset"] + norm["bytes"]], "<f4"),
                                  w.layers[1].ffn_norm)
    header, data = read_kernel_stage(last / KERNEL_STAGE_FILE)
    assert "output_norm" in header["tensors"] and "token_embd" not in header["matrices"]
    np.testing.assert_allclose(_matrix(header, data, "output"), w.output.dequantize(), rtol=1e-6, atol=1e-6)
    # What a tab's budget holds: the file's matrix bytes grown by the float32 scales and offsets.
    assert 1.1 < expansion(w) < 1.25


def test_the_kernels_products_are_the_float_products_to_int8_rounding(shipped_model: Model) -> None:
    """The replica's product of a layer's matrix with a vector: within 1% of the float32 product (the activation
    rounded to 8 bits a block), and its codes round half to even, as onnxruntime's int8 activations do."""
    rng = np.random.default_rng(0)
    t = shipped_model.weights.layers[3].w_gate
    x = rng.standard_normal(t.shape[1]).astype(np.float32)
    exact = t.dequantize() @ x
    got = product(_Matrix.of(to_affine_blocks(t)), x)
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.01
    codes, scales, sums = quantize(np.array([2.5, -1.5, 0.5] + [0.0] * 28 + [127.0], np.float32))
    assert codes[0, :3].tolist() == [2, -2, 0] and codes[0, -1] == 127 and scales[0] == 1.0
    assert sums[0] == pytest.approx(128.5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_kernel_replica_predicts_the_float_references_tokens_to_int8_rounding(tiny_spec, synth_gguf,
                                                                                   arch: str) -> None:
    """On a small untied Q4_0 model (the kernels' 4-bit codes without offsets), Llama's and Qwen2's (attention
    biases): the replica's logits of a prompt and its next token are the numpy reference's to int8 rounding."""
    model = load_model(synth_gguf(tiny_spec(arch, "Q4_0", tied=False)))
    assert unsupported(model.config, model.weights) is None
    prompt = [1, 5, 9, 2, 7, 3]
    replica = KernelReference(model.config, model.weights, 32)
    reference = ReferenceEngine(model, 32)
    got, want = replica.step(prompt), reference.step(prompt)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05
    assert int(np.argmax(got)) == int(np.argmax(want))
    got, want = replica.step([int(np.argmax(got))]), reference.step([int(np.argmax(want))])
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "gemma3-4b", "llama3", "phi3"])
def test_the_kernel_replica_runs_each_family_as_the_reference(tmp_path: Path, family: str) -> None:
    """Each family's blocks on the kernels' arithmetic (Qwen3's query/key norms; Gemma 3's GeGLU, post norms, scaled
    embedding and queries, windowed layers on their own RoPE base and linear RoPE scaling; Llama 3's RoPE factors;
    Phi-3's split matrices), its Q4_0 file: the reference's logits to int8 rounding at every step of two prompts and
    the reference's next token but at int8 near-ties (random weights have some)."""
    from edgerun.model.synth import FAMILIES, FAMILY_PROMPTS, write_synthetic

    write_synthetic(dataclasses.replace(FAMILIES[family], qtype="Q4_0"), tmp_path / "model.gguf", "gguf")
    model = load_model(tmp_path / "model.gguf")
    assert unsupported(model.config, model.weights) is None
    replica, reference = KernelReference(model.config, model.weights, 64), ReferenceEngine(model, 64)
    agree = steps = 0
    for prompt in FAMILY_PROMPTS:  # the reference's tokens fed to both: a near-tie does not carry on
        replica.reset()
        reference.reset()
        tokens = list(prompt)
        for _ in range(16):
            got, want = replica.step(tokens), reference.step(tokens)
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05
            agree += int(np.argmax(got)) == int(np.argmax(want))
            steps += 1
            tokens = [int(np.argmax(want))]
    assert agree >= steps - 2, (agree, steps)


def test_models_the_kernels_do_not_run_are_named_with_the_reason(tiny_spec, synth_gguf) -> None:
    from edgerun.model.synth import SHAPES, SynthSpec

    moe = load_model(synth_gguf(SynthSpec(SHAPES["moe-tiny"], "Q4_0", seed=5)))
    assert "qwen3moe" in unsupported(moe.config, moe.weights)
    q6 = load_model(synth_gguf(tiny_spec("llama", "Q6_K")))
    assert "Q6_K" in unsupported(q6.config, q6.weights)
    with pytest.raises(ValueError, match="cannot run this model"):
        KernelReference(moe.config, moe.weights, 16)


def _tab(name: str, weights: str) -> WorkerConn:
    return WorkerConn(name, SimpleNamespace(host="127.0.0.1"), 600.0, 1e8,
                      Capabilities(WorkerKind.BROWSER, weights=TabWeights(weights)), set())


def _deployment(model: Model, activations: Activations = Activations.INT8) -> Deployment:
    workers = Workers(b"k" * 32, Init(model.config, 64), lambda _: None, lambda *_: None)
    return Deployment(model, workers, PipelineConfig(max_len=64, activations=activations, route=Route.CHAIN),
                      lambda _: None, lambda: None)


def test_a_tab_that_asks_for_the_kernels_gets_stage_bin_where_they_run_the_model(tiny_spec, synth_gguf,
                                                                                  shipped_model: Model) -> None:
    """A kernels tab: stage.bin with int8 activations, its budget shrunk by the kernels' float32 scales and offsets
    (the planner's units are the file's bytes); the same tab on a model the kernels do not run, or in a deployment
    asked for float32 activations: a float32 ONNX stage, its budget shrunk to match."""
    d = _deployment(shipped_model)
    tab, f32, native = _tab("k", "kernels"), _tab("f", "f32"), WorkerConn(
        "n", SimpleNamespace(host="127.0.0.1"), 80.0, 1e8, Capabilities(WorkerKind.NATIVE), set())
    assert tab.tab_weights == TabWeights.KERNELS and native.tab_weights is None
    d.workers.by_name.update({w.name: w for w in (tab, f32, native)})
    stage = SimpleNamespace(first_layer=0, end_layer=3)
    spec = d.spec(stage, "k")
    assert spec.kernels and spec.accuracy_level == Activations.INT8.accuracy_level and not spec.dequantized
    assert d.kernel_tab(tab) and not d.dequantized(tab)
    assert d.budget_mb(tab) == pytest.approx(600.0 / expansion(shipped_model.weights))
    assert d.budget_mb(f32) < d.budget_mb(tab) < 600.0 and d.budget_mb(native) == 80.0
    assert d.spec(stage, "f").dequantized and not d.spec(stage, "f").kernels
    assert not d.spec(stage, "n").kernels
    assert [f.name for f in d._stage_files(spec)] == [KERNEL_STAGE_FILE]
    assert d.state == PipelineState.DOWN
    q6 = _deployment(load_model(synth_gguf(tiny_spec("llama", "Q6_K"))))  # 16-column blocks: not the kernels'
    q6.workers.by_name[tab.name] = tab
    assert not q6.kernel_tab(tab) and q6.dequantized(tab) and q6.budget_mb(tab) < 600.0
    assert not q6.spec(stage, "k").kernels and q6.spec(stage, "k").dequantized
    exact = _deployment(shipped_model, Activations.F32)
    exact.workers.by_name[tab.name] = tab
    assert not exact.kernel_tab(tab) and exact.dequantized(tab) and exact.spec(stage, "k").dequantized
    assert "float32" in exact.fit.kernels_unsupported
