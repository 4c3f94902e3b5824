"""Every byte edgerun puts on the network is defined here.

Datagrams and stream frames share one fixed header:

    magic "ER" | version u8 | type u8 | session u32 | position u32 | layer u16 | block u8 | node u8 |
    fragment index u16 | fragment count u16 | codec u8 | tokens u8 | element offset u32 | payload length u32

`tokens` is how many tokens' vectors an activation or partial holds (one per decode step: several-token steps
go over TCP); `node` is the sender's index for a partial and a probe's echo, 0 from the master.

followed by the payload, a 12-byte nonce and a 16-byte tag over header and payload: AES-256-GCM with nothing to
encrypt (GMAC). OpenSSL computes it with the CPU's AES and carry-less multiply instructions in 1.6 µs for a
vector's 8 KB on the device machine, where HMAC-SHA256 takes 10 µs and BLAKE2b 22 µs; a datagram's MAC is checked
and made several times per synchronization, on the critical path. A nonce must never repeat under a key: each
process counts up from a random 96-bit start (reseeded in a forked child), so two senders collide with a
probability of about (packets sent)² / 2⁹⁶. Little-endian.
A vector too long for one datagram is cut into fragments at codec-block boundaries; each fragment
names its element offset, so fragments decode independently and a lost one leaves zeros.

With dynamic unit mapping, every fragment of an activation starts with a prefix: the block's unit
ranking, one byte per unit (the unit at priority 0, 1, ...), so that each node learns which units to
compute from any fragment it receives. Both sides know the prefix length from the assignment.

A vector may be followed by a parity fragment, whose index equals the fragment count: the XOR of
the data fragments' payloads, each zero-padded to the first one's length (offset 0). Any one lost
data fragment is rebuilt from the parity and the others. Losses are mostly independent, so a vector
of k fragments is then lost only when two of its k + 1 datagrams are: at 5 % loss and k = 1 about
0.25 % of vectors instead of 5 %. The parity may be sent more than once: with two copies a
one-fragment vector (whose parity is a copy of its data) is lost only when all three datagrams are,
0.0125 % at 5 % loss; a receiver takes the first copy and ignores the others.

A parity fragment rebuilds one loss, which suits a vector of a few fragments. The mirrored blocks (the first layer
and the LM head, which must arrive whole) carry longer ones: the LM head's partial is tens of fragments, two of
which go missing at 5 % loss more often than not. Their receiver asks for what did not come with a RESEND
datagram (`Resend`: its payload the missing fragments' indices, u16 each, none meaning all), and the sender seals
those fragments again.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import math
import os
import struct
from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum, IntEnum, StrEnum
from typing import Any, NamedTuple

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from edgerun.net import erasure

MAGIC = b"ER"
VERSION = 5  # 2: HMAC-SHA256 instead of keyed BLAKE2b; 3: typed control messages, a tokens field, PROBE; 4: GMAC;
# 5: a vector's parity fragments are distinct (net.erasure), not copies of one XOR
MAC_SIZE = 16
NONCE_SIZE = 12
TRAILER = NONCE_SIZE + MAC_SIZE  # after a datagram's or frame's payload: the nonce, then the tag
HEADER = struct.Struct("<2sBBIIHBBHHBBII")
MAX_UDP_PAYLOAD = 65507  # IPv4's largest datagram less its IP and UDP headers
MAX_FRAME = 64 * 1024 * 1024  # stream frames larger than this are refused
Q8_BLOCK = 32
Q8_BLOCK_BYTES = 2 + Q8_BLOCK  # f16 scale + 32 int8


class WireError(ValueError):
    """A packet or frame that must be dropped: malformed, forged, or of another version."""


class BadMac(WireError):
    """A packet or frame whose MAC does not check: forged, corrupted, or sealed with another cluster key."""


class KeyRejected(WireError):
    """The master refused this node's registration because it failed authentication: the keys differ."""


def wrong_key(e: WireError) -> KeyRejected:
    """A worker whose master's first frame fails its check: they hold different cluster keys."""
    return KeyRejected(f"the master's frames fail this worker's check ({e}): the master has another cluster key; "
                       "give both the same --key (or $EDGERUN_KEY)")


def not_admitted(e: Exception | None) -> KeyRejected:
    """A worker whose connection the master closed before one frame of it passed the worker's check: most often
    the keys differ (the master refuses a hello it cannot check)."""
    reason = "" if e is None else f" ({e})"
    return KeyRejected(f"the master closed the connection before admitting this worker{reason}; does it have the "
                       "same cluster key (--key or $EDGERUN_KEY)?")


# What a master writes, in place of a frame's length, to a connection whose registration failed authentication,
# before closing it: a length no frame has. It cannot be authenticated (the two sides share no key), so a node
# treats it only as the reason its join failed.
KEY_REJECTED = b"\xff\xff\xff\xff"


class MsgType(IntEnum):
    ACTIVATION = 1  # master -> node: a block's normalized input
    PARTIAL = 2  # node -> master: the node's partial block output
    CONTROL = 4  # a control message (tp.messages) on the reliable channel
    PROBE = 6  # master -> node -> master: a link-loss probe the node echoes
    RESEND = 7  # a request for the fragments of a mirrored block's vector that did not come (Resend)


class Block(IntEnum):
    ATTN = 0
    MLP = 1
    HEAD = 2  # LM head


class Codec(IntEnum):
    F32 = 0
    F16 = 1
    Q8 = 2  # blocks of 32 int8 with one f16 scale


_MSG_TYPES = {m.value: m for m in MsgType}
_CODECS = {c.value: c for c in Codec}
_BLOCKS = {b.value: b for b in Block}


class Header(NamedTuple):
    """A packet's fixed header. A typed named tuple rather than a frozen dataclass: one is made for every
    datagram sent and received, and a tuple is built in a tenth of the time."""

    type: MsgType
    session: int
    position: int = 0
    layer: int = 0
    block: int = 0
    node: int = 0
    frag_index: int = 0
    frag_count: int = 1
    codec: Codec = Codec.F32
    tokens: int = 0  # vectors in an activation or partial
    offset: int = 0  # element offset of this fragment within the vector
    length: int = 0  # payload bytes

    def pack(self) -> bytes:
        return HEADER.pack(*self.pack_fields())

    def pack_fields(self) -> tuple:
        """HEADER's fields, in its order."""
        return (MAGIC, VERSION, self.type, self.session, self.position, self.layer, self.block, self.node,
                self.frag_index, self.frag_count, self.codec, self.tokens, self.offset, self.length)


def cluster_mac(key: bytes, data: bytes) -> bytes:
    """HMAC-SHA256, truncated: the pipeline frames' MAC, which browsers compute with WebCrypto."""
    return hmac.digest(key, data, "sha256")[:MAC_SIZE]


_gmacs: dict[bytes, AESGCM] = {}  # one cipher per cluster key (its key schedule is made once)
_nonces = itertools.count(int.from_bytes(os.urandom(NONCE_SIZE), "little"))


def _reseed_nonces() -> None:
    global _nonces
    _nonces = itertools.count(int.from_bytes(os.urandom(NONCE_SIZE), "little"))


os.register_at_fork(after_in_child=_reseed_nonces)  # a forked child must not repeat its parent's nonces


def _gmac(key: bytes) -> AESGCM:
    cipher = _gmacs.get(key)
    if cipher is None:
        cipher = _gmacs[key] = AESGCM(key)
    return cipher


def _nonce() -> bytes:
    return (next(_nonces) & ((1 << 96) - 1)).to_bytes(NONCE_SIZE, "little")


def authenticate(body: bytes, key: bytes) -> bytes:
    """body, a fresh nonce and the GMAC tag of body under it."""
    nonce = _nonce()
    return body + nonce + _gmac(key).encrypt(nonce, b"", body)


def derive_key(secret: str | None) -> bytes:
    """The MAC key from the cluster secret; without one every node uses the same public key, which still
    rejects corrupted and foreign packets but not forged ones."""
    return hashlib.sha256(b"edgerun cluster key\0" + (secret or "").encode()).digest()


def seal(header: Header, payload: bytes, key: bytes) -> bytes:
    return _sealed(header, header.frag_index, header.frag_count, header.offset, payload, key)


def _sealed(header: Header, frag_index: int, frag_count: int, offset: int, payload: bytes, key: bytes) -> bytes:
    """header with these fragment fields and the payload's length, the payload and its MAC (no dataclass copies:
    this runs for every datagram)."""
    body = HEADER.pack(MAGIC, VERSION, header.type, header.session, header.position, header.layer, header.block,
                       header.node, frag_index, frag_count, header.codec, header.tokens, offset, len(payload)) + payload
    return authenticate(body, key)


def open_packet(data: bytes, key: bytes) -> tuple[Header, bytes]:
    """Check and split one datagram or frame; raise WireError for anything not to be trusted."""
    return _checked_header(data, key), data[HEADER.size:-TRAILER]


def open_frame(data: bytes, key: bytes) -> tuple[Header, memoryview]:
    """open_packet for a stream frame: its payload a view of `data`, not a copy (a prefill's vectors are
    hundreds of kilobytes, each copy of which costs a block 0.1-0.3 ms on the path)."""
    return _checked_header(data, key), memoryview(data)[HEADER.size:-TRAILER]


def _checked_header(data: bytes, key: bytes) -> Header:
    if len(data) < HEADER.size + TRAILER:
        raise WireError(f"too short ({len(data)} bytes)")
    view = memoryview(data)
    try:
        _gmac(key).decrypt(view[-TRAILER:-MAC_SIZE], view[-MAC_SIZE:], view[:-TRAILER])
    except InvalidTag:
        raise BadMac("bad MAC") from None
    magic, version, mtype, session, position, layer, block, node, index, count, codec, tokens, offset, length = \
        HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError("bad magic")
    if version != VERSION:
        raise WireError(f"protocol version {version}, expected {VERSION}")
    if length != len(data) - HEADER.size - TRAILER:
        raise WireError(f"payload length {length} does not match {len(data) - HEADER.size - TRAILER}")
    try:  # the members by value from tables: an enum's own lookup costs a few microseconds per datagram
        header = Header(_MSG_TYPES[mtype], session, position, layer, block, node, index, count, _CODECS[codec],
                        tokens, offset, length)
    except KeyError as e:
        raise WireError(f"{e.args[0]} is not a valid {'MsgType' if mtype not in _MSG_TYPES else 'Codec'}") from e
    if count == 0 or index >= count + MAX_PARITY:  # index count + j: parity fragment j
        raise WireError(f"fragment {index} of {count}")
    return header


_F32 = np.dtype("<f4")


def as_f32(x: np.ndarray) -> np.ndarray:
    """x as C-ordered little-endian float32: x itself where it is one already (a block's output, a hidden state),
    without a numpy call. On the per-block path every call counts: right after a block's kernel has streamed its
    weights through the caches one costs 10-20 µs."""
    if x.dtype == _F32 and x.flags.c_contiguous:
        return x
    return np.ascontiguousarray(x, _F32)


def encode_vector(x: np.ndarray, codec: Codec) -> bytes:
    if codec == Codec.F32:
        return as_f32(x).tobytes()  # C order: the elements as reshape(-1) lists them
    x = as_f32(x).reshape(-1)
    if codec == Codec.F16:
        return x.astype("<f2").tobytes()
    pad = -x.size % Q8_BLOCK
    blocks = np.concatenate([x, np.zeros(pad, np.float32)]).reshape(-1, Q8_BLOCK)
    # ggml's quantizer of a product's activations (quantize_row_q8_0 and _q8_1 on x86), in float32: the scale
    # max|x| / 127 as f16, each value times 127 / max|x| rounded to the nearest, ties to even. A node's ggml
    # quantizes the decoded block back into these very bytes (exact_q8_inputs), so an input that goes as Q8 gives
    # the node's products the bits its float32 would.
    top = np.abs(blocks).max(axis=1)
    scale = (top / np.float32(127)).astype("<f2")
    inverse = np.divide(np.float32(127), top, out=np.zeros_like(top), where=top != 0)
    q = np.clip(np.rint(blocks * inverse[:, None]), -127, 127).astype(np.int8)
    out = np.empty((blocks.shape[0], Q8_BLOCK_BYTES), np.uint8)
    out[:, :2] = scale.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out.tobytes()


def payload_bytes(codec: Codec, n: int) -> int:
    """Bytes that n elements take in a codec."""
    if codec == Codec.Q8:
        return -(-n // Q8_BLOCK) * Q8_BLOCK_BYTES
    return n * (4 if codec == Codec.F32 else 2)


def decode_vector(payload: bytes, codec: Codec, n: int) -> np.ndarray:
    """Decode n elements; raise WireError when the payload does not hold exactly that many."""
    if len(payload) != payload_bytes(codec, n):
        raise WireError(f"{len(payload)} bytes for {n} {codec.name} values")
    if codec == Codec.F32 or codec == Codec.F16:
        return np.frombuffer(payload, "<f4" if codec == Codec.F32 else "<f2").astype(np.float32)
    nblocks = -(-n // Q8_BLOCK)
    raw = np.frombuffer(payload, np.uint8).reshape(nblocks, Q8_BLOCK_BYTES)
    # views of the payload, no copies, and one pass that writes the floats: a prompt's input (64 rows of a 1B's
    # 2048), decoded with cold caches as a node does after a block's kernels, took 189 µs so against 274 with copies
    out = np.empty((nblocks, Q8_BLOCK), np.float32)
    np.multiply(raw[:, 2:].view(np.int8), raw[:, :2].view("<f2").astype(np.float32), out=out)
    return out.reshape(-1)[:n]


def elements_per_fragment(codec: Codec, mtu_payload: int, prefix: int = 0) -> int:
    """The most elements one datagram carries after a prefix of `prefix` bytes, a whole number of
    codec blocks."""
    room = mtu_payload - HEADER.size - TRAILER - prefix
    if codec == Codec.Q8:
        return max(1, room // Q8_BLOCK_BYTES) * Q8_BLOCK
    return max(1, room // (4 if codec == Codec.F32 else 2))


MAX_PARITY = 4  # parity fragments a vector may have (the erasure code rebuilds any two lost; see net.erasure)


def parity_fragments(parity: int, count: int) -> int:
    """Parity fragments the engine sends after a vector of `count` data fragments on a link of `parity` (--parity):
    one more for every two data fragments, at most MAX_PARITY, so that a long vector is about as safe as a short
    one (fastpath.c's parity_fragments is this one). At 5 % loss a
    float32 vector of 2048 elements cut at a 1500-byte MTU (six data fragments) was lost 0.5 % of the time with two,
    and at 8 devices on the device's testbed 66 blocks in 1056 merged incomplete; with four, 0.006 %."""
    return 0 if parity == 0 else min(MAX_PARITY, parity + count // 2)


def fragments_of(codec: Codec, elements: int, mtu_payload: int, prefix: int = 0) -> int:
    """The data fragments `fragment` cuts a vector of this many elements into."""
    return -(-elements // elements_per_fragment(codec, mtu_payload, prefix))


def check_parity(fragments: int) -> None:
    """ValueError unless a vector may take `fragments` parity fragments (a receiver refuses indices beyond them)."""
    if not 0 <= fragments <= MAX_PARITY:
        raise ValueError(f"parity fragments must be 0 to {MAX_PARITY}, not {fragments}")


def is_parity(header: Header) -> bool:
    """A parity fragment: index frag_count + j for parity fragment j."""
    return header.frag_index >= header.frag_count


# HEADER's type, session, position, layer, block, node, frag index and frag count
_PARITY_PEEK = struct.Struct("<3xBIIHBBHH")
_VECTORS = (int(MsgType.ACTIVATION), int(MsgType.PARTIAL))


def peek_parity(data: bytes) -> tuple[tuple[int, int, int, int], int] | None:
    """The block key (session, position, layer, block) and node of a datagram whose header says it is a parity
    fragment, read before its MAC is checked; None for any other datagram. Unauthenticated: only to leave unread
    a parity fragment of a vector its receiver already holds whole, which it would drop once authentic anyway (a
    forged header can at most name such a vector, and a forged datagram is dropped either way). With parity on,
    a lossy link's every vector brings two of them after its data, and checking each one's MAC on the master
    holds up the partials queued behind them."""
    if len(data) < HEADER.size + TRAILER or data[:2] != MAGIC:
        return None
    mtype, session, position, layer, block, node, index, count = _PARITY_PEEK.unpack_from(data)
    return ((session, position, layer, block), node) if index >= count and mtype in _VECTORS else None


def fragment(header: Header, x: np.ndarray, key: bytes, mtu_payload: int = 1472, parity: int = 0,
             prefix: bytes = b"", only: Collection[int] | None = None) -> list[bytes]:
    """A vector as sealed datagrams that each fit `mtu_payload` bytes (1472: a 1500-byte Ethernet MTU
    less IPv4 and UDP headers), each payload starting with `prefix`, then `parity` parity fragments (a link's
    senders take parity_fragments of its parity), from which a receiver rebuilds as many lost fragments
    (net.erasure; those of a one-fragment vector are copies of it). `only`: just these data fragments, no parity
    (what a Resend asks for; indices beyond the vector's are left out)."""
    check_parity(parity)
    x = as_f32(x)
    per = elements_per_fragment(header.codec, mtu_payload, len(prefix))
    if x.size <= per and only is None:  # one datagram holds it all (loopback, small vectors): the common case
        payload = prefix + encode_vector(x, header.codec)
        return [_sealed(header, i, 1, 0, payload, key) for i in range(1 + int(parity))]
    x = x.reshape(-1)
    count = -(-x.size // per)

    def payload(i: int) -> bytes:
        return prefix + encode_vector(x[i * per:(i + 1) * per], header.codec)

    if only is not None:
        return [_sealed(header, i, count, i * per, payload(i), key) for i in sorted(set(only)) if 0 <= i < count]
    payloads = [payload(i) for i in range(count)]
    datagrams = [_sealed(header, i, count, i * per, p, key) for i, p in enumerate(payloads)]
    size = len(payloads[0])  # the first fragment is the longest
    datagrams += [_sealed(header, count + j, count, 0, erasure.check_fragment(payloads, j, size), key)
                  for j in range(int(parity))]
    return datagrams


def whole_vector(header: Header, payload: bytes, total: int, prefix: int = 0) -> np.ndarray | None:
    """The `total`-element vector of a datagram that holds all of it (the only data fragment of its vector, or a
    parity fragment of it, which is then a copy), decoded: most vectors travel so, and need no Reassembly. None for
    any other datagram, and for one whose payload does not hold exactly `prefix` bytes and `total` elements."""
    if header.frag_count != 1 or header.offset != 0 or len(payload) != prefix + payload_bytes(header.codec, total):
        return None
    if header.codec == Codec.F32:
        return np.frombuffer(payload, "<f4", total, prefix)
    return decode_vector(payload[prefix:], header.codec, total)


MAX_RESEND_FRAGMENTS = 4096  # a Resend names at most this many fragments (an LM-head partial of 16,384 floats is
# 45 datagrams of 1472 bytes)
RESEND_INDEX = np.dtype("<u2")


@dataclass(frozen=True)
class Resend:
    """A request for the data fragments of a mirrored block's vector that did not come: master -> node for the
    node's partial, node -> master for the node's input (`node` is the node's index either way). No fragments
    named: every one of them. Such a block's TCP copy would bring the vector too, but on a lossy link a TCP
    stream takes tens of milliseconds to recover a lost segment; a Resend takes a round trip."""

    session: int
    position: int
    layer: int
    block: Block
    node: int
    fragments: tuple[int, ...] = ()

    def seal(self, key: bytes) -> bytes:
        header = Header(MsgType.RESEND, self.session, self.position, self.layer, self.block, self.node)
        return seal(header, np.asarray(self.fragments, RESEND_INDEX).tobytes(), key)

    @classmethod
    def open(cls, header: Header, payload: bytes) -> Resend:
        """The request a RESEND datagram (opened with open_packet) carries; WireError if it is malformed."""
        if len(payload) % RESEND_INDEX.itemsize or len(payload) > MAX_RESEND_FRAGMENTS * RESEND_INDEX.itemsize:
            raise WireError(f"a resend request of {len(payload)} bytes")
        if header.block not in _BLOCKS or header.frag_count != 1:
            raise WireError(f"a resend request for block {header.block}, fragment count {header.frag_count}")
        fragments = tuple(int(i) for i in np.frombuffer(payload, RESEND_INDEX))
        return cls(header.session, header.position, header.layer, _BLOCKS[header.block], header.node, fragments)


def fragment_size(header: Header, total: int, mtu_payload: int = 1472, prefix: int = 0) -> int:
    """Elements in data fragment `header.frag_index` of a `total`-element vector."""
    per = elements_per_fragment(header.codec, mtu_payload, prefix)
    return max(0, min(per, total - header.frag_index * per))


class Added(Enum):
    """What a fragment did to a reassembly."""

    DUPLICATE = "duplicate"  # seen before
    STORED = "stored"  # kept; the vector is not complete yet, or was already
    COMPLETED = "completed"  # the vector is complete now (reported once per vector)


class Reassembly:
    """Collects one vector's fragments; what never arrives stays zero. With `prefix` > 0 every
    fragment starts with that many bytes, kept in `prefix_bytes` from the first fragment in."""

    def __init__(self, total: int, mtu_payload: int = 1472, prefix: int = 0) -> None:
        self.vector = np.zeros(total, np.float32)
        self.total = total
        self.mtu_payload = mtu_payload
        self.prefix = prefix
        self.prefix_bytes: bytes | None = None
        self.received: set[int] = set()  # data fragments in the vector, rebuilt ones included
        self.payloads: dict[int, bytes] = {}  # payloads as they came by fragment index, parity included, for a rebuild
        self.count: int | None = None
        self.codec: Codec | None = None
        self.recovered = False  # data fragments were rebuilt from the parity

    def add(self, header: Header, payload: bytes) -> Added:
        """Take a fragment. Raise WireError if it does not fit this vector."""
        if self.count is not None and header.frag_count != self.count:
            raise WireError(f"fragment count {header.frag_count}, expected {self.count}")
        if self.codec is not None and header.codec != self.codec:
            raise WireError(f"codec {header.codec.name}, expected {self.codec.name}")
        per = elements_per_fragment(header.codec, self.mtu_payload, self.prefix)
        parity = is_parity(header)
        n = min(per, self.total) if parity else fragment_size(header, self.total, self.mtu_payload, self.prefix)
        offset = 0 if parity else header.frag_index * per
        if n == 0 or header.offset != offset or header.frag_count != -(-self.total // per):
            raise WireError(f"fragment {header.frag_index}/{header.frag_count} at {header.offset} "
                            f"does not fit a vector of {self.total}")
        if header.frag_index in self.payloads:
            return Added.DUPLICATE
        was_complete = self.complete
        if parity:
            if len(payload) != self.prefix + payload_bytes(header.codec, n):
                raise WireError(f"parity of {len(payload)} bytes, expected "
                                f"{self.prefix + payload_bytes(header.codec, n)}")
        else:
            self._take_data(header.frag_index, payload, n, header.codec, per)
        self.payloads[header.frag_index] = payload
        self.count = header.frag_count
        self.codec = header.codec
        if not self.complete and len(self.payloads) >= self.count:  # as many fragments in as data, parity among them
            self._rebuild(per)
        return Added.COMPLETED if self.complete and not was_complete else Added.STORED

    def _take_data(self, index: int, payload: bytes, n: int, codec: Codec, per: int) -> None:
        """Decode data fragment `index` of n elements, after the prefix if there is one."""
        if len(payload) < self.prefix:
            raise WireError(f"{len(payload)} bytes cannot hold a prefix of {self.prefix}")
        if codec == Codec.F32 and len(payload) == self.prefix + 4 * n:  # straight into the vector: one copy
            self.vector[index * per:index * per + n] = np.frombuffer(payload, "<f4", n, self.prefix)
        else:
            self.vector[index * per:index * per + n] = decode_vector(payload[self.prefix:], codec, n)
        if self.prefix and self.prefix_bytes is None:
            self.prefix_bytes = payload[:self.prefix]
        self.received.add(index)

    def _rebuild(self, per: int) -> None:
        """The missing data fragments from the parity fragments that came (net.erasure), where they determine them."""
        count = self.count
        checks = {i - count: p for i, p in self.payloads.items() if i >= count}
        size = len(next(iter(checks.values())))
        rebuilt = erasure.solve({i: p for i, p in self.payloads.items() if i < count}, checks, self.missing(), size)
        if rebuilt is None:
            return
        for index, data in rebuilt.items():
            n = min(per, self.total - index * per)
            self._take_data(index, data[:self.prefix + payload_bytes(self.codec, n)], n, self.codec, per)
        self.recovered = True

    @property
    def complete(self) -> bool:
        return self.count is not None and len(self.received) == self.count

    def missing(self) -> tuple[int, ...]:
        """The data fragments not in yet (none known before the first fragment)."""
        return () if self.count is None else tuple(sorted(set(range(self.count)) - self.received))


JSON_LENGTH = struct.Struct("<I")


FRAME_LENGTH = struct.Struct("<I")


def control_frame(session: int, text: bytes, payload: bytes | memoryview, key: bytes) -> bytearray:
    """A length-prefixed control frame: the message's JSON length (u32), its JSON text, then its binary payload
    (tp.messages encodes and decodes the messages themselves). Built in place in one buffer, the payload copied
    once: a prefill's vectors are hundreds of kilobytes, and each copy of one (of the five that concatenating the
    parts made) costs its block 0.1-0.3 ms on the path."""
    length = JSON_LENGTH.size + len(text) + len(payload)
    if length > MAX_FRAME - HEADER.size - TRAILER:
        raise ValueError(f"control message of {length} bytes exceeds a frame")
    head = bytearray(FRAME_LENGTH.size + HEADER.size + JSON_LENGTH.size)
    FRAME_LENGTH.pack_into(head, 0, HEADER.size + length + TRAILER)
    start = FRAME_LENGTH.size
    HEADER.pack_into(head, start, *Header(MsgType.CONTROL, session, length=length).pack_fields())
    JSON_LENGTH.pack_into(head, start + HEADER.size, len(text))
    nonce = _nonce()
    # Joined into one buffer of the frame's size, the tag's room last: neither zeroed first (fresh pages written
    # twice) nor grown piece by piece (each growth past the payload may copy it again). A 64-row partial of a
    # 1B (512 KB) took 80-84 µs so, against 106-191 µs either way.
    frame = bytearray().join((head, text, payload, nonce, bytes(MAC_SIZE)))
    with memoryview(frame) as view:
        frame[-MAC_SIZE:] = _gmac(key).encrypt(nonce, b"", view[start:-TRAILER])  # no plaintext: the tag alone
    return frame


def parse_control(header: Header, body: bytes | memoryview) -> tuple[bytes, bytes | memoryview]:
    """A control frame's JSON text and payload (of a view, a view: open_frame)."""
    if header.type != MsgType.CONTROL or len(body) < JSON_LENGTH.size:
        raise WireError("not a control frame")
    (n,) = JSON_LENGTH.unpack_from(body)
    if n > len(body) - JSON_LENGTH.size:
        raise WireError(f"JSON length {n} past the frame")
    return bytes(body[JSON_LENGTH.size:JSON_LENGTH.size + n]), body[JSON_LENGTH.size + n:]


def frame_length(prefix: bytes) -> int:
    if prefix == KEY_REJECTED:
        raise KeyRejected("the master rejected this node's key")
    (n,) = FRAME_LENGTH.unpack(prefix)
    if not HEADER.size + TRAILER <= n <= MAX_FRAME:
        raise WireError(f"frame length {n} out of range")
    return n


# ---------------------------------------------------------------------------------------------------
# Pipeline frames: one WebSocket binary message each, between the pipeline master and its workers
# (native processes and browser pages alike, so the MAC is HMAC-SHA256, which browsers compute with
# WebCrypto):
#
#     magic "EP" | version u8 | type u8 | request u32 | JSON length u32 | payload length u32
#
# then the JSON message, the payload (tensors' raw little-endian bytes, described in the JSON under
# "tensors": {name: {"dtype", "shape", "offset", "bytes"}}), and 16 bytes of HMAC-SHA256 over all of it.

PP_MAGIC = b"EP"
PP_VERSION = 1
PP_HEADER = struct.Struct("<2sBBIII")
PP_MAX_FRAME = 256 * 1024 * 1024  # the largest message a master or worker accepts
PP_DTYPES = {"float32": "<f4", "int64": "<i8", "int32": "<i4"}


class Transport(StrEnum):
    """How a tensor-parallel cluster's layers travel."""

    UDP = "udp"  # lossy blocks over UDP with a timeout (HALO), the first layer and the LM head reliable
    TCP = "tcp"  # everything reliable: the strict baseline


class WorkerKind(StrEnum):
    """What a pipeline or expert worker is (its CONNECT's capabilities say)."""

    NATIVE = "native"  # `edgerun node`: ggml or onnxruntime, any stage or expert
    BROWSER = "browser"  # a web page: edgerun's WebAssembly kernels or onnxruntime-web


class PpMsg(IntEnum):
    """The messages of the web-inference thesis §4.4.2, plus ERROR (a worker's report of a failed request)."""

    INIT = 1  # master -> worker: shared state; answered by CONNECT
    CONNECT = 2  # worker -> master: name, memory, speed, capabilities, cached files
    DOWNLOAD_LAYERS = 3  # master -> worker: fetch these files ahead of an assignment
    LAYER_DOWNLOAD = 4  # worker -> master: one file fetched, and how long it took
    PREPARE_MODEL = 5  # master -> worker: the stage's layer range and file URLs
    PREPARE_DONE = 6
    COMMIT_MODEL = 7  # master -> worker: load the stage (an inference session)
    COMMIT_DONE = 8
    COMPUTATION = 9  # master -> worker: input tensors of a forward pass
    COMPUTATION_RESULT = 10  # worker -> master: output tensors (or the token id) and the time taken
    INVALIDATE_CACHE = 11  # master -> worker: forget a request's KV cache
    RELEASE_SESSION = 12  # master -> worker: drop the stage and every cache
    ERROR = 13  # worker -> master: a message it could not carry out, and why
    PING = 14  # master -> worker: answered at once with PONG (latency, measured over the worker's own WebSocket)
    PONG = 15
    KV_FETCH = 16  # master -> worker: one layer's KV rows of the positions cached; answered by KV_DATA
    KV_DATA = 17
    KV_LOAD = 18  # master -> worker: one layer's KV rows to continue from (a hot swap); answered by KV_LOADED
    KV_LOADED = 19
    # Tuning (edgerun tune): a worker takes a training stage instead of an inference one.
    TUNE_LOAD = 20  # master -> worker: model sha256, layer range, LoRA and optimizer settings, checkpoint tensors
    TUNE_LOADED = 21
    TUNE_FORWARD = 22  # master -> worker: a micro-batch's input (the last stage: with labels, answered with loss)
    TUNE_OUTPUT = 23  # worker -> master: the output hidden state, or the loss and the input's gradient
    TUNE_BACKWARD = 24  # master -> worker: the gradient of a micro-batch's output; answered by TUNE_GRAD
    TUNE_GRAD = 25  # worker -> master: the gradient of that micro-batch's input (none from the first stage)
    TUNE_STEP = 26  # master -> worker: apply the accumulated gradients (AdamW); answered by TUNE_STEPPED
    TUNE_STEPPED = 27
    TUNE_STATE = 28  # master -> worker: the LoRA matrices and optimizer moments, for a checkpoint
    TUNE_STATE_DATA = 29
    TUNE_EVAL = 30  # master -> worker: a forward pass without dropout or gradient; answered by TUNE_OUTPUT
    # Chained passes (pp.passes) go over a worker's pass port, plain TCP, as pp_stream packets.
    PASS_HELLO = 31  # master -> worker, first on its link to the pass port, and the answer: results go back on it
    # A batch (pp.batch): a sequence's slot takes another's cached prompt rows; answered by SLOT_COPIED.
    SLOT_COPY = 32
    SLOT_COPIED = 33
    # A batch's pass (pp.batch, ggml's stages): one position of each of several sequences, or a prompt's chunk.
    BATCH_COMPUTATION = 34
    BATCH_RESULT = 35


def pp_frame(kind: PpMsg, request: int, message: dict[str, Any], key: bytes,
             tensors: dict[str, np.ndarray] | None = None) -> bytes:
    """A sealed pipeline frame; `tensors` travel in the payload, described in message["tensors"]."""
    described, chunks, offset = {}, [], 0
    for name, array in (tensors or {}).items():
        dtype = str(array.dtype)
        if dtype not in PP_DTYPES:
            raise ValueError(f"tensor {name}: dtype {dtype} does not travel (only {', '.join(PP_DTYPES)})")
        raw = np.ascontiguousarray(array, PP_DTYPES[dtype]).tobytes()
        described[name] = {"dtype": dtype, "shape": list(array.shape), "offset": offset, "bytes": len(raw)}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps({**message, "tensors": described} if tensors else message, separators=(",", ":")).encode()
    payload = b"".join(chunks)
    body = PP_HEADER.pack(PP_MAGIC, PP_VERSION, kind, request, len(text), len(payload)) + text + payload
    return body + cluster_mac(key, body)  # HMAC-SHA256, as browsers compute it with WebCrypto


def open_pp_frame(data: bytes, key: bytes) -> tuple[PpMsg, int, dict[str, Any], dict[str, np.ndarray]]:
    """Check and split one pipeline frame; raise WireError for anything not to be trusted."""
    if len(data) < PP_HEADER.size + MAC_SIZE:
        raise WireError(f"frame too short ({len(data)} bytes)")
    if len(data) > PP_MAX_FRAME:
        raise WireError(f"frame of {len(data)} bytes exceeds {PP_MAX_FRAME}")
    body, mac = data[:-MAC_SIZE], data[-MAC_SIZE:]
    if not hmac.compare_digest(mac, cluster_mac(key, body)):
        raise WireError("bad MAC (wrong cluster key?)")
    magic, version, kind, request, text_len, payload_len = PP_HEADER.unpack_from(body)
    if magic != PP_MAGIC:
        raise WireError("bad magic")
    if version != PP_VERSION:
        raise WireError(f"pipeline protocol version {version}, expected {PP_VERSION}")
    if PP_HEADER.size + text_len + payload_len != len(body):
        raise WireError("lengths do not match the frame")
    try:
        kind = PpMsg(kind)
        message = json.loads(body[PP_HEADER.size:PP_HEADER.size + text_len])
    except (ValueError, RecursionError) as e:
        raise WireError(f"bad frame: {str(e)[:80]}") from e
    if not isinstance(message, dict):
        raise WireError("the message is not a JSON object")
    payload = body[PP_HEADER.size + text_len:]
    tensors = {}
    described = message.get("tensors", {})
    if not isinstance(described, dict):
        raise WireError("tensors must be described by name")
    for name, d in described.items():
        try:
            dtype, shape, offset, size = PP_DTYPES[d["dtype"]], tuple(int(n) for n in d["shape"]), int(d["offset"]), \
                int(d["bytes"])
        except (KeyError, TypeError, ValueError) as e:
            raise WireError(f"tensor {name!r}: bad description") from e
        count = math.prod(shape)  # not np.prod: 40 times slower on a tuple, once per tensor per hop
        if min(shape, default=0) < 0 or offset < 0 or size != count * np.dtype(dtype).itemsize or \
                offset + size > len(payload):
            raise WireError(f"tensor {name!r} does not fit the payload")
        tensors[name] = np.frombuffer(payload, dtype, count, offset).reshape(shape)
    return kind, request, message, tensors


# On a worker's pass port (plain TCP: a chained route's passes, pp.passes) each frame goes as a packet:
#
#     frame length u32 | pipeline frame (as above, HMAC and all)

PP_STREAM_LENGTH = struct.Struct("<I")


def pp_packet(frame: bytes) -> bytes:
    """A pipeline frame as it goes over a pass port's stream."""
    return PP_STREAM_LENGTH.pack(len(frame)) + frame


class PpStream:
    """Cuts a pass port's byte stream into pipeline frames (still sealed: open each with open_pp_frame)."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.broken: str | None = None  # why the stream can no longer be cut into frames

    def feed(self, data: bytes) -> list[bytes]:
        """The frames completed by `data`. A length no frame may have breaks the stream: `broken` says so, and
        nothing more comes out of it."""
        if self.broken is not None:
            return []
        self.buffer += data
        frames = []
        while len(self.buffer) >= PP_STREAM_LENGTH.size:
            (n,) = PP_STREAM_LENGTH.unpack_from(self.buffer)
            if not PP_HEADER.size + MAC_SIZE <= n <= PP_MAX_FRAME:
                self.broken = f"frame length {n} out of range"
                self.buffer.clear()
                break
            end = PP_STREAM_LENGTH.size + n
            if len(self.buffer) < end:
                break
            frames.append(bytes(self.buffer[PP_STREAM_LENGTH.size:end]))
            del self.buffer[:end]
        return frames
