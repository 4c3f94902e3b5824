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
def test_the_reference_and_the_ggml_engine_agree_on_float32_weights(tmp_path: Path, family: str) -> None:
    """Float32 weights (ggml's products then take float32 activations too): the numpy reference's greedy tokens
    are the ggml engine's, for each family's blocks (Gemma's window crossed by the 20-token prompt)."""
    path = tmp_path / f"{family}-f32.gguf"
    write_synthetic(replace(FAMILIES[family], qtype="F32"), path, "gguf")
    model = load_model(path)
    for prompt in FAMILY_PROMPTS:
        assert greedy(make_engine("ggml", model, 256, threads=1), prompt) == \
            greedy(ReferenceEngine(model, 256), prompt)


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
    model from it."""

    def __init__(self, model: Model, nodes: int) -> None:
        config = MasterConfig(strategy="minmax", host="127.0.0.1", max_len=256, activations=Activations.INT8)
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


def test_engines_without_a_familys_blocks_refuse_it_in_one_line(files: dict[str, Path],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """onnxruntime's stage graphs have Qwen3's query/key norms and Llama 3's RoPE factors (in their cos/sin tables),
    not Gemma's blocks; onnxruntime's tensor-parallel shares (float32 activations) have none of them."""
    from edgerun.tp.ggml_shard import build_share
    from edgerun.tp.shard import full_spec

    assert main(["generate", "--model", str(files["gemma3"]), "--engine", "onnx", "--max-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a GELU gate" in err and "ggml" in err, err
    for family in ("llama3", "qwen3"):
        assert main(["generate", "--model", str(files[family]), "--engine", "onnx", "--max-tokens", "2", "hi"]) == 0
        model = load_model(files[family])
        with pytest.raises(EdgerunError, match="an onnxruntime share does not compute"):
            build_share(model.config, model.weights, full_spec(model.config), 64, 1, Activations.F32)


def test_a_pipeline_leaves_out_workers_without_an_engine_for_the_model(files: dict[str, Path]) -> None:
    """A browser tab runs edgerun's kernels (every dense family's blocks, 4- and 8-bit codes in blocks of 32: not a
    Q4_K_M file's Q6_K) or onnxruntime-web's graphs (Qwen3's query/key norms and Llama 3's RoPE factors, no Gemma
    blocks): for a Gemma 3 Q4_K_M model it is left out of every plan, said once in the log, where a native worker
    with ggml computes it; for the other families (their Q4_K_M files on onnxruntime-web) the tab takes part."""
    from edgerun.pp.deployment import Deployment
    from edgerun.pp.master import Route
    from edgerun.pp.workers import WorkerConn, Workers

    for family, tab_computes in (("gemma3", False), ("llama3", True), ("qwen3", True), ("phi3", True)):
        logs: list[str] = []
        workers = Workers(b"k", {}, logs.append, lambda *_: None)
        for name, capabilities in (("native", {"kind": "native", "ggml": True}),
                                   ("tab", {"kind": "browser", "weights": "kernels"})):
            workers.by_name[name] = WorkerConn(name, None, 4096, 1e9, capabilities, set())
        deployment = Deployment(load_model(files[family]), workers, 256, "latency", 1, Activations.INT8, Route.STAR,
                                logs.append, None)
        for _ in range(2):
            assert [d.name for d in deployment.devices()] == (["native", "tab"] if tab_computes else ["native"])
        assert len([line for line in logs if "tab is left out" in line]) == (0 if tab_computes else 1), logs
