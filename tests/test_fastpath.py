"""The exchange's native data path (net.fastpath) against the Python path's bytes and sums, on real UDP sockets."""

from __future__ import annotations

import math
import os
import socket
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerun.net import wire
from edgerun.net.fastpath import (
    NATIVE_FRAGMENTS,
    FastPath,
    Gather,
    GatherEnd,
    addresses,
    fits,
    library_path,
    one_datagram_bytes,
)
from edgerun.net.group import join_group, new_group, send_to_groups
from edgerun.net.wire import Codec, Header, MsgType, authenticate, fragment, open_packet

KEY = os.urandom(32)


@pytest.fixture(scope="module")
def fast() -> FastPath:
    path = FastPath.load(KEY)
    assert library_path() is not None, "the install builds edgerun/net/_fastpath*.so (setup.py)"
    assert path is not None, "the native data path did not load (no libcrypto mapped?)"
    return path


def test_the_native_path_is_off_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGERUN_NATIVE", "0")
    assert FastPath.load(KEY) is None


def vectors(n: int, seed: int) -> np.ndarray:
    """Values across float32's range, with zeros, halves' ties and values beyond f16's range."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * rng.choice([1e-9, 1e-5, 1e-2, 1.0, 3e2, 7e4], n)).astype(np.float32)
    special = np.array([0.0, -0.0, 65504.0, 65520.0, 1e-8, 2.0 ** -24 * 1.5, 1.0 + 2.0 ** -11, -3.5], np.float32)
    x[:min(n, special.size)] = special[:n]
    return x


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("n", [1, 7, 31, 32, 33, 100, 2048])
def test_codecs_write_and_read_the_python_paths_bytes(fast: FastPath, codec: Codec, n: int) -> None:
    x = vectors(n, n)
    with np.errstate(over="ignore"):  # values beyond f16's range become infinities on both paths
        encoded = wire.encode_vector(x, codec)
    assert fast.encode(codec, x) == encoded
    assert np.array_equal(fast.decode(codec, encoded, n).view(np.uint32),
                          wire.decode_vector(encoded, codec, n).view(np.uint32))


def test_f16_rounds_every_bit_pattern_as_numpy() -> None:
    fast = FastPath.load(KEY)
    x = np.random.default_rng(0).integers(0, 2 ** 32, 400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = x[np.isfinite(x)]
    with np.errstate(over="ignore"):
        assert fast.encode(Codec.F16, x) == x.astype("<f2").tobytes()
    halves = np.arange(2 ** 16, dtype=np.uint16)
    finite = np.isfinite(halves.view(np.float16))
    decoded = fast.decode(Codec.F16, halves.tobytes(), halves.size)
    assert np.array_equal(decoded[finite].view(np.uint32), halves.view(np.float16).astype(np.float32)[finite]
                          .view(np.uint32))


def test_seals_open_both_ways(fast: FastPath) -> None:
    body = b"an authentic body" * 5
    sealed = fast.seal(body)
    cipher = wire._gmac(KEY)
    assert cipher.decrypt(sealed[-28:-16], sealed[-16:], sealed[:-28]) == b""  # the Python path accepts it
    assert fast.verify(authenticate(body, KEY))
    forged = bytearray(authenticate(body, KEY))
    forged[3] ^= 1
    assert not fast.verify(bytes(forged))
    assert not fast.verify(FastPath.load(os.urandom(32)).seal(body))  # another cluster's key
    assert fast.seal(body)[-28:-16] != sealed[-28:-16]  # a fresh nonce every time


@settings(max_examples=60, deadline=None)
@given(codec=st.sampled_from(list(Codec)), n=st.integers(1, 3000), parity=st.integers(0, 4),
       prefix=st.binary(max_size=12), position=st.integers(0, 2 ** 32 - 1), mtu=st.sampled_from([0, 1472, 700]))
def test_send_vector_sends_what_fragment_seals(codec: Codec, n: int, parity: int, prefix: bytes,
                                               position: int, mtu: int) -> None:
    """One datagram (mtu 0) or the fragments of a path's MTU, and the parity fragments of net.erasure's code: the
    datagrams wire.fragment seals, in its order."""
    fast = FastPath.load(KEY)
    receivers = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for r in receivers:
            r.bind(("127.0.0.1", 0))
            r.settimeout(5)
        x = vectors(n, n)
        header = Header(MsgType.ACTIVATION, 9, position, 3, 1, 2, codec=codec, tokens=1)
        sent = fast.send_vector(sender.fileno(), header, x, addresses([r.getsockname() for r in receivers]),
                                copies=1 + parity, prefix=prefix, mtu=mtu)
        with np.errstate(over="ignore"):
            count = wire.fragments_of(codec, n, mtu or 65507, len(prefix))  # a link of `parity` takes more for more
            expected = [open_packet(d, KEY) for d in fragment(header, x, KEY, mtu or 65507,
                                                               parity=wire.parity_fragments(parity, count),
                                                               prefix=prefix)]
        if count > NATIVE_FRAGMENTS:  # more fragments than the native path cuts
            assert sent == -1
            return
        assert sent == 2 * len(expected)
        for r in receivers:
            got = [open_packet(r.recv(70000), KEY) for _ in expected]
            assert [(h, p) for h, p in got] == expected  # header fields and payload, data before parity
    finally:
        sender.close()
        for r in receivers:
            r.close()


@pytest.mark.parametrize("parity", [0, 2])
def test_a_grouped_address_takes_the_data_and_its_parity_from_the_group(fast: FastPath, parity: int) -> None:
    group = new_group()
    members = [join_group(group, "127.0.0.1") for _ in range(2)]  # two nodes of one host: each gets a copy
    receivers = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        send_to_groups(sender, "127.0.0.1")
        for r in [*receivers, *members]:
            r.settimeout(5)
        for r in receivers:
            r.bind(("127.0.0.1", 0))
        x = vectors(1, 2048)
        header = Header(MsgType.ACTIVATION, 9, 4, 3, 1, 0, codec=Codec.F32, tokens=1)
        # the first receiver is grouped (nothing by unicast), the second is not (everything by unicast)
        sent = fast.send_vector(sender.fileno(), header, x, addresses([r.getsockname() for r in receivers]),
                                copies=1 + parity, group=group, grouped=[True, False])
        assert sent == 1 + parity + (1 + parity)
        expected = [open_packet(d, KEY) for d in fragment(header, x, KEY, 65507, parity=parity)]
        for m in members:
            assert [open_packet(m.recv(70000), KEY) for _ in expected] == expected
        assert [open_packet(receivers[1].recv(70000), KEY) for _ in expected] == expected
        for r in [*receivers, *members]:  # nothing more came
            r.setblocking(False)
            with pytest.raises(BlockingIOError):
                r.recv(70000)
    finally:
        for s in [sender, *receivers, *members]:
            s.close()


def test_a_vector_too_long_for_one_datagram_is_refused(fast: FastPath) -> None:
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    x = np.zeros(20_000, np.float32)
    assert not fits(Codec.F32, x.size, 0, 65507) and fits(Codec.Q8, x.size, 0, 65507)
    assert fast.send_vector(sender.fileno(), Header(MsgType.PARTIAL, 1, codec=Codec.F32, tokens=1), x,
                            addresses([("127.0.0.1", 9)])) == -1
    sender.close()


def test_only_a_clean_links_one_token_vectors_go_as_datagrams_longer_than_the_path() -> None:
    """Ethernet's 1472-byte payload: a clean link's one-token vector may take IPv4's longest datagram (the kernel
    fragments it); a link with parity, and a prompt's vectors, are cut to the path."""
    assert one_datagram_bytes(1472, 0) == wire.MAX_UDP_PAYLOAD
    assert fits(Codec.F32, 2048, 0, one_datagram_bytes(1472, 0)) and not fits(Codec.F32, 2048, 0, 1472)
    assert one_datagram_bytes(1472, 2) == 1472 and one_datagram_bytes(1472, 0, tokens=7) == 1472
    assert one_datagram_bytes(65507, 1) == 65507


@pytest.mark.parametrize("simd", [False, True], ids=["bytes", "cpu"])
def test_gf_products_are_net_erasures(fast: FastPath, simd: bool) -> None:
    """The parity's multiply-add over GF(2^8), byte at a time and 32 at a time (AVX2 where the CPU has it), against
    net.erasure's table, for every coefficient and lengths around the 32-byte step."""
    from edgerun.net import erasure

    rng = np.random.default_rng(11)
    for c in range(256):
        n = int(rng.integers(1, 100))
        data = rng.integers(0, 256, n, dtype=np.uint8)
        start = rng.integers(0, 256, n, dtype=np.uint8)
        out = start.copy()
        fast.gf_mul_add(out, data, c, simd)
        assert np.array_equal(out, start ^ erasure.MUL[c][data])


class Block:
    """A master's socket and three nodes' sockets on loopback, and a Gather for one block."""

    HIDDEN = 64
    KEY = (5, 17, 3, 1)  # session, position, layer, block

    def __init__(self, fast: FastPath) -> None:
        self.master = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.master.bind(("127.0.0.1", 0))
        self.master.setblocking(False)
        self.master.setsockopt(socket.SOL_SOCKET, 35, 1)  # SO_TIMESTAMPNS, as DatagramSocket
        self.node = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.gather = Gather(fast)
        self.parts = {i: np.full(self.HIDDEN, float(i), np.float32) for i in (1, 2, 3)}

    def start(self, deadline_s: float = 2.0, lag_bound: float | None = None) -> None:
        self.gather.start(self.KEY, [1, 2, 3], self.HIDDEN, time.perf_counter() + deadline_s, lag_bound, 0.0, [])

    def send(self, node: int, codec: Codec = Codec.F32, parity: int = 0, key: tuple = KEY, size: int = 0,
             datagram_bytes: int = 65507) -> None:
        session, position, layer, block = key
        header = Header(MsgType.PARTIAL, session, position, layer, block, node, codec=codec, tokens=1)
        x = self.parts[node] if not size else np.ones(size, np.float32)
        for d in fragment(header, x, KEY, datagram_bytes, parity=parity):
            self.node.sendto(d, self.master.getsockname())

    def close(self) -> None:
        self.master.close()
        self.node.close()


@pytest.fixture
def block(fast: FastPath):
    b = Block(fast)
    yield b
    b.close()


def test_gather_takes_every_partial_and_stamps_it(block: Block) -> None:
    before = time.perf_counter()
    for node in (3, 1, 2):
        block.send(node, codec=Codec.F16)
    block.start()
    assert block.gather.run(block.master.fileno()) == GatherEnd.WHOLE
    g = block.gather
    assert g.g.outstanding == 0 and g.g.from_parity == 0
    assert all(before <= t <= time.perf_counter() for t in g.arrived)
    for i, node in enumerate((1, 2, 3)):
        assert np.array_equal(g.buffer[i], block.parts[node])


def test_gather_takes_partials_of_a_size_each_into_the_front_of_their_rows(block: Block) -> None:
    sizes = {1: 6, 2: 40, 3: 2}  # an LM head's: each node's top logits and their places, or its rows
    block.parts = {node: np.arange(size, dtype=np.float32) + node for node, size in sizes.items()}
    block.send(1, size=5)  # a misfit: handed back, not taken
    for node in (2, 3, 1):
        block.send(node)
    block.gather.start(Block.KEY, [1, 2, 3], [sizes[n] for n in (1, 2, 3)], time.perf_counter() + 2, None, 0.0, [])
    ends = [block.gather.run(block.master.fileno()) for _ in range(2)]
    g = block.gather
    assert ends == [GatherEnd.OTHER, GatherEnd.WHOLE]
    assert g.g.outstanding == 0 and g.buffer.shape == (3, 40)
    for i, node in enumerate((1, 2, 3)):
        assert np.array_equal(g.buffer[i, :sizes[node]], block.parts[node])


def test_gather_ends_at_its_deadline_with_what_came(block: Block) -> None:
    block.send(2)
    block.start(deadline_s=0.05)
    started = time.perf_counter()
    assert block.gather.run(block.master.fileno()) == GatherEnd.TIME
    assert 0.04 <= time.perf_counter() - started < 1.0
    arrived = block.gather.arrived
    assert math.isnan(arrived[0]) and not math.isnan(arrived[1]) and math.isnan(arrived[2])
    assert block.gather.g.outstanding == 2


def test_the_first_partial_moves_the_deadline_by_the_lag_bound(block: Block) -> None:
    block.send(1)
    block.start(deadline_s=10.0, lag_bound=0.03)
    started = time.perf_counter()
    assert block.gather.run(block.master.fileno()) == GatherEnd.TIME
    assert time.perf_counter() - started < 1.0


def test_a_lost_datagram_is_replaced_by_its_parity_copy_and_copies_of_a_partial_in_are_left_unread(
        block: Block) -> None:
    header = Header(MsgType.PARTIAL, *Block.KEY, 2, codec=Codec.F32, tokens=1)
    _lost, *copies = fragment(header, block.parts[2], KEY, 65507, parity=2)
    for d in copies:  # the data datagram was lost: its first parity copy stands in, the second is needless
        block.node.sendto(d, block.master.getsockname())
    block.send(1, parity=2)
    block.send(3)
    block.start()
    assert block.gather.run(block.master.fileno()) == GatherEnd.WHOLE
    assert block.gather.g.from_parity == 1
    time.sleep(0.01)
    assert block.gather.g.skipped >= 1


@pytest.mark.parametrize(("codec", "lost", "parity"), [(Codec.F32, (), 0), (Codec.F32, (1,), 2),
                                                      (Codec.F16, (0, 2), 2), (Codec.Q8, (3,), 1),
                                                      (Codec.F32, (0, "p0"), 2)])
def test_gather_joins_fragments_and_rebuilds_lost_ones_from_their_parity(block: Block, codec: Codec,
                                                                         lost: tuple, parity: int) -> None:
    """Partials cut at a 400-byte path (a lossy link's, as wire.fragment cuts them): joined, what was lost rebuilt
    from the parity, each decoded as the Python path decodes it."""
    rng = np.random.default_rng(5)
    block.parts = {i: rng.standard_normal(Block.HIDDEN * 16).astype(np.float32) for i in (1, 2, 3)}
    for node in (1, 2, 3):
        header = Header(MsgType.PARTIAL, *Block.KEY, node, codec=codec, tokens=1)
        datagrams = fragment(header, block.parts[node], KEY, 400, parity=parity)
        count = len(datagrams) - parity
        assert count >= 4
        gone = {count + int(f[1:]) if isinstance(f, str) else f for f in lost} if node == 2 else set()
        for i, d in enumerate(datagrams):
            if i not in gone:
                block.node.sendto(d, block.master.getsockname())
    block.gather.start(Block.KEY, [1, 2, 3], Block.HIDDEN * 16, time.perf_counter() + 2, None, 0.0, [], join=True)
    assert block.gather.run(block.master.fileno()) == GatherEnd.WHOLE
    assert block.gather.g.from_parity == (1 if lost else 0)
    for i, node in enumerate((1, 2, 3)):
        expected = wire.decode_vector(wire.encode_vector(block.parts[node], codec), codec, Block.HIDDEN * 16)
        assert np.array_equal(block.gather.buffer[i], expected)


def test_every_fragment_of_a_vector_too_long_to_join_here_comes_back(block: Block) -> None:
    """A partial cut at a jumbo path (fragments of 8940 bytes, more than the native path keeps for a rebuild): both
    fragments go to the Python path, the short last one too (taken alone, it left the Python path's reassembly
    without it)."""
    header = Header(MsgType.PARTIAL, *Block.KEY, 1, codec=Codec.F32, tokens=1)
    datagrams = fragment(header, np.ones(2735, np.float32), KEY, 9000, parity=1)
    assert len(datagrams) == 3 and len(open_packet(datagrams[1], KEY)[1]) == 4 * 500
    for d in datagrams:
        block.node.sendto(d, block.master.getsockname())
    block.gather.start(Block.KEY, [1, 2, 3], 2735, time.perf_counter() + 2, None, 0.0, [], join=True)
    handed = []
    for _ in datagrams:
        assert block.gather.run(block.master.fileno()) == GatherEnd.OTHER
        handed.append(open_packet(block.gather.handed_back()[0], KEY)[0].frag_index)
    assert handed == [0, 1, 2] and block.gather.g.outstanding == 3


def test_a_partial_that_lost_more_fragments_than_its_parity_mends_stays_out(block: Block) -> None:
    block.parts = {i: np.full(Block.HIDDEN * 16, float(i), np.float32) for i in (1, 2, 3)}
    for node in (1, 2, 3):
        header = Header(MsgType.PARTIAL, *Block.KEY, node, codec=Codec.F32, tokens=1)
        datagrams = fragment(header, block.parts[node], KEY, 400, parity=1)
        for i, d in enumerate(datagrams):
            if node != 3 or i not in range(5):  # node 3 lost five data fragments; its parity mends four at most
                block.node.sendto(d, block.master.getsockname())
    block.gather.start(Block.KEY, [1, 2, 3], Block.HIDDEN * 16, time.perf_counter() + 0.05, None, 0.0, [], join=True)
    assert block.gather.run(block.master.fileno()) == GatherEnd.TIME
    assert math.isnan(block.gather.arrived[2]) and block.gather.g.outstanding == 1
    assert not math.isnan(block.gather.arrived[0]) and not math.isnan(block.gather.arrived[1])


@pytest.mark.parametrize("awaited", [False, True], ids=["block-before-whole", "block-before-awaited"])
def test_parity_copies_of_an_earlier_block_are_left_unread_unless_it_is_awaited(fast: FastPath, block: Block,
                                                                                awaited: bool) -> None:
    header = Header(MsgType.PARTIAL, 5, 16, 3, 1, 1, codec=Codec.F32, tokens=1)
    for copy in fragment(header, block.parts[1], KEY, 65507, parity=2)[1:]:
        block.node.sendto(copy, block.master.getsockname())
    for node in (1, 2, 3):
        block.send(node)
    block.gather.start(Block.KEY, [1, 2, 3], Block.HIDDEN, time.perf_counter() + 2, None, 0.0, [],
                       skip_old_parity=not awaited)
    if awaited:  # the block before misses a partial: its copies go to the Python path (they teach a lag)
        assert block.gather.run(block.master.fileno()) == GatherEnd.OTHER
        assert open_packet(block.gather.handed_back()[0], KEY)[0].position == 16
    else:
        assert block.gather.run(block.master.fileno()) == GatherEnd.WHOLE
        assert block.gather.g.skipped == 2


@pytest.mark.parametrize("what", ["fragment", "other block", "forged", "misfit"])
def test_what_the_native_path_does_not_take_comes_back_whole(block: Block, what: str) -> None:
    if what == "fragment":  # a partial of several datagrams: reassembled by the Python path
        block.send(1, datagram_bytes=200)
    elif what == "other block":
        block.send(1, key=(5, 16, 3, 1))
    elif what == "forged":
        header = Header(MsgType.PARTIAL, *Block.KEY, 1, codec=Codec.F32, tokens=1)
        forged = bytearray(fragment(header, block.parts[1], KEY, 65507)[0])
        forged[40] ^= 1
        block.node.sendto(bytes(forged), block.master.getsockname())
    else:
        block.send(1, size=Block.HIDDEN + 1)
    block.start()
    assert block.gather.run(block.master.fileno()) == GatherEnd.OTHER
    data, at, addr = block.gather.handed_back()
    assert addr[1] == block.node.getsockname()[1] and at <= time.perf_counter()
    assert block.gather.g.outstanding == 3
    if what == "forged":
        with pytest.raises(wire.BadMac):
            open_packet(data, KEY)
    else:
        assert open_packet(data, KEY)[0].type == MsgType.PARTIAL


def test_a_watched_stream_with_data_ends_the_gather(block: Block) -> None:
    a, b = socket.socketpair()
    try:
        b.send(b"x")
        block.gather.start(Block.KEY, [1, 2, 3], Block.HIDDEN, time.perf_counter() + 5, None, 0.0, [a.fileno()])
        assert block.gather.run(block.master.fileno()) == GatherEnd.STREAM
    finally:
        a.close()
        b.close()
