"""A MoEx hub with expert workers in their own processes, over real WebSockets: the numpy reference's greedy
tokens with and without hedging, a worker killed mid-request served by its replicas without a re-prefill, and a
hub that survives whatever a peer sends."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import websockets

from edgerun.model.generate import ReferenceEngine, generate
from edgerun.model.loader import Model, load_model
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.model.synth import SHAPES, SynthSpec, write_synthetic
from edgerun.moe.hub import HubConfig, MoeHub
from edgerun.net.moex import ExpertHeartbeat, ExpertHello, ExpertStatus, moex_frame
from edgerun.net.wire import derive_key

pytestmark = pytest.mark.slow  # hubs and expert workers in processes

SECRET = "moe-tests"
GREEDY = Sampler(SamplingParams())
PROMPT = "Experts of a mixture, each on a worker of its own"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    path = tmp_path_factory.mktemp("moe") / "moe-tiny.gguf"
    write_synthetic(SynthSpec(SHAPES["moe-tiny"], "Q4_0", seed=5), path, "gguf")
    return load_model(path)


@pytest.fixture(scope="module")
def expected(model: Model) -> list[int]:
    return generate(ReferenceEngine(model, 256), model.tokenizer.encode(PROMPT), 64, GREEDY).tokens


def start_worker(port: int, name: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--mode", "moe", "--master",
                             f"127.0.0.1:{port}", "--key", SECRET, "--name", name, "--memory-budget", "50",
                             "--threads", "1"], stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def cluster(model: Model, workers: int, config: HubConfig) -> Iterator[tuple[MoeHub, list[subprocess.Popen], list]]:
    logs: list[str] = []
    hub = MoeHub(model, derive_key(SECRET), config, log=logs.append)
    procs = [start_worker(hub.port, f"e{i}") for i in range(workers)]
    try:
        hub.wait_for_workers(workers)
        yield hub, procs, logs
    finally:
        hub.close()
        for p in procs:
            p.kill()
            p.wait()


def test_a_hub_and_three_workers_give_the_references_tokens_hedged_or_not(model: Model, expected: list[int]) -> None:
    prompt = model.tokenizer.encode(PROMPT)
    assert len(set(expected)) > 4  # a sequence worth comparing
    with cluster(model, 3, HubConfig(max_len=256, replicas=2)) as (hub, _, logs):
        assert hub.generate(prompt, 64, GREEDY) == expected
        single = hub.stats.sent
        assert single == hub.stats.dispatches  # h = 1: one frame per (expert, tokens)
        hub.reconfigure(replace(hub.config, hedge=2))
        assert hub.generate(prompt, 64, GREEDY) == expected
        assert hub.stats.sent - single == 2 * (hub.stats.dispatches - single)  # every dispatch went to both
        assert hub.stats.redispatched == 0
    # Every expert of both layers on two distinct workers, each worker holding a share.
    assert any("placed 32 experts x 2 replicas" in line for line in logs), logs


def test_int8_experts_on_ggml_repeat_themselves_and_track_the_onnx_engine(model: Model) -> None:
    """With int8 activations (the CLI's default) the workers compute their experts on ggml, llama.cpp's kernels,
    the hub its attention and LM head on ggml too, and it adds the experts by expert id: the same request gives the
    same tokens every time, and they are the int8 onnx engine's (all of it on onnxruntime) until the first near-tie,
    which this prompt does not reach in 16."""
    from edgerun.model.onnx_engine import OnnxEngine
    from edgerun.model.onnx_graph import Activations
    from edgerun.moe.hub_layers import GgmlLayers

    prompt = model.tokenizer.encode(PROMPT)
    single = generate(OnnxEngine(model, 256, threads=1, activations=Activations.INT8), prompt, 16, GREEDY).tokens
    with cluster(model, 2, HubConfig(max_len=256, replicas=1, activations=Activations.INT8, threads=1)) as (hub, _, _):
        runs = [hub.generate(prompt, 16, GREEDY) for _ in range(2)]
        assert isinstance(hub.layers, GgmlLayers)
    assert runs[0] == runs[1] == single, (runs, single)


def test_a_killed_worker_is_replaced_by_its_replicas_without_a_prefill(model: Model, expected: list[int]) -> None:
    prompt = model.tokenizer.encode(PROMPT)
    with cluster(model, 3, HubConfig(max_len=256, replicas=2)) as (hub, procs, logs):
        seen: list[int] = []

        def kill_at_ten(token: int) -> None:
            seen.append(token)
            if len(seen) == 10:
                procs[1].send_signal(signal.SIGKILL)

        result = generate(hub, prompt, 64, GREEDY, on_token=kill_at_ten)
        assert result.tokens == expected
        assert result.recoveries == 0  # no re-prefill: the surviving replicas answered
        assert any("e1 left" in line for line in logs), logs
        # In the background its experts got new replicas on the two left: each now holds every expert.
        hub.settle()
        assert any("experts of e1 replicated again" in line for line in logs), logs
        assert {len(hub.placement.experts_of(name)) for name in ("e0", "e2")} == {32}
        assert hub.generate(prompt, 64, GREEDY) == expected


def test_the_hub_survives_garbage_and_impostors(model: Model, expected: list[int]) -> None:
    """Frames with a foreign key, random bytes, text, a second worker under a taken name: each refused, and the
    cluster still computes the reference's tokens."""
    prompt = model.tokenizer.encode(PROMPT)

    async def pester(port: int) -> None:
        url = f"ws://127.0.0.1:{port}/moe"
        for first in (b"\x00" * 40, moex_frame(ExpertHeartbeat(0, ExpertHello("x")), derive_key("other")), "text",
                      moex_frame(ExpertHeartbeat(0, ExpertHello("e0", 1)), derive_key(SECRET)),
                      moex_frame(ExpertHeartbeat(0, ExpertStatus()), derive_key(SECRET))):
            with contextlib.suppress(websockets.ConnectionClosed):
                async with websockets.connect(url) as ws:
                    await ws.send(first)
                    await asyncio.wait_for(ws.recv(), 5)

    with cluster(model, 2, HubConfig(max_len=256, replicas=2)) as (hub, _, logs):
        asyncio.run(pester(hub.port))
        assert hub.generate(prompt, 64, GREEDY) == expected
        assert len([w for w in hub.workers.values() if w.alive]) == 2
    assert any("already connected" in line for line in logs), logs


def test_bench_moe_times_each_hedge_beside_the_latency_model(model: Model, capsys: pytest.CaptureFixture) -> None:
    """A base row without injected latency, then one per hedging factor with every reply held back by a
    log-normal delay: hedging sends that many frames per dispatch and shortens the expert phase, which lands near
    the model's prediction (base + Eq. 18)."""
    import json

    from edgerun.cli import main

    assert main(["bench", "moe", "--model", str(model.path), "--workers", "2", "--replicas", "2", "--hedge", "1,2",
                 "--latency", "lognormal:30:0.6", "--tokens", "12", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["hedge"], r["latency"]) for r in rows] == [(1, "none"), (1, "lognormal:30:0.6"), (2, "lognormal:30:0.6")]
    base, h1, h2 = rows
    assert h1["frames_per_dispatch"] == 1 and h2["frames_per_dispatch"] == 2
    assert h1["expert_mean_ms"] > base["expert_mean_ms"] + 10 and h2["expert_mean_ms"] < h1["expert_mean_ms"]
    for r in (h1, h2):
        assert r["model_mean_ms"] > base["expert_mean_ms"] and r["tokens_per_s"] > 0 and r["single_ms_per_token"] > 0
        assert r["expert_mean_ms"] == pytest.approx(r["model_mean_ms"], rel=0.5)  # 11 decode steps x 2 layers
    assert main(["bench", "moe", "--model", str(model.path), "--replicas", "2", "--hedge", "3"]) == 2
    assert "between 1 and --replicas" in capsys.readouterr().err


def test_an_expert_deadline_drops_late_experts_and_rescales_the_gates_of_those_that_came(model: Model,
                                                                                      expected: list[int]) -> None:
    """Workers that answer in 40-ms-median log-normal time against a 25 ms deadline: some experts of most layers
    are dropped, generation goes on with the rest (the gates of those that came scaled to the full sum); with the
    deadline far away every expert counts and the tokens are the reference's."""
    from edgerun.bench.moe import local_hub
    from edgerun.sched.moe import LogNormal

    prompt = model.tokenizer.encode(PROMPT)
    with local_hub(model, 2, 2, latency=LogNormal(40, 0.5)) as hub:
        hub.reconfigure(replace(hub.config, expert_deadline_s=0.025))
        tokens = hub.generate(prompt, 8, GREEDY)
        assert len(tokens) == 8 and hub.stats.dropped > 0
        dropped = hub.stats.dropped
        hub.reconfigure(replace(hub.config, expert_deadline_s=10.0))
        assert hub.generate(prompt, 8, GREEDY) == expected[:8]
        assert hub.stats.dropped == dropped


def test_adaptive_hedging_sends_one_copy_to_a_fast_pool_and_more_past_the_threshold(model: Model,
                                                                                   expected: list[int]) -> None:
    from edgerun.bench.moe import local_hub

    prompt = model.tokenizer.encode(PROMPT)
    with local_hub(model, 2, 2, latency=None) as hub:
        hub.reconfigure(replace(hub.config, hedge=2, adaptive_hedge=True))
        assert hub.generate(prompt, 16, GREEDY) == expected[:16]
        first = hub.stats.sent / hub.stats.dispatches
        assert 1 < first < 1.5  # hedged only until each worker had answered: then its median is the pool's
        sent, dispatches = hub.stats.sent, hub.stats.dispatches
        hub.reconfigure(replace(hub.config, hedge_threshold_ms=1e-3))  # slower than this: every dispatch hedged
        assert hub.generate(prompt, 16, GREEDY) == expected[:16]
        assert hub.stats.sent - sent == 2 * (hub.stats.dispatches - dispatches)


def test_bad_moe_settings_are_one_line_each(model: Model, shipped_path: Path, capsys: pytest.CaptureFixture) -> None:
    from edgerun.cli import main
    from edgerun.errors import EdgerunError

    for argv, says in (([str(shipped_path)], "is dense"), ([str(model.path), "--expect", "1", "--replicas", "2"],
                                                            "at most --expect"),
                       ([str(model.path), "--hedge", "x"], "--hedge takes")):
        assert main(["master", "--plan", "moe", "--no-advertise", "--port", "0", "--key", SECRET, "--model",
                     *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
    # A worker whose budget holds no expert: the placement says what it needs.
    hub = MoeHub(model, derive_key(SECRET), HubConfig(max_len=256, replicas=1))
    tiny = subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--mode", "moe", "--master",
                             f"127.0.0.1:{hub.port}", "--key", SECRET, "--name", "tiny", "--memory-budget", "0.01"],
                            stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(EdgerunError, match="budgets hold"):
            hub.wait_for_workers(1)
    finally:
        hub.close()
        tiny.kill()
        tiny.wait()


def batch_requests(model: Model) -> list[tuple[list[int], SamplingParams]]:
    """Greedy and seeded requests for a batch: a prompt of several 16-token chunks, and two sharing a prompt."""
    tok = model.tokenizer
    shared = tok.encode("Many sequences at once, one dispatch per expert")
    return [(tok.encode(PROMPT), SamplingParams()),
            (shared, SamplingParams(temperature=0.8, seed=7)),
            (tok.encode("A prompt long enough to take several prefill chunks of the batch loop, " * 3),
             SamplingParams()),
            (shared, SamplingParams(temperature=1.0, top_p=0.9, seed=3)),
            (tok.encode("The last to join"), SamplingParams(temperature=0.7, seed=1))]


def test_a_hub_batches_sequences_each_with_its_tokens_alone_through_a_lost_worker(model: Model) -> None:
    """`serve --plan moe --parallel N`: a hub holding three sequences' caches (int8, on ggml) steps them together,
    each expert getting one dispatch of every token of the step that chose it, and each sequence gets the tokens it
    gets alone: greedy and seeded, a chunked prompt, a prompt shared with a running sequence (its rows copied), one
    joining late. A worker killed mid-batch (one replica each): the experts are placed again over the one left and
    the step runs again on the hub's caches: every sequence completes with the same tokens."""
    from edgerun.model.batch import BatchLoop
    from edgerun.model.generate import Generation
    from edgerun.model.onnx_graph import Activations

    requests = batch_requests(model)
    config = HubConfig(max_len=256, replicas=1, activations=Activations.INT8, threads=1, slots=3)
    with cluster(model, 2, config) as (hub, procs, _):
        alone, dispatched = [], []
        for prompt, params in requests:
            before = hub.stats.dispatches
            got: list = []
            loop = BatchLoop(hub, prefill_chunk=16)
            loop.add(Generation(prompt, 12, Sampler(params)), got.append)
            while loop.running:
                loop.step()
            alone.append(got[0].tokens)
            dispatched.append(hub.stats.dispatches - before)
        assert len({tuple(t) for t in alone}) == len(alone) and all(len(t) == 12 for t in alone)

        results: dict[int, list[int]] = {}
        seen: list[int] = []

        def kill_at_eight(token: int) -> None:
            seen.append(token)
            if len(seen) == 8:
                procs[1].send_signal(signal.SIGKILL)

        loop = BatchLoop(hub, prefill_chunk=16)
        before, waiting, steps = hub.stats.dispatches, list(enumerate(requests)), 0
        while waiting or loop.running:
            while waiting and loop.free and (waiting[0][0] < 4 or steps >= 6):  # the last joins late
                i, (prompt, params) = waiting.pop(0)
                loop.add(Generation(prompt, 12, Sampler(params), on_token=kill_at_eight),
                         lambda r, i=i: results.__setitem__(i, r.tokens))
            loop.step()
            steps += 1
        assert [results[i] for i in range(len(requests))] == alone
        assert loop.reused_tokens >= len(requests[1][0])  # the shared prompt was prefilled once
        # fewer dispatches than the sequences alone: an expert that several tokens chose got them in one
        assert hub.stats.dispatches - before < sum(dispatched)
        assert procs[1].poll() is not None and hub.placement is not None
        assert len(hub.placement.experts_of("e0")) == 32 and not hub.placement.experts_of("e1")
