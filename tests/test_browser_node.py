"""The browser node page in a real headless Chromium (Debian's, driven by Playwright): one native
worker and one browser worker run the shipped model as a two-stage pipeline and produce the
reference tokens. Also: the page's JavaScript frames and HMAC agree with edgerun/net/wire.py."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edgerun.bench.browser import CHROMIUM, CHROMIUM_FLAGS, WEBGPU_FLAGS
from edgerun.model.generate import ReferenceEngine, generate
from edgerun.model.loader import load_model
from edgerun.model.onnx_graph import Activations
from edgerun.model.sampling import Sampler, SamplingParams, uniform
from edgerun.net.wire import PpMsg, derive_key
from edgerun.pp.config import PipelineConfig
from edgerun.pp.master import PipelineMaster, PipelineState, browser_dir, chat_template_prefix
from edgerun.pp.messages import Computation, ComputationResult, open_frame, seal

pytestmark = pytest.mark.slow  # a headless Chromium

SECRET = "browser-test"
PROMPT = "The capital of France is"
N_TOKENS = 64


def missing() -> str | None:
    """What this machine lacks for the browser tests; CI installs all of it, so there it is a failure."""
    if not Path(CHROMIUM).exists():
        return "Debian's chromium is not installed (apt-get install chromium chromium-driver)"
    if not (browser_dir() / "node_modules" / "onnxruntime-web" / "dist").is_dir():
        return f"onnxruntime-web is not installed (npm install --prefix {browser_dir()})"
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    return None


def open_page(playwright, console_errors: bool = False, webgpu: bool = False):
    """Debian's Chromium with one page, and the list its uncaught errors (with `console_errors`, its console's
    errors too) are appended to. `webgpu`: with its software WebGPU adapter."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=WEBGPU_FLAGS if webgpu else CHROMIUM_FLAGS)
    page = browser.new_page()
    errors: list[str] = []
    if console_errors:
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return browser, page, errors


def require_browser() -> None:
    reason = missing()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


def start_native_worker(port: int, budget_mb: int) -> subprocess.Popen:
    """A native pipeline worker, "native", with one thread, joining the master at this port."""
    return subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--mode", "pp", "--master",
                             f"127.0.0.1:{port}", "--key", SECRET, "--name", "native", "--memory-budget",
                             str(budget_mb), "--threads", "1"], env=dict(os.environ), stderr=subprocess.DEVNULL)


def run_node(script: Path, *args: str) -> str:
    """The stdout of a JavaScript module run by Node (which CI installs)."""
    node = shutil.which("node")
    if node is None:
        if os.environ.get("CI"):
            pytest.fail("node is not installed")
        pytest.skip("node is not installed")
    return subprocess.run([node, str(script), *args], capture_output=True, text=True, check=True).stdout


def test_javascript_frames_match_python(tmp_path: Path) -> None:
    script = tmp_path / "frames.mjs"
    script.write_text(f"""
import {{clusterKey, hex, openFrame, packFrame, sha256}} from "{(browser_dir() / 'frames.js').as_posix()}";
const key = clusterKey("{SECRET}");
console.log(hex(sha256(new Uint8Array(1000).fill(7))));
const out = packFrame(key, 10, 9, {{seconds: 0.25}},
                      {{hidden: {{dtype: "float32", shape: [1, 3], data: new Float32Array([1, -2.5, 3])}}}});
console.log(Buffer.from(out).toString("base64"));
const input = openFrame(key, Buffer.from(process.argv[2], "base64"));
console.log(JSON.stringify({{type: input.type, request: input.request, ids: Array.from(input.tensors.input_ids.data,
                                                                                    Number)}}));
""")
    python_frame = seal(77, Computation(3, np.array([[11, 12, 13]], np.int64)), derive_key(SECRET))
    digest, frame, parsed = run_node(script, base64.b64encode(python_frame).decode()).split()
    assert digest == hashlib.sha256(bytes([7]) * 1000).hexdigest()
    request, message = open_frame(base64.b64decode(frame), derive_key(SECRET))
    assert (request, type(message), message.seconds) == (9, ComputationResult, 0.25)
    assert np.array_equal(message.hidden, np.array([[1, -2.5, 3]], np.float32))
    assert parsed == '{"type":9,"request":77,"ids":[11,12,13]}'


def test_the_pages_message_numbers_are_pythons(tmp_path: Path) -> None:
    """browser/frames.js's table of pipeline messages is net.wire.PpMsg's: every message a tab takes part in (the
    inference ones, INIT to KV_LOADED), each with Python's number; tuning and chained passes go to native workers
    only."""
    script = tmp_path / "messages.mjs"
    script.write_text(f'import {{Msg}} from "{(browser_dir() / "frames.js").as_posix()}";\n'
                      "console.log(JSON.stringify(Msg));\n")
    assert json.loads(run_node(script)) == {m.name: m.value for m in PpMsg if m <= PpMsg.KV_LOADED}


def wait_for(condition: Callable[[], bool], logs: list[str], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "\n".join(logs[-20:])
        time.sleep(0.2)


def test_javascript_sampling_matches_python(tmp_path: Path) -> None:
    """browser/sampling.js draws the same tokens as edgerun/model/sampling.py: greedy, temperature,
    top-k, top-p and min-p, over many seeds and positions, also with tied logits and a temperature that
    overflows them."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((40, 300)).astype(np.float32) * 3
    logits[:, 10:20] = logits[:, 5:6]  # ties: the stable order keeps them by index
    settings = [{"temperature": 0.0}, {"temperature": 0.8}, {"temperature": 1.3, "top_k": 12},
                {"temperature": 1.0, "top_p": 0.6}, {"temperature": 0.7, "top_k": 40, "top_p": 0.9},
                {"temperature": 1.5, "min_p": 0.2}, {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
                {"temperature": 2.2250738585e-313, "min_p": 0.05}]  # logits over it overflow: greedy
    cases = [(row, setting | {"seed": seed}, position) for row in range(len(logits)) for setting in settings
             for seed, position in ((row * 7919, row), (2**53 - 1 - row, 1000 + row))]
    (tmp_path / "logits.json").write_text(json.dumps(logits.tolist()))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    script = tmp_path / "sample.mjs"
    script.write_text(f"""
import {{readFileSync}} from "fs";
import {{sample, uniform}} from "{(browser_dir() / 'sampling.js').as_posix()}";
const logits = JSON.parse(readFileSync("{tmp_path / 'logits.json'}")).map((row) => Float32Array.from(row));
const cases = JSON.parse(readFileSync("{tmp_path / 'cases.json'}"));
console.log(JSON.stringify({{tokens: cases.map(([row, sampling, position]) => sample(logits[row], sampling, position)),
                             draws: [uniform(0, 0), uniform(12345, 678), uniform(2 ** 53 - 1, 2 ** 40)]}}));
""")
    got = json.loads(run_node(script))
    expected = [Sampler(SamplingParams(**{k: v for k, v in setting.items()}))(logits[row], position)
                for row, setting, position in cases]
    assert got["tokens"] == expected
    assert got["draws"] == [uniform(0, 0), uniform(12345, 678), uniform(2**53 - 1, 2**40)]
    assert len(set(expected)) > 50  # the draws spread, not all greedy


@pytest.mark.slow
def test_a_webgpu_stage_equals_the_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tab whose onnxruntime-web runs its stage on WebGPU (SwiftShader's adapter: slow, a few seconds a pass,
    so a few tokens) beside a native worker: the numpy reference's tokens."""
    require_browser()
    from playwright.sync_api import sync_playwright

    model = load_model()
    tokens = 4
    reference = generate(ReferenceEngine(model, 256), model.tokenizer.encode(PROMPT), tokens,
                         Sampler(SamplingParams())).tokens
    monkeypatch.setenv("EDGERUN_CACHE", str(tmp_path / "cache"))
    master = PipelineMaster(model, derive_key(SECRET), PipelineConfig(host="127.0.0.1", max_len=256,
                                                                      activations=Activations.F32))
    native = start_native_worker(master.port, 80)
    try:
        with sync_playwright() as p:
            browser, page, errors = open_page(p, webgpu=True)
            page.goto(f"http://127.0.0.1:{master.port}/node?name=gpu&memory=80#key={SECRET}")
            master.wait_for_workers(2, timeout_s=120)
            assert master.workers["gpu"].capabilities.backend == "webgpu", "no WebGPU adapter in Chromium"
            assert {s.worker for s in master.start().stages} == {"native", "gpu"}
            assert master.generate(model.tokenizer.encode(PROMPT), tokens) == reference
            browser.close()
        assert not errors, errors
    finally:
        master.close()
        native.kill()
        native.wait()


@pytest.mark.slow
def test_native_and_browser_pipeline_equals_the_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_browser()
    from playwright.sync_api import sync_playwright

    model = load_model()
    reference = generate(ReferenceEngine(model, 256), model.tokenizer.encode(PROMPT), N_TOKENS,
                         Sampler(SamplingParams())).tokens
    monkeypatch.setenv("EDGERUN_CACHE", str(tmp_path / "cache"))  # stage graphs here, files in the workers'
    logs: list[str] = []
    prefix = chat_template_prefix(model.tokenizer)  # the page saves and restores the prefix's KV too
    chat = model.tokenizer.encode(model.tokenizer.apply_chat_template([{"role": "user", "content": "Hi there."}]))
    chat_reference = generate(ReferenceEngine(model, 256), chat, 16, Sampler(SamplingParams())).tokens
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=11)
    sampled_reference = generate(ReferenceEngine(model, 256), model.tokenizer.encode(PROMPT), 16,
                                 Sampler(sampling)).tokens
    # Float32 on the native worker too: the tab computes in float32, and the two together give the numpy
    # reference's tokens.
    master = PipelineMaster(model, derive_key(SECRET), PipelineConfig(host="127.0.0.1", max_len=256,
                                                                      activations=Activations.F32,
                                                                      prefix=tuple(prefix)), log=logs.append)
    native = start_native_worker(master.port, 80)
    try:
        with sync_playwright() as p:
            browser, page, errors = open_page(p)
            # onnxruntime-web's WebAssembly with float32 matrices (weights=f32: without it the tab takes the
            # kernels, int8 activations; test_two_tabs_on_the_wasm_kernels...): 5.6x the quantized bytes, so 600 MB
            # hold about 107 MB of the shipped model's 126, and neither the tab nor the native worker (80) holds it.
            page.goto(f"http://127.0.0.1:{master.port}/node?name=browser&memory=600&weights=f32#key={SECRET}")
            master.wait_for_workers(2, timeout_s=120)
            assert master.workers["browser"].capabilities.kind == "browser"
            # Served cross-origin isolated, the page computes with as many WebAssembly threads as it has cores.
            assert page.evaluate("crossOriginIsolated") is True
            assert master.workers["browser"].capabilities.threads == page.evaluate("navigator.hardwareConcurrency")
            plan = master.start()
            assert {s.worker for s in plan.stages} == {"native", "browser"}  # neither holds the model alone
            tokens = master.generate(model.tokenizer.encode(PROMPT), N_TOKENS)
            chat_tokens = master.generate(chat, 16)
            status = page.inner_text("#status")
            # The tab reloads, now claiming to be fast: the master replans and gives it the last stage,
            # where it samples.
            page.goto("about:blank")
            wait_for(lambda: not master.workers["browser"].alive, logs)
            page.goto(f"http://127.0.0.1:{master.port}/node?name=browser&memory=600&speed=1e10&weights=f32"
                      f"#key={SECRET}")
            wait_for(lambda: master.state == PipelineState.UP and master.workers["browser"].alive
                     and master.plan.stages[-1].worker == "browser", logs)
            sampled = master.generate(model.tokenizer.encode(PROMPT), 16, sampling)
            browser.close()
        assert plan.stages[0].worker == "browser"  # first the browser runs the embedding
        assert tokens == reference
        assert chat_tokens == chat_reference
        assert sampled == sampled_reference != tokens[:16]
        assert not errors, errors
        # At least the prefix pass, the plain request's passes, then the chat request's; a repartition
        # meanwhile (the master measures the tab's speed) adds a prefix pass and a prefill of the context.
        assert "connected: true" in status and "thread(s)" in status, status
        served = int(status.split("passes served: ")[1].split()[0])
        assert served >= 1 + N_TOKENS + 16, (status, logs)
    finally:
        master.close()
        native.kill()
        native.wait()


def test_a_browser_tab_serves_experts_beside_a_native_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A MoEx hub with one native expert worker and one headless Chromium tab in expert mode (WebAssembly, float32
    expert graphs), each expert on one of them: the numpy reference's greedy tokens on moe-tiny for 64 tokens."""
    require_browser()
    from playwright.sync_api import sync_playwright

    from edgerun.model.synth import SHAPES, SynthSpec, write_synthetic
    from edgerun.moe.hub import HubConfig, MoeHub

    monkeypatch.setenv("EDGERUN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "moe-tiny.gguf"
    write_synthetic(SynthSpec(SHAPES["moe-tiny"], "Q4_0", seed=5), path, "gguf")
    model = load_model(path)
    prompt = model.tokenizer.encode("Experts of a mixture, each on a worker of its own")
    reference = generate(ReferenceEngine(model, 256), prompt, N_TOKENS, Sampler(SamplingParams())).tokens
    logs: list[str] = []
    hub = MoeHub(model, derive_key(SECRET), HubConfig(max_len=256, replicas=1), log=logs.append)
    native = subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--mode", "moe", "--master",
                               f"127.0.0.1:{hub.port}", "--key", SECRET, "--name", "native", "--memory-budget", "50",
                               "--threads", "1"], env=dict(os.environ), stderr=subprocess.DEVNULL)
    try:
        with sync_playwright() as p:
            browser, page, errors = open_page(p)
            page.goto(f"http://127.0.0.1:{hub.port}/node?mode=moe&name=tab&memory=500#key={SECRET}")
            hub.wait_for_workers(2, timeout_s=120)
            assert hub.workers["tab"].kind == "browser"
            assert {len(hub.placement.experts_of(n)) > 0 for n in ("native", "tab")} == {True}  # both hold experts
            tokens = hub.generate(prompt, N_TOKENS, Sampler(SamplingParams()))
            status = page.inner_text("#status")
            browser.close()
        assert not errors, errors
        assert tokens == reference, (tokens, reference)
        assert "experts:" in status and "passes served: 0" not in status, status
    finally:
        hub.close()
        native.kill()
        native.wait()


def test_the_wasm_kernels_compute_the_numpy_products() -> None:
    """browser/kernels.wat, assembled and run in Chromium: 4-bit blocks with offsets and 8-bit blocks without, rows
    of 18 blocks (four at a time, then a tail of two) and 48, against the numpy replica of their arithmetic."""
    require_browser()
    from playwright.sync_api import sync_playwright

    from edgerun.model.kernel_reference import _Matrix, product, quantize
    from edgerun.model.kernel_stage import packed_codes
    from edgerun.model.quant import AffineBlocks

    rng = np.random.default_rng(3)
    cases = []
    for bits, rows, cols, offsets in ((4, 40, 576, True), (4, 24, 1536, True), (8, 40, 576, False),
                                      (8, 16, 1536, True)):
        form = AffineBlocks(bits, 32, rng.integers(0, 2 ** bits, (rows, cols)).astype(np.uint8),
                            rng.uniform(0.001, 0.02, (rows, cols // 32)).astype(np.float32),
                            rng.uniform(-0.1, 0.1, (rows, cols // 32)).astype(np.float32) if offsets else None)
        x = (rng.standard_normal(cols) * rng.uniform(0.1, 10, cols)).astype(np.float32)
        codes, scale, sums = quantize(x)
        mid = 2 ** (bits - 1) if bits == 4 else 0  # 8-bit codes travel signed (code - 128)
        cases.append({"bits": bits, "rows": rows, "nb": cols // 32, "expected": product(_Matrix.of(form), x),
                      "arrays": [packed_codes(form), form.scales, form.offsets, codes.astype(np.int8),
                                 scale.astype(np.float32), (mid * codes.sum(axis=1)).astype(np.int32),
                                 sums.astype(np.float32)]})
    master = PipelineMaster(load_model(), derive_key(SECRET), PipelineConfig(host="127.0.0.1"))  # serves the files
    try:
        with sync_playwright() as p:
            browser, page, errors = open_page(p)
            page.goto(f"http://127.0.0.1:{master.port}/status")
            got = [page.evaluate("""async ([bits, rows, nb, arrays]) => {
                const bytes = await (await fetch("/kernels.wasm")).arrayBuffer();
                const k = (await WebAssembly.instantiate(bytes, {})).instance.exports;
                k.memory.grow(64);
                const heap = new Uint8Array(k.memory.buffer);
                let top = 64;
                const at = arrays.map((b64) => {
                    if (b64 === null) return 0;
                    const raw = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0)), address = top;
                    heap.set(raw, address);
                    top += Math.ceil(raw.length / 64) * 64;
                    return address;
                });
                k.gemv(bits, ...at, top, rows, nb);
                return Array.from(new Float32Array(k.memory.buffer, top, rows));
            }""", [c["bits"], c["rows"], c["nb"], [None if a is None else base64.b64encode(
                np.ascontiguousarray(a).tobytes()).decode() for a in c["arrays"]]]) for c in cases]
            browser.close()
        assert not errors, errors
        for case, values in zip(cases, got, strict=True):
            np.testing.assert_allclose(values, case["expected"], rtol=1e-5, atol=1e-4 * np.abs(case["expected"]).max())
    finally:
        master.close()


@pytest.mark.parametrize(("family", "weights"), [("shipped", "kernels"), ("llama3", "kernels"), ("qwen3", "kernels"),
                                                 ("gemma3", "kernels"), ("gemma3", "f32")])
def test_two_tabs_give_their_reference_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str,
                                              weights: str) -> None:
    """Two tabs, neither holding the model alone, run it as a two-stage pipeline: on edgerun's WebAssembly kernels
    (the default without WebGPU) the tokens of the numpy replica of the kernels' arithmetic, on onnxruntime-web's
    float32 graphs (weights=f32, a float32 deployment) the numpy reference's, for a plain request and a chat request
    through the saved prefix's KV; the shipped model, a synthetic Llama 3.2 in Q4_0 whose RoPE frequency factors
    (the stage's header carries them) change its tokens, a Qwen3 (query/key norms) and a Gemma 3 (GeGLU, post
    norms, scaled embedding and queries, windowed layers on their own RoPE base: the chat request reaches past the
    window)."""
    require_browser()
    from playwright.sync_api import sync_playwright

    from edgerun.bench.pp import stage_budgets_mb
    from edgerun.model.gguf_file import write_gguf
    from edgerun.model.kernel_reference import KernelReference
    from edgerun.model.kernel_stage import expansion
    from edgerun.model.synth import FAMILIES, synth_vocabulary, synth_weights, write_synthetic
    from edgerun.pp.deployment import dequantized_expansion
    from edgerun.sched.profiles import model_profile

    if family == "shipped":
        model = load_model()
    elif family != "llama3":
        write_synthetic(dataclasses.replace(FAMILIES[family], qtype="Q4_0"), tmp_path / "model.gguf", "gguf")
        model = load_model(tmp_path / "model.gguf")
    else:  # factors far from 1 and weights large enough that a short request's tokens depend on them
        spec = dataclasses.replace(FAMILIES[family], qtype="Q4_0", std=0.1)
        factored = dataclasses.replace(synth_weights(spec), rope_freqs=np.geomspace(
            1, 40, spec.config.head_dim // 2).astype(np.float32))
        write_gguf(tmp_path / "llama3.gguf", spec.config, factored, synth_vocabulary(spec.config.vocab_size),
                   "llama3")
        model = load_model(tmp_path / "llama3.gguf")
        plain = KernelReference(model.config, dataclasses.replace(model.weights, rope_freqs=None), 256)
        assert generate(plain, model.tokenizer.encode(PROMPT), N_TOKENS, Sampler(SamplingParams())).tokens != \
            generate(KernelReference(model.config, model.weights, 256), model.tokenizer.encode(PROMPT), N_TOKENS,
                     Sampler(SamplingParams())).tokens
    kernels = weights == "kernels"
    oracle = KernelReference(model.config, model.weights, 256) if kernels else ReferenceEngine(model, 256)
    reference = generate(oracle, model.tokenizer.encode(PROMPT), N_TOKENS, Sampler(SamplingParams())).tokens
    chat = model.tokenizer.encode(model.tokenizer.apply_chat_template([{"role": "user", "content": "Hi there."}]))
    chat_reference = generate(oracle, chat, 16, Sampler(SamplingParams())).tokens
    if family == "gemma3":  # the chat request reaches past the window, and the window changes its tokens
        whole = dataclasses.replace(model, config=dataclasses.replace(model.config, sliding_window=0))
        assert generate(KernelReference(whole.config, whole.weights, 256) if kernels else ReferenceEngine(whole, 256),
                        chat, 16, Sampler(SamplingParams())).tokens != chat_reference
    monkeypatch.setenv("EDGERUN_CACHE", str(tmp_path / "cache"))
    logs: list[str] = []
    master = PipelineMaster(model, derive_key(SECRET), PipelineConfig(
        host="127.0.0.1", max_len=256, prefix=tuple(chat_template_prefix(model.tokenizer)),
        activations=Activations.INT8 if kernels else Activations.F32), log=logs.append)
    # Budgets with which two tabs must share the model: its layers in two ranges, in the stage files' bytes.
    layers = model_profile(model.name, model.config, model.weights, context=256).layer_memory_bytes
    grown = expansion(model.weights) if kernels else dequantized_expansion(model)
    memory = stage_budgets_mb(layers, 2) * grown * 1.02
    try:
        with sync_playwright() as p:
            browser, page, errors = open_page(p, console_errors=True)
            pages = [page, browser.new_page()]
            pages[1].on("pageerror", lambda e: errors.append(str(e)))
            for i, tab in enumerate(pages):
                tab.goto(f"http://127.0.0.1:{master.port}/node?name=tab{i}&memory={memory:.3f}&weights={weights}"
                         f"#key={SECRET}")
            master.wait_for_workers(2, timeout_s=120)
            for name in ("tab0", "tab1"):
                assert master.workers[name].capabilities.weights.value == weights
                assert master.deployment.kernel_tab(master.workers[name]) == kernels
            plan = master.start()
            assert {s.worker for s in plan.stages} == {"tab0", "tab1"}, logs
            tokens = master.generate(model.tokenizer.encode(PROMPT), N_TOKENS)
            chat_tokens = master.generate(chat, 16)
            status = [tab.inner_text("#status") for tab in pages]
            browser.close()
        assert tokens == reference
        assert chat_tokens == chat_reference
        assert not [e for e in errors if "404" not in e], errors  # (the page asks for a favicon it has none of)
        assert all(f"{weights} weights" in s for s in status), status
    finally:
        master.close()


@pytest.mark.slow
def test_a_tab_closed_mid_request_leaves_the_request_to_the_native_worker(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A tab and a native worker that could hold the model alone share it; the tab closes mid-request: the
    pipeline replans over the native worker, prefills the context again and the request completes with the
    reference's tokens."""
    require_browser()
    from playwright.sync_api import sync_playwright

    model = load_model()
    tokens = 24
    reference = generate(ReferenceEngine(model, 256), model.tokenizer.encode(PROMPT), tokens,
                         Sampler(SamplingParams())).tokens
    monkeypatch.setenv("EDGERUN_CACHE", str(tmp_path / "cache"))
    logs: list[str] = []
    master = PipelineMaster(model, derive_key(SECRET), PipelineConfig(host="127.0.0.1", max_len=256,
                                                                      activations=Activations.F32), log=logs.append)
    native = start_native_worker(master.port, 400)
    try:
        with sync_playwright() as p:
            browser, page, errors = open_page(p)
            # A tab that claims to be ten times faster gets most of the layers (float32 matrices: 600 MB hold
            # about 107 MB of the model's 126), the native worker the rest.
            page.goto(f"http://127.0.0.1:{master.port}/node?name=tab&memory=600&speed=1e10&weights=f32"
                      f"#key={SECRET}")
            master.wait_for_workers(2, timeout_s=120)
            plan = master.start()
            assert {s.worker for s in plan.stages} == {"native", "tab"}, logs
            seen: list[int] = []

            def close_the_tab(token: int) -> None:
                seen.append(token)
                if len(seen) == 6:
                    page.close()

            got = master.generate(model.tokenizer.encode(PROMPT), tokens, on_token=close_the_tab)
            browser.close()
        assert got == reference, logs
        assert any("lost mid-request" in line for line in logs), logs
        assert [s.worker for s in master.plan.stages] == ["native"], logs
        assert not errors, errors
    finally:
        master.close()
        native.kill()
        native.wait()


def test_a_tab_names_the_files_the_server_lacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `npm install --prefix browser` (no onnxruntime-web, no kernels.wasm) the master says at its start
    that tabs cannot join and how to fix it; a tab that comes anyway names the missing files in its page, and the
    server's log names them once with the command."""
    require_browser()
    from playwright.sync_api import sync_playwright

    bare = tmp_path / "browser"
    bare.mkdir()
    for name in ("node.html", "node.js", "frames.js", "sampling.js", "expert.js", "kernels.js"):
        shutil.copy(browser_dir() / name, bare / name)
    monkeypatch.setenv("EDGERUN_BROWSER_DIR", str(bare))
    logs: list[str] = []
    master = PipelineMaster(load_model(), derive_key(SECRET), PipelineConfig(host="127.0.0.1", max_len=64),
                            log=logs.append)
    try:
        assert any(line.startswith("browser tabs cannot join until `npm install --prefix") and
                   "kernels.wasm" in line for line in logs), logs
        with sync_playwright() as p:
            browser, page, _ = open_page(p)
            page.goto(f"http://127.0.0.1:{master.port}/node?name=tab#key={SECRET}")
            page.wait_for_function("document.getElementById('status').textContent.startsWith('cannot start')",
                                   timeout=30_000)
            status = page.inner_text("#status")
            browser.close()
        assert "/kernels.wasm (HTTP 404)" in status and "/ort/ort.all.min.mjs (HTTP 404)" in status, status
        assert "/node.js" not in status, status
        asked = [line for line in logs if line.startswith("a browser tab asked for")]
        assert any("kernels.wasm" in line and "npm install --prefix" in line for line in asked), logs
        assert len(asked) == len(set(asked)), asked  # each file once
    finally:
        master.close()


@pytest.mark.slow
def test_a_master_builds_the_page_files_npm_makes_when_they_are_missing(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkout's browser/ without `npm install` run: a master with npm at hand fetches and builds the page's
    files in the background, saying so, and says when tabs can join."""
    if shutil.which("npm") is None:
        if os.environ.get("CI"):
            pytest.fail("npm is not installed")
        pytest.skip("npm is not installed")
    from edgerun.pp import http

    bare = tmp_path / "browser"
    bare.mkdir()
    for path in browser_dir().iterdir():
        if path.is_file() and path.name != "kernels.wasm":
            shutil.copy(path, bare / path.name)
    monkeypatch.setenv("EDGERUN_BROWSER_DIR", str(bare))
    monkeypatch.setattr(http, "_installing", [])
    logs: list[str] = []
    master = PipelineMaster(load_model(), derive_key(SECRET), PipelineConfig(host="127.0.0.1", max_len=64),
                            log=logs.append)
    try:
        assert any(line.startswith("browser tabs: ") and "fetching and building them" in line for line in logs), logs
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any("browser tabs can join now" in line or "failed" in line
                                                      for line in logs):
            time.sleep(0.5)
        assert any("browser tabs can join now" in line for line in logs), logs
        assert http.missing_page_files() == []
    finally:
        master.close()
