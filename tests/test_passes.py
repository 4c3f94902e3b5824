"""Chained passes over plain TCP (pp.passes, pp.pass_links): real sockets and threads, with stages that compute
with numpy instead of onnxruntime (test_pp runs the real stages)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from edgerun.net.wire import PpStream, WorkerKind, derive_key, pp_packet
from edgerun.pp.messages import (
    Capabilities,
    Computation,
    ComputationResult,
    Error,
    ErrorReason,
    ReleaseSession,
    seal,
)
from edgerun.pp.pass_links import Breach, PassLinks
from edgerun.pp.passes import PassPort
from edgerun.pp.workers import BadInput, WorkerConn, WorkerLost

KEY = derive_key("passes")


def test_a_stream_cuts_frames_wherever_the_bytes_break() -> None:
    frames = [seal(i, Computation(i, hidden=np.full((1, 1, 5), i, np.float32)), KEY) for i in range(3)]
    data = b"".join(pp_packet(f) for f in frames)
    stream, got = PpStream(), []
    for i in range(0, len(data), 7):
        got += stream.feed(data[i:i + 7])
    assert got == frames and not stream.buffer
    for bad in (b"\xff\xff\xff\xff", b"\x01\x00\x00\x00"):  # longer than any frame, shorter than a header
        stream = PpStream()
        assert stream.feed(pp_packet(frames[0]) + bad) == [frames[0]]  # what came before it still counts
        assert "frame length" in stream.broken and stream.feed(data) == []


def add_one(last: bool, calls: list[Computation]):
    """A stage: adds 1 to the hidden state; the last one answers with a token (the sum) and the chain's times."""

    def compute(message: Computation) -> tuple[Any, bool]:
        calls.append(message)
        if message.position == 7:
            return Error("malformed", ErrorReason.INPUT), False
        out = message.input().astype(np.float32) + 1
        chain = (*message.chain, 0.001)
        if last:
            return ComputationResult(token=int(out.sum()), stage_seconds=chain), False
        return Computation(message.position, hidden=out, chain=chain), True

    return compute


def worker(name: str, port: int) -> WorkerConn:
    return WorkerConn(name, SimpleNamespace(host="127.0.0.1"), 1.0, 1.0,
                      Capabilities(WorkerKind.NATIVE, peer_port=port), set())


def a_pass(position: int, ids: list[int]) -> Computation:
    return Computation(position, np.array([ids], np.int64), chain=())


@pytest.fixture
def chain() -> Iterator[tuple[list[PassPort], list[WorkerConn], list[str], list[list[Computation]]]]:
    logs: list[str] = []
    calls: list[list[Computation]] = [[], []]
    ports = [PassPort("127.0.0.1", 0, KEY, add_one(i == 1, calls[i]), logs.append, f"w{i}") for i in range(2)]
    ports[0].connect_next("127.0.0.1", ports[1].port)
    yield ports, [worker(f"w{i}", p.port) for i, p in enumerate(ports)], logs, calls
    for p in ports:
        p.close()


def test_a_pass_goes_stage_to_stage_and_its_token_back(chain) -> None:
    _, workers, logs, calls = chain
    links = PassLinks(KEY, logs.append)
    for request in (1, 2):  # the second pass reuses the connections
        reply = links.forward(workers, request, a_pass(0, [3, 4]), 10)
        assert reply == ComputationResult(token=3 + 4 + 2 * 2, stage_seconds=(0.001, 0.001))
    assert [m.chain for m in calls[1]] == [(0.001,), (0.001,)]
    assert len(links.links) == 2
    links.close()


def test_refused_input_names_the_stage_and_a_closed_port_is_a_lost_worker(chain) -> None:
    ports, workers, logs, _ = chain
    links = PassLinks(KEY, logs.append)
    with pytest.raises(BadInput) as refused:
        links.forward(workers, 1, a_pass(7, [3]), 10)
    assert refused.value.worker == "w0" and any("malformed" in line for line in logs)
    ports[1].close()
    with pytest.raises(WorkerLost, match="w1"):
        links.forward(workers, 2, a_pass(0, [3]), 10)
    workers[0].alive = False  # the control link saw it leave: nothing is sent, and its connection goes
    with pytest.raises(WorkerLost, match="w0"):
        links.forward(workers, 3, a_pass(0, [3]), 10)
    assert not links.links
    links.close()


def test_an_answer_out_of_turn_is_a_breach_and_silence_times_out(chain) -> None:
    ports, workers, logs, _ = chain
    links = PassLinks(KEY, logs.append)
    with pytest.raises(Breach, match="ComputationResult as stage 1 of 2"):  # a last stage put first answers
        links.forward(workers[::-1], 1, a_pass(0, [3]), 10)
    ports[0].drop_next()  # its output now goes nowhere: the pass is never answered
    start = time.monotonic()
    with pytest.raises(WorkerLost):
        links.forward(workers, 2, a_pass(0, [3]), 0.3)
    assert 0.3 <= time.monotonic() - start < 5
    assert any("no next stage" in line for line in logs), logs
    links.close()


def test_the_port_drops_what_it_cannot_trust_and_serves_on(chain) -> None:
    ports, workers, logs, calls = chain
    with socket.create_connection(("127.0.0.1", ports[0].port)) as sock:
        sock.sendall(pp_packet(seal(1, a_pass(0, [1]), derive_key("another cluster"))))
        sock.sendall(pp_packet(seal(2, ReleaseSession(), KEY)))
        sock.sendall(b"\xff" * 8)
        assert sock.recv(1) == b""  # a length no frame has: the connection goes
    assert calls == [[], []]
    assert any("bad MAC" in line for line in logs)
    assert any("RELEASE_SESSION is not a message this end takes" in line for line in logs)
    links = PassLinks(KEY, logs.append)
    assert links.forward(workers, 3, a_pass(0, [1]), 10).token == 3
    links.close()
