"""The wire format: sealing and opening packets, vector codecs, fragmentation and reassembly, control frames,
and a seeded fuzz that feeds malformed and forged-but-authentic datagrams through the receive path."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import warnings
from collections import Counter
from math import comb

import numpy as np
import pytest

from edgerun.commands.common import parity_arg
from edgerun.net.channel import Counters, add_fragment
from edgerun.net.wire import (
    HEADER,
    MAC_SIZE,
    MAGIC,
    MAX_FRAME,
    MAX_PARITY,
    NONCE_SIZE,
    Q8_BLOCK,
    Q8_BLOCK_BYTES,
    TRAILER,
    VERSION,
    Added,
    Block,
    Codec,
    Header,
    MsgType,
    Reassembly,
    Resend,
    WireError,
    authenticate,
    control_frame,
    decode_vector,
    derive_key,
    elements_per_fragment,
    encode_vector,
    fragment,
    fragment_size,
    frame_length,
    is_parity,
    open_frame,
    open_packet,
    parity_fragments,
    parse_control,
    seal,
)

KEY = derive_key("test cluster secret")
OTHER_KEY = derive_key("another cluster")
OVERHEAD = HEADER.size + TRAILER
BYTES_PER_ELEMENT = {Codec.F32: 4, Codec.F16: 2}

# The header fields in struct order, with the struct code of each.
FIELDS = ["magic", "version", "type", "session", "position", "layer", "block", "node",
          "frag_index", "frag_count", "codec", "tokens", "offset", "length"]
FIELD_CODES = dict(zip(FIELDS, HEADER.format.lstrip("<").replace("2s", "s"), strict=True))
FIELD_MAX = {"B": 0xFF, "H": 0xFFFF, "I": 0xFFFF_FFFF}


def raw_fields(header: Header, payload: bytes) -> dict[str, object]:
    """The struct fields `seal` would write, for tests that then change some of them."""
    return {"magic": MAGIC, "version": VERSION, "type": int(header.type), "session": header.session,
            "position": header.position, "layer": header.layer, "block": header.block, "node": header.node,
            "frag_index": header.frag_index, "frag_count": header.frag_count, "codec": int(header.codec),
            "tokens": header.tokens, "offset": header.offset, "length": len(payload)}


def pack_sealed(fields: dict[str, object], payload: bytes, key: bytes = KEY) -> bytes:
    """A packet built field by field, bypassing Header, with a MAC that passes under `key`."""
    return authenticate(HEADER.pack(*(fields[f] for f in FIELDS)) + payload, key)


def sample_header(**changes: object) -> Header:
    h = Header(MsgType.ACTIVATION, session=0xDEAD_BEEF, position=12_345, layer=27, block=Block.MLP, node=7,
               frag_index=3, frag_count=5, codec=Codec.Q8, tokens=0x81, offset=999, length=0)
    return h._replace(**changes)


# ---------------------------------------------------------------------------------------------------------------
# seal / open_packet


@pytest.mark.parametrize("mtype", list(MsgType))
def test_seal_open_round_trip(mtype: MsgType) -> None:
    payload = bytes(range(256)) * 3
    # seal writes the real payload length whatever the header says.
    header = sample_header(type=mtype, length=12)
    packet = seal(header, payload, KEY)
    assert len(packet) == HEADER.size + len(payload) + TRAILER
    got, body = open_packet(packet, KEY)
    assert got == header._replace(length=len(payload))
    assert body == payload
    assert type(got.type) is MsgType
    assert type(got.codec) is Codec


def test_seal_open_field_extremes() -> None:
    for header in [Header(MsgType.PROBE, 0, 0, 0, 0, 0, 0, 1, Codec.F32, 0, 0),
                   Header(MsgType.PARTIAL, 0xFFFF_FFFF, 0xFFFF_FFFF, 0xFFFF, 0xFF, 0xFF, 0xFFFE, 0xFFFF, Codec.F16,
                          0xFF, 0xFFFF_FFFF)]:
        for payload in [b"", b"\x00", b"x" * 9000]:
            got, body = open_packet(seal(header, payload, KEY), KEY)
            assert got == header._replace(length=len(payload))
            assert body == payload


def test_derive_key() -> None:
    assert derive_key("a") == derive_key("a")
    assert derive_key("a") != derive_key("b")
    assert derive_key(None) == derive_key("")
    assert len(KEY) == 32


# ---------------------------------------------------------------------------------------------------------------
# codecs


def test_f32_exact() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(1000).astype(np.float32) * 1e3,
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -3.4e38], np.float32)])
    payload = encode_vector(x, Codec.F32)
    assert len(payload) == 4 * x.size
    y = decode_vector(payload, Codec.F32, x.size)
    assert y.dtype == np.float32
    # Bit patterns, so that -0.0 and NaN count too.
    assert np.array_equal(y.view(np.uint32), x.view(np.uint32))


def test_f16_within_half_precision() -> None:
    rng = np.random.default_rng(1)
    # Spread over the f16 normal range [6.1e-5, 65504].
    x = (rng.standard_normal(5000) * 10.0 ** rng.uniform(-4, 4.5, 5000)).astype(np.float32)
    x = np.clip(x, -65000, 65000)
    x = np.where(np.abs(x) < 6.2e-5, 1.0, x).astype(np.float32)
    payload = encode_vector(x, Codec.F16)
    assert len(payload) == 2 * x.size
    y = decode_vector(payload, Codec.F16, x.size)
    assert y.dtype == np.float32
    # Round to nearest with an 11-bit significand: relative error at most 2**-11.
    assert np.all(np.abs(y - x) <= np.abs(x) * 2.0**-11)
    assert np.array_equal(y, x.astype(np.float16).astype(np.float32))


def q8_block_errors(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-block max |decoded - x| and per-block max |x| for a Q8 round trip."""
    y = decode_vector(encode_vector(x, Codec.Q8), Codec.Q8, x.size)
    assert y.shape == x.shape
    pad = -x.size % Q8_BLOCK
    err = np.pad(np.abs(y - x), (0, pad)).reshape(-1, Q8_BLOCK).max(axis=1)
    top = np.pad(np.abs(x), (0, pad)).reshape(-1, Q8_BLOCK).max(axis=1)
    return err, top


@pytest.mark.parametrize("n", [1, 5, 31, 32, 33, 63, 64, 65, 100, 4096, 4097])
def test_q8_error_bound(n: int) -> None:
    """Each block's error is at most half a quantization step, max|x| / 127 / 2, plus the rounding of the
    scale to f16 (relative 2**-11, over up to 127 steps: max|x| * 2**-11)."""
    rng = np.random.default_rng(n)
    # Block magnitudes from 0.01 to 1000 keep the f16 scale a normal number.
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-2, 3, n)).astype(np.float32)
    payload = encode_vector(x, Codec.Q8)
    assert len(payload) == -(-n // Q8_BLOCK) * Q8_BLOCK_BYTES
    err, top = q8_block_errors(x)
    assert np.all(err <= top / 127 / 2 + top * 2.0**-11 + top * 1e-6)


def test_q8_exact_on_grid_and_zero_blocks() -> None:
    # A block whose max|x| is 127 has scale 1, exact in f16, so its integers come back exactly.
    rng = np.random.default_rng(2)
    grid = rng.integers(-127, 128, (6, Q8_BLOCK)).astype(np.float32)
    grid[:, 5] = rng.choice([-127.0, 127.0], 6)
    grid[[1, 4]] = 0.0  # all-zero blocks between others
    x = np.concatenate([grid.reshape(-1), [127.0, -3.0, 0.0, 64.0]]).astype(np.float32)
    y = decode_vector(encode_vector(x, Codec.Q8), Codec.Q8, x.size)
    assert np.array_equal(y, x)
    # An all-zero vector has scale 0 and decodes to exact zeros, not NaN.
    z = np.zeros(70, np.float32)
    assert np.array_equal(decode_vector(encode_vector(z, Codec.Q8), Codec.Q8, 70), z)


def test_q8_partial_last_block_padding_does_not_leak() -> None:
    x = np.full(33, 5.0, np.float32)
    x[32] = -1.0
    y = decode_vector(encode_vector(x, Codec.Q8), Codec.Q8, 33)
    assert y.shape == (33,)
    assert np.allclose(y, x, atol=5 / 254 + 1e-6)
    # The last block holds only -1.0, so its scale is 1/127 and -1.0 comes back almost exactly.
    assert abs(y[32] + 1.0) <= 1 / 254


@pytest.mark.parametrize("codec", list(Codec))
def test_encode_accepts_other_shapes_and_dtypes(codec: Codec) -> None:
    x = np.arange(24, dtype=np.float64).reshape(2, 3, 4) / 7
    flat = x.astype(np.float32).reshape(-1)
    assert encode_vector(x, codec) == encode_vector(flat, codec)


@pytest.mark.parametrize("codec", list(Codec))
def test_decode_rejects_wrong_sizes(codec: Codec) -> None:
    for n in [1, 31, 32, 33, 100]:
        payload = encode_vector(np.ones(n, np.float32), codec)
        assert decode_vector(payload, codec, n).shape == (n,)
        for bad in [b"", payload[:-1], payload + b"\x00", payload * 2]:
            with pytest.raises(WireError):
                decode_vector(bad, codec, n)
        # A payload for n elements is not one for n + 1 (for Q8, once n + 1 spills into another block).
        if codec != Codec.Q8 or n % Q8_BLOCK == 0:
            with pytest.raises(WireError):
                decode_vector(payload, codec, n + 1)
    with pytest.raises(WireError):
        decode_vector(b"\x00" * 3, codec, 1)


def test_q8_payload_fits_any_count_within_its_blocks() -> None:
    payload = encode_vector(np.ones(32, np.float32), Codec.Q8)
    for n in range(1, 33):
        assert decode_vector(payload, Codec.Q8, n).shape == (n,)
    for n in [0, 33, 64]:
        with pytest.raises(WireError):
            decode_vector(payload, Codec.Q8, n)


# ---------------------------------------------------------------------------------------------------------------
# fragmentation and reassembly

SIZES = [1, 31, 32, 33, 576, 4096, 151936]
MTUS = [512, 1472, 9000]


def round_trip(x: np.ndarray, codec: Codec) -> np.ndarray:
    return decode_vector(encode_vector(x, codec), codec, x.size)


@pytest.mark.parametrize("mtu", MTUS)
@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("n", SIZES)
def test_fragment_reassemble(n: int, codec: Codec, mtu: int) -> None:
    rng = np.random.default_rng(n * 31 + mtu + codec)
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    expected = round_trip(x, codec)
    header = Header(MsgType.PARTIAL, session=42, position=17, layer=5, block=Block.ATTN, node=3, codec=codec,
                    tokens=2)
    packets = fragment(header, x, KEY, mtu)

    per = elements_per_fragment(codec, mtu)
    assert len(packets) == -(-n // per)
    assert all(len(p) <= mtu for p in packets)
    # Fragments are as full as the MTU allows: one more codec block would not fit.
    block = Q8_BLOCK if codec == Codec.Q8 else 1
    assert len(seal(header, encode_vector(np.zeros(per + block, np.float32), codec), KEY)) > mtu

    opened = [open_packet(p, KEY) for p in packets]
    for i, (h, _) in enumerate(opened):
        assert h == header._replace(frag_index=i, frag_count=len(packets), offset=i * per, length=h.length)
        assert fragment_size(h, n, mtu) == min(per, n - i * per)

    # All fragments, in random order.
    order = list(range(len(opened)))
    random.Random(n + mtu).shuffle(order)
    whole = Reassembly(n, mtu)
    for k, i in enumerate(order):
        assert not whole.complete
        last = k == len(order) - 1
        assert whole.add(*opened[i]) is (Added.COMPLETED if last else Added.STORED)
        assert whole.complete == last
    assert np.array_equal(whole.vector, expected)

    # Some fragments lost: exactly their element ranges stay zero.
    drop_rng = random.Random(n * mtu + codec)
    lost = {i for i in range(len(opened)) if drop_rng.random() < 0.3}
    if len(opened) > 1 and not lost:
        lost = {len(opened) - 1}
    partial = Reassembly(n, mtu)
    for i in order:
        if i not in lost:
            assert partial.add(*opened[i]) is (Added.COMPLETED if not lost else Added.STORED)
    want = expected.copy()
    for i in lost:
        want[i * per:(i + 1) * per] = 0.0
    assert np.array_equal(partial.vector, want)
    assert partial.complete == (not lost)
    assert partial.received == set(range(len(opened))) - lost

    # Duplicates, even with other contents, are refused and change nothing.
    before, received = partial.vector.copy(), set(partial.received)
    for i in sorted(received)[:5]:
        h, body = opened[i]
        assert partial.add(h, body) is Added.DUPLICATE
        other = encode_vector(np.full(fragment_size(h, n, mtu), 9.0, np.float32), codec)
        assert partial.add(*open_packet(seal(h, other, KEY), KEY)) is Added.DUPLICATE
    assert np.array_equal(partial.vector, before)
    assert partial.received == received


def test_two_parity_fragments_of_a_one_fragment_vector_are_copies_of_it() -> None:
    """A one-fragment vector with two parity fragments arrives whole from any one of its three datagrams;
    the others that follow are not counted as rejected duplicates, a repeated datagram is."""
    x = np.random.default_rng(3).standard_normal(576).astype(np.float32)
    header = Header(MsgType.PARTIAL, session=1, position=2, layer=3, block=Block.MLP, node=1, codec=Codec.F16, tokens=1)
    opened = [open_packet(p, KEY) for p in fragment(header, x, KEY, parity=2)]
    assert [h.frag_index for h, _ in opened] == [0, 1, 2] and len({body for _, body in opened}) == 1
    for survivor in range(3):
        r, counters = Reassembly(576), Counters()
        assert add_fragment(r, *opened[survivor], counters)
        assert np.array_equal(r.vector, round_trip(x, Codec.F16))
        for other in range(3):
            if other != survivor:
                assert not add_fragment(r, *opened[other], counters)
        assert counters.total() == 0
    r, counters = Reassembly(576), Counters()
    add_fragment(r, *opened[0], counters)
    add_fragment(r, *opened[0], counters)
    assert counters.rejected == {"duplicate": 1}


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("n", [1, 31, 576, 713, 714, 2048, 5000])
def test_parity_rebuilds_any_one_lost_fragment(n: int, codec: Codec) -> None:
    mtu = 1472
    x = (np.random.default_rng(n + codec).standard_normal(n) * 3).astype(np.float32)
    expected = round_trip(x, codec)
    header = Header(MsgType.PARTIAL, session=1, position=9, layer=2, block=Block.MLP, node=1, codec=codec, tokens=1)
    opened = [open_packet(p, KEY) for p in fragment(header, x, KEY, mtu, parity=True)]
    count = len(opened) - 1
    assert count == -(-n // elements_per_fragment(codec, mtu))
    assert opened[-1][0].frag_index == count == opened[-1][0].frag_count and opened[-1][0].offset == 0

    for lost in range(count):  # every data fragment but one, then the parity: rebuilt exactly
        r = Reassembly(n, mtu)
        rest = [p for i, p in enumerate(opened) if i != lost]
        for k, (h, body) in enumerate(rest):
            assert r.add(h, body) is (Added.COMPLETED if k == len(rest) - 1 else Added.STORED)
        assert r.recovered and r.complete
        assert np.array_equal(r.vector, expected)
        # The lost fragment coming late changes nothing and does not complete the vector twice.
        assert r.add(*opened[lost]) is Added.STORED
        assert np.array_equal(r.vector, expected)

    # The parity after a complete vector is taken silently; a second copy is a duplicate.
    r = Reassembly(n, mtu)
    for h, body in opened[:-1]:
        r.add(h, body)
    assert r.complete and not r.recovered
    assert r.add(*opened[-1]) is Added.STORED
    assert r.add(*opened[-1]) is Added.DUPLICATE
    assert np.array_equal(r.vector, expected)

    if count >= 2:  # two lost: the parity cannot help, their ranges stay zero
        r = Reassembly(n, mtu)
        for h, body in [opened[0], *opened[3:]]:
            r.add(h, body)
        assert not r.complete and not r.recovered
        per = elements_per_fragment(codec, mtu)
        assert not r.vector[per:3 * per].any()
        assert np.array_equal(r.vector[:per], expected[:per])


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize(("n", "mtu"), [(2048, 1472), (576, 1472), (5000, 1472), (3000, 512)])
@pytest.mark.parametrize("parity", [2, 3])
def test_parity_fragments_rebuild_any_as_many_lost_fragments(n: int, mtu: int, codec: Codec, parity: int) -> None:
    """With k parity fragments every pattern of up to k lost datagrams, data or parity, leaves a vector that is
    whole and exact (net.erasure); one more lost leaves the missing ranges zero and the rest exact."""
    x = (np.random.default_rng(n + parity).standard_normal(n) * 2).astype(np.float32)
    expected = round_trip(x, codec)
    header = Header(MsgType.PARTIAL, session=1, position=9, layer=2, block=Block.ATTN, node=2, codec=codec, tokens=1)
    opened = [open_packet(p, KEY) for p in fragment(header, x, KEY, mtu, parity=parity)]
    count = len(opened) - parity
    assert [h.frag_index for h, _ in opened] == list(range(count + parity))
    assert all(is_parity(h) == (h.frag_index >= count) for h, _ in opened)
    for lost in itertools.combinations(range(len(opened)), parity):
        r = Reassembly(n, mtu)
        for i in np.random.default_rng(sum(lost)).permutation(len(opened)):  # in any order
            if i not in lost:
                r.add(*opened[i])
        assert r.complete and r.recovered == any(i < count for i in lost), lost
        assert np.array_equal(r.vector, expected), lost
    if count >= 2:
        r = Reassembly(n, mtu)
        for h, body in opened[parity + 1:]:  # the first parity + 1 data fragments lost
            r.add(h, body)
        per = elements_per_fragment(codec, mtu)
        assert not r.complete and r.missing() == tuple(range(min(count, parity + 1)))
        assert not r.vector[:min(n, (parity + 1) * per)].any()
        assert np.array_equal(r.vector[(parity + 1) * per:], expected[(parity + 1) * per:])


@pytest.mark.parametrize("codec", list(Codec))
def test_prefix_travels_in_every_fragment_and_survives_a_rebuild(codec: Codec) -> None:
    n, prefix = 2048, bytes([2, 0, 1, 5, 4, 3])
    x = np.random.default_rng(codec).standard_normal(n).astype(np.float32)
    expected = round_trip(x, codec)
    header = Header(MsgType.ACTIVATION, session=1, position=3, layer=4, block=Block.MLP, codec=codec, tokens=1)
    opened = [open_packet(p, KEY) for p in fragment(header, x, KEY, parity=True, prefix=prefix)]
    assert all(len(p) <= 1472 for p in fragment(header, x, KEY, parity=True, prefix=prefix))
    assert all(body[:len(prefix)] == prefix for _, body in opened[:-1])  # data fragments
    count = len(opened) - 1
    assert count == -(-n // elements_per_fragment(codec, 1472, len(prefix)))
    for lost in range(count):
        r = Reassembly(n, prefix=len(prefix))
        for i, (h, body) in enumerate(opened):
            if i != lost:
                r.add(h, body)
        assert r.complete and r.prefix_bytes == prefix
        assert np.array_equal(r.vector, expected)


def test_malformed_parity_is_refused() -> None:
    n = 1000
    header = Header(MsgType.PARTIAL, session=1, codec=Codec.F32, tokens=1)
    packets = [open_packet(p, KEY) for p in fragment(header, np.ones(n, np.float32), KEY, parity=True)]
    parity_h, parity_body = packets[-1]
    for h, body in [(parity_h._replace(offset=4), parity_body),  # parity sits at offset 0
                    (parity_h, parity_body[:-4]),  # shorter than the first fragment
                    (parity_h._replace(frag_index=parity_h.frag_count + MAX_PARITY), parity_body)]:
        r = Reassembly(n)
        with pytest.raises(WireError):
            r.add(*open_packet(seal(h, body, KEY), KEY))
        assert not r.payloads and not r.received


def test_fragment_stays_in_header_range() -> None:
    # The largest vector in the brief at the smallest MTU still needs fewer fragments than a u16 holds.
    assert -(-151936 // elements_per_fragment(Codec.F32, 512)) < 0xFFFF


# ---------------------------------------------------------------------------------------------------------------
# rejection


def valid_packet() -> tuple[Header, bytes, bytes]:
    header = Header(MsgType.ACTIVATION, session=9, position=3, layer=1, codec=Codec.F16)
    payload = encode_vector(np.arange(4, dtype=np.float32), Codec.F16)
    return header._replace(length=len(payload)), payload, seal(header, payload, KEY)


def test_reject_wrong_key() -> None:
    _, _, packet = valid_packet()
    with pytest.raises(WireError, match="bad MAC"):
        open_packet(packet, OTHER_KEY)


def test_reject_every_flipped_bit() -> None:
    _, _, packet = valid_packet()
    for bit in range(8 * len(packet)):
        damaged = bytearray(packet)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(WireError):
            open_packet(bytes(damaged), KEY)


def test_reject_truncated_and_extended() -> None:
    _, _, packet = valid_packet()
    for n in range(len(packet)):
        with pytest.raises(WireError):
            open_packet(packet[:n], KEY)
    for tail in [b"\x00", b"\xff" * 16, packet]:
        with pytest.raises(WireError):
            open_packet(packet + tail, KEY)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("version", 0, "version"),
    ("version", VERSION + 1, "version"),
    ("version", 255, "version"),
    ("magic", b"RE", "magic"),
    ("magic", b"\x00\x00", "magic"),
    ("type", 0, "MsgType"),
    ("type", max(MsgType) + 1, "MsgType"),
    ("type", 255, "MsgType"),
    ("codec", max(Codec) + 1, "Codec"),
    ("codec", 255, "Codec"),
    ("frag_count", 0, "fragment"),
    ("frag_index", 1 + MAX_PARITY, "fragment"),  # of frag_count 1
    ("frag_index", 0xFFFF, "fragment"),
])
def test_reject_authentic_but_invalid_header(field: str, value: object, message: str) -> None:
    header, payload, _ = valid_packet()
    fields = raw_fields(header, payload)
    assert open_packet(pack_sealed(fields, payload), KEY) == (header, payload)  # the unchanged fields pass
    fields[field] = value
    with pytest.raises(WireError, match=message):
        open_packet(pack_sealed(fields, payload), KEY)


def test_indices_from_count_are_the_parity_and_beyond_it_are_refused() -> None:
    header, payload, _ = valid_packet()
    with pytest.raises(WireError):
        open_packet(seal(header._replace(frag_index=4 + MAX_PARITY, frag_count=4), payload, KEY), KEY)
    for index in range(4, 4 + MAX_PARITY):
        parity, _ = open_packet(seal(header._replace(frag_index=index, frag_count=4), payload, KEY), KEY)
        assert is_parity(parity)
    data, _ = open_packet(seal(header._replace(frag_index=3, frag_count=4), payload, KEY), KEY)
    assert data.frag_index == 3 and not is_parity(data)


@pytest.mark.parametrize("delta", [-1, 1, 100, -8])
def test_reject_payload_length_mismatch(delta: int) -> None:
    header, payload, _ = valid_packet()
    fields = raw_fields(header, payload)
    fields["length"] = len(payload) + delta
    with pytest.raises(WireError, match="length"):
        open_packet(pack_sealed(fields, payload), KEY)


def test_reject_fragments_that_do_not_fit() -> None:
    n, mtu = 1000, 1472
    x = np.linspace(-1, 1, n, dtype=np.float32)
    base = Header(MsgType.ACTIVATION, session=1, codec=Codec.F32)
    packets = [open_packet(p, KEY) for p in fragment(base, x, KEY, mtu)]
    per = elements_per_fragment(Codec.F32, mtu)
    count = len(packets)
    assert count == 3

    first_h, first_body = packets[0]
    last_h, last_body = packets[-1]
    misfits = [
        (first_h._replace(offset=1), first_body),  # offset off the fragment grid
        (last_h._replace(offset=0), last_body),
        (first_h._replace(frag_count=count + 1), first_body),  # more fragments than the vector needs
        (first_h._replace(frag_count=count - 1), first_body),
        (first_h._replace(frag_index=count + 1, frag_count=count + 2, offset=(count + 1) * per), first_body),
        (first_h._replace(frag_index=count - 1, offset=(count - 1) * per), first_body),  # too long for the tail
        (last_h, last_body + b"\x00\x00\x00\x00"),
        (first_h._replace(codec=Codec.F16), first_body),  # F16 packs 1000 elements in one fragment
        (first_h._replace(codec=Codec.Q8), first_body),
    ]
    for header, body in misfits:
        reassembly = Reassembly(n, mtu)
        with pytest.raises(WireError):
            reassembly.add(*open_packet(seal(header, body, KEY), KEY))
        assert not reassembly.received and reassembly.count is None
        assert not reassembly.vector.any()

    # Once a fragment is in, the fragment count is fixed: a whole-vector F16 fragment cannot join.
    reassembly = Reassembly(n, mtu)
    assert reassembly.add(*packets[1]) is Added.STORED
    f16 = seal(base._replace(codec=Codec.F16, frag_count=1), encode_vector(x, Codec.F16), KEY)
    before = reassembly.vector.copy()
    with pytest.raises(WireError, match="fragment count"):
        reassembly.add(*open_packet(f16, KEY))
    assert np.array_equal(reassembly.vector, before)
    assert reassembly.received == {1}


def test_reassembly_of_empty_vector_refuses_everything() -> None:
    header = Header(MsgType.ACTIVATION, session=1)
    with pytest.raises(WireError):
        Reassembly(0).add(*open_packet(seal(header, b"", KEY), KEY))


# ---------------------------------------------------------------------------------------------------------------
# control frames


@pytest.mark.parametrize("payload", [b"", b"\x00\xff{}" * 100, b'{"message": "fake"}'])
def test_control_frame_round_trip(payload: bytes) -> None:
    text = json.dumps({"message": "Ping", "name": "ünïcødé", "nested": {"a": None, "b": 1.5}}).encode()
    frame = control_frame(77, text, payload, KEY)
    n = frame_length(frame[:4])
    assert n == len(frame) - 4
    header, body = open_packet(frame[4:], KEY)
    assert header.type == MsgType.CONTROL
    assert header.session == 77
    assert parse_control(header, body) == (text, payload)


def test_control_frame_layout_and_view() -> None:
    """The frame built in place holds exactly the length prefix, the sealed header, JSON length, text and payload
    that sealing their concatenation gives (only the nonce and tag differ); open_frame hands the payload out as a
    view of the frame, and refuses what open_packet refuses."""
    text, payload = b'{"message":"Ping","seq":1}', np.arange(1000, dtype=np.float32).tobytes()
    frame = bytes(control_frame(5, text, payload, KEY))
    body = (len(text)).to_bytes(4, "little") + text + payload
    expected = seal(Header(MsgType.CONTROL, 5), body, KEY)
    assert frame[:4] == len(expected).to_bytes(4, "little")
    assert frame[4:-TRAILER] == expected[:-TRAILER]
    header, view = open_frame(frame[4:], KEY)
    assert isinstance(view, memoryview) and view.obj is not None and bytes(view) == body
    got_text, got_payload = parse_control(header, view)
    assert (got_text, bytes(got_payload)) == (text, payload)
    assert isinstance(got_payload, memoryview)  # not copied on the way to numpy
    np.testing.assert_array_equal(np.frombuffer(got_payload, "<f4"), np.arange(1000, dtype=np.float32))
    for bad in (frame[4:-1] + bytes([frame[-1] ^ 1]), frame[4:20] + b"x" + frame[21:], frame[4:30]):
        with pytest.raises(WireError):
            open_frame(bad, KEY)
    with pytest.raises(WireError):
        open_frame(frame[4:], OTHER_KEY)


def test_control_frame_rejections() -> None:
    def sealed_control(body: bytes, mtype: MsgType = MsgType.CONTROL) -> tuple[Header, bytes]:
        return open_packet(seal(Header(mtype, 1), body, KEY), KEY)

    for header, body in [
        sealed_control(b"\x00\x00"),  # shorter than its JSON length
        sealed_control((100).to_bytes(4, "little") + b'{"a": 1}'),  # JSON length past the body
        sealed_control((0).to_bytes(4, "little"), mtype=MsgType.PROBE),  # not a control frame
    ]:
        with pytest.raises(WireError):
            parse_control(header, body)
    with pytest.raises(ValueError):
        control_frame(1, b"x" * MAX_FRAME, b"", KEY)


def test_frame_length_bounds() -> None:
    def prefix(n: int) -> bytes:
        return n.to_bytes(4, "little")

    assert frame_length(prefix(OVERHEAD)) == OVERHEAD
    assert frame_length(prefix(MAX_FRAME)) == MAX_FRAME
    for n in [0, 1, OVERHEAD - 1, MAX_FRAME + 1, 0xFFFF_FFFF]:
        with pytest.raises(WireError):
            frame_length(prefix(n))


def test_resend_requests_round_trip_and_malformed_ones_are_refused() -> None:
    for request in [Resend(7, 3, 0, Block.HEAD, 2, (0, 5, 44)), Resend(1, 0, 0, Block.ATTN, 1)]:
        assert Resend.open(*open_packet(request.seal(KEY), KEY)) == request
    header = Header(MsgType.RESEND, 1, block=Block.MLP)
    for payload in [b"\x01", b"\x00" * (2 * 4096 + 2)]:  # half an index; more fragments than any vector has
        with pytest.raises(WireError):
            Resend.open(*open_packet(seal(header, payload, KEY), KEY))
    with pytest.raises(WireError):
        Resend.open(*open_packet(seal(header._replace(block=9), b"", KEY), KEY))


def test_fragments_sent_again_complete_a_vector_exactly() -> None:
    """A receiver that lost three fragments (more than its two parity fragments rebuild) names them
    (Reassembly.missing); the sender seals just those again (fragment(..., only=...)) and the vector is whole and
    exact."""
    x = np.random.default_rng(3).standard_normal(4096).astype(np.float32)
    header = Header(MsgType.PARTIAL, 1, 2, 0, Block.HEAD, 1, codec=Codec.F32, tokens=1)
    sent = fragment(header, x, KEY, 1472, parity=2)
    reassembly = Reassembly(x.size, 1472)
    assert reassembly.missing() == ()
    for i, datagram in enumerate(sent):
        if i not in (3, 5, 8):
            reassembly.add(*open_packet(datagram, KEY))
    assert not reassembly.complete and reassembly.missing() == (3, 5, 8)
    again = fragment(header, x, KEY, 1472, only=(*reassembly.missing(), 99))  # 99: no such fragment, left out
    assert [open_packet(d, KEY)[0].frag_index for d in again] == [3, 5, 8]
    for datagram in again:
        reassembly.add(*open_packet(datagram, KEY))
    assert reassembly.complete and np.array_equal(reassembly.vector, x)
    assert len(fragment(header, x[:100], KEY, 1472, only=(0,))) == 1  # a one-datagram vector: its datagram


# ---------------------------------------------------------------------------------------------------------------
# fuzz

FUZZ_N = int(os.environ.get("EDGERUN_FUZZ_N", "3000"))
FUZZ_SEED = int(os.environ.get("EDGERUN_FUZZ_SEED", "0"))
FUZZ_TOTAL = 576  # one hidden vector of the shipped model; Reassembly's default MTU of 1472 applies


def fuzz_corpus() -> list[bytes]:
    """Valid packets to mutate: fragments that fit a Reassembly(576), fragments that belong to other MTUs or
    vector sizes, and packets of every other type."""
    rng = np.random.default_rng(FUZZ_SEED)
    corpus: list[bytes] = []
    for codec in Codec:
        header = Header(MsgType.ACTIVATION, session=5, position=2, layer=3, codec=codec)
        corpus += fragment(header, rng.standard_normal(FUZZ_TOTAL).astype(np.float32), KEY, parity=2)
        corpus += fragment(header, rng.standard_normal(FUZZ_TOTAL).astype(np.float32), KEY, 512, parity=True)
        corpus += fragment(header, rng.standard_normal(1000).astype(np.float32), KEY)
    corpus.append(control_frame(5, b'{"message":"Ping","seq":1}', b"\x01\x02", KEY)[4:])
    corpus.append(seal(Header(MsgType.PROBE, 5, position=2, node=3), b"", KEY))
    corpus.append(Resend(5, 2, 0, Block.HEAD, 3, (0, 4, 7)).seal(KEY))
    corpus.append(Resend(5, 2, 0, Block.ATTN, 1).seal(KEY))
    return corpus


def wild_value(rng: random.Random, field: str, current: object) -> object:
    """A new value for one header field: anything in the field's range, or close to something meaningful."""
    if field == "magic":
        return rng.choice([rng.randbytes(2), b"ER"[::-1], b"E\x00"])
    top = FIELD_MAX[FIELD_CODES[field]]
    assert isinstance(current, int)
    choice = rng.randrange(6)
    if choice == 0:
        return rng.randint(0, top)
    if choice == 1:
        return top
    if choice == 2:
        return rng.randint(0, 4)
    if choice == 3:
        return min(top, max(0, current + rng.choice([-1, 1])))
    if choice == 4:
        # Fragment-grid values: multiples of the per-fragment element counts of the MTUs in use.
        per = rng.choice([elements_per_fragment(c, m) for c in Codec for m in (512, 1472)])
        return min(top, per * rng.randint(0, 3))
    return min(top, current + rng.randint(-40, 40)) if current > 40 else rng.randint(0, 80)


def mutate_payload(rng: random.Random, payload: bytes) -> bytes:
    choice = rng.randrange(5)
    if choice == 0:
        return payload[:rng.randrange(len(payload) + 1)]
    if choice == 1:
        return payload + rng.randbytes(rng.choice([1, 2, 4, 34, rng.randint(1, 200)]))
    if choice == 2:
        return rng.randbytes(len(payload))
    if choice == 3:
        return b""
    # Non-finite or huge values are authentic data, so the codecs must carry them without failing.
    return rng.choice([b"\xff\x7f", b"\x00\x7c", b"\x00\xfc", b"\xff"]) * (len(payload) // 2)


def reseal_mutated(rng: random.Random, packet: bytes) -> bytes:
    """A valid packet with some header fields (and maybe its payload) changed, sealed again with the right key,
    so the MAC passes and only the field checks stand between it and the receiver."""
    header, payload = open_packet(packet, KEY)
    fields = raw_fields(header, payload)
    if rng.random() < 0.4:
        payload = mutate_payload(rng, payload)
    fields["length"] = len(payload)
    for field in rng.sample(FIELDS, rng.choice([1, 1, 1, 2, 2, 3, 5])):
        # Version and magic are rarely worth changing: every change is refused at once.
        if field in ("magic", "version") and rng.random() < 0.7:
            continue
        fields[field] = wild_value(rng, field, fields[field])
    return pack_sealed(fields, payload)


def random_fields_sealed(rng: random.Random) -> bytes:
    """Every header field random, the payload random, the MAC right."""
    fields = {f: wild_value(rng, f, 0) for f in FIELDS}
    fields["magic"], fields["version"] = MAGIC, VERSION
    fields["type"] = rng.randint(0, 7)
    fields["codec"] = rng.randint(0, 3)
    payload = rng.randbytes(rng.choice([0, 4, 34, 68, 1424, rng.randint(0, 2000)]))
    if rng.random() < 0.8:
        fields["length"] = len(payload)
    return pack_sealed(fields, payload)


def mutate(rng: random.Random, corpus: list[bytes]) -> tuple[str, bytes]:
    kind = rng.choice(["random", "flip", "truncate", "extend", "resealed", "resealed", "resealed", "random_fields"])
    packet = rng.choice(corpus)
    if kind == "random":
        return kind, rng.randbytes(rng.choice([rng.randint(0, 64), rng.randint(0, 2000)]))
    if kind == "flip":
        damaged = bytearray(packet)
        for _ in range(rng.randint(1, 8)):
            damaged[rng.randrange(len(damaged))] ^= rng.randint(1, 255)
        return kind, bytes(damaged)
    if kind == "truncate":
        return kind, packet[:rng.randrange(len(packet))]
    if kind == "extend":
        return kind, packet + rng.randbytes(rng.randint(1, 64))
    if kind == "resealed":
        return kind, reseal_mutated(rng, packet)
    return kind, random_fields_sealed(rng)


def receive(data: bytes, reassembly: Reassembly) -> str:
    """The receive path: authenticate, decode, reassemble. Returns the stage that refused the packet, or
    'accepted' / 'duplicate'; any exception other than WireError escapes."""
    try:
        header, payload = open_packet(data, KEY)
    except WireError:
        return "rejected: open_packet"
    if header.type == MsgType.RESEND:
        try:
            request = Resend.open(header, payload)
        except WireError:
            return "rejected: Resend.open"
        assert all(0 <= i < 1 << 16 for i in request.fragments) and request.block in Block
        return "accepted"
    with contextlib.suppress(WireError):
        decode_vector(payload, header.codec, fragment_size(header, FUZZ_TOTAL))
    try:
        added = reassembly.add(header, payload)
    except WireError:
        return "rejected: Reassembly.add"
    assert reassembly.count == header.frag_count
    assert reassembly.received <= set(range(header.frag_count))
    assert set(reassembly.payloads) <= set(range(header.frag_count + MAX_PARITY))
    return "duplicate" if added is Added.DUPLICATE else "accepted"


def test_fuzz_receive_path() -> None:
    rng = random.Random(FUZZ_SEED)
    corpus = fuzz_corpus()
    outcomes: Counter[tuple[str, str]] = Counter()
    reassembly = Reassembly(FUZZ_TOTAL)
    with warnings.catch_warnings():
        # Authentic payloads may carry inf or NaN scales; numpy's warnings about them are not failures.
        warnings.simplefilter("ignore", RuntimeWarning)
        for i in range(FUZZ_N):
            if i % 8 == 0:
                reassembly = Reassembly(FUZZ_TOTAL)
            kind, data = mutate(rng, corpus)
            try:
                stage = receive(data, reassembly)
            except WireError:
                raise
            except Exception as e:
                pytest.fail(f"iteration {i} ({kind}): {type(e).__name__}: {e}; datagram {data.hex()}")
            outcomes[kind, stage] += 1

    by_stage = Counter(stage for (_, stage), n in outcomes.items() for _ in range(n))
    rejected = sum(n for stage, n in by_stage.items() if stage.startswith("rejected"))
    print(f"\nfuzz: {FUZZ_N} datagrams (seed {FUZZ_SEED}), {rejected} rejected ({rejected / FUZZ_N:.1%})")
    for (kind, stage), n in sorted(outcomes.items()):
        print(f"  {kind:14} {stage:26} {n}")

    # Damage without a fresh MAC never gets past authentication.
    for (kind, stage), n in outcomes.items():
        if kind in ("random", "flip", "truncate", "extend"):
            assert stage == "rejected: open_packet", (kind, stage, n)
    if FUZZ_N >= 1000:
        # The resealed mutations reach every stage, so the checks behind the MAC are exercised too.
        assert by_stage["rejected: Reassembly.add"] > 0
        assert by_stage["accepted"] > 0
        assert outcomes["resealed", "rejected: open_packet"] > 0


def test_every_packet_has_a_nonce_of_its_own_and_a_changed_nonce_is_refused() -> None:
    header = sample_header(type=MsgType.PARTIAL)
    first, second = seal(header, b"same payload", KEY), seal(header, b"same payload", KEY)
    assert first[-TRAILER:-MAC_SIZE] != second[-TRAILER:-MAC_SIZE]
    assert open_packet(first, KEY)[1] == open_packet(second, KEY)[1] == b"same payload"
    damaged = bytearray(first)
    damaged[-TRAILER] ^= 1
    with pytest.raises(WireError, match="bad MAC"):
        open_packet(bytes(damaged), KEY)


def test_a_forked_child_does_not_repeat_its_parents_nonces() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next nonces, to the parent
        os.write(write, b"".join(seal(sample_header(), b"", KEY)[-TRAILER:-MAC_SIZE] for _ in range(100)))
        os._exit(0)
    os.close(write)
    ours = {seal(sample_header(), b"", KEY)[-TRAILER:-MAC_SIZE] for _ in range(100)}
    received = b""
    while chunk := os.read(read, 4096):
        received += chunk
    os.waitpid(pid, 0)
    theirs = {received[i:i + NONCE_SIZE] for i in range(0, len(received), NONCE_SIZE)}
    assert len(theirs) == 100 and not ours & theirs


def test_peek_parity_names_a_parity_fragments_block_and_node_before_its_mac_is_checked() -> None:
    """wire.peek_parity reads an unauthenticated header: a parity fragment's block key and node, None for a data
    fragment or anything that is not a datagram of ours. It is only for leaving needless datagrams unread."""
    from edgerun.net.wire import peek_parity

    key = derive_key("peek")
    header = Header(MsgType.PARTIAL, 7, 12, 3, int(Block.MLP), 5, codec=Codec.Q8, tokens=1)
    x = np.random.default_rng(0).standard_normal(600).astype(np.float32)
    datagrams = fragment(header, x, key, 512, parity=2)  # two data fragments, then two parity fragments
    named = ((7, 12, 3, int(Block.MLP)), 5)
    assert [peek_parity(d) for d in datagrams] == [None, None, named, named]
    forged = bytearray(datagrams[2])
    forged[-1] ^= 1  # a bad MAC does not change what the header says
    assert peek_parity(bytes(forged)) == named
    assert peek_parity(b"XY" + datagrams[2][2:]) is None  # not ours
    assert peek_parity(datagrams[2][:HEADER.size]) is None  # too short to be a datagram
    probe = fragment(header._replace(type=MsgType.PROBE), x, key, 512, parity=2)[2]
    assert peek_parity(probe) is None  # only a vector's fragments are parity
    one = fragment(header, x[:8], key, 512, parity=1)  # a one-fragment vector's parity is a copy of it
    assert [peek_parity(d) for d in one] == [None, named]


def test_parity_help_says_what_the_rule_sends() -> None:
    """--parity's help gives the loss of a two-datagram vector at 5% for each setting, and says that a six-datagram
    one (a 1B float32 vector at Ethernet's MTU) gets four parity fragments from --parity 1 on: both follow from
    parity_fragments, which the help would otherwise misstate (--parity 2, 3 and 4 send the same such vector)."""
    def lost(data: int, checks: int, rate: float = 0.05) -> float:  # more lost of the vector's datagrams than checks
        total = data + checks
        return sum(comb(total, k) * rate ** k * (1 - rate) ** (total - k) for k in range(checks + 1, total + 1))

    parser = argparse.ArgumentParser()
    parity_arg(parser)
    said = " ".join(parser.format_help().split())
    for setting, figure in [(0, "9.75%"), (1, "0.048%"), (2, "0.003%"), (3, "0.0002%")]:
        assert f"{lost(2, parity_fragments(setting, 2)):.{len(figure.split('.')[1]) - 1}%}" == figure
        assert figure in said
    assert [parity_fragments(setting, 6) for setting in range(1, MAX_PARITY + 1)] == [MAX_PARITY] * MAX_PARITY
    assert "gets 4 with any value from 1" in said
