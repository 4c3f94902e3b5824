"""The tensor-parallel control protocol: every message round-trips through one encode/decode, routes are data,
and nothing malformed decodes to anything but a BadMessage."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable

import pytest

from edgerun.net.wire import Block, Codec, Header, MsgType, control_frame, open_frame, open_packet, parse_control
from edgerun.tp import messages as m
from edgerun.tp.shard import ShardSpec

Mutate = Callable[[object, random.Random], object]  # conftest's mutate fixture

KEY = b"k" * 32
SPEC = ShardSpec(attn_units=((0, 1), (2,)), mlp_groups=((1,), ()), vocab_blocks=(0, 2), group_size=128,
                 vocab_block=512)
SAMPLES: list[m.Message] = [
    m.Register("pi-4", 512.5, 2e9, 40_000, 1472),
    m.Spare("pi-4", 40_000),
    m.Ready(3, 10_000_000, 65_536),
    m.Heartbeat(7, 0.25, 300.5, m.KernelFit(3, 4_000_000, 0.01, 6e12, 1.5e4), 0.012, 3, 0.125, 660, 0.0132, 12, 0.0625),
    m.Fetch(3, 17, 5, Block.ATTN),
    m.Partial(3, 17, 5, Block.MLP, bytes(range(16))),
    m.Pong(4),
    m.BandwidthReply(bytes(1000)),
    m.Welcome("ab" * 32, 8080, 40_001),
    m.Assign(3, 1, SPEC, 64, Codec.Q8, m.Routes.for_transport("udp", 2), 40_001, 5.0, 2, 65_507,
             (((0,), (1,)), ((0,), ()))),
    m.Assign(4, 2, SPEC, 1024, Codec.F32, m.Routes.for_transport("tcp", 2), 40_001, None, 0, 1472, slots=8),
    m.Input(3, 0, 1, Block.HEAD, None, b"\x00" * 8),
    m.Input(3, 9, 1, Block.ATTN, (2, 0, 1), b"\x01" * 8),
    m.Input(3, 9, 2, Block.MLP, None, b"\x02" * 68, Codec.Q8),
    m.Reset(5),
    m.Reset(6, 40),
    m.Reset(7, None, batch=True),
    m.BatchStep(7, 0, (2,), (0,)),
    m.BatchStep(7, 3, (0, 3, 1), (40, 17, 9), copy=(0, 3, 16, 0, 2, 16)),
    m.BatchStep(7, 4, (2, 0, 3), (64, 41, 18), counts=(11, 1, 1)),  # a prompt's chunk beside two decode tokens
    m.BatchStep(7, 5, (2, 0), (75, 42), top=40),  # decode rows whose draws pick from 40 logits at most
    m.ParityOn(2),
    m.Ping(1),
    m.BandwidthProbe(1 << 20, bytes(64)),
    m.Shutdown(),
]


def test_every_message_type_has_a_sample() -> None:
    assert {type(s) for s in SAMPLES} == set(m.MESSAGES.values())


@pytest.mark.parametrize("message", SAMPLES, ids=lambda s: type(s).__name__)
def test_round_trip_through_a_sealed_frame(message: m.Message) -> None:
    frame = bytes(control_frame(9, *m.encode(message), KEY))  # as a stream reads it
    header, body = open_packet(frame[4:], KEY)
    decoded = m.decode(*parse_control(header, body))
    assert decoded == message
    # Enums and tuples come back as such, not as JSON's ints and lists.
    for f in dataclasses.fields(decoded):
        assert type(getattr(decoded, f.name)) is type(getattr(message, f.name))


@pytest.mark.parametrize("message", [s for s in SAMPLES if any(f.type == "Payload" for f in dataclasses.fields(s))],
                         ids=lambda s: type(s).__name__)
def test_payloads_decode_as_views_of_their_frame(message: m.Message) -> None:
    """As a stream receives them (open_frame): the same message, its payload a read-only view, not a copy."""
    frame = bytes(control_frame(9, *m.encode(message), KEY))
    decoded = m.decode(*parse_control(*open_frame(frame[4:], KEY)))
    assert decoded == message
    (payload,) = [getattr(decoded, f.name) for f in dataclasses.fields(decoded) if f.type == "Payload"]
    assert isinstance(payload, memoryview) and payload.readonly and payload.obj is not None


def test_routes_are_data() -> None:
    udp = m.Routes.for_transport("udp", 3)
    assert [udp.of(layer, Block.ATTN, 1) for layer in range(3)] == [m.Route.MIRRORED, m.Route.DATAGRAM,
                                                                     m.Route.DATAGRAM]
    assert udp.of(2, Block.MLP, 1) == m.Route.DATAGRAM and udp.of(0, Block.HEAD, 1) == m.Route.MIRRORED
    assert udp.of(2, Block.MLP, 5) == m.Route.RELIABLE  # prefill is always reliable
    tcp = m.Routes.for_transport("tcp", 3)
    assert {tcp.of(layer, b, 1) for layer in range(3) for b in Block} == {m.Route.RELIABLE}
    with pytest.raises(ValueError):
        m.Routes.for_transport("quic", 3)


@pytest.mark.parametrize("text", [
    b'{"message": "Nope"}',  # unknown message
    b'{"seq": 1}',  # no message name
    b'["Ping"]',  # not an object
    b'{"message": "Ping"}',  # missing field
    b'{"message": "Ping", "seq": 1, "extra": 2}',  # unknown field
    b'{"message": "Ping", "seq": "1"}',  # a string for an int
    b'{"message": "Ping", "seq": 1.0}',  # a float for an int
    b'{"message": "Ping", "seq": true}',  # a bool for an int
    b'{"message": "Fetch", "session": 1, "position": 2, "layer": 3, "block": 9}',  # no such block
    b'{"message": "Input", "session": 1, "position": 2, "layer": 3, "block": 0, "ranking": [1, "x"]}',
    b'{"message": "Input", "session": 1, "position": 2, "layer": 3, "block": 0, "ranking": 5}',
    b'{"message": "Heartbeat", "rejected": 0, "compute_s": null, "peak_rss_mb": 1}',  # null for a number
    b'{"message": "Assign", "session": 1}',
    b'{"message": "Reset", "session": 1, "top": 0}',  # out of its range: a sampler draws from one logit at least
    b'{"message": "BatchStep", "session": 1, "step": 0, "slots": [0, 0], "starts": [1, 2]}',  # a slot twice
    b'{"message": "BatchStep", "session": 1, "step": 0, "slots": [0], "starts": []}',  # a slot without its start
    b'{"message": "BatchStep", "session": 1, "step": 0, "slots": [64], "starts": [1]}',  # past the most slots
    b'{"message": "BatchStep", "session": 1, "step": 0, "slots": [1], "starts": [1], "copy": [0, 1]}',  # no rows
    b'{"message": "BatchStep", "session": 1, "step": 0, "slots": [1, 2], "starts": [1, 2], "counts": [3]}',
    b'{"message": "BatchStep", "session": 1, "step": 0, "slots": [1, 2], "starts": [1, 2], "counts": [3, 0]}',
    b'{"message": "BatchStep", "session": 1, "step": 0, "slots": [1], "starts": [1], "top": -1}',  # a negative top
    b'{"message": "ParityOn", "fragments": 5}',  # more parity fragments than a vector may have (wire.MAX_PARITY)
    b'{"message": "ParityOn", "fragments": -1}',
    b'{"message": "Ping", "seq": 1',  # truncated
    b"[" * 100_000,  # nested past the parser's recursion
    b"\xff\xfe",  # not text
])
def test_malformed_messages_are_bad_messages(text: bytes) -> None:
    with pytest.raises(m.BadMessage):
        m.decode(text, b"")


def test_fuzzed_messages_decode_or_are_refused(mutate: Mutate) -> None:
    """Thousands of structurally mutated messages: each either decodes to a message of its declared types or
    raises BadMessage; nothing else escapes."""
    rng = random.Random(0)
    decoded = refused = 0
    for i in range(4000):
        text, payload = m.encode(SAMPLES[i % len(SAMPLES)])
        data = mutate(json.loads(text), rng)
        try:
            message = m.decode(json.dumps(data).encode(), payload)
        except m.BadMessage:
            refused += 1
            continue
        decoded += 1
        assert type(message) in m.MESSAGES.values()
        assert m.decode(*m.encode(message)) == message  # what decoded is well-formed
    assert refused > 1000 and decoded > 100


def test_header_fields_have_one_meaning_each() -> None:
    """A datagram's token count is its own field, and a link probe its own type."""
    header = Header(MsgType.PARTIAL, 1, tokens=3)
    assert header.tokens == 3 and "flags" not in Header._fields
    assert {t.name for t in MsgType} == {"ACTIVATION", "PARTIAL", "CONTROL", "PROBE", "RESEND"}


def test_a_control_stream_reads_whole_frames_however_its_bytes_arrive() -> None:
    """channel.FrameReader over a real TCP stream: frames that come a byte at a time, several in one write, or in
    one large piece are each received whole and in order; a length no frame has (or the master's KEY_REJECTED)
    ends the stream with a WireError once the frames before it are taken; a closed stream, with a ConnectionError.
    """
    import asyncio
    import socket

    from edgerun.net.channel import FrameReader
    from edgerun.net.wire import KEY_REJECTED, KeyRejected, WireError
    from edgerun.tp.channel import AsyncChannel, connect_channel

    sent = [SAMPLES[0], m.Input(3, 0, 1, Block.MLP, None, bytes(range(256)) * 2400), m.Ping(2), m.Ping(3)]
    frames = [bytes(control_frame(0, *m.encode(message), KEY)) for message in sent]

    async def serve(trailer: bytes) -> list[object]:
        loop = asyncio.get_running_loop()
        received: list[object] = []
        done = loop.create_future()

        async def take(reader: FrameReader) -> None:
            channel = AsyncChannel(reader, KEY, loop)
            try:
                while True:
                    received.append(await channel.receive())
            except (WireError, ConnectionError) as e:
                received.append(e)
                done.set_result(None)

        server = await loop.create_server(lambda: FrameReader(lambda r: loop.create_task(take(r))), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        writer = socket.create_connection(("127.0.0.1", port))
        writer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for byte in frames[0]:  # a byte at a time
            writer.send(bytes([byte]))
            await asyncio.sleep(0)
        writer.sendall(frames[1])  # 614 KB in one piece
        writer.sendall(frames[2] + frames[3] + trailer)  # two frames, then what ends the stream
        if not trailer:
            writer.close()
        await asyncio.wait_for(done, 10)
        writer.close()
        server.close()
        return received

    for trailer, error in ((b"", ConnectionError), (KEY_REJECTED, KeyRejected), (b"\x01\x00\x00\x00", WireError)):
        received = asyncio.run(serve(trailer))
        assert received[:4] == sent, trailer
        assert len(received) == 5 and isinstance(received[4], error), received[4:]

    async def client_side() -> m.Message:  # connect_channel: the node's end
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: FrameReader(lambda r: AsyncChannel(r, KEY, loop).send(m.Pong(9))), "127.0.0.1", 0)
        channel = await connect_channel("127.0.0.1", server.sockets[0].getsockname()[1], KEY, loop)
        reply = await asyncio.wait_for(channel.receive(), 10)
        channel.close()
        server.close()
        return reply

    assert asyncio.run(client_side()) == m.Pong(9)
