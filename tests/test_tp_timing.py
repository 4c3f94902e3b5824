"""Loss handling inside the tensor-parallel engines, without a cluster: the adaptive timeout's
estimators, and a node that misses an attention input keeping its KV cache whole."""

from __future__ import annotations

import contextlib
import dataclasses
import socket

import numpy as np
import pytest

from edgerun.model.loader import Model, load_model
from edgerun.net.wire import Block, Codec, Header, MsgType, Reassembly, derive_key, fragment, open_packet
from edgerun.tp.messages import Assign, Fetch, Input, Message, Partial, Routes
from edgerun.tp.node import Node, NodeConfig
from edgerun.tp.shard import Shard, ShardSpec, full_spec
from edgerun.tp.timeouts import ArrivalEstimator, Timeouts

KEY = derive_key("timing")


def test_arrival_estimator_follows_rfc6298() -> None:
    e = ArrivalEstimator()
    assert e.bound(4) is None
    e.observe(0.010)
    assert e.mean == pytest.approx(0.010) and e.deviation == pytest.approx(0.005)
    e.observe(0.020)
    # deviation += (|20 - 10| - 5) / 4; mean += (20 - 10) / 8
    assert e.deviation == pytest.approx(0.00625) and e.mean == pytest.approx(0.01125)
    assert e.bound(4) == pytest.approx(0.01125 + 4 * 0.00625)
    assert e.bound(0) == pytest.approx(1.25 * 0.020)  # never below the slowest recent sample, with a margin


def test_arrival_estimator_keeps_a_heavy_tail() -> None:
    """One arrival in fifty is ten times slower (a descheduled process): mean plus four deviations
    would cut it off; the bound covers it for as long as it is among the recent samples."""
    e = ArrivalEstimator(window=100)
    for i in range(100):
        e.observe(0.010 if i % 50 == 10 else 0.001)
    assert e.mean + 4 * e.deviation < 0.010
    assert e.bound(4) == pytest.approx(0.0125)
    for _ in range(100):  # the slow ones leave the window
        e.observe(0.001)
    assert e.bound(4) == pytest.approx(0.00125)


def test_timeouts_fixed_warmup_and_lag() -> None:
    fixed = Timeouts(0.010)
    steady = [ArrivalEstimator() for _ in range(2)]
    for e in steady:
        for _ in range(10):
            e.observe(0.004)
    assert fixed.after_send(steady) == 0.010 and fixed.after_first(steady) is None
    adaptive = Timeouts(None)
    cold = ArrivalEstimator()
    assert adaptive.after_send([cold]) == adaptive.initial_s  # until every participant has samples
    assert adaptive.after_first([cold]) is None
    # Steady arrivals converge on their time; the floor keeps the timer above its resolution.
    assert adaptive.after_send(steady) == pytest.approx(0.004, abs=0.002)
    lags = ArrivalEstimator()
    for _ in range(10):
        lags.observe(0.0)
    assert adaptive.after_first([lags]) == adaptive.floor_s
    # The slowest participant sets the bound, and fewer deviations give a tighter one.
    jittery = ArrivalEstimator()
    for t in (0.004, 0.012) * 5:
        jittery.observe(t)
    assert adaptive.after_send([*steady, jittery]) > adaptive.after_send(steady)
    assert Timeouts(None, deviations=1).after_send([jittery]) < adaptive.after_send([jittery])


class _Recorder:
    """Stands in for the node's TCP channel: records what the node sends."""

    def __init__(self) -> None:
        self.sent: list[Message] = []

    def send(self, message: Message) -> None:
        self.sent.append(message)

    def frame(self, message: Message) -> Message:  # a frame made once for several streams: here the message
        return message

    def send_frame(self, frame: Message) -> None:
        self.sent.append(frame)

    def set_rto_min(self, ms: float | None) -> bool:
        return True


def assignment(n_layers: int, spec: ShardSpec, codec: Codec, master_udp_port: int) -> Assign:
    """Session 5's share for node 1, with --transport udp's routes."""
    return Assign(5, 1, spec, 64, codec, Routes.for_transport("udp", n_layers), master_udp_port, None, 0, 1472)


def _assigned_node(model: Model) -> tuple[Node, socket.socket, ShardSpec]:
    """A node holding every unit of `model` in float32 (session 5, `assignment`), its TCP channel a recorder, its
    master's UDP port a socket of this process (the sink); and the spec."""
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # the "master's" UDP port
    sink.bind(("127.0.0.1", 0))
    node = Node(NodeConfig(("127.0.0.1", 9), "t", 100.0, 1e9), model, KEY)
    node.channel = _Recorder()
    c = model.config
    spec = full_spec(c, group_size=128)
    node._assign(assignment(c.n_layers, spec, Codec.F32, sink.getsockname()[1]), spec,
                 Shard(c, model.weights, spec, 64))
    return node, sink, spec


def test_node_fetches_a_lost_attention_input_and_keeps_its_cache_whole(tiny_spec, synth_gguf) -> None:
    """Decode step at position 3: the UDP input of layer 1's attention never arrives. When the next
    input (layer 1's MLP) comes, the node asks for it over TCP; the fetched input fills the cache
    (no output: it would be too late); the cache then equals that of a shard that saw every input,
    and the next step computes layer 1's attention normally."""
    model = load_model(synth_gguf(tiny_spec(tied=False)))
    c = model.config
    node, sink, spec = _assigned_node(model)
    reference = Shard(c, model.weights, spec, 64)
    rng = np.random.default_rng(0)

    def tcp_input(position: int, layer: int, block: Block, x: np.ndarray) -> None:
        node._control(Input(5, position, layer, block, None, x.astype("<f4").tobytes()))

    def udp_input(position: int, layer: int, block: Block, x: np.ndarray) -> None:
        header = Header(MsgType.ACTIVATION, 5, position, layer, block, 0, tokens=1)
        for datagram in fragment(header, x.reshape(-1), KEY):
            node._on_datagram(*open_packet(datagram, KEY), ("127.0.0.1", 0))

    prefill = rng.standard_normal((3, c.hidden)).astype(np.float32)
    for layer in range(c.n_layers):  # prefill goes over TCP
        tcp_input(0, layer, Block.ATTN, prefill)
        reference.attention(layer, prefill, 0)
    step = [rng.standard_normal((1, c.hidden)).astype(np.float32) for _ in range(c.n_layers)]
    tcp_input(3, 0, Block.ATTN, step[0])  # the first layer is reliable
    reference.attention(0, step[0], 3)
    assert not any(isinstance(m, Fetch) for m in node.channel.sent)
    udp_input(3, 1, Block.MLP, step[1])  # layer 1's attention input was lost: this reveals it
    fetches = [m for m in node.channel.sent if isinstance(m, Fetch)]
    assert fetches == [Fetch(5, 3, 1, Block.ATTN)]
    assert node.shard.lengths[1] == 3
    tcp_input(3, 1, Block.ATTN, step[1])  # the master's reply
    reference.attention(1, step[1], 3)
    assert node.shard.lengths == [4] * c.n_layers
    for layer in range(c.n_layers):
        np.testing.assert_array_equal(node.shard.attn[layer].k[:, :4], reference.attn[layer].k[:, :4])
        np.testing.assert_array_equal(node.shard.attn[layer].v[:, :4], reference.attn[layer].v[:, :4])
    # The next step's attention of layer 1 arrives by UDP and is computed and answered at once.
    sink.settimeout(2.0)
    while True:  # drain what the node answered so far
        sink.setblocking(False)
        try:
            sink.recv(65536)
        except BlockingIOError:
            break
    sink.settimeout(2.0)
    udp_input(4, 1, Block.ATTN, rng.standard_normal((1, c.hidden)).astype(np.float32))
    header, _ = open_packet(sink.recv(65536), KEY)
    assert (header.type, header.position, header.layer, header.block) == (MsgType.PARTIAL, 4, 1, Block.ATTN)
    assert node.shard.lengths[1] == 5
    node.udp.close()
    node.net.stop()
    sink.close()


def test_node_answers_a_mirrored_block_once_over_both_channels(tiny_spec, synth_gguf) -> None:
    """With --transport udp a decode step's first layer and LM head come over TCP and UDP both. The node
    computes the stateless MLP once, whichever copy lands first, and answers over both channels, the UDP
    copy in f32 like the TCP one whatever the cluster's codec; lossy layers are answered over UDP alone."""
    model = load_model(synth_gguf(tiny_spec(tied=False)))
    c = model.config
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    sink.settimeout(2.0)
    node = Node(NodeConfig(("127.0.0.1", 9), "t", 100.0, 1e9), model, KEY)
    node.channel = _Recorder()
    spec = full_spec(c, group_size=128)
    node._assign(assignment(c.n_layers, spec, Codec.Q8, sink.getsockname()[1]), spec, Shard(c, model.weights, spec, 64))
    x = np.random.default_rng(1).standard_normal((1, c.hidden)).astype(np.float32)
    expected = Shard(c, model.weights, spec, 64).mlp(0, x)
    header = Header(MsgType.ACTIVATION, 5, 0, 0, Block.MLP, 0, codec=Codec.F32, tokens=1)
    for datagram in fragment(header, x.reshape(-1), KEY):  # the UDP copy first
        node._on_datagram(*open_packet(datagram, KEY), ("127.0.0.1", 0))
    node._control(Input(5, 0, 0, Block.MLP, None, x.astype("<f4").tobytes()))  # then the TCP copy: already done
    partials = [m for m in node.channel.sent if isinstance(m, Partial)]
    assert [(p.session, p.position, p.layer, p.block) for p in partials] == [(5, 0, 0, Block.MLP)]
    np.testing.assert_array_equal(np.frombuffer(partials[0].vector, "<f4"), expected.reshape(-1))
    reply = Reassembly(c.hidden)
    while not reply.complete:
        h, payload = open_packet(sink.recv(65536), KEY)
        assert (h.type, h.layer, h.block, h.codec) == (MsgType.PARTIAL, 0, Block.MLP, Codec.F32)
        reply.add(h, payload)
    np.testing.assert_array_equal(reply.vector, expected.reshape(-1))
    sink.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:  # the parity fragment, if any: no second answer follows
            h, _ = open_packet(sink.recv(65536), KEY)
            assert h.frag_index == h.frag_count
    lossy = Header(MsgType.ACTIVATION, 5, 0, 1, Block.MLP, 0, codec=Codec.Q8, tokens=1)
    for datagram in fragment(lossy, x.reshape(-1), KEY):
        node._on_datagram(*open_packet(datagram, KEY), ("127.0.0.1", 0))
    assert len([m for m in node.channel.sent if isinstance(m, Partial)]) == 1  # no TCP copy for a lossy layer
    sink.settimeout(2.0)
    h, _ = open_packet(sink.recv(65536), KEY)
    assert (h.layer, h.codec) == (1, Codec.Q8)
    node.udp.close()
    node.net.stop()
    sink.close()


def test_a_node_answers_a_prompt_on_both_streams_once_the_master_uses_its_spare(tiny_spec, synth_gguf) -> None:
    """Assign.spare_stream: a prompt's inputs over a lossy link come on both of a node's streams. The node computes
    each block once, whichever copy is whole first, and sends its partial on both streams once an input has come
    on its spare; before that, and for one-token steps, on the first stream alone."""
    model = load_model(synth_gguf(tiny_spec(tied=False)))
    c = model.config
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    node = Node(NodeConfig(("127.0.0.1", 9), "t", 100.0, 1e9), model, KEY)
    node.channel, node.spare = _Recorder(), _Recorder()  # the spare as if opened after an earlier assignment
    spec = full_spec(c, group_size=128)
    assign = dataclasses.replace(assignment(c.n_layers, spec, Codec.F32, sink.getsockname()[1]), spare_stream=True)
    node._assign(assign, spec, Shard(c, model.weights, spec, 64))
    reference = Shard(c, model.weights, spec, 64)
    rng = np.random.default_rng(2)
    prompt = [rng.standard_normal((3, c.hidden)).astype(np.float32) for _ in range(2)]

    def send(x: np.ndarray, layer: int, block: Block, position: int = 0) -> Input:
        return Input(5, position, layer, block, None, x.astype("<f4").tobytes())

    def partials(channel: _Recorder) -> list[tuple[int, int, Block]]:
        return [(m.position, m.layer, m.block) for m in channel.sent if isinstance(m, Partial)]

    node._control(send(prompt[0], 0, Block.ATTN))  # before the master uses the spare: one copy back
    assert partials(node.channel) == [(0, 0, Block.ATTN)] and partials(node.spare) == []
    node.spare_used = True  # what the spare stream's reader sets when an input comes on it (Node._serve_spare)
    node._control(send(prompt[1], 0, Block.MLP))  # the spare's copy first ...
    node._control(send(prompt[1], 0, Block.MLP))  # ... then the first stream's: computed already
    node._control(send(prompt[0], 1, Block.ATTN))
    node._control(send(prompt[0], 1, Block.ATTN))  # a second copy of an attention input: its keys are cached
    assert partials(node.channel) == [(0, 0, Block.ATTN), (0, 0, Block.MLP), (0, 1, Block.ATTN)]
    assert partials(node.spare) == [(0, 0, Block.MLP), (0, 1, Block.ATTN)]
    assert node.shard.lengths[:2] == [3, 3]
    reference.attention(0, prompt[0], 0)
    expected = reference.mlp(0, prompt[1])
    sent = next(m for m in node.spare.sent if isinstance(m, Partial) and m.block == Block.MLP)
    np.testing.assert_array_equal(np.frombuffer(sent.vector, "<f4"), expected.reshape(-1))
    node._control(send(prompt[1][:1], 0, Block.MLP, position=3))  # a one-token step (mirrored): first stream only
    assert partials(node.channel)[-1] == (3, 0, Block.MLP)
    assert partials(node.spare) == [(0, 0, Block.MLP), (0, 1, Block.ATTN)]
    node.udp.close()
    node.net.stop()
    sink.close()


@pytest.mark.parametrize("idle_spin", [False, True])
def test_a_spinning_socket_holds_its_reader_only_where_told(idle_spin: bool) -> None:
    """--spin-us: a node's socket (idle_spin) keeps reading after a datagram, so one that comes 20 ms later is
    handled in the same call (up to MAX_SPIN_S, when the loop's timers get their turn); a master's returns at once:
    its event loop runs the step being generated, which a reader spinning after a stray datagram held up for the
    whole spin (2-3x slower tokens on the device)."""
    import threading
    import time

    from edgerun.net.channel import Counters, DatagramSocket
    from edgerun.net.wire import seal

    got: list[int] = []
    reader = DatagramSocket("127.0.0.1", KEY, Counters(), lambda header, _, __: got.append(header.position),
                            spin_s=2.0, idle_spin=idle_spin)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        def send(position: int) -> None:
            header = Header(MsgType.ACTIVATION, 1, position, 0, Block.ATTN, 0, tokens=1)
            sender.sendto(seal(header, b"\0" * 4, KEY), ("127.0.0.1", reader.port))

        send(0)
        time.sleep(0.05)  # in the socket's queue
        later = threading.Timer(0.02, send, (1,))
        later.start()
        reader.read_all()
        later.join()
        assert got == ([0, 1] if idle_spin else [0])
    finally:
        sender.close()
        reader.close()


def test_a_prompt_block_marks_a_stream_that_sends_segments_again_lossy(tiny_spec, synth_gguf) -> None:
    """A prompt crosses TCP, where loss shows only as segments sent again: after a prompt's block, a node whose first
    stream sent again LOSSY_RESENT segments and LOSSY_RESENT_SHARE of those it sent since the last look is on a lossy
    link (parity on, and its next prompt blocks on its spare too); a stray few now and then are not."""
    from edgerun.net.channel import Counters
    from edgerun.tp.config import MasterConfig
    from edgerun.tp.exchange import LOSSY_RESENT, LOSSY_RESENT_SHARE, BlockExchange
    from edgerun.tp.membership import NodeConn
    from edgerun.tp.messages import ParityOn

    class Stream(_Recorder):
        counts = (0, 0)

        def segments(self) -> tuple[int, int]:
            return self.counts

    model = load_model(synth_gguf(tiny_spec()))
    said: list[str] = []
    exchange = BlockExchange(model.config, KEY, MasterConfig(), None, None, Counters(), said.append)
    node = NodeConn(1, "n", Stream(), "127.0.0.1", 9, 100.0, 1e9, segments=(1000, 1))
    block = int(LOSSY_RESENT / LOSSY_RESENT_SHARE)  # segments a block sends, at which LOSSY_RESENT is the share
    looks = [((1000 + block, 1), False),  # none again
             ((1000 + 2 * block, LOSSY_RESENT), False),  # 7 in a block: a stray few
             ((1000 + 2 * block + 4 * block, 2 * LOSSY_RESENT), False),  # 8 of many more sent: under the share
             ((1000 + 7 * block, 3 * LOSSY_RESENT), True)]  # 8 of a block's
    for counts, lossy in looks:
        node.channel.counts = counts
        exchange._watch_streams([node])
        assert node.lossy == lossy, counts
    assert node.parity == MasterConfig().parity and node.channel.sent == [ParityOn(node.parity)] and said
    node.segments = None  # a stream whose kernel does not count: nothing is judged
    node.lossy, node.channel.sent = False, []
    exchange._watch_streams([node])
    assert not node.lossy and node.channel.sent == []


def test_segments_sent_again_for_a_late_acknowledgement_are_not_loss() -> None:
    """resent_segments: segments sent again less those the receiver reported it already had (DSACK), where the
    kernel's tcp_info counts them; the plain count on a kernel whose tcp_info stops before. A real loopback stream
    reads as data sent and nothing lost."""
    import socket
    import struct

    from edgerun.net.channel import (
        TCP_INFO_BYTES,
        TCP_INFO_DATA_OUT_AT,
        TCP_INFO_DSACK_AT,
        TCP_INFO_DSACK_BYTES,
        TCP_INFO_RESENT_AT,
        resent_segments,
    )

    info = bytearray(TCP_INFO_DSACK_BYTES)
    struct.pack_into("<I", info, TCP_INFO_DATA_OUT_AT, 500)
    struct.pack_into("<I", info, TCP_INFO_RESENT_AT, 12)
    struct.pack_into("<I", info, TCP_INFO_DSACK_AT, 9)
    assert resent_segments(bytes(info)) == (500, 3)  # 9 of 12 arrived twice: 3 were lost
    assert resent_segments(bytes(info[:TCP_INFO_BYTES])) == (500, 12)  # no DSACK count: every one
    assert resent_segments(bytes(info[:TCP_INFO_BYTES - 1])) is None
    struct.pack_into("<I", info, TCP_INFO_DSACK_AT, 20)  # never below none
    assert resent_segments(bytes(info)) == (500, 0)
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        peer, _ = server.accept()
        with peer:
            for _ in range(20):
                client.sendall(b"x" * 4000)
                peer.recv(65536)
            sent, lost = resent_segments(client.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO,
                                                           TCP_INFO_DSACK_BYTES))
    assert sent >= 20 and lost == 0


def test_a_prompt_copy_goes_only_where_the_link_carries_it_quickly() -> None:
    """SPARE_COPY_MAX_S: a second copy shares the link with the first. A 70-token vector of a 1B model (573 KB)
    crosses a 10 Gbit/s link in under half a millisecond (worth a copy against a retransmission timer) and a
    100 Mbit/s one in 46 ms (not); a link not measured is taken as fast."""
    from edgerun.sched.profiles import Link
    from edgerun.tp.exchange import _copy_pays
    from edgerun.tp.membership import NodeConn

    node = NodeConn(1, "n", _Recorder(), "127.0.0.1", 9, 100.0, 1e9)
    vector = 70 * 2048 * 4
    assert _copy_pays(node, vector)
    node.link = Link(0.2, 10_000.0, 10_000.0, 0.05)
    assert _copy_pays(node, vector)
    node.link = Link(0.2, 10_000.0, 100.0, 0.05)  # the slower way sets it
    assert not _copy_pays(node, vector)


def test_a_nodes_parity_goes_from_the_send_thread_once_its_data_is_sent(tiny_spec, synth_gguf) -> None:
    """BlockExchange._send_datagrams: every node's data fragments from the caller, in node order, before it
    returns; each node's parity fragments from the send thread, handed over after that node's data (so after it on
    the wire), in their order; a node of less parity gets only its first ones, a clean link none."""
    import threading

    from edgerun.net.channel import Counters
    from edgerun.tp.config import MasterConfig
    from edgerun.tp.exchange import BlockExchange
    from edgerun.tp.membership import NodeConn

    class Udp:
        def __init__(self) -> None:
            self.sent: list[tuple[int, int, bool]] = []  # (port, fragment index, from the caller's thread)
            self.lock = threading.Lock()

        def send_all(self, datagrams: list[bytes], address: tuple[str, int]) -> None:
            caller = threading.current_thread() is threading.main_thread()
            with self.lock:
                self.sent += [(address[1], open_packet(d, KEY)[0].frag_index, caller) for d in datagrams]

    model = load_model(synth_gguf(tiny_spec()))
    udp = Udp()
    exchange = BlockExchange(model.config, KEY, MasterConfig(), udp, None, Counters(), print)
    nodes = [NodeConn(i, f"n{i}", _Recorder(), "127.0.0.1", port, 100.0, 1e9) for i, port in enumerate((1, 2, 3), 1)]
    for node, parity in zip(nodes, (2, 1, 0), strict=True):
        node.parity, node.datagram_bytes = parity, 512
    x = np.random.default_rng(0).standard_normal((1, 600)).astype(np.float32)  # two fragments of 512 bytes in q8
    exchange._send_datagrams(nodes, (1, 0, 1, int(Block.MLP)), x, None, Codec.Q8)
    with udp.lock:
        data = [(port, index) for port, index, caller in udp.sent if caller]
    assert data == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]  # all of it before the call returned
    exchange.sender.flush()
    parity = [(port, index) for port, index, caller in udp.sent if not caller]
    # a two-fragment vector takes one more than its link's parity (wire.parity_fragments): 3, 2 and none
    assert sorted(parity) == [(1, 2), (1, 3), (1, 4), (2, 2), (2, 3)]
    assert parity.index((1, 2)) < parity.index((1, 3)) < parity.index((1, 4))
    for port, index in parity:  # each after its node's data
        assert udp.sent.index((port, index, False)) > udp.sent.index((port, 1, True))
    assert exchange.sender.thread.is_alive()
    exchange.close()
    assert exchange.sender is None


def test_the_parity_of_a_partial_already_whole_is_left_unread_before_its_mac(tiny_spec, synth_gguf) -> None:
    """BlockExchange.needless over a real DatagramSocket: a parity fragment of a partial already whole (of the
    block in merge, the block merged last, or an older one) is left unread before its MAC is checked; one that may
    still complete a partial, or teach a late one's lag, and every data fragment are authenticated and handed on."""
    import asyncio
    import select

    from edgerun.net.channel import Counters, DatagramSocket
    from edgerun.tp.config import MasterConfig
    from edgerun.tp.exchange import BlockExchange, _Wait

    model = load_model(synth_gguf(tiny_spec()))
    counters = Counters()
    exchange = BlockExchange(model.config, KEY, MasterConfig(), None, None, counters, print)
    loop = asyncio.new_event_loop()
    now, last, older = (1, 5, 2, int(Block.MLP)), (1, 5, 2, int(Block.ATTN)), (1, 4, 2, int(Block.MLP))

    def waiting(key: tuple[int, int, int, int], whole: int) -> _Wait:
        w = _Wait(key, {1: None, 2: None}, {1: 8, 2: 8}, loop.create_future(), 0.0, 2, 1)
        w.arrived[whole] = 0.001
        return w

    exchange.wait, exchange.merged = waiting(now, whole=1), waiting(last, whole=2)
    x = np.random.default_rng(0).standard_normal(8).astype(np.float32)

    def datagrams(key: tuple[int, int, int, int], node: int) -> list[bytes]:  # data, then its parity copy
        return fragment(Header(MsgType.PARTIAL, *key, node, tokens=1), x, KEY, parity=1)

    assert exchange.needless(datagrams(now, 1)[1])  # node 1's partial is whole
    assert not exchange.needless(datagrams(now, 2)[1])  # node 2's may yet come from it
    assert exchange.needless(datagrams(last, 2)[1])
    assert not exchange.needless(datagrams(last, 1)[1])  # a late partial still teaches its node's lag
    assert exchange.needless(datagrams(older, 1)[1]) and exchange.needless(datagrams(older, 2)[1])
    assert not any(exchange.needless(datagrams(key, node)[0]) for key in (now, last, older) for node in (1, 2))

    handed: list[tuple[int, int]] = []
    receiver = DatagramSocket("127.0.0.1", KEY, counters, lambda h, p, a: handed.append((h.node, h.frag_index)),
                              needless=exchange.needless)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def forged(datagram: bytes) -> bytes:
        return datagram[:-1] + bytes([datagram[-1] ^ 1])

    sent = [forged(datagrams(now, 1)[1]),  # needless: left unread, so its bad MAC is never seen
            forged(datagrams(now, 2)[1]),  # needed: checked, refused
            datagrams(now, 2)[1],  # needed and authentic: handed on
            datagrams(now, 1)[0]]  # data: handed on
    for datagram in sent:
        sender.sendto(datagram, ("127.0.0.1", receiver.port))
    poller = select.poll()
    poller.register(receiver.sock.fileno(), select.POLLIN)
    read = 0
    while read < len(sent) and poller.poll(2000):
        read += receiver.read_waiting()
    assert read == len(sent)
    assert receiver.skipped == 1 and counters.rejected == {"bad": 1} and handed == [(2, 1), (1, 0)]
    sender.close()
    receiver.close()
    loop.close()


def test_a_node_leaves_the_parity_of_an_input_it_holds_whole_unread(tiny_spec, synth_gguf) -> None:
    """Node._needless: a parity fragment of an input whole or computed (a stateless block's, or an attention input
    already in the KV cache) is left unread; one of an input still missing fragments, another session's, and
    every data fragment are read."""
    model = load_model(synth_gguf(tiny_spec(tied=False)))
    c = model.config
    node, sink, _ = _assigned_node(model)
    rng = np.random.default_rng(0)

    def datagrams(session: int, position: int, layer: int, block: Block, mtu: int = 1472) -> list[bytes]:
        header = Header(MsgType.ACTIVATION, session, position, layer, block, 0, tokens=1)
        return fragment(header, rng.standard_normal(c.hidden).astype(np.float32), KEY, mtu, parity=1)

    mlp = datagrams(5, 0, 1, Block.MLP)
    assert not node._needless(mlp[-1])  # nothing of it yet: its parity may be what completes it
    node._on_datagram(*open_packet(mlp[0], KEY), ("127.0.0.1", 0))
    assert node.inputs[(5, 0, 1, int(Block.MLP))].done
    assert node._needless(mlp[-1]) and not node._needless(mlp[0])
    attn = datagrams(5, 0, 0, Block.ATTN)
    node._on_datagram(*open_packet(attn[0], KEY), ("127.0.0.1", 0))
    assert node.shard.lengths[0] == 1 and (5, 0, 0, int(Block.ATTN)) not in node.inputs  # cached, record gone
    assert node._needless(attn[-1])
    assert not node._needless(datagrams(5, 1, 0, Block.ATTN)[-1])  # the next position's: not yet
    assert not node._needless(datagrams(4, 0, 0, Block.ATTN)[-1])  # another session's: read (and refused)
    split = datagrams(5, 0, 1, Block.ATTN, mtu=256)  # several fragments, one of them here
    node._on_datagram(*open_packet(split[0], KEY), ("127.0.0.1", 0))
    assert not node._needless(split[-1])
    node.udp.close()
    node.net.stop()
    sink.close()


def test_a_partial_that_comes_after_its_block_was_merged_leaves_its_link_clean(tiny_spec, synth_gguf) -> None:
    """A block merged without a node's partial is judged (BlockExchange.settle) only after what came since is read:
    a partial that was late, not lost, completes the block's record, teaches its node's lag and keeps its link clean
    (no parity, no prompt copies); a node of which nothing came is on a lossy link, parity on from then on."""
    import asyncio

    from edgerun.net.channel import Counters, DatagramSocket
    from edgerun.tp.config import MasterConfig
    from edgerun.tp.exchange import BlockExchange, _Wait
    from edgerun.tp.membership import NodeConn
    from edgerun.tp.messages import ParityOn

    model = load_model(synth_gguf(tiny_spec()))
    counters = Counters()
    config = dataclasses.replace(MasterConfig(), timeout_ms=None)  # adaptive: lags are learnt
    exchange = BlockExchange(model.config, KEY, config, None, None, counters, print)
    exchange.datagrams = DatagramSocket("127.0.0.1", KEY, counters,
                                        lambda h, p, a: exchange.on_datagram(h, p), needless=exchange.needless)
    nodes = [NodeConn(i, f"n{i}", _Recorder(), "127.0.0.1", 9, 100.0, 1e9) for i in (1, 2, 3)]
    loop = asyncio.new_event_loop()
    key = (1, 5, 2, int(Block.MLP))
    hidden = model.config.hidden
    w = _Wait(key, {1: None, 2: None, 3: None}, dict.fromkeys((1, 2, 3), hidden), loop.create_future(), 0.0, 3, 1,
              nodes={n.index: n for n in nodes})
    w.arrive(1, at=0.002)  # node 1's partial came in time; 2 and 3 had not when the deadline passed
    exchange.merged, exchange.unaccounted = w, (w, nodes, False, 0.01, 0.0)
    x = np.random.default_rng(0).standard_normal(hidden).astype(np.float32)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    late = fragment(Header(MsgType.PARTIAL, *key, 2, tokens=1), x, KEY)[0]
    sender.sendto(late, ("127.0.0.1", exchange.datagrams.port))  # loopback delivers within the send call
    exchange.settle()
    assert exchange.stats.blocks == 1 and exchange.stats.blocks_incomplete == 1  # merged without two partials
    assert 2 in w.arrived and w.late == {2} and nodes[1].lag.samples == 1  # late: its lag is learnt
    assert not nodes[1].lossy and nodes[1].channel.sent == []  # ... and its link stays clean
    assert nodes[2].lossy and nodes[2].channel.sent == [ParityOn(config.parity)]  # nothing came: lost
    assert not nodes[0].lossy
    sender.close()
    exchange.datagrams.close()
    loop.close()


def test_a_runner_block_counted_in_the_heads_slack_leaves_the_head_in_merge(tiny_spec, synth_gguf) -> None:
    """The native runner's last blocks are counted while the LM head's nodes compute (settle, from the head's
    `run`): one merged without a partial is counted as incomplete, and the head stays the block in merge, so that
    its partials that come through the Python path (fragments, a resend, the stream) still find it (a head that lost
    its record waited for ever: 8 devices, 5% kernel loss)."""
    from types import SimpleNamespace

    from edgerun.net.channel import Counters
    from edgerun.tp.config import MasterConfig
    from edgerun.tp.exchange import BlockExchange, _Wait
    from edgerun.tp.membership import NodeConn

    model = load_model(synth_gguf(tiny_spec()))
    hidden = model.config.hidden
    exchange = BlockExchange(model.config, KEY, MasterConfig(), None, None, Counters(), print)
    node = NodeConn(1, "n", _Recorder(), "127.0.0.1", 9, 100.0, 1e9)
    # the runner merged layer 1's attention without the node's partial (its deadline passed)
    record = SimpleNamespace(sent=1.0, computed=1.002, own_s=0.001, merged=1.004, after_send=0.003, skipped=0,
                             outstanding=1, mirrored=0, from_parity=0)
    exchange.runner = SimpleNamespace(r=SimpleNamespace(next=1), records=[record], inputs=np.ones((1, hidden)),
                                      arrived=np.full((1, 1), np.nan), parts=np.zeros((1, hidden), np.float32),
                                      blocks=[SimpleNamespace(layer=1, block=int(Block.ATTN), mirrored=False)])
    exchange.datagrams = SimpleNamespace(read_waiting=lambda: None, skipped=0)
    exchange.udp = SimpleNamespace(sent=0)
    head = _Wait((0, 5, 0, int(Block.HEAD)), {1: None}, {1: 8}, None, 1.01, 1, 1, nodes={1: node}, mirror=True)
    exchange.wait = head
    exchange._uncounted = (0, 5, [[node]])
    exchange.settle()
    assert exchange.stats.blocks_incomplete == 1 and node.lossy  # counted, and its link marked lossy
    assert exchange.wait is head and exchange.merged.key == (0, 5, 1, int(Block.ATTN))


def test_a_merge_adds_the_partials_in_the_participants_order(tiny_spec, synth_gguf) -> None:
    """The master's share plus each partial that came, in the participants' order whatever order they came in (float
    addition is not associative: a sum that followed arrivals gave the same request other tokens from run to run):
    one in pieces adds what of it came, one of which nothing came is left out, and the sum is a new array."""
    from edgerun.net.channel import Counters
    from edgerun.tp.config import MasterConfig
    from edgerun.tp.exchange import BlockExchange, _Wait

    model = load_model(synth_gguf(tiny_spec()))
    exchange = BlockExchange(model.config, KEY, MasterConfig(), None, None, Counters(), print)
    rng = np.random.default_rng(5)
    own = rng.standard_normal((4, 64)).astype(np.float32)
    vectors = {i: (rng.standard_normal(256) * 10.0 ** rng.integers(-6, 6)).astype(np.float32) for i in (1, 2, 3, 4)}
    pieces = Reassembly(256)
    pieces.vector[:128] = vectors[4][:128]  # a lossy partial's first fragment alone
    # arrived 3, 1, then 4 in part; nothing of 2
    w = _Wait((1, 0, 0, int(Block.MLP)), {3: vectors[3], 1: vectors[1], 4: pieces, 2: None},
              dict.fromkeys((1, 2, 3, 4), 256), None, 0.0, 1, 4)
    total = exchange._merge(w, own)
    expected = own.copy()
    for part in (vectors[1], vectors[3], pieces.vector):
        expected += part.reshape(own.shape)
    assert total.shape == own.shape and np.array_equal(total, expected) and total is not own
    arrival_order = own + vectors[3].reshape(own.shape) + vectors[1].reshape(own.shape) + \
        pieces.vector.reshape(own.shape)
    assert not np.array_equal(total, arrival_order)  # the order shows in the bits
