"""The model families beside Llama and Qwen2 (Qwen3, Gemma 3, Llama 3.x with RoPE factors, Phi-3), on synthetic
files of each (edgerun.model.synth.FAMILIES): the default engine gives llama.cpp's greedy ids (fixtures made by
scripts/llamacpp_fixtures.py --synthetic), the numpy reference and the ggml engine agree on float32 weights, and a
pipeline and a tensor-parallel cluster of real worker processes give the single engine's tokens."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest

from edgerun.bench.pp import local_pipeline, worker_budget_mb
from edgerun.cli import main
from edgerun.errors import EdgerunError
from edgerun.model.generate import ReferenceEngine, generate, make_engine
from edgerun.model.loader import Model, load_model
from edgerun.model.onnx_graph import Activations
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.model.synth import FAMILIES, FAMILY_PROMPTS, write_family, write_synthetic
from edgerun.net.wire import derive_key
from edgerun.sched.profiles import model_profile
from edgerun.tp.config import MasterConfig
from edgerun.tp.master import Master

FIXTURES = Path(__file__).parent / "fixtures"
AGREEMENT = 0.97
TOKENS = 24
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("families")
    return {family: write_family(family, folder / f"{family}.gguf") for family in FAMILIES}


def greedy(engine, prompt, n: int = TOKENS) -> list[int]:
    return generate(engine, list(prompt), n, Sampler(GREEDY)).tokens


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_default_engine_gives_llamacpps_ids(files: dict[str, Path], family: str) -> None:
    """Each prompt's greedy continuation (llama.cpp's: same file, one thread) agrees with llama.cpp's ids."""
    data = json.loads((FIXTURES / f"llamacpp_synthetic_{family}.json").read_text())
    assert hashlib.sha256(files[family].read_bytes()).hexdigest() == data["sha256"]  # the same synthetic file
    model = load_model(files[family])
    assert model.config.architecture == {"llama3": "llama", "gemma3-4b": "gemma3"}.get(family, family)
    engine = make_engine("ggml", model, 256, threads=1)
    agree = total = 0
    for row in data["prompts"]:
        tokens = greedy(engine, row["prompt_tokens"], data["tokens"])
        agree += next((i for i, (a, b) in enumerate(zip(tokens, row["tokens"], strict=True)) if a != b), len(tokens))
        total += len(row["tokens"])
    print(f"{family}: {agree}/{total} ids as llama.cpp's")
    assert agree >= AGREEMENT * total, (agree, total)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_reference_ggml_and_onnxruntime_agree_on_float32_weights(tmp_path: Path, family: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Float32 weights (ggml's products then take float32 activations too) and onnxruntime's graph with float32
    activations: the numpy reference's greedy tokens, for each family's blocks (Gemma's window crossed by the
    20-token prompt and by the decode after the 13-token one)."""
    from edgerun.model.onnx_engine import OnnxEngine

    monkeypatch.setenv("EDGERUN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / f"{family}-f32.gguf"
    write_synthetic(replace(FAMILIES[family], qtype="F32"), path, "gguf")
    model = load_model(path)
    for prompt in FAMILY_PROMPTS:
        reference = greedy(ReferenceEngine(model, 256), prompt)
        assert greedy(make_engine("ggml", model, 256, threads=1), prompt) == reference
        assert greedy(OnnxEngine(model, 256, activations=Activations.F32), prompt) == reference


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_pipeline_and_a_tensor_parallel_cluster_give_the_single_engines_tokens(files: dict[str, Path],
                                                                                 family: str) -> None:
    """Two ggml stages on two worker processes (hidden states handed on as float32: the single engine's tokens
    exactly); a master and two node processes sharing every layer's heads and neuron groups, over udp and tcp
    (int8 activations as the single engine; Gemma's windowed layers on the Python path, the others natively)."""
    model = load_model(files[family])
    prompt = FAMILY_PROMPTS[0]
    want = greedy(make_engine("ggml", model, 256, threads=1), prompt)
    layers = model_profile(model.name, model.config, model.weights, context=256).layer_memory_bytes
    budget = worker_budget_mb(layers, 2)
    with local_pipeline(model, [budget, budget], 256) as (master, _):
        plan = master.start()
        assert len(plan.stages) == 2 and all(master.deployment.ggml_stages(s.worker) for s in plan.stages)
        assert master.generate(prompt, TOKENS) == want
    with tensor_parallel(model, 2) as master:
        for transport in ("udp", "tcp"):
            master.reconfigure(replace(master.config, transport=transport))
            master.replan()
            assert len(master.deployed) == 2
            assert master.generate(prompt, TOKENS, Sampler(GREEDY)) == want, transport
            assert master.stats.blocks_incomplete == 0


class tensor_parallel:
    """A master in this process (minmax: every node takes a share) and `nodes` node processes that fetch the
    model from it. Over udp a block waits up to a second: the split's tokens are what is checked, and a node of a
    busy 2-core machine may take longer than the default 10 ms (a block merged without it is another test's)."""

    def __init__(self, model: Model, nodes: int) -> None:
        config = MasterConfig(strategy="minmax", host="127.0.0.1", max_len=256, activations=Activations.INT8,
                              timeout_ms=1000.0)
        self.master = Master(model, derive_key("families"), config)
        self.nodes = [subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--master",
                                        f"127.0.0.1:{self.master.port}", "--name", f"n{i}", "--key", "families",
                                        "--speed", "1e9", "--threads", "1"], stderr=subprocess.DEVNULL)
                      for i in range(nodes)]

    def __enter__(self) -> Master:
        self.master.wait_for_nodes(len(self.nodes), timeout_s=120)
        self.master.replan()
        return self.master

    def __exit__(self, *_: object) -> None:
        self.master.close()
        for p in self.nodes:
            p.kill()
            p.wait()


def test_an_unsupported_architecture_or_quant_type_is_one_line_naming_the_supported(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def refusal(arch: str, fill) -> str:
        """`edgerun model info` on a GGUF file of this architecture that `fill` writes into: exit 2, its one line."""
        path = tmp_path / f"{arch}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert main(["model", "info", "--model", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        return err

    err = refusal("mamba", lambda w: w.add_block_count(2))
    assert "'mamba'" in err and "gemma3" in err and "phi3" in err, err
    err = refusal("llama", lambda w: w.add_tensor("token_embd.weight", np.zeros((4, 66), np.uint8), raw_shape=(4, 66),
                                                   raw_dtype=gguf.GGMLQuantizationType.IQ2_XXS))
    assert "IQ2_XXS" in err and "Q4_K" in err, err


def test_onnxruntime_stages_run_every_family_and_its_shares_refuse_them_in_one_line(
        files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """onnxruntime's stage graphs (the onnx engine, pipeline stages, tabs on onnxruntime-web) have every family's
    blocks; its tensor-parallel shares (float32 activations) and LoRA tuning have none of those beyond Llama's and
    Qwen2's: one line each."""
    from edgerun.model.weights import features
    from edgerun.tp.ggml_shard import build_share
    from edgerun.tp.shard import full_spec
    from edgerun.tune.model import StageModel

    for family in FAMILIES:
        assert main(["generate", "--model", str(files[family]), "--engine", "onnx", "--max-tokens", "2", "hi"]) == 0
        model = load_model(files[family])
        if not features(model.config, model.weights):  # Phi-3: Llama's block once its matrices are split
            continue
        with pytest.raises(EdgerunError, match="an onnxruntime share does not compute"):
            build_share(model.config, model.weights, full_spec(model.config), 64, 1, Activations.F32)
        with pytest.raises(EdgerunError, match="tuning does not compute"):
            StageModel(model.config, model.weights, 0, model.config.n_layers, None)


def test_a_browser_tab_computes_every_family(files: dict[str, Path]) -> None:
    """A browser tab runs edgerun's kernels (every dense family's blocks, 4- and 8-bit codes in blocks of 32) or,
    for a Q4_K_M file's Q6_K matrices, onnxruntime-web's graphs with float32 matrices: for each family's Q4_K_M
    file the tab takes part in the plans beside a native worker."""
    from edgerun.net.wire import WorkerKind
    from edgerun.pp.config import PipelineConfig, Route
    from edgerun.pp.deployment import Deployment
    from edgerun.pp.messages import Capabilities, Init, TabWeights
    from edgerun.pp.workers import WorkerConn, Workers

    for family in FAMILIES:
        model = load_model(files[family])
        workers = Workers(b"k", Init(model.config, 256), lambda _: None, lambda *_: None)
        for name, capabilities in (("native", Capabilities(WorkerKind.NATIVE, ggml=True)),
                                   ("tab", Capabilities(WorkerKind.BROWSER, weights=TabWeights.KERNELS))):
            workers.by_name[name] = WorkerConn(name, None, 4096, 1e9, capabilities, set())
        deployment = Deployment(model, workers, PipelineConfig(max_len=256, route=Route.STAR), lambda _: None, None)
        assert [d.name for d in deployment.devices()] == ["native", "tab"]
        assert deployment.dequantized(workers.by_name["tab"])  # the Q6_K head
