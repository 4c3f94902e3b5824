"""Pipeline mode end to end: a master in this process and native workers as real processes over
WebSocket on loopback, checked against the single-process engine (int8 activations, as the stages by default)
and, with float32 stages, against the numpy reference."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from edgerun.bench.pp import SECRET, local_pipeline, start_worker
from edgerun.cli import main
from edgerun.model.generate import ReferenceEngine, default_engine, generate, make_engine
from edgerun.model.loader import Model, load_model
from edgerun.model.onnx_graph import Activations
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.net.wire import PP_HEADER, PpMsg, WorkerKind, cluster_mac, derive_key, open_pp_frame, pp_frame, pp_packet
from edgerun.pp.master import (
    PipelineConfig,
    PipelineMaster,
    PipelineState,
    Route,
    chat_template_prefix,
    describe,
)
from edgerun.pp.messages import Capabilities, Computation, ComputationResult, Connect, ReleaseSession, StageFile, seal
from edgerun.pp.worker import PipelineWorker, load_threads
from edgerun.sched.pp_plan import Stage

KEY = derive_key(SECRET)
PROMPT = "The capital of France is"
N_TOKENS = 64

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Stage graphs (master) and downloaded files (workers) in a fresh cache."""
    old = os.environ.get("EDGERUN_CACHE")
    os.environ["EDGERUN_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if old is None:
        del os.environ["EDGERUN_CACHE"]
    else:
        os.environ["EDGERUN_CACHE"] = old


@pytest.fixture(scope="module")
def model() -> Model:
    return load_model()


@pytest.fixture(scope="module")
def reference_tokens(model: Model) -> list[int]:
    """What one process computes with the stages' default (int8) activations: a pipeline computes each layer
    exactly as the whole-model graph does, so its tokens are these, not merely close to them."""
    return reference_run(model, PROMPT, N_TOKENS)


@contextlib.contextmanager
def pipeline(model: Model, budgets: list[float], **options: object) -> Iterator[tuple[PipelineMaster, list]]:
    """A local pipeline whose master keeps its log lines in `master.logs`."""
    logs: list[str] = []
    with local_pipeline(model, budgets, 256, logs.append, **options) as (master, workers):
        master.logs = logs
        yield master, workers


def kill_after(n: int, victim: subprocess.Popen) -> Callable[[int], None]:
    """An on_token callback that kills -9 the victim when the n-th token is out."""
    seen: list[int] = []

    def on_token(token: int) -> None:
        seen.append(token)
        if len(seen) == n:
            victim.send_signal(signal.SIGKILL)

    return on_token


@pytest.mark.parametrize("budgets, stages, activations, route, threads", [
    ([80, 80], 2, Activations.INT8, Route.CHAIN, 1), ([50, 50, 50], 3, Activations.INT8, Route.CHAIN, 2),
    ([50, 50, 50], 3, Activations.INT8, Route.STAR, 1), ([80, 80], 2, Activations.F32, Route.CHAIN, 2)])
def test_split_by_memory_budgets_equals_the_reference(model: Model, reference_tokens: list[int],
                                                      budgets: list[float], stages: int, activations: Activations,
                                                      route: Route, threads: int,
                                                      capsys: pytest.CaptureFixture) -> None:
    """The shipped model (126 MB by the planner's count) does not fit one worker's budget. Int8 stages give the
    single-process engine's tokens (ggml stages); float32 stages the numpy reference's (onnxruntime's); passes
    stage to stage (chain) or through the master (star) alike; stages in one graph, or (`edgerun node
    --load-threads 2`, onnxruntime) in two whose sessions the worker creates at once."""
    expected = reference_tokens if activations is Activations.INT8 else generate(
        ReferenceEngine(model, 256), model.tokenizer.encode(PROMPT), N_TOKENS, Sampler(SamplingParams())).tokens
    with pipeline(model, budgets, activations=activations, route=route, load_threads=threads) as (master, _):
        plan = master.start()
        assert len(plan.stages) == stages and master.state == PipelineState.UP
        assert master.deployment.chained == (route == Route.CHAIN)
        assert plan.stages[0].first_layer == 0 and plan.stages[-1].end_layer == model.config.n_layers
        for s in plan.stages:  # in parts where asked, if the machine and its onnxruntime can load them at once
            # int8 stages run on ggml (llama.cpp's kernels, one graph), float32 ones on onnxruntime
            assert master.deployment.ggml_stages(s.worker) == (activations is Activations.INT8)
            bounds = master.deployment.part_bounds(s, s.worker)
            parts = 1 if activations is Activations.INT8 else load_threads(threads)
            assert len(bounds) == parts - 1, bounds
            assert all(s.first_layer < b < s.end_layer for b in bounds), bounds
        assert master.generate(model.tokenizer.encode(PROMPT), N_TOKENS) == expected
        assert master.generate(model.tokenizer.encode(PROMPT), N_TOKENS) == expected  # and again: the same tokens
        assert main(["status", "--master", f"127.0.0.1:{master.port}"]) == 0
        shown = capsys.readouterr().out
        assert shown.startswith(f"state Up, route {route}"), shown
        assert all(f"{s.worker}: native" in shown for s in plan.stages), shown
        assert f"layers 0-{plan.stages[0].end_layer - 1}" in shown


@pytest.mark.parametrize("victim", [0, 1])
def test_killing_a_worker_mid_generation_recovers_identically(model: Model, reference_tokens: list[int],
                                                              victim: int, capsys: pytest.CaptureFixture) -> None:
    """Three workers, two stages on a chained route; the first stage's worker (which the master sends to) or the
    second's (which the first hands its output to) is killed."""
    with pipeline(model, [80, 80, 80]) as (master, workers):
        plan = master.start()
        assert master.deployment.chained
        lost = plan.stages[victim].worker
        kill_at_ten = kill_after(10, workers[int(lost[1:])])
        tokens = master.generate(model.tokenizer.encode(PROMPT), N_TOKENS, on_token=kill_at_ten)
        prompt = len(model.tokenizer.encode(PROMPT))
        assert master.prefill_lengths == [prompt, prompt + 10]  # the context prefilled again after token 10
        assert tokens[:10] == reference_tokens[:10] and tokens == replayed(model, master, 0)
        assert len(master.recovery_seconds) == 1 and master.state == PipelineState.UP
        assert lost not in {s.worker for s in master.plan.stages}
        assert main(["status", "--master", f"127.0.0.1:{master.port}"]) == 0
        shown = capsys.readouterr().out
        assert f"{lost}:" not in shown, shown  # the dead worker left the list
        assert all(f"{s.worker}: native" in shown for s in master.plan.stages), shown
        print(f"recovered in {master.recovery_seconds[0]:.2f} s")


def test_a_spare_worker_that_loaded_a_running_stage_ahead_takes_it_over(model: Model,
                                                                          reference_tokens: list[int]) -> None:
    """Three workers, two stages: the spare cannot hold a whole standby plan, so it loads the first running stage
    ahead. Killing that stage's worker hands the stage to the spare as it is, the other worker keeps its own,
    and the output is the reference's."""
    with pipeline(model, [80, 80, 80]) as (master, workers):
        plan = master.start()
        deadline = time.monotonic() + 120
        while not master.deployment.covers and time.monotonic() < deadline:
            time.sleep(0.1)
        covers = dict(master.deployment.covers)
        assert len(covers) == 1, master.logs
        spare, stage = next(iter(covers.items()))
        assert spare not in {s.worker for s in plan.stages}
        covered = next(s for s in plan.stages if (s.first_layer, s.end_layer) == (stage.first_layer, stage.end_layer))
        kept = [s for s in plan.stages if s != covered]
        kill_at_ten = kill_after(10, workers[int(covered.worker[1:])])
        tokens = master.generate(model.tokenizer.encode(PROMPT), N_TOKENS, on_token=kill_at_ten)
        assert tokens[:10] == reference_tokens[:10] and tokens == replayed(model, master, 0)
        assert any(f"{spare} takes {covered.worker}'s layers {stage.first_layer}-{stage.end_layer - 1} (loaded "
                   "ahead)" in line for line in master.logs), "\n".join(master.logs)
        assert set(master.plan.stages) == {stage, *kept}
        print(f"recovered in {master.recovery_seconds[0]:.2f} s")


class WrongShapeWorker(PipelineWorker):
    """Loads its stage like any worker, then answers every computation to the master with garbage."""

    def _pass(self, message: Computation) -> tuple[Any, bool]:
        return ComputationResult(0.0, 10**9, hidden=np.zeros((1, 3, 7), np.float32)), False


class GarbageForwarder(PipelineWorker):
    """On a chained route, hands the next stage a hidden state of the wrong shape (as the last stage: a token
    that does not exist)."""

    def _pass(self, message: Computation) -> tuple[Any, bool]:
        if self.stage is not None and self.stage.lm_head:
            return ComputationResult(token=-1, stage_seconds=(0.1, 0.1)), False
        return dataclasses.replace(message, input_ids=None, hidden=np.zeros((1, 3, 7), np.float32), chain=(0.1,)), \
            True


def test_bad_input_is_rejected_while_the_master_keeps_serving(model: Model, reference_tokens: list[int]) -> None:
    with pipeline(model, [80, 80], max_frame=1 << 20) as (master, _):
        url = f"ws://127.0.0.1:{master.port}/ws"
        # An unauthenticated worker, a wrong protocol version, an oversized frame: refused with a reason.
        with connect(url, max_size=None) as ws:
            ws.recv()
            ws.send(seal(0, Connect("intruder", 1e6, 1e12, Capabilities(WorkerKind.NATIVE)),
                         derive_key("wrong secret")))
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=10)
        with connect(url, max_size=None) as ws:
            ws.recv()
            frame = bytearray(seal(0, Connect("future", 1e6, 1e12, Capabilities(WorkerKind.NATIVE)), KEY))
            frame[2] = 9  # version
            body = bytes(frame[:-16])
            ws.send(body + cluster_mac(KEY, body))
            with pytest.raises(ConnectionClosed):
                ws.recv(timeout=10)
        with connect(url, max_size=None) as ws:
            ws.recv()
            with pytest.raises(ConnectionClosed):
                ws.send(b"\0" * (2 << 20))
                ws.recv(timeout=10)
        assert {"intruder", "future"}.isdisjoint(master.workers)
        assert any("bad MAC" in line for line in master.logs), master.logs
        assert any("version 9" in line for line in master.logs), master.logs

        # A worker that returns tensors of the wrong shape is expelled; the request recovers without it.
        liar = WrongShapeWorker(url, KEY, "liar", 80, 1e12, 1, log=lambda _: None)
        thread = threading.Thread(target=lambda: asyncio.run(liar.run()), daemon=True)
        thread.start()
        master.wait_for_workers(3, timeout_s=60)
        master.start()
        assert "liar" in {s.worker for s in master.plan.stages}  # the fastest: it gets a stage
        assert master.generate(model.tokenizer.encode(PROMPT), N_TOKENS) == reference_tokens
        assert "liar" not in {s.worker for s in master.plan.stages}
        assert any("liar expelled" in line for line in master.logs), master.logs
        thread.join(timeout=10)


def test_a_stage_that_hands_on_garbage_is_expelled(model: Model, reference_tokens: list[int]) -> None:
    """On a chained route the next stage checks what it is handed: a stage that sends a malformed hidden state
    is expelled (not the stage that refused it), and the request recovers without it. A frame sealed with
    another key, or a message other than a pass, sent to a worker's peer port is dropped."""
    with pipeline(model, [80, 80]) as (master, _):
        liar = GarbageForwarder(f"ws://127.0.0.1:{master.port}/ws", KEY, "liar", 80, 1e12, 1, log=lambda _: None)
        thread = threading.Thread(target=lambda: asyncio.run(liar.run()), daemon=True)
        thread.start()
        master.wait_for_workers(3, timeout_s=60)
        master.start()
        assert master.deployment.chained and "liar" in {s.worker for s in master.plan.stages}
        honest = next(w for w in master.workers.alive() if w.name != "liar")
        with socket.create_connection(("127.0.0.1", honest.capabilities.peer_port)) as sock:
            sock.sendall(pp_packet(seal(1, Computation(0, hidden=np.zeros((1, 1, model.config.hidden), np.float32)),
                                        derive_key("wrong secret"))))
            sock.sendall(pp_packet(seal(2, ReleaseSession(), KEY)))
            sock.sendall(b"\xff" * 8)  # a length no frame has: the port drops this connection
            assert sock.recv(1) == b""
        assert master.generate(model.tokenizer.encode(PROMPT), N_TOKENS) == reference_tokens
        assert "liar" not in {s.worker for s in master.plan.stages}
        expelled = [line for line in master.logs if "expelled" in line]
        assert len(expelled) == 1 and expelled[0].startswith("worker liar expelled"), master.logs
        # One loss only: the honest worker kept its stage through what came to its peer port.
        assert [line for line in master.logs if "lost mid-request" in line] == \
            ["worker liar lost mid-request: replanning and prefilling the context again"], master.logs
        thread.join(timeout=10)


def test_frames_round_trip_and_refuse_tampering() -> None:
    tensors = {"hidden": np.arange(12, dtype=np.float32).reshape(1, 3, 4), "input_ids": np.array([[5, 6]])}
    frame = pp_frame(PpMsg.COMPUTATION, 42, {"position": 7}, KEY, tensors)
    kind, request, message, out = open_pp_frame(frame, KEY)
    assert (kind, request, message["position"]) == (PpMsg.COMPUTATION, 42, 7)
    assert np.array_equal(out["hidden"], tensors["hidden"]) and out["input_ids"].dtype == np.int64
    assert PP_HEADER.size == 16
    from edgerun.net.wire import WireError

    for i in (0, 3, 20, len(frame) - 20, len(frame) - 1):
        tampered = bytearray(frame)
        tampered[i] ^= 1
        with pytest.raises(WireError):
            open_pp_frame(bytes(tampered), KEY)
    with pytest.raises(WireError, match="MAC"):
        open_pp_frame(frame, derive_key("other"))
    # Authentic but lying about a tensor: refused, never read out of bounds.
    lie = pp_frame(PpMsg.COMPUTATION, 1, {"tensors": {"x": {"dtype": "float32", "shape": [1000], "offset": 0,
                                                              "bytes": 4000}}}, KEY)
    with pytest.raises(WireError, match="does not fit"):
        open_pp_frame(lie, KEY)
    time.sleep(0)


def test_a_better_worker_joining_is_taken_by_a_repartition(model: Model, reference_tokens: list[int]) -> None:
    with pipeline(model, [80, 80]) as (master, workers):
        master.start()
        assert len(master.plan.stages) == 2
        workers.append(start_worker(master.port, "big", 400, speed=1e12))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (master.state == PipelineState.UP and master.plan is not None and
                                                   "big" in {s.worker for s in master.plan.stages}):
            time.sleep(0.5)
        assert [s.worker for s in master.plan.stages] == ["big"], master.logs
        assert any("repartitioning (a better plan)" in line for line in master.logs), master.logs
        assert master.generate(model.tokenizer.encode(PROMPT), N_TOKENS) == reference_tokens


class SlowWorker(PipelineWorker):
    """A worker on a slow device: every pass takes 150 ms longer."""

    def _pass(self, message: Computation) -> tuple[Any, bool]:
        time.sleep(0.15)
        return super()._pass(message)


def test_a_better_plan_is_hot_swapped_in_mid_request(model: Model, reference_tokens: list[int]) -> None:
    """Two slow workers serve; a fast one joins after 3 tokens. Its stage is downloaded beside the running
    plan, the request swaps to it at a token boundary, the two stages' KV caches move to it (no prefill), and the
    output is unchanged."""
    logs: list[str] = []
    master = PipelineMaster(model, KEY, PipelineConfig(host="127.0.0.1", max_len=256), log=logs.append)
    url = f"ws://127.0.0.1:{master.port}/ws"
    slow = [SlowWorker(url, KEY, f"slow{i}", 80, 1e9, 1, log=lambda _: None) for i in range(2)]
    threads = [threading.Thread(target=lambda w=w: asyncio.run(w.run()), daemon=True) for w in slow]
    joined: list[subprocess.Popen] = []

    def join_after_three(token: int) -> None:
        if not joined and master.deployment.busy and len([line for line in logs if "hot swap" in line]) == 0:
            seen.append(token)
            if len(seen) == 3:
                joined.append(start_worker(master.port, "big", 400, speed=1e12))

    seen: list[int] = []
    try:
        for t in threads:
            t.start()
        master.wait_for_workers(2, timeout_s=60)
        assert len(master.start().stages) == 2
        tokens = master.generate(model.tokenizer.encode(PROMPT), N_TOKENS, on_token=join_after_three)
        # The running stages' KV caches moved to the new one: no prefill again, the uninterrupted run's tokens.
        assert master.prefill_lengths == [len(model.tokenizer.encode(PROMPT))], logs
        assert any("KV cache of" in line for line in logs), logs
        assert tokens == reference_tokens
        assert [s.worker for s in master.plan.stages] == ["big"], logs
        assert len(master.swap_seconds) == 1 and master.recovery_seconds == [], logs
        assert any("prepared beside the running one" in line for line in logs), logs
        assert master.state == PipelineState.UP and master.staged is None
        print(f"hot swap in {master.swap_seconds[0]:.2f} s")
    finally:
        master.close()
        for p in joined:
            p.kill()
            p.wait()


def test_spares_that_hold_every_running_stage_cover_them_all(model: Model, reference_tokens: list[int],
                                                            capsys: pytest.CaptureFixture) -> None:
    """Four workers, two stages: each spare loads one running stage ahead, so a loss of either stage's worker
    is handed over with nothing to load, the other stage keeps its worker, and the other spare still covers
    its stage for the next loss."""
    with pipeline(model, [80, 80, 80, 80]) as (master, workers):
        plan = master.start()
        deadline = time.monotonic() + 120
        while len(master.deployment.covers) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        covers = dict(master.deployment.covers)
        assert {(s.first_layer, s.end_layer) for s in covers.values()} == \
            {(s.first_layer, s.end_layer) for s in plan.stages}, master.logs
        assert master.shadow is None  # covers stand by instead of a plan of other boundaries
        assert main(["status", "--master", f"127.0.0.1:{master.port}"]) == 0
        shown = capsys.readouterr().out
        assert "loaded ahead: " + ", ".join(f"{w} layers {s.first_layer}-{s.end_layer - 1}"
                                            for w, s in sorted(covers.items())) in shown, shown
        lost = plan.stages[0]
        taker = next(w for w, s in covers.items() if (s.first_layer, s.end_layer) == (lost.first_layer, lost.end_layer))
        other = next(w for w in covers if w != taker)
        tokens = master.generate(model.tokenizer.encode(PROMPT), N_TOKENS,
                                 on_token=kill_after(10, workers[int(lost.worker[1:])]))
        assert tokens[:10] == reference_tokens[:10] and tokens == replayed(model, master, 0)
        assert any(f"{taker} takes {lost.worker}'s layers {lost.first_layer}-{lost.end_layer - 1} (loaded ahead)"
                   in line for line in master.logs), "\n".join(master.logs)
        assert master.plan.stages == (Stage(taker, lost.first_layer, lost.end_layer), plan.stages[1])
        assert master.deployment.covers.get(other) == covers[other]  # still loaded, still covering


def test_a_shadow_plan_takes_over_from_a_lost_worker(model: Model, reference_tokens: list[int],
                                                    capsys: pytest.CaptureFixture) -> None:
    """Two workers of 70 MB run the model in two stages; three of 50 MB cannot hold either stage, but can hold a
    standby plan of three stages (strict shadow), whose stages they download and load. Killing a running
    worker falls back to it: identical output, without planning or downloading anew."""
    with pipeline(model, [70, 70, 50, 50, 50]) as (master, workers):
        plan = master.start()
        assert {s.worker for s in plan.stages} == {"w0", "w1"}
        deadline = time.monotonic() + 120
        while master.shadow is None and time.monotonic() < deadline:
            time.sleep(0.2)
        shadow = master.shadow
        assert shadow is not None, master.logs
        assert {s.worker for s in shadow.stages}.isdisjoint(s.worker for s in plan.stages)
        assert not master.deployment.covers
        assert main(["status", "--master", f"127.0.0.1:{master.port}"]) == 0
        assert "shadow plan:" in capsys.readouterr().out
        kill_at_ten = kill_after(10, workers[int(plan.stages[0].worker[1:])])
        since = len(master.prefill_lengths)
        tokens = master.generate(model.tokenizer.encode(PROMPT), N_TOKENS, on_token=kill_at_ten)
        # Prefilled again after token 10, and maybe later when a repartition improves on the shadow plan.
        assert master.prefill_lengths[since + 1] == master.prefill_lengths[since] + 10
        assert tokens == replayed(model, master, since)
        fallback = next(i for i, line in enumerate(master.logs) if "falling back to the shadow plan" in line)
        # The shadow plan is what was deployed then (a later repartition may still improve on it).
        assert next(line for line in master.logs[fallback:] if line.startswith("plan: ")) == f"plan: {describe(shadow)}"
        print(f"recovered onto the shadow plan in {master.recovery_seconds[0]:.2f} s")


def test_hedged_replicas_keep_serving_through_a_loss_without_recovery(model: Model,
                                                                      reference_tokens: list[int]) -> None:
    with pipeline(model, [80, 80, 80, 80], replicas=2) as (master, workers):
        plan = master.start()
        assert len(plan.stages) == 2 and all(len(names) == 2 for names in master.deployment.stage_workers)
        kill_at_ten = kill_after(10, workers[int(plan.stages[0].worker[1:])])
        assert master.generate(model.tokenizer.encode(PROMPT), N_TOKENS, on_token=kill_at_ten) == reference_tokens
        assert master.recovery_seconds == []  # the replica answered: no replan, no re-prefill
        assert not master.workers[plan.stages[0].worker].alive


def test_prefix_cache_serves_chat_prompts_exactly(model: Model) -> None:
    tok = model.tokenizer
    prefix = chat_template_prefix(tok)
    assert len(prefix) > 10 and tok.decode(prefix).count("user") == 1
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name a large river."}]))
    assert prompt[:len(prefix)] == prefix
    reference = generate(make_engine(default_engine(model), model, 256, threads=1), prompt, 24,
                         Sampler(SamplingParams())).tokens
    with pipeline(model, [80, 80], prefix=tuple(prefix)) as (master, _):
        master.start()
        for _ in range(2):  # the second request restores the prefix after the first moved past it
            assert master.generate(prompt, 24) == reference
        assert master.generate(model.tokenizer.encode(PROMPT), 8) == reference_run(model, PROMPT, 8)


def replayed(model: Model, master: PipelineMaster, since: int, n: int = N_TOKENS) -> list[int]:
    """The single-process engine's greedy tokens for PROMPT, prefilling its context again wherever the request
    that began with the master's `since`-th prefill did (a recovery, a hot swap): with int8 activations, a prefill
    of many tokens rounds unlike the one-token steps that first made them, so this is what the pipeline must
    equal exactly."""
    prompt = model.tokenizer.encode(PROMPT)
    lengths = master.prefill_lengths[since:]
    assert lengths[0] == len(prompt)
    engine, sampler = make_engine(default_engine(model), model, 256, threads=1), Sampler(SamplingParams())
    engine.reset()
    tokens = [sampler(engine.step(prompt), len(prompt))]
    while len(tokens) < n:
        context = prompt + tokens
        if len(context) in lengths[1:]:
            engine.reset()
            tokens.append(sampler(engine.step(context), len(context)))
        else:
            tokens.append(sampler(engine.step(tokens[-1:]), len(context)))
    return tokens


def reference_run(model: Model, text: str, n: int) -> list[int]:
    """The single-process engine's greedy tokens (int8 activations, the default: ggml, as native stages)."""
    return generate(make_engine(default_engine(model), model, 256, threads=1), model.tokenizer.encode(text), n,
                    Sampler(SamplingParams())).tokens


def test_kv_rows_move_between_stage_sessions_in_parts_or_by_handover(model: Model) -> None:
    """A stage session's KV rows, fetched in two parts (`since`) and loaded into another session, or its buffers
    adopted by one that holds the same layers, let that session go on exactly as the first does; rows that do
    not fit are refused."""
    from edgerun.model.onnx_graph import StageSpec, cached_stage
    from edgerun.model.session import StageSession
    from edgerun.pp.worker import hand_over_kv

    c = model.config
    spec = StageSpec.for_layers(c, 0, c.n_layers, Activations.INT8)
    directory = cached_stage(model.path, c, model.weights, spec)
    sessions = [StageSession(directory, c, 0, c.n_layers, 64, threads=1) for _ in range(4)]
    source, twin, copied, adopted = sessions
    ids = np.asarray([model.tokenizer.encode(PROMPT)], np.int64)
    assert ids.shape[1] > 3
    source.run(ids)
    twin.run(ids)
    for layer in range(c.n_layers):  # rows 0-2 first (a pre-copy), then the rest (the swap's delta)
        head_k, head_v = (a[:, :, :3] for a in source.kv_rows(layer))
        copied.load_kv_rows(layer, head_k, head_v)
        copied.load_kv_rows(layer, *source.kv_rows(layer, since=3), since=3)
    assert hand_over_kv(twin, adopted) == list(range(c.n_layers))
    assert copied.position == adopted.position == source.position == ids.shape[1]
    step = np.asarray([[42]], np.int64)
    expected = source.run(step)
    assert np.array_equal(copied.run(step), expected) and np.array_equal(adopted.run(step), expected)
    keys, values = source.kv_rows(0)
    with pytest.raises(ValueError, match="do not fit"):
        copied.load_kv_rows(0, keys[:, :1], values[:, :1])  # one KV head of several
    with pytest.raises(ValueError, match="do not fit"):
        copied.load_kv_rows(0, keys, values, since=60)  # past the context
    with pytest.raises(ValueError, match="no KV rows"):
        source.kv_rows(0, since=source.position + 1)


def test_a_reset_session_keeps_its_kv_buffers_and_computes_as_a_fresh_one(model: Model) -> None:
    """StageSession.reset forgets the positions but keeps the buffers bound (no allocation per request): what they
    hold past the positions cached is never read, so a short prompt after a longer one gives a fresh session's
    outputs exactly. A session whose buffers another adopted takes buffers of its own at its next reset."""
    from edgerun.model.onnx_graph import StageSpec, cached_stage
    from edgerun.model.session import StageSession
    from edgerun.pp.worker import hand_over_kv

    c = model.config
    directory = cached_stage(model.path, c, model.weights, StageSpec.for_layers(c, 0, c.n_layers, Activations.INT8))
    used, fresh, adopted = (StageSession(directory, c, 0, c.n_layers, 64, threads=1) for _ in range(3))
    long, short = (np.asarray([model.tokenizer.encode(text)], np.int64) for text in (PROMPT * 2, "Paris is"))
    used.run(long)
    buffers = {name: a.ctypes.data for name, a in used.kv.items()}
    used.reset()
    assert used.position == 0 and {name: a.ctypes.data for name, a in used.kv.items()} == buffers
    assert np.array_equal(used.run(short), fresh.run(short))
    step = np.asarray([[42]], np.int64)
    assert np.array_equal(used.run(step), fresh.run(step))
    hand_over_kv(used, adopted)
    used.reset()  # the lender starts over on buffers of its own: the adopter's rows stay
    assert not any(used.kv[name] is adopted.kv[name] for name in used.kv)
    used.run(long)
    assert np.array_equal(adopted.run(step), fresh.run(step))


def test_a_stage_in_two_parts_computes_what_the_whole_does(model: Model, tmp_path) -> None:
    """A stage loaded as two graphs (their sessions created at once) gives the whole stage's outputs bit for bit,
    prefill and steps, and takes a whole session's KV buffers over; bounds that do not split it are refused."""
    from edgerun.model.onnx_graph import StageSpec, cached_stage
    from edgerun.model.session import StageSession
    from edgerun.pp.worker import hand_over_kv

    c = model.config

    def stage_dir(first: int, end: int) -> Path:
        return cached_stage(model.path, c, model.weights, StageSpec.for_layers(c, first, end, Activations.INT8))

    for first, bound, end in ((0, 5, 12), (12, 25, c.n_layers)):  # the embedding's stage, the LM head's
        for i, (a, b) in enumerate(((first, bound), (bound, end))):
            (tmp_path / f"{first}" / str(i)).parent.mkdir(exist_ok=True)
            (tmp_path / f"{first}" / str(i)).symlink_to(stage_dir(a, b))
        whole = StageSession(stage_dir(first, end), c, first, end, 64, threads=1)
        parts = StageSession(tmp_path / f"{first}", c, first, end, 64, threads=1, bounds=[bound])
        rng = np.random.default_rng(first)
        x = rng.integers(0, c.vocab_size, (1, 9)) if first == 0 else \
            rng.standard_normal((1, 9, c.hidden)).astype(np.float32)
        assert np.array_equal(parts.run(x), whole.run(x))
        assert np.array_equal(parts.run(x[:, :1]), whole.run(x[:, :1]))
        assert all(np.array_equal(p, w) for layer in range(first, end)
                   for p, w in zip(parts.kv_rows(layer), whole.kv_rows(layer), strict=True))
        adopted = StageSession(tmp_path / f"{first}", c, first, end, 64, threads=1, bounds=[bound])
        assert hand_over_kv(whole, adopted) == list(range(first, end)) and adopted.position == 10
        assert np.array_equal(adopted.run(x[:, 1:2]), parts.run(x[:, 1:2]))
    with pytest.raises(ValueError, match="do not split"):
        StageSession(tmp_path / "0", c, 0, 12, 64, threads=1, bounds=[12])


def test_a_worker_refuses_stage_files_named_outside_their_directory(tmp_path) -> None:
    """Part files come as 0/model.onnx, 1/model.onnx, ...: a name that climbs out of the stage's directory (or is
    absolute) is refused before anything is fetched or linked."""
    worker = PipelineWorker("ws://127.0.0.1:1/ws", KEY, "w", 80, 1e9, 1)
    for name in ("../model.onnx", "0/../../x", "/etc/passwd"):
        with pytest.raises(ValueError, match="outside its directory"):
            asyncio.run(worker._fetch_files(0, (StageFile(name, "0" * 64),), tmp_path / "stage"))
    assert not (tmp_path / "stage").exists()


def test_a_batch_on_the_pipeline_gives_each_request_its_tokens_alone(model: Model) -> None:
    """`PipelineConfig.slots` stages hold several sequences; a BatchLoop over the pipeline (pp.batch) runs them
    together, each one-token step cut into micro-batches that go through the stages at once, and every request gets
    the tokens it gets alone on the same pipeline: greedy and seeded sampling (drawn by the last stage), a penalized
    draw (its logits sent to the master), prompts of different lengths, a prompt in several chunks, one that shares
    another's prompt (its cache rows copied between slots on every stage), and one that joins late."""
    from edgerun.model.batch import BatchLoop
    from edgerun.model.generate import Generation
    from edgerun.model.logits import LogitRules, LogitShaper
    from edgerun.pp.batch import PipelineBatch

    def penalized(prompt: list[int]) -> LogitShaper:  # a draw that needs the whole vocabulary's logits here
        return LogitShaper(LogitRules(frequency_penalty=0.5), model.tokenizer, prompt, model.config.vocab_size)

    prompts = [model.tokenizer.encode(p) for p in ("The capital of France is", "Once upon a time, in a land far "
                                                   "away, there lived a", "1, 2, 3,")]
    settings = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=7), SamplingParams(),
                SamplingParams(temperature=0.7, seed=3)]
    requests = [(prompts[0], settings[0], None), (prompts[1], settings[1], None), (prompts[2], settings[2], None),
                (prompts[1], settings[3], None),
                (prompts[2], SamplingParams(), penalized)]
    with pipeline(model, [70, 70, 70], route=Route.STAR, slots=4) as (master, _):  # 50 MB hold no 4 caches
        master.start()
        assert master.deployment.batched
        alone = []
        for prompt, params, shaper in requests:
            sampler = Sampler(params, shaper(prompt) if shaper else None)
            alone.append(generate(master, prompt, 12, sampler).tokens)
        loop = BatchLoop(PipelineBatch(master), prefill_chunk=8, draws=True)
        results: dict[int, object] = {}

        def add(i: int) -> None:
            prompt, params, shaper = requests[i]
            gen = Generation(prompt, 12, Sampler(params, shaper(prompt) if shaper else None), frozenset(),
                             lambda _: None, lambda: False)
            loop.add(gen, lambda r, i=i: results.__setitem__(i, r))

        for i in range(4):
            add(i)
        assert loop.free == 0
        late = False
        while loop.running:
            loop.step()
            if results and not late:  # a slot is free: the last request joins the running batch
                add(4)
                late = True
        assert loop.reused_tokens == 8  # the fourth request's first chunk came from the second one's slot
        assert [results[i].tokens for i in range(len(requests))] == alone
