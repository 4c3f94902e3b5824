"""The tensor-parallel engine end to end: a master in this process, nodes as real processes on
loopback, checked against the single-process reference."""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edgerun.errors import EdgerunError
from edgerun.model.generate import ReferenceEngine, default_engine, generate, make_engine
from edgerun.model.loader import Model, load_model
from edgerun.model.onnx_graph import Activations
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.net.channel import MAX_UDP_PAYLOAD
from edgerun.net.loss import parse_loss
from edgerun.net.wire import Block, Codec, Header, MsgType, Resend, control_frame, derive_key, fragment, seal
from edgerun.tp import messages
from edgerun.tp.config import MasterConfig
from edgerun.tp.master import COLD_STEPS, Master, Rebalance, StepClock

SECRET = "test-cluster"
KEY = derive_key(SECRET)
PROMPT = "The capital of France is"
N_TOKENS = 64
GREEDY = Sampler(SamplingParams())


@pytest.fixture(scope="module")
def model() -> Model:
    return load_model()


@pytest.fixture(scope="module")
def reference_tokens(model: Model) -> list[int]:
    engine = ReferenceEngine(model, 256)
    return generate(engine, model.tokenizer.encode(PROMPT), N_TOKENS, GREEDY).tokens


def start_nodes(port: int, speeds: list[float], loss: str = "0", spin_us: float = 0.0,
                model_path: Path | None = None) -> list[subprocess.Popen]:
    """Node processes of the shipped model, or of the file at `model_path`."""
    extra = [] if model_path is None else ["--model", str(model_path)]
    return [subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--master", f"127.0.0.1:{port}",
                              "--name", f"n{i}", "--key", SECRET, "--speed", str(speed), "--loss", loss,
                              "--loss-seed", str(i), "--spin-us", str(spin_us), "--threads", "1", *extra],
                             stderr=subprocess.DEVNULL)
            for i, speed in enumerate(speeds)]


def cluster(model: Model, speeds: list[float], *, loss: str = "0", model_path: Path | None = None,
            **settings: object) -> Iterator[tuple[Master, list]]:
    # minmax: every node takes a share by its speed (halo may leave a node out where its synchronizations cost
    # more than it computes, which depends on the RTT measured on a busy machine).
    # Float32 activations unless a test asks for int8: the cluster then gives the numpy reference's tokens exactly
    # (int8's own parity with the single engine is test_int8_cluster_agrees_with_the_single_engine).
    settings = {"activations": Activations.F32, **settings}
    config = MasterConfig(strategy="minmax", host="127.0.0.1", max_len=256, **settings)
    master = Master(model, KEY, config, loss=parse_loss(loss, seed=99))
    nodes = start_nodes(master.port, speeds, loss, config.spin_us, model_path)
    try:
        master.wait_for_nodes(len(speeds), timeout_s=120)
        master.replan()
        yield master, nodes
    finally:
        master.close()
        for p in nodes:
            p.kill()
            p.wait()


@pytest.mark.slow
@pytest.mark.parametrize("speeds", [[1e9, 1e9], [2e9, 1e9, 0.5e9], [1e9, 3e9, 1e9, 0.7e9]],
                         ids=["2-nodes", "3-nodes-uneven", "4-nodes-uneven"])
def test_lossless_udp_and_tcp_equal_the_reference(model: Model, reference_tokens: list[int],
                                                  speeds: list[float]) -> None:
    prompt = model.tokenizer.encode(PROMPT)
    for master, _ in cluster(model, speeds, timeout_ms=2000):
        shares = [sum(len(x) for layer in master.plan.mlp for x in [layer[i]]) for i in range(len(speeds) + 1)]
        assert all(s > 0 for s in shares[1:]), shares  # every node computes something
        for transport in ("udp", "tcp"):
            master.reconfigure(replace(master.config, transport=transport))
            master.replan()
            assert master.generate(prompt, N_TOKENS, GREEDY) == reference_tokens, transport
        # Clean links carry no parity, and a vector of the shipped model fits one loopback datagram.
        assert all(n.parity == 0 and not n.lossy for n in master.nodes)
        assert all(n.datagram_bytes == MAX_UDP_PAYLOAD for n in master.nodes)
        assert master.stats.blocks_incomplete == 0 and master.stats.partials_rebuilt == 0
        if len(set(speeds)) > 1:
            assert len(set(shares)) > 1  # uneven speeds gave uneven shares


@pytest.mark.slow
def test_the_master_takes_the_nodes_partials_while_it_computes_a_prompts_share(model: Model,
                                                                                reference_tokens: list[int]) -> None:
    """A prompt's blocks: the master computes its share on a thread of its own while its event loop reads the
    nodes' partials, so they do not wait in the sockets until it is done. Here its MLP share holds on until every
    node's partial of the block has been taken (which could never happen with the loop blocked: it gives up after
    5 s); one-token blocks compute on the loop's thread as before (or natively). The tokens stay the reference's."""
    prompt = model.tokenizer.encode(PROMPT)
    for master, _ in cluster(model, [1e9, 1e9], timeout_ms=2000):
        seen: list[tuple[bool, int, int]] = []
        mlp = master.shard.mlp

        def patient_mlp(*args: object, mlp=mlp, exchange=master.exchange, seen=seen, **kwargs: object) -> np.ndarray:
            out = mlp(*args, **kwargs)
            own_thread = threading.current_thread().name.startswith("own-share")
            w = exchange.wait
            give_up = time.monotonic() + 5.0
            while own_thread and len(w.arrived) < len(w.parts) and time.monotonic() < give_up:
                time.sleep(0.001)
            seen.append((own_thread, len(w.arrived), len(w.parts)))
            return out

        master.shard.mlp = patient_mlp
        assert master.generate(prompt, N_TOKENS, GREEDY) == reference_tokens
        prompt_blocks = [(arrived, parts) for own_thread, arrived, parts in seen if own_thread]
        assert len(prompt_blocks) == model.config.n_layers  # the prompt's step; the others were one token each
        assert all(arrived == parts == 2 for arrived, parts in prompt_blocks), prompt_blocks


@pytest.mark.slow
@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "python"])
def test_the_native_data_path_and_the_python_path_give_the_reference(model: Model, reference_tokens: list[int],
                                                                    native: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The exchange's native data path (net.fastpath: inputs sent, partials taken, sums) on the master and the
    nodes, and the Python path it stands in for (EDGERUN_NATIVE=0, which the node processes inherit)."""
    monkeypatch.setenv("EDGERUN_NATIVE", native)
    prompt = model.tokenizer.encode(PROMPT)
    for master, _ in cluster(model, [1e9, 1e9], timeout_ms=2000):
        assert (master.exchange.fast is not None) == (native == "1")
        assert master.generate(prompt, N_TOKENS, GREEDY) == reference_tokens
        assert master.stats.blocks_incomplete == 0
        if native == "1":  # the lossy one-token blocks' partials came through it (but those the event loop read
            # while it read a heartbeat that ended a gather)
            lossy_blocks = 2 * (model.config.n_layers - 1) * (N_TOKENS - 1)
            assert master.stats.native_partials >= 0.95 * 2 * lossy_blocks
        else:
            assert master.stats.native_partials == 0


@pytest.mark.slow
def test_the_native_runner_gives_the_python_paths_tokens_under_fuzz_and_a_kill(model: Model,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """With int8 activations the master's share is on ggml, and a one-token step's layers after the first run on
    the native runner (BlockExchange.run_blocks) and the nodes' native servers (NodeServer): the same tokens as the
    Python path block by block, while forged
    and garbled datagrams hit the master's socket (handed back to the Python path, counted and dropped), and a node
    killed mid-generation is replanned around."""
    prompt = model.tokenizer.encode(PROMPT)
    lossy_blocks = 2 * (model.config.n_layers - 1) * (N_TOKENS - 1)
    for master, nodes in cluster(model, [1e9, 1e9], timeout_ms=2000, activations=Activations.INT8):
        ran = master.generate(prompt, N_TOKENS, GREEDY)
        # the first layer's blocks too, on clean links (mirrored: float32, every partial awaited), and the LM head's
        # input went from the runner as its last block merged
        assert master.stats.native_blocks >= 0.95 * (lossy_blocks + 2 * (N_TOKENS - 1))
        assert master.exchange.runner.head is not None and master.exchange.runner.r.head_count == 2
        assert master.stats.blocks_incomplete == 0
        time.sleep(1.2)  # the nodes' next heartbeats: their native servers computed the lossy blocks too
        assert all(n.native_blocks >= 0.9 * lossy_blocks for n in master.nodes), [n.native_blocks for n in master.nodes]
        # both nodes echoed the group's probe: the inputs went once to the multicast group (net.group) ...
        assert all(n.in_group for n in master.nodes) and master.exchange.runner.r.group.port != 0
        master.reconfigure(dataclasses.replace(master.config, multicast=False))  # ... and by unicast alike
        assert master.generate(prompt, N_TOKENS, GREEDY) == ran and master.exchange.runner.r.group.port == 0
        master.reconfigure(dataclasses.replace(master.config, multicast=True))
        with monkeypatch.context() as patched:
            patched.setattr(Master, "_native_step", lambda self, start, first: None)
            before = master.stats.native_blocks
            assert master.generate(prompt, N_TOKENS, GREEDY) == ran
            assert master.stats.native_blocks == before
        # A node that stops for a moment just before a step (SIGSTOP, then SIGCONT 50 ms later) has no first-layer
        # partial in by the runner's lag bound: the Python path gets it (MIRROR_WAIT: drained, asked for again), and
        # the step runs on natively with the same tokens (the lossy layers' 2 s deadline outlasts the pause).
        waits = master.stats.native_mirror_waits
        assert master.generate(prompt, 16, GREEDY, on_token=pause_at(nodes[1].pid, 8, 0.05)) == ran[:16]
        assert master.stats.native_mirror_waits > waits and master.stats.blocks_incomplete == 0
        # Links marked lossy (parity both ways from then on, ParityOn): the first layer and the LM head's input still
        # go through the runner, each input with its parity copy, the same tokens.
        master.net.call(functools.partial(mark_lossy, master))
        before = master.stats.native_blocks
        assert master.generate(prompt, N_TOKENS, GREEDY) == ran
        assert master.stats.native_blocks - before >= 0.95 * (lossy_blocks + 2 * (N_TOKENS - 1))
        assert master.config.parity > 0 and all(n.parity == master.config.parity for n in master.nodes)
        assert list(master.exchange.runner.copies[:2]) == [1 + master.config.parity] * 2  # the first block's nodes
        assert master.exchange.runner.r.head_count == 2 and master.stats.blocks_incomplete == 0
        rng, stop = random.Random(1), threading.Event()
        partial = Header(MsgType.PARTIAL, 1, 0, 1, Block.MLP, 1, tokens=1)
        valid = fragment(partial, np.ones(model.config.hidden, np.float32), KEY)
        rejected = master.counters.total() + master.stats.late_packets

        fuzzer = threading.Thread(target=fuzz_until, args=(stop, master.udp_port, valid, rng))
        fuzzer.start()
        try:
            assert master.generate(prompt, N_TOKENS, GREEDY) == ran
        finally:
            stop.set()
            fuzzer.join()
        assert master.counters.total() + master.stats.late_packets > rejected
        tokens = master.generate(prompt, 32, GREEDY, on_token=kill_at(nodes[0].pid, 5))
        assert tokens[:5] == ran[:5] and len(tokens) == 32 and master.lost_nodes() == ["n0"]


@pytest.mark.slow
def test_nodes_that_cannot_join_the_group_keep_unicast_inputs(model: Model, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group the nodes cannot join (here a unicast address: IP_ADD_MEMBERSHIP refuses it) leaves every node on
    unicast inputs: none echoes a group probe, the runner sends to each, and the tokens are the Python path's."""
    import edgerun.tp.master as master_module

    monkeypatch.setattr(master_module, "new_group", lambda: ("127.0.0.1", 9))
    prompt = model.tokenizer.encode(PROMPT)
    for master, _ in cluster(model, [1e9, 1e9], timeout_ms=2000, activations=Activations.INT8):
        ran = master.generate(prompt, 16, GREEDY)
        assert master.stats.native_blocks > 0 and master.exchange.runner.r.group.port == 0
        assert not any(n.in_group for n in master.nodes)
        with monkeypatch.context() as patched:
            patched.setattr(Master, "_native_step", lambda self, start, first: None)
            assert master.generate(prompt, 16, GREEDY) == ran


class FullLogits:
    """A master as an engine that returns logits for the generation loop to sample: its nodes send every row."""

    def __init__(self, master: Master) -> None:
        self.master = master

    @property
    def max_len(self) -> int:
        return self.master.max_len

    def reset(self) -> None:
        self.master.reset()

    def step(self, tokens: list[int]) -> np.ndarray:
        return self.master.step(tokens)

    def release(self) -> None:
        self.master.release()


@pytest.mark.slow
def test_nodes_send_only_the_logits_the_sampler_can_draw(model: Model) -> None:
    """A top-k draw over the cluster, whose nodes send their k largest logits and their rows, picks the tokens the
    same draw picks from every row; greedy steps gather one logit a node; a step that wants more than its request
    declared is refused rather than given minus infinity for logits it needs."""
    prompt = model.tokenizer.encode(PROMPT)
    sampler = Sampler(SamplingParams(temperature=0.9, top_k=5, seed=11))
    # A timeout no load on a busy two-core machine reaches: a block merged without a late partial would change the
    # logits of one generation and not the other's, which is HALO's loss semantics, not what this test is about.
    for master, _ in cluster(model, [1e9, 1e9], timeout_ms=2000):
        assert generate(master, prompt, 24, sampler).tokens == generate(FullLogits(master), prompt, 24, sampler).tokens
        assert master.stats.blocks_incomplete == 0
        master.reset()
        logits = master.net.run(master._step(prompt, 1))
        own = len(master.shard.vocab_rows)
        assert np.isfinite(logits).sum() == own + sum(bool(n.spec.vocab_blocks) for n in master.deployed)  # one a node
        assert int(np.argmax(logits)) == int(np.argmax(master_logits(master, prompt)))
        master.reset()
        master.net.run(master._step(prompt, 5))
        with pytest.raises(RuntimeError):
            master.step([1])


def master_logits(master: Master, prompt: list[int]) -> np.ndarray:
    """Every row of the prompt's last logits, as a fresh request."""
    master.reset()
    return master.step(prompt)


def test_a_plan_that_leaves_every_node_out_runs_the_whole_model_engine(model: Model) -> None:
    """A master whose plan gives no node a unit (none joined yet) computes the whole model as one graph, the single
    engine's, so its tokens and logits are the single engine's exactly; once a node joins and the plan gives it a
    share, the master goes back to its share."""
    prompt = model.tokenizer.encode(PROMPT)
    single = make_engine(default_engine(model), model, 256)
    expected = generate(single, prompt, 16, GREEDY).tokens
    single.reset()
    want = single.step(prompt).copy()
    for master, _ in cluster(model, [], activations=Activations.INT8):
        assert master.whole is not None and master.shard is None and master.weight_bytes == single.weight_bytes
        assert master.generate(prompt, 16, GREEDY) == expected
        master.reset()
        np.testing.assert_array_equal(master.step(prompt), want)
        assert master.stats.blocks == 0 and master.own_decode.seconds > 0 and master.own_decode.bytes > 0
        nodes = start_nodes(master.port, [1e9])
        try:
            master.wait_for_nodes(1, timeout_s=120)
            plan = master.replan()
            assert plan.devices_used == 2 and master.whole is None and master.shard is not None
            master.reset()  # int8 on shares sums in another order (near ties may flip): the first logits, close
            got = master.step(prompt)
            assert got.argmax() == want.argmax() and np.abs(got - want).max() < 0.1 * np.abs(want).max()
        finally:
            for p in nodes:
                p.kill()
                p.wait()


# Logits. With int8 activations the difference between the single engine's top two logits moved by up to 0.48 in
# six runs here at first (the largest |dlogit| over the whole vocabulary by up to 2.5); later, in the 2-node case,
# by 0.38-0.64 in 12 runs of one commit and 0.37-0.85 in 14 of the next (0.85 in CI, 0.83 here), which changed
# nothing these runs compute: the partials' sum order varies from run to run. Flips came where those two were
# 0.03, 0.08 and 0.19 apart (the prompt's five closest steps have them 0.03, 0.08, 0.19, 0.32 and 0.61 apart).
NEAR_TIE = 1.0


@pytest.mark.slow
@pytest.mark.parametrize("speeds", [[1e9, 1e9], [2e9, 1e9, 0.5e9], [1e9, 3e9, 1e9, 0.7e9]],
                         ids=["2-nodes", "3-nodes-uneven", "4-nodes-uneven"])
def test_int8_cluster_agrees_with_the_single_engine(model: Model, speeds: list[float]) -> None:
    """With int8 activations (the default) every device quantizes the blocks it multiplies as the single engine
    does, but the master normalizes in its own rounding and sums partials in another order, so a near-tie may break the
    other way. Fed the single engine's greedy tokens (so one flip does not change every later input), the
    cluster's argmax differs only at near-ties (the single engine's logits of the two tokens within NEAR_TIE of
    each other), the difference between the single engine's top two moves by less than NEAR_TIE at every step,
    over udp and tcp, and the logits stay close. Partials are summed in the participants' order, whatever order
    they arrive in: the same request gives the same tokens on every run."""
    prompt = model.tokenizer.encode(PROMPT)
    single = make_engine(default_engine(model), model, 256)
    expected = generate(single, prompt, N_TOKENS, GREEDY).tokens
    single.reset()
    want = [single.step(prompt).copy()] + [single.step([t]).copy() for t in expected[:-1]]
    for master, _ in cluster(model, speeds, timeout_ms=2000, activations=Activations.INT8):
        for transport in ("udp", "tcp"):
            master.reconfigure(replace(master.config, transport=transport))
            master.replan()
            master.reset()
            got = [master.step(prompt).copy()] + [master.step([t]).copy() for t in expected[:-1]]
            master.release()
            runs = [master.generate(prompt, N_TOKENS, GREEDY) for _ in range(3)]
            assert runs[0] == runs[1] == runs[2], (transport, runs)
            assert master.stats.blocks_incomplete == 0
            agree = sum(int(g.argmax()) == int(w.argmax()) for g, w in zip(got, want, strict=True))
            worst = max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))
            print(f"int8 {len(speeds)} nodes {transport}: top-1 agreement {agree}/{N_TOKENS}, max |dlogit| {worst:.3f}")
            flips = [float(w.max() - w[int(g.argmax())]) for g, w in zip(got, want, strict=True)
                     if int(g.argmax()) != int(w.argmax())]
            assert all(gap < NEAR_TIE for gap in flips), (transport, flips)
            top_two = [np.argsort(w)[-2:] for w in want]
            moved = max(abs(float((g[j] - g[i]) - (w[j] - w[i])))
                        for g, w, (i, j) in zip(got, want, top_two, strict=True))
            assert moved < NEAR_TIE, (transport, moved)
            assert worst < 0.1 * max(float(np.abs(w).max()) for w in want), (transport, worst)


@pytest.mark.slow
@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "python"])
def test_q8_inputs_give_every_step_the_bits_of_float32_inputs(tiny_spec, synth_gguf, native: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes whose shares take Q8_0 activations (a Q4_0 model) take their layers' inputs as Q8, and the master sends
    them so (3.8x fewer bytes): every step's logits are those of float32 inputs bit for bit, on the native data
    path and on the Python path (EDGERUN_NATIVE=0, which the nodes inherit)."""
    monkeypatch.setenv("EDGERUN_NATIVE", native)
    # a model of its own: its nodes fetch it into the session's cache, where test_node_without_the_masters_model_
    # fetches_it must not find its model
    m = load_model(synth_gguf(tiny_spec(tied=False, seed=5)))
    prompt = m.tokenizer.encode("Hello there, how are you today")
    master = Master(m, KEY, MasterConfig(strategy="minmax", host="127.0.0.1", max_len=64, timeout_ms=2000))
    nodes = start_nodes(master.port, [1e9, 1e9])
    try:
        master.wait_for_nodes(2, timeout_s=120)
        runs = {}
        for q8 in (True, False):
            master.reconfigure(replace(master.config, q8_inputs=q8))
            master.replan()
            assert all(n.q8_inputs for n in master.nodes)  # what the nodes' shares said
            assert master.exchange.input_codec(master.nodes) == (Codec.Q8 if q8 else Codec.F32)
            before = master.exchange.stats.q8_inputs
            tokens = master.generate(prompt, 12, GREEDY)
            master.reset()
            logits = [master.step(prompt).copy()] + [master.step([t]).copy() for t in tokens[:-1]]
            master.release()
            sent_q8 = master.exchange.stats.q8_inputs - before
            # the layers after the first (lossy, by datagram) of every one-token step and prompt went as Q8
            assert sent_q8 >= 2 * (m.config.n_layers - 1) * 11 if q8 else sent_q8 == 0, (q8, sent_q8)
            assert master.stats.blocks_incomplete == 0
            runs[q8] = tokens, logits
        assert runs[True][0] == runs[False][0]
        assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(runs[True][1], runs[False][1],
                                                                                         strict=True))
        # A lossy codec on the datagrams: the prompt's inputs on the streams go as float32 (a node takes no other
        # codec there), none as Q8, and the request completes with every block whole
        master.reconfigure(replace(master.config, q8_inputs=True, codec=Codec.F16))
        master.replan()
        before = master.exchange.stats.q8_inputs
        assert len(master.generate(prompt, 4, GREEDY)) == 4
        assert master.exchange.stats.q8_inputs == before and master.stats.blocks_incomplete == 0
    finally:
        master.close()
        for p in nodes:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_spinning_master_and_node_equal_the_reference(model: Model, reference_tokens: list[int]) -> None:
    """--spin-us: the master and the node poll their sockets between packets; tokens as the reference's, and the
    node's heartbeats still arrive while it spins (it answers fresh_reports)."""
    prompt = model.tokenizer.encode(PROMPT)
    for master, _ in cluster(model, [1e9], timeout_ms=2000, spin_us=3000):
        beats = master.nodes[0].heartbeats
        assert master.generate(prompt, N_TOKENS, GREEDY) == reference_tokens
        assert master.fresh_reports()[0].heartbeats > beats
        assert master.stats.blocks_incomplete == 0


def test_a_nodes_sync_time_is_its_arrivals_beyond_its_kernels() -> None:
    """NodeConn.sync_s: the seconds from sending a one-token block's input to its partial's arrival, less the
    node's kernel time over the same blocks (both as its last heartbeat found them), per block; nothing until
    enough blocks were timed, and nothing once a new share resets them."""
    from edgerun.tp.kernel_fit import KernelFit
    from edgerun.tp.membership import MIN_SYNC_BLOCKS, NodeConn

    node = NodeConn(0, "n0", None, "127.0.0.1", 0, 100.0, 1e9)
    assert node.sync_s is None
    node.decode, node.decode_s = KernelFit(100, 1e9, 0.7), 0.8  # the kernels' time, the LM head's included
    node.arrival_s, node.arrival_blocks = 1.4, MIN_SYNC_BLOCKS * 2
    node.reported_arrivals = (1.0, MIN_SYNC_BLOCKS * 2)  # the heartbeat's decode time covered these
    assert node.sync_s == pytest.approx(0.2 / (MIN_SYNC_BLOCKS * 2))
    node.reported_arrivals = (1.0, MIN_SYNC_BLOCKS - 1)
    assert node.sync_s is None
    node.reported_arrivals = (0.5, MIN_SYNC_BLOCKS)  # faster than its kernels: clock noise, not a negative time
    assert node.sync_s == 0.0
    node.reset_estimators()
    assert node.sync_s is None and node.arrival_blocks == 0


@pytest.mark.slow
def test_measured_speeds_rebalance_a_node_that_overstated_its_speed(model: Model, reference_tokens: list[int]) -> None:
    """n0 declares itself ten times faster than the master and n1 (which declare about what this machine's kernels
    do) and gets most units; after one request the master knows its measured speed and hands out shares that
    fit it, and the tokens stay the reference's. (Where the others declared a tenth of what they run at, n0's
    true speed was still the fastest the plan knew of, and it rightly kept every unit.)
    (On loopback the synchronizations the plan prices dominate the shipped model's time. The shares are first
    minmax's, so that n1 holds some, and rebalanced by halo, whose local search prices the synchronizations:
    minmax's shares at the measured speeds, which ignore them, were once predicted slower than the shares they
    replace (a clean-clone run), where halo's are 22-25% faster here.)"""
    prompt = model.tokenizer.encode(PROMPT)
    def n0_units(master: Master) -> int:
        i = master.plan.devices.index("n0")  # nodes take their places in the plan in the order they joined
        return sum(len(layer[i]) for layer in master.plan.mlp)

    for master, _ in cluster(model, [1e11, 1e10], timeout_ms=2000, speed=1e10):
        before = n0_units(master)
        assert master.generate(prompt, N_TOKENS, GREEDY) == reference_tokens
        master.fresh_reports()
        master.reconfigure(replace(master.config, strategy="halo"))
        assert master.rebalance(min_gain=0.0) is Rebalance.REPLANNED
        assert 0 < master.measured["n0"].speed < 1e11
        # The time per block beyond its kernels of the node that took part.
        assert 0 <= master.measured_sync["n0"] < 0.1
        # The master's own time per node before its share, measured over the request, is what plans charge it.
        assert master.stats.sends >= 2 * model.config.n_layers * (N_TOKENS - 1) and 0 < master.send_s_per_node < 0.01
        assert master._devices(master.membership.alive())[0].compute.send_s_per_node == master.send_s_per_node
        s = master.stats  # ... sending the nodes' inputs, adding their partials and counting them
        assert s.fold_s > 0 and s.account_s > 0
        assert master.send_s_per_node == pytest.approx((s.send_s + s.fold_s + s.account_s) / s.sends)
        assert n0_units(master) < before
        # The new split is on trial against the old one's measured steps; nothing measured since: the same speeds
        # give the same shares, and the trial has no steps to judge.
        replaced = master.trials.current.replaced
        assert replaced.counts() != master.plan.counts() and 0 < master.trials.current.replaced_s < 10
        assert master.rebalance(min_gain=0.02) is Rebalance.KEPT and master.trials.current is not None
        assert master.generate(prompt, N_TOKENS, GREEDY) == reference_tokens
        # Judged on its own steps (N_TOKENS - 1 one-token steps, the first COLD_STEPS left out): had the old split
        # run at a microsecond a step, the master goes back to it and does not try the new one again.
        assert master.clock.steps == N_TOKENS - 1 - COLD_STEPS and master.clock.per_step() > 0
        tried, trial = master.plan.counts(), master.trials.current
        master.trials.current = replace(trial, replaced_s=1e3)  # had the old split been slower: the new one stays
        assert master.rebalance(min_gain=0.0) is Rebalance.KEPT and master.trials.current is None
        assert master.plan.counts() == tried
        master.trials.current = replace(trial, replaced_s=1e-6)
        assert master.rebalance(min_gain=0.0) is Rebalance.REVERTED
        assert master.trials.current is None and master.plan.counts() == replaced.counts()
        assert (master.plan.devices, tried) in master.trials.rejected
        assert master.clock == StepClock()  # the old split's steps are timed afresh
        assert master.generate(prompt, N_TOKENS, GREEDY) == reference_tokens
        # `edgerun serve` says which it was: a split on trial found slower is told with its figures.
        from edgerun.serve.clusters import TensorParallel

        master.trials.current = replace(trial, replaced_s=1e-6)
        said = TensorParallel(master, None, print).rebalance()
        assert said.endswith("back to the split before it") and "ms a step against 0.0" in said
        assert not master.rebalance(min_gain=0.0) or master.plan.counts() != tried  # never the rejected split again


@pytest.mark.slow
def test_q8_codec_tracks_the_reference(model: Model, reference_tokens: list[int]) -> None:
    """Teacher-forced: both engines see the reference's tokens; q8 activations perturb the logits a
    little (the f16 scale and int8 values of every block input and partial output). Measured: max
    |Δlogit| 0.91 on logits up to ~28, top-1 agreement 64/64."""
    prompt = model.tokenizer.encode(PROMPT)
    reference = ReferenceEngine(model, 256)
    for master, _ in cluster(model, [1e9, 1e9], codec=Codec.Q8, timeout_ms=2000):
        master.reset()
        reference.reset()
        a, b = master.step(prompt), reference.step(prompt)
        errors, agree = [], 0
        for token in reference_tokens:
            errors.append(float(np.abs(a - b).max()))
            agree += int(a.argmax() == b.argmax())
            a, b = master.step([token]), reference.step([token])
        print(f"q8: max |dlogit| {max(errors):.3f}, top-1 agreement {agree}/{len(reference_tokens)}")
        assert max(errors) < 3.0, max(errors)
        assert agree >= 56, agree


@pytest.mark.slow
def test_five_percent_loss_completes_without_waiting_past_the_timeout(model: Model) -> None:
    prompt = model.tokenizer.encode(PROMPT)
    for master, _ in cluster(model, [1e9, 1e9], loss="5%", timeout_ms=20, parity=0):
        tokens = master.generate(prompt, 24, GREEDY)
        assert len(tokens) == 24
        stats = master.stats
        assert stats.blocks_incomplete > 0 and stats.partials_rebuilt == 0  # loss did happen and was tolerated
        # Waits end at their deadline; the slack covers thread wake-up on a loaded 2-core machine.
        assert stats.max_overshoot_s < 0.05, stats
        # Prefill is reliable, so the first token is exact; later ones feel the loss (predictors, which
        # decide what may be lost, are a separate part).
        assert model.tokenizer.decode(tokens).startswith(" Paris"), model.tokenizer.decode(tokens)

        # With a parity fragment after every vector, both ways, a lost datagram is mostly rebuilt:
        # 4 one-fragment vectors per block lose one in 1 - 0.95^4 = 19 % of blocks without parity,
        # about 1 % with it.
        without = stats.blocks_incomplete / stats.blocks
        master.reconfigure(replace(master.config, parity=1))
        master.replan()
        blocks, incomplete = stats.blocks, stats.blocks_incomplete
        assert len(master.generate(prompt, 24, GREEDY)) == 24
        with_parity = (stats.blocks_incomplete - incomplete) / (stats.blocks - blocks)
        print(f"incomplete blocks at 5% loss: {without:.1%} without parity, {with_parity:.1%} with; "
              f"{stats.partials_rebuilt} partials rebuilt on the master")
        assert stats.partials_rebuilt > 0
        # Most partials come whole from their data: their parity copies are left unread, unauthenticated.
        assert master.datagrams.skipped > 0
        assert with_parity < without / 4, (with_parity, without)
        assert all(n.lossy and n.parity == 1 for n in master.nodes)  # the links lost packets: parity on them
        assert stats.max_overshoot_s < 0.05, stats
        master.forget_loss()  # a benchmark's next row: the links count as clean until they lose again
        master.replan()
        # (Parity stays on a link that measured loss when its node joined: the loss here is the master's own.)
        assert all(not n.lossy and n.parity == (n.link.loss_rate > 0) for n in master.nodes), \
            [(n.lossy, n.parity, n.link) for n in master.nodes]


@pytest.mark.slow
def test_a_prompt_crosses_a_lossy_link_on_both_streams(model: Model, reference_tokens: list[int]) -> None:
    """Assign.spare_stream: with --transport udp every node opens a second stream. Once a node's link has lost a
    packet, a prompt's inputs go to it on both streams and it answers on both; the second copies are neither merged
    twice nor counted late, so the tokens are the reference's. The strict tcp baseline has no spare."""
    prompt = model.tokenizer.encode(PROMPT)

    def spares(attached: bool) -> bool:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if all((n.spare is not None) == attached for n in master.nodes):
                return True
            time.sleep(0.05)
        return False

    for master, _ in cluster(model, [1e9, 1e9], timeout_ms=2000):
        assert spares(True)
        assert master.generate(prompt, 8, GREEDY) == reference_tokens[:8]
        assert master.stats.spare_inputs == 0  # clean links: one copy
        for node in master.nodes:
            node.lossy = True  # as after a lost packet (BlockExchange.saw_loss)
        assert master.generate(prompt, 16, GREEDY) == reference_tokens[:16]
        stats = master.stats
        assert stats.spare_inputs >= 2 * model.config.n_layers and stats.late_packets == 0, stats
        assert all(n.spare_partials > 0 for n in master.nodes)
        master.reconfigure(replace(master.config, transport="tcp"))
        master.replan()
        assert spares(False)
        assert master.wait_for_spares(timeout_s=0.0)  # the strict baseline asks for none
        doubled = stats.spare_inputs
        assert master.generate(prompt, 8, GREEDY) == reference_tokens[:8]
        assert stats.spare_inputs == doubled
        master.reconfigure(replace(master.config, transport="udp"))
        master.replan()  # the nodes open their spares again; Master.wait_for_spares waits for them
        assert master.wait_for_spares() and all(n.spare is not None for n in master.nodes)


def mark_lossy(master: Master) -> None:
    """Every node's link as if it had lost a packet (on the master's loop): parity both ways from now on."""
    for node in master.nodes:
        master.exchange.saw_loss(node)


def pause_at(pid: int, tokens: int, seconds: float) -> Callable[[int], None]:
    """A generation's on_token that stops the process `pid` (SIGSTOP) once `tokens` tokens are out, and lets it go
    on (SIGCONT) `seconds` later."""
    seen: list[int] = []

    def on_token(token: int) -> None:
        seen.append(token)
        if len(seen) == tokens:
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(seconds, os.kill, (pid, signal.SIGCONT)).start()

    return on_token


def kill_at(pid: int, tokens: int) -> Callable[[int], None]:
    """A generation's on_token that kills the process `pid` (SIGKILL) once `tokens` tokens are out."""
    seen: list[int] = []

    def on_token(_: int) -> None:
        seen.append(1)
        if len(seen) == tokens:
            os.kill(pid, signal.SIGKILL)

    return on_token


@pytest.mark.slow
def test_kill_a_node_mid_generation(model: Model, reference_tokens: list[int]) -> None:
    prompt = model.tokenizer.encode(PROMPT)
    for master, nodes in cluster(model, [1e9, 1e9], timeout_ms=2000):
        tokens = master.generate(prompt, 32, GREEDY, on_token=kill_at(nodes[0].pid, 5))
        # The request finished on the devices left, and a re-prefill keeps greedy output exact.
        assert tokens == reference_tokens[:32]
        assert master.lost_nodes() == ["n0"]
        assert master.generate(prompt, 8, GREEDY) == reference_tokens[:8]  # still serving
        # A node that dies between requests, and is known dead before the next one starts, still holds units of
        # the plan: the request replans rather than leave its units out of every block.
        os.kill(nodes[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while sorted(master.lost_nodes()) != ["n0", "n1"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(master.lost_nodes()) == ["n0", "n1"]  # in the order they joined
        assert master.generate(prompt, 8, GREEDY) == reference_tokens[:8]
        assert master.plan is not None and master.plan.devices == ("master",)


def mutate(datagram: bytes, rng: random.Random) -> bytes:
    data = bytearray(datagram)
    choice = rng.randrange(4)
    if choice == 0:
        return rng.randbytes(rng.randrange(1, 1500))
    if choice == 1:
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    if choice == 2:
        return bytes(data[: rng.randrange(len(data))])
    # Authentic but wild: a header the receiver does not expect, sealed with the right key.
    header = Header(MsgType(rng.choice([1, 2, 4, 7])), rng.randrange(1 << 32), rng.randrange(1 << 32),
                    rng.randrange(1 << 16), rng.choice([0, 1, 2]), rng.randrange(256), rng.randrange(4), 4,
                    Codec(rng.randrange(3)), rng.randrange(256), rng.randrange(1 << 20))  # a PROBE would be valid
    return seal(header, rng.randbytes(rng.randrange(0, 600)), KEY)


def fuzz_until(stop: threading.Event, port: int, valid: list[bytes], rng: random.Random) -> None:
    """Mutated datagrams (mutate) to 127.0.0.1:port, one a millisecond, until `stop` is set."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        while not stop.wait(0.001):
            sock.sendto(mutate(rng.choice(valid), rng), ("127.0.0.1", port))


def authentic_malformed_messages(port: int, rng: random.Random, n: int = 300) -> int:
    """A "node" with the cluster key registers, then sends n control frames that are authentic but hold no valid
    message: fixed malformed ones and valid messages with a byte changed (those that still decode are skipped)."""
    fixed = [b'{"message": "Partial", "session": "x"}', b'{"message": "Fetch"}', b'{"message": 5}', b"[1",
             b'{"message": "Heartbeat", "rejected": [], "compute_s": 0, "peak_rss_mb": 0}',
             b'{"message": "Assign", "session": 1, "spec": {}}']
    sent = 0
    with socket.create_connection(("127.0.0.1", port)) as peer:
        peer.sendall(control_frame(0, *messages.encode(messages.Register("fuzz", 64.0, 1e9, 9, 1472)), KEY))
        while sent < n:
            text = bytearray(messages.encode(messages.Fetch(1, 2, 3, Block.ATTN))[0])
            text[rng.randrange(len(text))] = rng.randrange(256)
            text = rng.choice(fixed) if sent % 2 else bytes(text)
            try:
                messages.decode(text, b"")
                continue
            except messages.BadMessage:
                pass
            peer.sendall(control_frame(0, text, b"", KEY))
            sent += 1
        time.sleep(0.5)
    return sent


@pytest.mark.slow
def test_fuzzed_datagrams_are_counted_and_nothing_breaks(model: Model, reference_tokens: list[int]) -> None:
    n = int(os.environ.get("EDGERUN_TP_FUZZ_N", "2000"))
    rng = random.Random(0)
    partial = Header(MsgType.PARTIAL, 1, 0, 1, Block.MLP, 1, tokens=1)
    valid = [*fragment(partial, np.ones(576, np.float32), KEY), Resend(1, 0, 0, Block.HEAD, 1, (0, 1)).seal(KEY)]
    prompt = model.tokenizer.encode(PROMPT)
    for master, _ in cluster(model, [1e9], timeout_ms=2000):
        node = master.nodes[0]
        before = master.counters.total() + master.stats.late_packets
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for i in range(n):
            if i % 200 == 0:
                time.sleep(0.002)  # paced, so the kernel's receive buffers do not overflow and drop some
            packet = mutate(rng.choice(valid), rng)
            sock.sendto(packet, ("127.0.0.1", master.udp_port))
            sock.sendto(packet, ("127.0.0.1", node.udp_port))
        with socket.create_connection(("127.0.0.1", master.port)) as junk:  # an unauthenticated "node"
            junk.sendall(b"\x40\x00\x00\x00" + bytes(64))
        refused = authentic_malformed_messages(master.port, rng)
        time.sleep(1.5)  # the node reports its count with its next heartbeat
        assert master.counters.rejected.get("message", 0) >= refused
        assert master.counters.total() + master.stats.late_packets - before >= n
        assert node.rejected >= n * 0.9  # node: all but datagrams that arrived while it was busy
        assert master.generate(prompt, 16, GREEDY) == reference_tokens[:16]


def test_node_without_the_masters_model_fetches_it(tiny_spec, synth_gguf) -> None:
    """The node's local file is another model: it downloads the master's over HTTP, checks its sha256,
    and the cluster then equals the reference of the master's model."""
    masters = load_model(synth_gguf(tiny_spec(tied=False, seed=1)))
    other = synth_gguf(tiny_spec(tied=False, seed=2))
    prompt = masters.tokenizer.encode("Hello there")
    expected = generate(ReferenceEngine(masters, 64), prompt, 12, GREEDY).tokens
    master = Master(masters, KEY, MasterConfig(host="127.0.0.1", max_len=64, timeout_ms=2000,
                                               activations=Activations.F32))
    node = subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--master", f"127.0.0.1:{master.port}",
                             "--key", SECRET, "--model", str(other), "--threads", "1"],
                            stderr=subprocess.PIPE, text=True)
    try:
        master.wait_for_nodes(1, timeout_s=120)
        master.replan()
        assert master.generate(prompt, 12, GREEDY) == expected
    finally:
        master.close()
        node.kill()
        _, err = node.communicate()
    assert "fetching it" in err and "downloading model: 100%" in err


@pytest.mark.slow
def test_bench_tp_reports_the_split(tiny_spec, synth_gguf, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import json

    from edgerun.bench.cores import USABLE_CORES
    from edgerun.cli import main
    from edgerun.net.loops import auto_spin_us

    spec = tiny_spec(tied=False)
    path = synth_gguf(spec)
    assert main(["bench", "tp", "--model", str(path), "--nodes", "1", "--tokens", "4", "--transport", "udp,tcp",
                 "--group-size", "64", "--baseline", "--plan", "minmax", "--no-rebalance", "--pin", "1", "--json",
                 "--trace", str(tmp_path / "trace"), "--ceiling"]) == 0
    from edgerun.bench.tp import tp_result

    results = [tp_result(row) for row in json.loads(capsys.readouterr().out)]  # --json holds every record
    assert [r.setup.transport for r in results] == ["udp", "tcp"]
    # The udp row's decode steps ran their layers after the first on the master's native runner; tcp's cannot.
    assert results[0].blocks.native > 0 and results[1].blocks.native == 0
    assert results[0].blocks.group_nodes == 1  # its inputs went to the master's multicast group
    for r in results:
        t, time = r.timing, r.time
        assert r.tokens == 4 and r.setup.group_size == 64 and t.ms_per_token > 0 and r.blocks.total > 0
        assert time.compute_ms + time.wait_ms <= t.ms_per_token * 1.01
        # The node's own kernels and memory, from its heartbeats; the single engine timed in the same run.
        assert 0 < time.node_compute_ms < t.ms_per_token
        # The decode steps' own synchronization: their time beyond their slowest device's kernels, a block; the
        # node's kernels in them are less than the whole time of the steps.
        blocks_a_step = 2 * load_model(path).config.n_layers + 1  # attention and MLP a layer, and the LM head
        assert 0 < time.decode_sync_us * 1e-3 * blocks_a_step < t.decode_ms_per_token
        m = r.memory
        assert m.node_weight_mb > 0 and m.node_kv_mb > 0 and m.node_peak_rss_mb > m.node_weight_mb
        assert m.node_overhead_mb == pytest.approx(m.node_peak_rss_mb - m.node_weight_mb - m.node_kv_mb)
        single = r.single.timing
        assert single.ms_per_token > 0
        assert r.single.speedup == pytest.approx(single.ms_per_token / t.ms_per_token)
        # The one-token steps alone, beside the whole request's (which has the prompt's prefill).
        assert t.decode_ms_per_token > 0 and single.decode_ms_per_token > 0
        assert r.single.decode_speedup == pytest.approx(single.decode_ms_per_token / t.decode_ms_per_token)
        # The time to the first token: the prompt's prefill, a part of the whole request.
        assert 0 < t.prefill_ms < t.ms_per_token * r.tokens and single.prefill_ms > 0
        assert r.single.prefill_speedup == pytest.approx(single.prefill_ms / t.prefill_ms)
        # --ceiling: the two devices' kernels alone, in step, for the node count (one figure for both transports).
        c = r.ceiling.timing
        assert c.decode_ms_per_token == results[0].ceiling.timing.decode_ms_per_token > 0
        assert r.ceiling.single.decode_speedup == pytest.approx(single.decode_ms_per_token / c.decode_ms_per_token)
        # ... and the bench's prompt before the steps: the whole request the kernels allow, timed as the cluster's.
        assert c.prefill_ms == results[0].ceiling.timing.prefill_ms > 0
        assert c.ms_per_token == pytest.approx((c.prefill_ms + 3 * c.decode_ms_per_token) / 4)
        assert r.ceiling.single.prefill_speedup == pytest.approx(single.prefill_ms / c.prefill_ms)
        assert r.ceiling.single.speedup == pytest.approx(single.ms_per_token / c.ms_per_token)
        assert time.predicted_ms > 0  # what the plan said it would take, beside what it took
        assert r.setup.spin_us == auto_spin_us(2, 1, len(USABLE_CORES))  # auto: master and node poll, a core each
    # --trace: the udp row's one-token blocks leg by leg, from the master's and the node's timelines (tcp inputs
    # reach the node on its stream, which the node's timeline does not see).
    udp = results[0]
    legs = {leg.name: leg for leg in udp.trace.legs}
    assert {"node kernel", "master's own share", "block, send to merged"} <= set(legs)
    assert (tmp_path / "trace" / "nodes1" / "master.jsonl").stat().st_size > 0
    assert (tmp_path / "trace" / "nodes1" / "node-0.jsonl").stat().st_size > 0
    assert 0 < legs["node kernel"].median_us < legs["block, send to merged"].median_us
    assert legs["input to the node"].median_us > 0 and legs["master merges"].median_us > 0
    from edgerun.bench.tp import Traced, tp_table

    # ... and each device's share with its kernels as measured in the run
    assert [d.name for d in udp.split.devices] == ["master", "bench-0"]
    assert all(d.weight_mb > 0 for d in udp.split.devices)
    # ... among them each ggml share's own cost a call beyond its kernels (inputs in, output out, Python): the
    # master's first layer and LM head are such calls; a node's one-token blocks may all have run natively (none)
    master_run, node_run = udp.split.devices
    assert 0 < master_run.call_us < 1000 and (node_run.call_us is None or 0 < node_run.call_us < 1000)
    plain = replace(udp, trace=None, split=replace(udp.split, devices=()))
    table = tp_table([plain])
    assert " plan " in table.splitlines()[0] and f"{udp.time.predicted_ms:.1f}" in table
    assert " prefill " in table.splitlines()[0] and f"{udp.timing.prefill_ms:.1f}" in table
    ceiling = next(line for line in table.splitlines() if line.startswith("kernel ceiling, 2 device(s)"))
    c = udp.ceiling
    assert f"decode {c.timing.decode_ms_per_token:.1f} ms/token" in ceiling
    assert f"({udp.timing.decode_ms_per_token / c.timing.decode_ms_per_token:.2f}x it)" in ceiling
    assert f"prefill {c.timing.prefill_ms:.1f} ms = {c.single.prefill_speedup:.2f}x" in ceiling
    assert f"whole request {c.timing.ms_per_token:.1f} ms/token = {c.single.speedup:.2f}x the single engine's" \
        in ceiling
    assert f"({udp.timing.prefill_ms / c.timing.prefill_ms:.2f}x it)" in ceiling
    assert table.splitlines()[-1] == ("spin: off" if not udp.setup.spin_us else
                                      f"spin: {udp.setup.spin_us:.0f} µs in every process")
    traced = tp_table([replace(udp, trace=Traced(udp.trace.legs))])
    assert "critical path" in traced.splitlines()[-2] and "node kernel " in traced.splitlines()[-2]
    assert "shares" in traced.splitlines()[-1] and "bench-0 " in traced.splitlines()[-1]
    assert f"calls {master_run.call_us:.0f} µs" in traced.splitlines()[-1]
    # ... and the blocks of each kind alone, which the ceiling's line sets against its own block of that kind: what
    # the cluster's block takes beyond the kernels' (the LM head's partial, a top-k list, is not the layers').
    kinds = udp.trace.kind_legs
    assert list(kinds)[:2] == ["attention", "MLP"]  # the LM head's where the node holds some of its rows
    for kind, kind_legs in kinds.items():
        assert {"node kernel", "block, send to merged"} <= {leg.name for leg in kind_legs}, kind
    assert list(c.block_us) == ["attention", "MLP", "LM head"]
    assert min(c.block_us.values()) > 0
    by_kind = tp_table([replace(plain, trace=Traced((), kinds))])
    assert "attention blocks alone: " in by_kind and "MLP blocks alone: " in by_kind
    ceiling_line = next(line for line in by_kind.splitlines() if line.startswith("kernel ceiling"))
    merged = {kind: next(leg for leg in kind_legs if leg.name == "block, send to merged").mean_us
              for kind, kind_legs in kinds.items()}
    assert f"slowest device's kernel: attention {c.block_us['attention']:.0f} µs" in ceiling_line
    assert f"MLP {merged['MLP']:.0f} µs ({merged['MLP'] - c.block_us['MLP']:+.0f})" in ceiling_line
    # tcp's row was traced, and its inputs went over the node's stream, which the node's timeline does not see: the
    # table says so, and an untraced row says nothing of tracing.
    tcp = results[1]
    assert tcp.trace is not None and not tcp.trace.legs and "no one-token block" in tp_table([tcp])
    assert "no one-token block" not in tp_table([replace(tcp, trace=None)])
    # --no-rebalance: no trial; a rebalance's trial is told with its row, kept or not.
    from edgerun.tp.master import TrialOutcome

    assert udp.split.trial is None and "measured speeds called for" not in tp_table([tcp])

    def tried(outcome: TrialOutcome) -> str:
        return tp_table([replace(tcp, split=replace(tcp.split, trial=outcome))])

    back = tried(TrialOutcome(0.0709, 0.0797, kept=False))
    assert "ran 79.7 ms a step against 70.9 on the split before it: back to the split before it" in back
    assert tried(TrialOutcome(0.0709, 0.0650, kept=True)).count("65.0 ms a step") == 1
    # The units each device holds (the plan's), which a row's speed depends on: every layer's are all placed.
    devices = udp.split.devices
    assert "attention units and" in traced.splitlines()[-1]
    assert all(d.attn_units[0] <= d.attn_units[1] for d in devices) and sum(d.vocab_blocks for d in devices)
    groups = spec.config.ffn // 64  # --group-size 64
    assert sum(d.mlp_groups[0] for d in devices) <= groups <= sum(d.mlp_groups[1] for d in devices)


def test_the_kernel_ceiling_script_times_every_share_against_the_single_engine(tiny_spec, synth_gguf) -> None:
    """scripts/tp_ceiling.py: a row per device count, the slowest share at least the mean, and the ceiling the
    single engine's one-token step over the slowest share's."""
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "tp_ceiling.py"
    path = synth_gguf(tiny_spec(tied=False))
    proc = subprocess.run([sys.executable, str(script), "--model", str(path), "--devices", "1,2", "--tokens", "3",
                           "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["devices"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["mean_ms"] <= r["slowest_ms"] and r["alone_ms"] > 0
        assert r["ceiling"] == pytest.approx(r["single_decode_ms"] / r["slowest_ms"])
    assert rows[0]["alone_ms"] == rows[0]["slowest_ms"]  # one device is alone
    bad = subprocess.run([sys.executable, str(script), "--devices", "two"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--devices" in bad.stderr


def test_the_star_floor_script_times_a_bare_exchange_beside_its_kernel() -> None:
    """scripts/star_floor.py: a master and a worker process exchange sealed datagrams around their matrix-vector
    products; the block takes longer than the master's own product, and the difference is what it reports. Bad
    input: one line, exit 2."""
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "star_floor.py"
    proc = subprocess.run([sys.executable, str(script), "--nodes", "1", "--rows", "64", "--blocks", "40", "--warmup",
                           "5", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["nodes"] == 1 and result["rows"] == 64
    assert 0 < result["kernel_us"] < result["block_us"] <= result["block_mean_us"] * 10
    assert result["beyond_us"] == pytest.approx(result["block_us"] - result["kernel_us"])
    for bad in (["--nodes", "0"], ["--hidden", "20000"]):
        refused = subprocess.run([sys.executable, str(script), *bad], capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, bad


def test_pinned_devices_take_a_physical_core_each_before_any_second_hardware_thread() -> None:
    from edgerun.bench.cores import physical_first

    pairs = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}  # hardware threads numbered side by side
    assert physical_first(range(4), pairs.__getitem__) == (0, 2, 1, 3)
    halves = {c: [c % 4, c % 4 + 4] for c in range(8)}  # ... or in halves
    assert physical_first(range(8), halves.__getitem__) == tuple(range(8))
    assert physical_first([5, 1], lambda c: [c]) == (1, 5)  # no hyperthreads: in order


def test_pinned_devices_take_cores_of_their_own_in_turn() -> None:
    from edgerun.bench.cores import USABLE_CORES, device_cores, pinned
    from edgerun.bench.tp import TpBenchConfig

    n = len(USABLE_CORES)
    assert device_cores(0, 0) is None  # not pinned
    assert device_cores(0, 1) == {USABLE_CORES[0]} and device_cores(1, 1) == {USABLE_CORES[1 % n]}
    assert device_cores(n, 1) == {USABLE_CORES[0]}  # more devices than cores: around again
    assert len(device_cores(1, 2)) == min(2, n)
    before = os.sched_getaffinity(0)
    with pinned(device_cores(0, 1)):
        assert os.sched_getaffinity(0) == {USABLE_CORES[0]}
    assert os.sched_getaffinity(0) == before
    assert TpBenchConfig(pin=1, loss_at="testbed").pin == 1  # a testbed's nodes are pinned too (cpu quotas aside)
    with pytest.raises(EdgerunError, match="--pin"):
        TpBenchConfig(pin=-1)


def test_measured_loss_puts_the_lossy_node_on_the_least_important_groups(tiny_spec, synth_gguf) -> None:
    """HALO's Algorithm 3 with the loss measured at join: a node behind 30% loss holds no unit of
    priority 0 (the most important), while it does compute some units."""
    model = load_model(synth_gguf(tiny_spec(tied=False)))
    master = Master(model, KEY, MasterConfig(strategy="minmax", host="127.0.0.1", max_len=64, group_size=128,
                                             timeout_ms=2000))
    procs = [subprocess.Popen([sys.executable, "-m", "edgerun.cli", "node", "--master", f"127.0.0.1:{master.port}",
                               "--key", SECRET, "--model", str(synth_gguf(tiny_spec(tied=False))), "--name", name,
                               "--loss", loss, "--loss-seed", "3", "--threads", "1"], stderr=subprocess.DEVNULL)
             for name, loss in (("clean", "0"), ("lossy", "30%"))]
    try:
        master.wait_for_nodes(2, timeout_s=120)
        plan = master.replan()
        lossy = plan.devices.index("lossy")
        assert plan.plrs[lossy] > 0.1 and plan.plrs[plan.devices.index("clean")] < 0.05
        held = [i for layer in plan.mlp for i in layer[lossy]]
        assert held and 0 not in held
        for node in master.nodes:  # RTT and bandwidth were measured too
            assert 0 < node.link.rtt_ms < 1000 and node.link.up_mbit > 10
    finally:
        master.close()
        for p in procs:
            p.kill()
            p.wait()


def test_kernel_ceiling_runs_each_share_in_a_process_of_its_own(tiny_spec, synth_gguf, tmp_path: Path) -> None:
    """bench.ceiling: every device's even share runs in its own process; the time per token is the slowest device's
    kernel in each block, summed, so it is at least each device's own; a device that fails is named."""
    from edgerun.bench.ceiling import kernel_ceiling

    path = synth_gguf(tiny_spec(tied=False))
    ceiling = kernel_ceiling(path, 3, 1, "int8", 4, 64)
    assert ceiling.devices == 3 and ceiling.tokens == 4 and len(ceiling.device_ms_per_token) == 3
    assert all(0 < ms <= ceiling.decode_ms_per_token for ms in ceiling.device_ms_per_token)
    assert ceiling.prompt == 0 and np.isnan(ceiling.prefill_ms)  # no prompt asked for
    # A prompt before the steps: its blocks in step too, and a request's time per token as a benchmark counts it.
    prompted = kernel_ceiling(path, 2, 1, "int8", 3, 64, prompt=9)
    assert prompted.prompt == 9 and prompted.prefill_ms > 0
    assert prompted.ms_per_token(3) == pytest.approx((prompted.prefill_ms + 2 * prompted.decode_ms_per_token) / 3)
    # Each kind of one-token block in step, on average: a layer's attention and MLP block and the LM head, which add
    # up to a token's time over the layers.
    blocks = dict(prompted.block_us)
    assert list(blocks) == ["attention", "MLP", "LM head"] and all(us > 0 for us in blocks.values())
    layers = load_model(path).config.n_layers
    assert (layers * (blocks["attention"] + blocks["MLP"]) + blocks["LM head"]) / 1e3 == \
        pytest.approx(prompted.decode_ms_per_token)
    with pytest.raises(ValueError, match="do not fit a context of 64"):
        kernel_ceiling(path, 2, 1, "int8", 3, 64, prompt=60)
    with pytest.raises(RuntimeError, match=r"device \d failed: .*not found"):
        kernel_ceiling(tmp_path / "missing.gguf", 2, 1, "int8", 1, 64)


def bench_row(nodes: int, ms: float, transport: str = "udp", loss: str = "0", plan: str = "halo",
              on: tuple[str, ...] = (), left_out: tuple[str, ...] = (),
              single: tuple[float, float, float] | None = None, llamacpp_ms: float | None = None):
    """A `bench tp` row for the table's and the ratios' tests: `ms` a token, `single` the single engine's
    (whole, decode, prefill) times; every count zero."""
    from edgerun.bench.single import RequestTiming
    from edgerun.bench.tp import (
        BlockCounts,
        Compared,
        MemoryUse,
        PacketCounts,
        RowSetup,
        Split,
        TimeSplit,
        TpResult,
        Yardstick,
    )

    timing = RequestTiming(ms, ms * 0.9, ms * 8)
    return TpResult(
        RowSetup(nodes, transport, loss, "process", "f32", "10 ms", 0, plan, "index", 256, "none", None), 4, timing,
        TimeSplit(*[0.0] * 9), BlockCounts(0, 0, 0, 0, 0), PacketCounts(0, 0, 0, 0, 0, 0), MemoryUse(*[0.0] * 5),
        Split(on, left_out, False),
        single=None if single is None else Compared.of(RequestTiming(*single), timing),
        llamacpp=None if llamacpp_ms is None else
        Yardstick(llamacpp_ms, 80.0, llamacpp_ms / timing.decode_ms_per_token))


def test_bench_ratios_pair_each_lossy_row_with_the_lossless_row_beside_it() -> None:
    """bench tp's summary: a lossy udp row against the lossless udp row run last before it, tcp against udp at the
    same loss; loss rates given again (--plr 0,5%,0,5%) give a pair each and their median, per plan."""
    from edgerun.bench.tp import tp_ratios

    def row(loss: str, ms: float, transport: str = "udp", plan: str = "halo"):
        return bench_row(7, ms, transport, loss, plan)

    assert tp_ratios([row("0", 80.0), row("0", 200.0, "tcp"), row("5%", 90.0), row("5%", 360.0, "tcp")]) == (
        "7 node(s), loss 0: udp 80.0 ms/token; 1.00x udp at loss 0; tcp 200.0 ms/token = 2.50x udp\n"
        "7 node(s), loss 5%: udp 90.0 ms/token; 1.12x udp at loss 0; tcp 360.0 ms/token = 4.00x udp")
    drifting = [row("0", 80.0), row("5%", 88.0), row("0", 100.0), row("5%", 105.0), row("0", 60.0), row("5%", 72.0)]
    assert tp_ratios(drifting).splitlines()[1] == (
        "7 node(s), loss 5%: udp 88.0 ms/token; 1.10x udp at loss 0 (median of 3 pairs: 1.10x, 1.05x, 1.20x)")
    plans = tp_ratios([row("0", 80.0), row("0", 40.0, plan="ilp"), row("5%", 88.0), row("5%", 60.0, plan="ilp")])
    assert plans.splitlines() == ["7 node(s), plan halo, loss 0: udp 80.0 ms/token; 1.00x udp at loss 0",
                                  "7 node(s), plan halo, loss 5%: udp 88.0 ms/token; 1.10x udp at loss 0",
                                  "7 node(s), plan ilp, loss 0: udp 40.0 ms/token; 1.00x udp at loss 0",
                                  "7 node(s), plan ilp, loss 5%: udp 60.0 ms/token; 1.50x udp at loss 0"]


def test_bench_table_gives_the_median_speed_up_of_a_node_count_run_several_times() -> None:
    """--nodes 1,3,1,3 --baseline: each node count run more than once gets the median of its speed-ups over the
    single engine (whole request, decode, prefill) with every run's; one run alone gets no such line."""
    from edgerun.bench.tp import tp_table

    def row(nodes: int, speedup: float):  # the row's own times: 50 ms a token, 45 decoding, 400 prefilling
        return bench_row(nodes, 50.0, single=(50.0 * speedup, 45.0 * (speedup - 0.1), 400.0 * (speedup + 0.1)))

    lines = tp_table([row(1, 1.5), row(3, 2.5), row(1, 1.7), row(3, 3.1), row(1, 1.6), row(7, 3.0)]).splitlines()
    repeated = [line for line in lines if " runs: " in line]
    assert repeated == [
        "1 node(s), plan halo, udp, loss 0, 3 runs: speed-up over the single engine, median 1.60x (1.50x, 1.70x, "
        "1.60x); decode 1.50x (1.40x, 1.60x, 1.50x); prefill 1.70x (1.60x, 1.80x, 1.70x)",
        "3 node(s), plan halo, udp, loss 0, 2 runs: speed-up over the single engine, median 2.80x (2.50x, 3.10x); "
        "decode 2.70x (2.40x, 3.00x); prefill 2.90x (2.60x, 3.20x)"]
    assert not any(" runs: " in line for line in tp_table([row(7, 3.0)]).splitlines())


@pytest.mark.slow
def test_bench_rows_run_on_every_device_and_say_which(tiny_spec, synth_gguf, capsys) -> None:
    """--every-device: udp and tcp rows on one split that every device computes, each row naming its devices; a
    planner that leaves a device out at the declared speeds is an error naming it."""
    import json

    from edgerun.bench.tp import TpBenchConfig, bench_tp, tp_result
    from edgerun.cli import main

    path = synth_gguf(tiny_spec(tied=False))
    assert main(["bench", "tp", "--model", str(path), "--nodes", "1", "--tokens", "4", "--transport", "udp,tcp",
                 "--plan", "even", "--every-device", "--json"]) == 0
    rows = [tp_result(row).split for row in json.loads(capsys.readouterr().out)]
    assert len(rows) == 2  # udp and tcp
    assert all(r.computed_on == ("master", "bench-0") and r.left_out == () and not r.rebalanced for r in rows)
    slow = TpBenchConfig(path, "halo", tokens=2, node_speeds=(1e3,), rebalance=False, every_device=True)
    with pytest.raises(EdgerunError, match="leaves bench-0 out"):
        bench_tp(slow, [1], ["0"], ["udp"])
    with pytest.raises(EdgerunError, match="--every-device"):
        TpBenchConfig(path, every_device=True)  # with a rebalance


def test_bench_table_gives_no_speed_up_for_a_row_whose_nodes_computed_nothing() -> None:
    from edgerun.bench.tp import tp_ratios, tp_table

    def row(transport: str, loss: str, ms: float, on: tuple[str, ...]):
        devices = ("master", "n1", "n2")
        return bench_row(2, ms, transport, loss, on=on, left_out=tuple(d for d in devices if d not in on),
                         single=(100.0, ms * 0.9 * 1.5, ms * 8 * 1.2), llamacpp_ms=60.0)

    alone = row("tcp", "0", 50.0, ("master",))
    rows = [row("udp", "0", 40.0, ("master", "n1", "n2")), alone]
    table = tp_table(rows)
    assert "2 node(s), udp, loss 0: computed on master, n1, n2" in table
    assert "2 node(s), tcp, loss 0: computed on master; left out: n1, n2; the nodes computed nothing" in table
    assert "2.50x" in table and "2.00x" not in table  # the udp row's speed-up; none for the master alone
    assert "decode against it: 2 node(s) udp loss 0 1.67x, 2 node(s) tcp loss 0 - (nodes idle)" in table
    ratios = tp_ratios(rows)
    assert "tcp 50.0 ms/token;" in ratios and "= " not in ratios.split("tcp")[1]
    assert "rows whose nodes computed nothing are left out of the ratios" in ratios


BATCH_PROMPTS = ["The capital of France is", "Once upon a time there was a", "1, 2, 3, 4,",
                 "Write a long poem about the sea and the wind. " * 4, "Once upon a time there was a"]
BATCH_PARAMS = [SamplingParams(), SamplingParams(temperature=0.8, seed=7), SamplingParams(),
                SamplingParams(temperature=1.0, top_p=0.9, seed=3), SamplingParams(temperature=0.7, seed=1)]


def drain_batch(loop, model: Model, requests: list[int], max_tokens: int = 12, late: int | None = None,
                on_token: Callable[[int], None] | None = None) -> dict[int, list[int]]:
    """BATCH_PROMPTS[i] with BATCH_PARAMS[i] for each of `requests` through `loop`, each joining as a slot frees
    (`late`: that one only after six rounds); a round whose engine lost its caches recovers as the server does.
    Each one's tokens."""
    from edgerun.model.generate import EngineLost, Generation

    tok, results, waiting, rounds = model.tokenizer, {}, list(requests), 0
    while waiting or loop.running:
        while waiting and loop.free and (waiting[0] != late or rounds >= 6):
            i = waiting.pop(0)
            gen = Generation(tok.encode(BATCH_PROMPTS[i]), max_tokens, Sampler(BATCH_PARAMS[i]), on_token=on_token)
            try:
                loop.add(gen, lambda r, i=i: results.__setitem__(i, r.tokens))
            except EngineLost:  # the caches it would copy from are gone
                loop.recover()
                loop.add(gen, lambda r, i=i: results.__setitem__(i, r.tokens))
        try:
            loop.step()
        except EngineLost:
            loop.recover()
        rounds += 1
    return results


@pytest.mark.slow
def test_a_cluster_batch_of_q4_k_m_rows_gives_each_its_logits_alone(tiny_spec, synth_gguf) -> None:
    """Q4_K_M's matrices (ggml multiplies repacked Q4_K by 4 columns or more, and Q6_K by 8 or more, with other bits
    than one column's): a batch session's decode step of 9 sequences on a master and a node gives each sequence the
    logits of a step of it alone, bit for bit (every share takes such weights in groups of columns that each get
    their bits alone, kernels.each_column_alone)."""
    from edgerun.tp.batch import TpBatch

    path = synth_gguf(tiny_spec(qtype="Q4_K_M", tied=False))
    model = load_model(path)
    prompts = [[i, 2 * i + 1, 3 * i + 2, 7] for i in range(1, 10)]
    for master, _ in cluster(model, [1e9, 1e9], activations=Activations.INT8, slots=9, model_path=path):
        engine = TpBatch(master)
        last = [int(engine.prefill(s, p, 0).argmax()) for s, p in enumerate(prompts)]
        together = engine.decode([(s, len(p), t) for s, (p, t) in enumerate(zip(prompts, last, strict=True))])
        for s, (p, t) in enumerate(zip(prompts, last, strict=True)):
            engine.prefill(s, p, 0)  # the slot again as before the step
            alone = engine.decode([(s, len(p), t)])
            assert np.array_equal(alone[0].view(np.uint32), together[s].view(np.uint32)), s


@pytest.mark.slow
def test_a_cluster_runs_a_rounds_prompt_chunks_and_decode_step_as_one_step(model: Model) -> None:
    """The shipped model (Q4_1 and Q8_0: every product gives a column its bits at any column count) on a master and
    a node: a round's prompt chunks (16 tokens, one token) and decode token go through every block as one step
    (BatchStep.counts), and each sequence's logits are bit for bit those of steps of its own, its cache then what
    they leave (the next decode step agrees too). Slots 0-2 take the round, slots 3-5 the same sequences apart."""
    from edgerun.tp.batch import TpBatch

    tok = model.tokenizer
    first, second = tok.encode(BATCH_PROMPTS[0]), tok.encode(BATCH_PROMPTS[3])[:16]
    for master, _ in cluster(model, [1e9, 1e9], activations=Activations.INT8, slots=6):
        engine = TpBatch(master)
        assert engine.fuses
        for slot in (0, 3):
            engine.prefill(slot, first, 0)
        apart = [engine.prefill(4, second, 0), engine.prefill(5, [7], 0), engine.decode([(3, len(first), 5)])[0]]
        blocks = master.stats.blocks
        outs, rows = engine.round_step([(1, second, 0), (2, [7], 0)], [(0, len(first), 5)])
        assert master.stats.blocks - blocks == 2 * model.config.n_layers + 1  # one step's blocks
        for ours, theirs in zip([*outs, rows[0]], apart, strict=True):
            assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
        after = engine.decode([(0, len(first) + 1, 9), (1, 16, 9), (2, 1, 9)])
        before = engine.decode([(3, len(first) + 1, 9), (4, 16, 9), (5, 1, 9)])
        assert np.array_equal(after.view(np.uint32), before.view(np.uint32))


@pytest.mark.slow
def test_a_batchs_decode_step_gathers_only_the_logits_its_draws_can_pick(model: Model) -> None:
    """A batch of greedy and top-k sequences on a master and a node: each decode step's nodes send each row's few
    largest logits of their vocabulary share (the most any row's draw picks from, 40), not the share itself; a
    step with a top-p sequence (no top-k) and the prompts' steps get every logit. Each sequence's tokens are those
    of the same batch with every logit gathered."""
    from edgerun.model.batch import BatchLoop, most_candidates
    from edgerun.model.generate import Generation
    from edgerun.tp.batch import TpBatch

    params = [SamplingParams(), SamplingParams(temperature=0.9, top_k=40, seed=5), SamplingParams(),
              SamplingParams(temperature=1.0, top_p=0.9, seed=3)]
    assert most_candidates([Sampler(p) for p in params[:3]]) == 40
    assert most_candidates([Sampler(p) for p in params]) is None
    tok = model.tokenizer
    for master, _ in cluster(model, [1e9, 1e9], timeout_ms=2000, activations=Activations.INT8, slots=4):
        head = master.exchange._reply_size
        sizes: list[int] = []

        def reply_size(node, block, seq, head=head, sizes=sizes):
            size = head(node, block, seq)
            if block == Block.HEAD:
                sizes.append(size // seq)
            return size

        master.exchange._reply_size = reply_size
        ends = {}
        for gathers in (True, False):
            engine = TpBatch(master)
            engine.gathers = gathers
            loop, results = BatchLoop(engine, prefill_chunk=16), {}
            for i, (prompt, p) in enumerate(zip(BATCH_PROMPTS, params, strict=False)):
                max_tokens = 6 if i == 3 else 12  # the top-p sequence leaves first: then steps gather 40 a node
                loop.add(Generation(tok.encode(prompt), max_tokens, Sampler(p)),
                         lambda r, i=i, results=results: results.__setitem__(i, r.tokens))
            while loop.running:
                loop.step()
            ends[gathers] = results
            share = max(sizes)
            assert share > 1000  # a prompt's last logits: the node's whole vocabulary share
            if gathers:
                assert 2 * 40 in sizes, sizes  # top-k steps: 40 logits and their places a row
            else:
                assert set(sizes) == {share}
            sizes.clear()
        assert ends[True] == ends[False] and all(len(ends[True][i]) == 12 for i in range(3))


@pytest.mark.slow
def test_a_batchs_decode_rows_are_lossy_and_its_prompts_reliable(model: Model) -> None:
    """HALO's semantics per row: at 5% loss without parity, a batch's decode steps (each row one sequence's token) go
    as a request's decode tokens go, over UDP with the timeout, so some merge incomplete, and no wait runs far past
    its deadline; its prompt chunks go reliable, and the LM head both ways, so each greedy sequence's first token is
    the single engine's (a confident one: int8 shares add their partials in another order). Every sequence
    completes."""
    from edgerun.model.batch import BatchLoop
    from edgerun.tp.batch import TpBatch

    tok = model.tokenizer
    single = make_engine("ggml", model, 256, threads=1)
    firsts = {i: generate(single, tok.encode(BATCH_PROMPTS[i]), 1, Sampler(BATCH_PARAMS[i])).tokens[0]
              for i in (0, 2)}
    for master, _ in cluster(model, [1e9, 1e9], loss="5%", timeout_ms=20, parity=0, slots=3,
                             activations=Activations.INT8):
        ended = drain_batch(BatchLoop(TpBatch(master), prefill_chunk=16), model, [0, 1, 2], max_tokens=16)
        assert sorted(ended) == [0, 1, 2] and all(len(t) == 16 for t in ended.values())
        assert {i: ended[i][0] for i in (0, 2)} == firsts
        stats = master.stats
        assert stats.blocks_incomplete > 0, stats  # the decode rows felt the loss
        assert stats.max_overshoot_s < 0.05, stats


@pytest.mark.slow
def test_a_cluster_batches_sequences_each_with_its_tokens_alone(model: Model) -> None:
    """`serve --parallel` on a tensor-parallel cluster: every device's share holds three sequences' caches, and a
    batch session's step carries a prompt chunk or one token of each running sequence through every block at once.
    Each sequence gets the tokens it gets alone: greedy and seeded, a prompt of several chunks, a prompt shared with a
    running sequence (its rows copied on every device, layer by layer), one joining late. A request alone in between
    makes a new session: the batch's next step finds its caches gone and its sequences prefill again. A node killed
    mid-batch: the master plans over the one left, and every sequence completes."""
    from edgerun.model.batch import BatchLoop
    from edgerun.tp.batch import TpBatch

    for master, nodes in cluster(model, [1e9, 1e9], timeout_ms=2000, activations=Activations.INT8, slots=3):
        engine = TpBatch(master)
        alone = {}
        # A step begins its batch session in its own turn on the master's loop: a call through the loop between
        # steps would wait out the turns' polling (--spin-us) every step.
        calls, call = [], master.net.call
        master.net.call = lambda fn, calls=calls, call=call: calls.append(fn) or call(fn)
        try:
            alone.update(drain_batch(BatchLoop(engine, prefill_chunk=16), model, [0]))
        finally:
            master.net.call = call
        assert calls == [] and master.batch is not None and len(alone[0]) == 12
        for i in range(1, len(BATCH_PROMPTS)):
            alone.update(drain_batch(BatchLoop(engine, prefill_chunk=16), model, [i]))
        assert len({tuple(t) for t in alone.values()}) == len(alone) and all(len(t) == 12 for t in alone.values())
        loop = BatchLoop(engine, prefill_chunk=16)
        assert drain_batch(loop, model, [0, 1, 2, 3, 4], late=4) == alone
        assert loop.reused_tokens > 0  # prompt 4 is prompt 1: its rows came from slot to slot
        with pytest.raises(RuntimeError, match="batch session"):  # its nodes take positions as its step numbers
            master.step([1])
        blocks = master.stats.blocks
        assert master.generate(model.tokenizer.encode(PROMPT), 4, GREEDY)  # a new session
        assert drain_batch(loop, model, [1, 4, 0]) == {i: alone[i] for i in (1, 4, 0)}
        assert master.stats.blocks > blocks
        ended = drain_batch(loop, model, [0, 1, 2], max_tokens=24, on_token=kill_at(nodes[0].pid, 10))
        assert sorted(ended) == [0, 1, 2] and all(len(t) == 24 for t in ended.values())
        assert master.lost_nodes() == ["n0"]
