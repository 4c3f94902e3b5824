"""The native datagram path (net.native, fastpath.c) against the wire format's Python implementation, over real
UDP sockets."""

from __future__ import annotations

import shutil
import socket
import time

import numpy as np
import pytest

from edgerun.net import native
from edgerun.net.channel import SO_TIMESTAMPNS, LossyUdp
from edgerun.net.native import Drained, NativeDatagrams
from edgerun.net.wire import (
    HEADER,
    MAGIC,
    VERSION,
    BadMac,
    Codec,
    Header,
    MsgType,
    derive_key,
    open_packet,
    seal,
)

KEY = derive_key("native")
N = 64  # elements of a test partial


@pytest.fixture(scope="module")
def fast() -> NativeDatagrams:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the Python path runs instead")
    path = native.load()
    assert path is not None, "fastpath.c did not build or load although a C compiler is here"
    datagrams = NativeDatagrams.for_key(KEY)
    assert datagrams is not None
    return datagrams


def partial(node: int, x: np.ndarray, block: tuple[int, int, int, int] = (3, 9, 2, 1), parity: bool = False,
            key: bytes = KEY) -> bytes:
    session, position, layer, kind = block
    header = Header(MsgType.PARTIAL, session, position, layer, kind, node, int(parity), 1, Codec.F32, 1, 0, 0)
    return seal(header, x.astype(np.float32).tobytes(), key)


def match(block: tuple[int, int, int, int] = (3, 9, 2, 1)) -> bytes:
    return HEADER.pack(MAGIC, VERSION, MsgType.PARTIAL, *block, 0, 0, 1, 0, 1, 0, 0)[:15]


@pytest.fixture
def sockets():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.setblocking(False)
    rx.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    yield rx, tx, rx.getsockname()
    rx.close()
    tx.close()


def test_it_checks_the_wire_formats_gmac(fast: NativeDatagrams) -> None:
    x = np.arange(N, dtype=np.float32)
    datagram = partial(4, x)
    assert fast.authentic(datagram)
    assert not fast.authentic(datagram[:-1] + bytes([datagram[-1] ^ 1]))  # tag
    assert not fast.authentic(datagram[:40] + bytes([datagram[40] ^ 1]) + datagram[41:])  # payload
    assert not fast.authentic(partial(4, x, key=derive_key("another")))
    assert not fast.authentic(datagram[:20])


def test_a_drain_merges_a_blocks_partials_and_hands_back_everything_else(fast: NativeDatagrams, sockets) -> None:
    rx, tx, addr = sockets
    rng = np.random.default_rng(0)
    own = rng.standard_normal(N).astype(np.float32)
    parts = {i: rng.standard_normal(N).astype(np.float32) for i in (1, 2, 5)}
    total = own.copy()
    sent = time.perf_counter()
    tx.sendto(partial(1, parts[1]), addr)
    tx.sendto(partial(7, parts[1], block=(3, 9, 2, 0)), addr)  # another block's: for the Python path
    tx.sendto(partial(2, parts[2], parity=True), addr)  # a parity copy stands for its data
    tx.sendto(partial(1, parts[1], parity=True), addr)  # the parity copy of a partial merged: dropped
    tx.sendto(partial(5, parts[5])[:-1] + b"\0", addr)  # forged: for the Python path, which rejects it
    tx.sendto(partial(5, parts[5]), addr)
    fast.begin(rx.fileno(), match(), total, [1, 2, 5], False, None, [], 0.0)
    handed = []
    while (drained := fast.drain(time.perf_counter() + 5)) == Drained.OTHER:
        handed.append(fast.other_datagram())
    assert drained == Drained.DONE and fast.merge.outstanding == 0
    assert open_packet(handed[0], KEY)[0].block == 0
    with pytest.raises(BadMac):
        open_packet(handed[1], KEY)
    assert len(handed) == 2
    np.testing.assert_allclose(total, own + parts[1] + parts[2] + parts[5], rtol=1e-6)
    for i in (1, 2, 5):
        vector, at, parity = fast.take(i)
        assert np.array_equal(vector, parts[i]) and sent <= at <= time.perf_counter() and parity == (i == 2)
        assert not fast.awaited(i)


def test_a_drain_ends_at_its_deadline_brought_forward_by_the_first_partial(fast: NativeDatagrams, sockets) -> None:
    rx, tx, addr = sockets
    total = np.zeros(N, np.float32)
    fast.begin(rx.fileno(), match(), total, [0, 1], False, None, [], 0.0)
    started = time.perf_counter()
    assert fast.drain(started + 0.05) == Drained.TIMEOUT
    assert 0.05 <= time.perf_counter() - started < 0.5 and fast.awaited(0) and fast.awaited(1)
    # With a lag bound the first partial moves the deadline to that long after it: node 1 is given 20 ms, not 5 s.
    fast.begin(rx.fileno(), match(), total, [0, 1], False, 0.02, [], 0.0)
    tx.sendto(partial(0, np.ones(N)), addr)
    started = time.perf_counter()
    assert fast.drain(started + 5) == Drained.TIMEOUT
    assert time.perf_counter() - started < 1 and fast.merge.deadline < started + 1
    assert not fast.awaited(0) and fast.awaited(1) and fast.merge.first == 1
    np.testing.assert_array_equal(total, np.ones(N))


def test_a_drain_gives_way_to_a_stream_with_data(fast: NativeDatagrams, sockets) -> None:
    rx, _, _ = sockets
    stream, peer = socket.socketpair()
    try:
        for spin_s in (0.0, 0.2):  # asleep in poll, and spinning
            fast.begin(rx.fileno(), match(), np.zeros(N, np.float32), [0], False, None, [stream.fileno()], spin_s)
            peer.send(b"x")
            started = time.perf_counter()
            assert fast.drain(started + 5) == Drained.WATCHED
            assert time.perf_counter() - started < 1
            stream.recv(1)
    finally:
        stream.close()
        peer.close()


def test_one_datagram_goes_to_every_destination_in_one_call(fast: NativeDatagrams) -> None:
    receivers = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3)]
    udp = LossyUdp(KEY, "127.0.0.1")
    try:
        for r in receivers:
            r.bind(("127.0.0.1", 0))
            r.settimeout(5)
        datagram = partial(0, np.arange(N))
        udp.send_many([datagram, datagram[::-1]], [r.getsockname() for r in receivers])
        assert [(r.recv(2048), r.recv(2048)) for r in receivers] == [(datagram, datagram[::-1])] * 3
        assert udp.sent == 6 and udp.dropped == 0
    finally:
        udp.close()
        for r in receivers:
            r.close()


def test_edgerun_native_0_keeps_the_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGERUN_NATIVE", "0")
    assert native.load() is None and NativeDatagrams.for_key(KEY) is None
    udp = LossyUdp(KEY, "127.0.0.1")
    assert udp.native is None
    udp.close()
