"""The block exchange's native data path (fastpath.c, compiled by the install into `_fastpath*.so` beside this file):
sealing and sending a one-datagram vector to every node of a block, and taking a block's one-datagram partials off
the socket until it is whole or its deadline passes, then their sum, with no Python per datagram.

It is loaded with ctypes (each call releases the GIL) and keyed with the cluster key; the GMAC is OpenSSL's, from the
libcrypto this process has loaded (hashlib links it). `FastPath.load(key)` is None where the library was not built,
no libcrypto is loaded, or EDGERUN_NATIVE=0 asks for the Python path: everything then runs as it did, datagram by
datagram in Python, with the same bytes on the wire and the same sums.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import math
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

import numpy as np

from edgerun.net.wire import (
    HEADER,
    MAX_UDP_PAYLOAD,
    NONCE_SIZE,
    TRAILER,
    Codec,
    Header,
    elements_per_fragment,
    fragments_of,
    payload_bytes,
)

_f32p = ctypes.POINTER(ctypes.c_float)
_u8p = ctypes.POINTER(ctypes.c_uint8)


class _Head(ctypes.Structure):
    _fields_ = [("session", ctypes.c_uint32), ("position", ctypes.c_uint32), ("layer", ctypes.c_uint16),
                ("type", ctypes.c_uint8), ("block", ctypes.c_uint8), ("node", ctypes.c_uint8),
                ("codec", ctypes.c_uint8), ("tokens", ctypes.c_uint8)]


class _Addr(ctypes.Structure):
    _fields_ = [("ip", ctypes.c_uint32), ("port", ctypes.c_uint16)]


class _Gather(ctypes.Structure):
    _fields_ = [("session", ctypes.c_uint32), ("position", ctypes.c_uint32), ("layer", ctypes.c_uint16),
                ("block", ctypes.c_uint8), ("pad", ctypes.c_uint8), ("n", ctypes.c_int32),
                ("nodes", _u8p), ("sizes", ctypes.POINTER(ctypes.c_int32)), ("parts", ctypes.POINTER(_f32p)),
                ("arrived", ctypes.POINTER(ctypes.c_double)), ("outstanding", ctypes.c_int32),
                ("from_parity", ctypes.c_int32), ("deadline", ctypes.c_double), ("lag_bound", ctypes.c_double),
                ("spin_s", ctypes.c_double), ("watch", ctypes.POINTER(ctypes.c_int32)), ("nwatch", ctypes.c_int32),
                ("skipped", ctypes.c_int32), ("other", _u8p), ("other_cap", ctypes.c_int32),
                ("other_len", ctypes.c_int32), ("other_at", ctypes.c_double), ("other_ip", ctypes.c_uint32),
                ("other_port", ctypes.c_uint16), ("skip_old_parity", ctypes.c_int32), ("join", ctypes.c_int32),
                ("fresh", ctypes.c_int32), ("joins", ctypes.c_void_p)]


OTHER_BYTES = 65536  # room for a datagram the native path hands back: more than any edgerun sends


def _room_for_other(native: _Gather | _Node) -> ctypes.Array:
    """The buffer where the native path leaves a datagram it hands back, wired into `native`."""
    buffer = ctypes.create_string_buffer(OTHER_BYTES)
    native.other, native.other_cap = ctypes.cast(buffer, _u8p), OTHER_BYTES
    return buffer


def _room_for_joins(path: FastPath, vectors: int) -> ctypes.Array:
    """Room for the joining state of this many vectors cut into fragments (fastpath.c's `joined`), zeroed."""
    return ctypes.create_string_buffer(path.lib.er_joined_bytes() * vectors)


def _handed_back(buffer: ctypes.Array, native: _Gather | _Node) -> tuple[bytes, float, tuple[str, int]]:
    """A datagram the native path handed back (in `buffer`, as `native` describes it): its bytes, when it arrived
    (perf_counter time) and where from."""
    return (buffer.raw[:native.other_len], native.other_at,
            (socket.inet_ntoa(struct.pack("=I", native.other_ip)), socket.ntohs(native.other_port)))


class GatherEnd(IntEnum):
    """Why er_gather_run returned."""

    WHOLE = 0  # every partial is in
    TIME = 1  # the deadline passed
    STREAM = 2  # a watched TCP stream has data: the event loop must read it
    OTHER = 3  # a datagram the native path does not take (GatherState.other): the Python path handles it


def library_path() -> Path | None:
    """The compiled data path beside this file, if the install built it."""
    found = sorted(glob.glob(str(Path(__file__).with_name("_fastpath")) + "*.so"))
    return Path(found[0]) if found else None


def loaded_libcrypto() -> str | None:
    """The libcrypto this process has mapped (hashlib's), by path: the one whose AES this data path uses; else the
    system's (a Python that carries OpenSSL inside itself maps none)."""
    import hashlib  # noqa: F401  (links libcrypto where Python was built with OpenSSL)

    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libcrypto.so" in path:
                    return path
    except OSError:
        pass
    return ctypes.util.find_library("crypto")


@functools.cache
def _library() -> ctypes.CDLL | None:
    path = library_path()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    lib.er_new.restype = ctypes.c_void_p
    lib.er_new.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p]
    lib.er_free.argtypes = [ctypes.c_void_p]
    lib.er_seal.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.er_verify.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.er_encode.argtypes = [ctypes.c_int, _f32p, ctypes.c_int, ctypes.c_char_p]
    lib.er_decode.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, _f32p]
    lib.er_decode.restype = None
    lib.er_send_group.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Head), ctypes.c_char_p,
                                  ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Addr), ctypes.c_int,
                                  ctypes.c_int, _u8p, ctypes.POINTER(_Addr), _u8p, ctypes.c_int]
    lib.er_gather_run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Gather)]
    lib.er_joined_bytes.argtypes = []
    lib.er_gf_mul_add.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.er_gf_mul_add.restype = None
    lib.er_run_blocks.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.er_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float]
    lib.er_rms_norm.restype = None
    lib.er_node_serve.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _floats(x: np.ndarray) -> ctypes._Pointer:
    return x.ctypes.data_as(_f32p)


def fits(codec: Codec, elements: int, prefix: int, datagram_bytes: int) -> bool:
    """Whether a vector of this many elements (after `prefix` bytes) goes as one datagram of at most
    `datagram_bytes`: what send_vector sends."""
    return HEADER.size + prefix + payload_bytes(codec, elements) + TRAILER <= datagram_bytes


# What fastpath.c cuts and joins (its MAX_FRAGS, MAX_FRAG_PAYLOAD and FRAG_SLOTS): a lossy link's vector of at most
# this many data fragments, each of at most this many payload bytes, for at most this many nodes of a block.
NATIVE_FRAGMENTS = 16
NATIVE_FRAGMENT_PAYLOAD = 4096
NATIVE_JOINS = 32


def cuts_natively(codec: Codec, elements: int, datagram_bytes: int) -> bool:
    """Whether the native data path cuts (and joins) a vector of this many elements (no prefix) at `datagram_bytes`,
    as wire.fragment cuts it."""
    per = elements_per_fragment(codec, datagram_bytes)
    return (fragments_of(codec, elements, datagram_bytes) <= NATIVE_FRAGMENTS
            and payload_bytes(codec, per) <= NATIVE_FRAGMENT_PAYLOAD)


def one_datagram_bytes(path_bytes: int, parity: int, tokens: int = 1) -> int:
    """The longest datagram a vector of `tokens` tokens may go as, natively, on a link whose path carries UDP
    payloads of `path_bytes` in one IP packet and whose vectors take `parity` parity fragments. A clean link's
    one-token vectors (no parity) may take IPv4's longest: the kernel cuts a datagram longer than the path MTU
    into IP fragments and joins them again at the other end, so the native data path (one datagram a vector) runs
    on Ethernet's 1500-byte MTU too, where a float32 vector of 576 elements already takes two packets. A lossy
    link's vectors are cut to the path by edgerun itself (wire.fragment), each fragment decoded on its own: an
    IP-fragmented datagram is lost whole with any one of its packets, and a receiving kernel keeps each
    half-joined datagram for ipfrag_time (30 s) until its fragment memory is full, after which it drops every
    fragment. A prompt's vectors are cut to the path too: tens of packets, of which one lost would lose them
    all."""
    return MAX_UDP_PAYLOAD if parity == 0 and tokens == 1 else path_bytes


def native_mtu(codec: Codec, elements: int, path_bytes: int, parity: int, tokens: int = 1) -> int | None:
    """How the native data path sends a vector of this many elements (no prefix) on a link of this path and
    parity: 0, whole in one datagram (one_datagram_bytes); `path_bytes`, cut at the path as wire.fragment cuts it
    (a one-token vector that cuts_natively); None, not at all (the Python path cuts any)."""
    if fits(codec, elements, 0, one_datagram_bytes(path_bytes, parity, tokens)):
        return 0
    return path_bytes if tokens == 1 and cuts_natively(codec, elements, path_bytes) else None


def addresses(peers: Sequence[tuple[str, int]]) -> ctypes.Array:
    """Where send_vector sends, in its form: IPv4 addresses and ports, in network order."""
    out = (_Addr * len(peers))()
    for slot, (host, port) in zip(out, peers, strict=True):
        slot.ip = struct.unpack("=I", socket.inet_aton(host))[0]
        slot.port = socket.htons(port)
    return out


class FastPath:
    """The native data path under one cluster key (its own nonce counter, from a random start as wire's)."""

    def __init__(self, lib: ctypes.CDLL, ctx: int) -> None:
        self.lib, self.ctx = lib, ctx
        self._head = _Head()
        self._head_ref = ctypes.byref(self._head)

    @classmethod
    def load(cls, key: bytes) -> FastPath | None:
        """The data path for this key, or None where it cannot run here (see the module's docstring)."""
        if os.environ.get("EDGERUN_NATIVE", "1") == "0":
            return None
        lib, crypto = _library(), loaded_libcrypto()
        if lib is None or crypto is None:
            return None
        ctx = lib.er_new(crypto.encode(), key, os.urandom(NONCE_SIZE))
        return None if not ctx else cls(lib, ctx)

    def close(self) -> None:
        if self.ctx:
            self.lib.er_free(self.ctx)
            self.ctx = 0

    def __del__(self) -> None:
        self.close()

    def send_vector(self, fd: int, header: Header, x: np.ndarray, to: ctypes.Array, copies: int = 1,
                    prefix: bytes = b"", group: tuple[str, int] | None = None, grouped: Sequence[bool] = (),
                    mtu: int = 0) -> int:
        """x (float32, C order) to every address of `to` (addresses()) as the datagrams wire.fragment seals for it at
        `mtu` (0: one datagram however long) on a link of copies - 1 parity fragments (more for a cut vector:
        wire.parity_fragments): one datagram and copies of it where it fits one. With a multicast `group`, the
        datagrams go once to the group instead of to each address whose `grouped` is true. The datagrams sent; -1
        where x does not fit one datagram (or, cut, NATIVE_FRAGMENTS)."""
        h = self._head
        h.session, h.position, h.layer, h.type = header.session, header.position, header.layer, header.type
        h.block, h.node, h.codec, h.tokens = header.block, header.node, header.codec, header.tokens
        to_group = (None, None) if group is None else \
            (addresses([group]), (ctypes.c_uint8 * len(to))(*map(int, grouped)))
        return self.lib.er_send_group(self.ctx, fd, self._head_ref, prefix, len(prefix), x.ctypes.data, x.size, to,
                                      len(to), copies, None, *to_group, mtu)

    # --- for tests: each piece against the Python path's ---------------------------------------------------
    def seal(self, body: bytes) -> bytes:
        buf = ctypes.create_string_buffer(body, len(body) + 28)
        n = self.lib.er_seal(self.ctx, buf, len(body))
        return buf.raw[:n]

    def verify(self, data: bytes) -> bool:
        return self.lib.er_verify(self.ctx, data, len(data)) == 1

    def encode(self, codec: Codec, x: np.ndarray) -> bytes:
        x = np.ascontiguousarray(x, np.float32)
        buf = ctypes.create_string_buffer(4 * x.size + 64)
        n = self.lib.er_encode(int(codec), _floats(x), x.size, buf)
        return buf.raw[:n]

    def gf_mul_add(self, out: np.ndarray, data: np.ndarray, c: int, simd: bool) -> None:
        """out ^= c * data over GF(2^8) (uint8 arrays of one length), byte at a time or as this CPU runs it."""
        self.lib.er_gf_mul_add(out.ctypes.data, data.ctypes.data, data.size, c, int(simd))

    def decode(self, codec: Codec, payload: bytes, n: int) -> np.ndarray:
        out = np.empty(n, np.float32)
        self.lib.er_decode(int(codec), payload, n, _floats(out))
        return out


class Gather:
    """A master's reusable state for er_gather_run: a block's participants, their partials' buffers and arrival
    times, and room for a datagram handed back."""

    def __init__(self, path: FastPath) -> None:
        self.path = path
        self.g = _Gather()
        self.other = _room_for_other(self.g)
        self.joins = _room_for_joins(path, NATIVE_JOINS)
        self.g.joins = ctypes.addressof(self.joins)
        self._shape: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        self._shapes: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple] = {}  # each shape's buffers, by shape
        self._watch = (ctypes.c_int32 * 0)()

    def start(self, key: tuple[int, int, int, int], nodes: Sequence[int], size: int | Sequence[int], deadline: float,
              lag_bound: float | None, spin_s: float, watch: Sequence[int], skip_old_parity: bool = True,
              join: bool = False) -> None:
        """A new block: every participant's partial is `size` elements (or each its own: an LM head's). Each one's
        row of `buffer` is the longest's; its partial is the row's first elements. `skip_old_parity`: parity copies
        of other blocks' partials are left unread (nothing of the block before is awaited). `join`: partials cut
        into fragments are joined (and rebuilt from their parity) here, else handed back (as the runner joins its
        lossy blocks')."""
        g = self.g
        g.skip_old_parity, g.join, g.fresh = skip_old_parity, join, 1
        g.session, g.position, g.layer, g.block = key
        n = g.n = len(nodes)
        sizes = (size,) * n if isinstance(size, int) else tuple(size)
        shape = (tuple(nodes), sizes)
        if self._shape != shape:  # the same participants block after block: set up once for each shape of block
            if shape not in self._shapes:  # (a step's first layer's and its LM head's differ)
                if len(self._shapes) >= 8:
                    self._shapes.clear()
                buffer = np.zeros((n, max(sizes, default=0)), np.float32)
                self._shapes[shape] = (buffer, (ctypes.c_uint8 * n)(*nodes), (ctypes.c_int32 * n)(*sizes),
                                       (_f32p * n)(*[_floats(buffer[i]) for i in range(n)]), np.full(n, math.nan))
            self._shape = shape
            self.buffer, self.nodes, self.sizes, self.parts, self.arrived = self._shapes[shape]
            g.nodes, g.sizes, g.parts = self.nodes, self.sizes, self.parts
            g.arrived = self.arrived.ctypes.data_as(ctypes.POINTER(ctypes.c_double))
        self.arrived.fill(math.nan)
        g.outstanding, g.from_parity, g.skipped = n, 0, 0
        g.deadline = deadline
        g.lag_bound = -1.0 if lag_bound is None else lag_bound
        g.spin_s = spin_s
        if list(self._watch) != list(watch):
            self._watch = (ctypes.c_int32 * len(watch))(*watch)
        g.watch, g.nwatch = self._watch, len(watch)

    def run(self, fd: int) -> GatherEnd:
        return GatherEnd(self.path.lib.er_gather_run(self.path.ctx, fd, ctypes.byref(self.g)))

    def handed_back(self) -> tuple[bytes, float, tuple[str, int]]:
        """The datagram of an OTHER end, when it arrived (perf_counter time) and where from."""
        return _handed_back(self.other, self.g)


class _Block(ctypes.Structure):
    _fields_ = [("layer", ctypes.c_uint16), ("block", ctypes.c_uint8), ("mirrored", ctypes.c_uint8),
                ("norm", ctypes.c_void_p), ("graph", ctypes.c_void_p), ("graph_in", ctypes.c_void_p),
                ("graph_out", ctypes.c_void_p), ("pos", ctypes.c_void_p), ("rows", ctypes.c_void_p),
                ("mask", ctypes.c_void_p), ("n_kv", ctypes.c_int32), ("first", ctypes.c_int32),
                ("count", ctypes.c_int32), ("after_send", ctypes.c_double), ("lag_bound", ctypes.c_double),
                ("input", ctypes.c_void_p), ("arrived", ctypes.c_void_p), ("sent", ctypes.c_double),
                ("computed", ctypes.c_double), ("merged", ctypes.c_double), ("own_s", ctypes.c_double),
                ("outstanding", ctypes.c_int32), ("from_parity", ctypes.c_int32), ("skipped", ctypes.c_int32),
                ("done", ctypes.c_int32)]


NativeRecord = _Block  # a runner block's record, as the caller reads it after the run


class _Runner(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int32), ("nblocks", ctypes.c_int32), ("next", ctypes.c_int32),
                ("phase", ctypes.c_int32), ("eps", ctypes.c_float), ("x", ctypes.c_void_p),
                ("blocks", ctypes.POINTER(_Block)), ("addrs", ctypes.POINTER(_Addr)), ("node_index", _u8p),
                ("copies", _u8p), ("session", ctypes.c_uint32), ("position", ctypes.c_uint32),
                ("codec", ctypes.c_uint8), ("pad", ctypes.c_uint8 * 3), ("send_fd", ctypes.c_int32),
                ("recv_fd", ctypes.c_int32), ("backend", ctypes.c_void_p), ("compute", ctypes.c_void_p),
                ("parts", ctypes.c_void_p), ("sum", ctypes.c_void_p), ("skip_first", ctypes.c_int32),
                ("g", _Gather), ("group", _Addr), ("grouped", _u8p), ("head_norm", ctypes.c_void_p),
                ("head_input", ctypes.c_void_p), ("head_first", ctypes.c_int32), ("head_count", ctypes.c_int32),
                ("head_sent", ctypes.c_double), ("mtu", ctypes.c_int32)]


class RunEnd(IntEnum):
    """Why er_run_blocks returned."""

    STREAM = 2  # a watched stream has data: the event loop must read it, then run on
    OTHER = 3  # a datagram it does not take (Runner.handed_back): the Python path handles it, then run on
    INCOMPLETE = 4  # a block ended without every partial: noted, then run on
    DONE = 5  # every block ran
    # a mirrored block (the first layer's) lacks a partial at its deadline: the Python path gets it (asking again,
    # then over the stream) and tells the gather (BlockExchange._tell_native), then run on
    MIRROR_WAIT = 8


@dataclass(frozen=True)
class NativeGraph:
    """A one-token graph of the master's share as the runner computes it: addresses of the graph and of its input
    and output in its memory; for attention, of its position, cache row and mask (n_kv float16; 0 where the graph
    reads none), which the runner writes for each token."""

    graph: int
    x: int
    out: int
    pos: int = 0
    rows: int = 0
    mask: int = 0
    n_kv: int = 0


@dataclass(frozen=True)
class NativeBlock:
    """One block of a step as the runner takes it: its RMS norm's weight (float32), the master's graph for its share
    (None: it holds no unit of it), and its participants' addresses and node indices."""

    layer: int
    block: int
    norm: np.ndarray
    graph: NativeGraph | None
    peers: tuple[tuple[str, int], ...]
    nodes: tuple[int, ...]
    mirrored: bool = False  # the first layer's: float32 both ways, and never merged without a partial


@dataclass(frozen=True)
class NativeHead:
    """The LM head's input as the runner sends it once a step's last block is merged: the final RMS norm's weight
    (float32), and the head's participants' addresses and node indices. Its partials are gathered by the caller."""

    norm: np.ndarray
    peers: tuple[tuple[str, int], ...]
    nodes: tuple[int, ...]


class Runner:
    """A step's lossy blocks run natively (er_run_blocks), with the records the caller accounts them by. `prepare`
    sets up a run of blocks (once for as long as they stay the same), `start` each step."""

    def __init__(self, path: FastPath) -> None:
        self.path = path
        self.r = _Runner()
        self.other = _room_for_other(self.r.g)
        self.joins = _room_for_joins(path, NATIVE_JOINS)
        self.r.g.joins = ctypes.addressof(self.joins)
        self.blocks: tuple[NativeBlock, ...] = ()
        self._keep: list = []  # what the C structures point into, alive while they do

    def prepare(self, blocks: Sequence[NativeBlock], hidden: int, eps: float, codec: int, send_fd: int, recv_fd: int,
                backend: int, compute: int, spin_s: float, watch: Sequence[int],
                head: NativeHead | None = None, mtu: int = 0) -> None:
        """`head`: the LM head's input is sent too, once the last block is merged (`head_input`, `head_sent`);
        its participants take the slots after the blocks'. `mtu`: the participants' path, where a block's inputs are
        cut when one of its links has parity (cuts_natively)."""
        r, n = self.r, len(blocks)
        self.blocks = tuple(blocks)
        self.head = head
        self.inputs = np.empty((n, hidden), np.float32)  # each block's input (copied out for the nodes' fetches)
        most = max((len(b.nodes) for b in blocks), default=0)
        self.arrived = np.full((n, max(1, most)), math.nan)
        self.parts = np.empty((max(1, most), hidden), np.float32)
        total = np.empty(hidden, np.float32)
        self.records = (_Block * n)()
        first = 0
        for rec, b, i in zip(self.records, blocks, range(n), strict=True):
            rec.layer, rec.block, rec.mirrored, rec.norm = b.layer, b.block, b.mirrored, b.norm.ctypes.data
            graph = b.graph or NativeGraph(0, 0, 0)
            rec.graph, rec.graph_in, rec.graph_out = graph.graph or None, graph.x, graph.out
            rec.pos, rec.rows, rec.mask, rec.n_kv = graph.pos or None, graph.rows or None, graph.mask or None, \
                graph.n_kv
            rec.first, rec.count = first, len(b.nodes)
            first += len(b.nodes)
            rec.input, rec.arrived = self.inputs[i].ctypes.data, self.arrived[i].ctypes.data
        sending = [*blocks, head] if head is not None else list(blocks)
        slots = first + (len(head.nodes) if head is not None else 0)
        peers = [p for b in sending for p in b.peers]
        addrs = addresses(peers) if peers else (_Addr * 1)()
        index = (ctypes.c_uint8 * max(1, slots))(*[i for b in sending for i in b.nodes])
        self.copies = (ctypes.c_uint8 * max(1, slots))(*([1] * slots))
        self.grouped = (ctypes.c_uint8 * max(1, slots))()
        watched = (ctypes.c_int32 * max(1, len(watch)))(*watch)
        self.head_input = np.empty((1, hidden), np.float32)
        self._keep = [addrs, index, watched, total]
        r.head_first, r.head_count = first, 0 if head is None else len(head.nodes)
        r.head_norm = None if head is None else head.norm.ctypes.data
        r.head_input, r.head_sent = self.head_input.ctypes.data, math.nan
        r.hidden, r.nblocks, r.eps, r.blocks = hidden, n, eps, self.records
        r.addrs, r.node_index, r.copies, r.grouped = addrs, index, self.copies, self.grouped
        r.codec, r.send_fd, r.recv_fd, r.backend, r.compute = codec, send_fd, recv_fd, backend, compute
        r.parts, r.sum = self.parts.ctypes.data, total.ctypes.data
        r.g.spin_s, r.g.watch, r.g.nwatch = spin_s, watched, len(watch)
        r.mtu = mtu

    def start(self, x: np.ndarray, session: int, position: int, skip_old_parity: bool = True) -> None:
        """A step on the hidden state x (float32, C order, updated in place) at this position. `skip_old_parity`:
        as Gather.start's, for its first block."""
        r = self.r
        r.x, r.session, r.position, r.next, r.phase = x.ctypes.data, session, position, 0, 0
        r.skip_first = skip_old_parity

    def set_timing(self, timing: Sequence[tuple[float, float | None]]) -> None:
        """Each block's deadline after its send and its lag bound (None: none)."""
        for rec, (after_send, lag_bound) in zip(self.records, timing, strict=True):
            rec.after_send, rec.lag_bound = after_send, -1.0 if lag_bound is None else lag_bound

    def set_copies(self, copies: Sequence[int]) -> None:
        """Datagrams each participant slot takes of a block's input: 1 + its link's parity fragments."""
        for slot, n in enumerate(copies):
            self.copies[slot] = n

    def set_group(self, group: tuple[str, int] | None, grouped: Sequence[bool]) -> None:
        """The multicast group the inputs go to (None: none), and per participant slot whether its node takes its
        input from there, its parity copies too (the most any of them takes; the rest by unicast)."""
        if group is None:
            self.r.group.port = 0
        else:
            self.r.group = addresses([group])[0]
        for slot, on in enumerate(grouped):
            self.grouped[slot] = on

    def run(self) -> RunEnd:
        end = self.path.lib.er_run_blocks(self.path.ctx, ctypes.byref(self.r))
        if end < 0:
            raise RuntimeError("ggml's graph failed in a native step")
        return RunEnd(end)

    def handed_back(self) -> tuple[bytes, float, tuple[str, int]]:
        return _handed_back(self.other, self.r.g)


def rms_norm(path: FastPath, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """The runner's RMS norm of one row (float32 (1, hidden) or (hidden,)): the sum of squares in double."""
    out = np.empty_like(x)
    path.lib.er_rms_norm(x.ctypes.data, weight.ctypes.data, out.ctypes.data, x.size, eps)
    return out


def rms_norm_rows(path: FastPath, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """The runner's RMS norm of each row of x (float32 (rows, hidden)), each as rms_norm gives it alone."""
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty_like(x)
    hidden = x.shape[-1]
    row, source, target, w = hidden * 4, x.ctypes.data, out.ctypes.data, weight.ctypes.data
    for i in range(x.shape[0]):
        path.lib.er_rms_norm(source + i * row, w, target + i * row, hidden, eps)
    return out


class _ShareBlock(ctypes.Structure):
    _fields_ = [("graph", ctypes.c_void_p), ("graph_in", ctypes.c_void_p), ("graph_out", ctypes.c_void_p),
                ("pos", ctypes.c_void_p), ("rows", ctypes.c_void_p), ("mask", ctypes.c_void_p),
                ("n_kv", ctypes.c_int32), ("bytes", ctypes.c_double)]


class _Node(ctypes.Structure):
    _fields_ = [("session", ctypes.c_uint32), ("index", ctypes.c_uint8), ("codec", ctypes.c_uint8),
                ("copies", ctypes.c_uint8), ("pad", ctypes.c_uint8), ("hidden", ctypes.c_int32),
                ("n_layers", ctypes.c_int32), ("blocks", ctypes.POINTER(_ShareBlock)), ("datagram", _u8p),
                ("lengths", ctypes.POINTER(ctypes.c_int32)), ("attn_layers", ctypes.POINTER(ctypes.c_int32)),
                ("n_attn", ctypes.c_int32), ("mlp_taken", ctypes.POINTER(ctypes.c_int32)),
                ("latest", ctypes.c_int32 * 3), ("master", _Addr), ("send_fd", ctypes.c_int32),
                ("recv_fd", ctypes.c_int32), ("group_fd", ctypes.c_int32), ("backend", ctypes.c_void_p),
                ("compute", ctypes.c_void_p),
                ("spin_s", ctypes.c_double), ("max_s", ctypes.c_double), ("watch", ctypes.POINTER(ctypes.c_int32)),
                ("nwatch", ctypes.c_int32), ("computed", ctypes.c_int32), ("skipped", ctypes.c_int32),
                ("seconds", ctypes.c_double), ("bytes", ctypes.c_double), ("bytes_sq", ctypes.c_double),
                ("cross", ctypes.c_double), ("other", _u8p), ("other_cap", ctypes.c_int32),
                ("other_len", ctypes.c_int32), ("other_at", ctypes.c_double), ("other_ip", ctypes.c_uint32),
                ("other_port", ctypes.c_uint16), ("trace", ctypes.POINTER(ctypes.c_double)),
                ("trace_cap", ctypes.c_int32), ("trace_len", ctypes.c_int32), ("mirrored", _u8p),
                ("served", ctypes.c_int32 * 3), ("mtu", ctypes.c_int32), ("input", ctypes.c_void_p)]


class ServeEnd(IntEnum):
    """Why er_node_serve returned."""

    TIME = 1  # it kept the loop long enough: its timers run, then it serves on
    STREAM = 2  # a watched stream (the master's) has data
    OTHER = 3  # a datagram it does not take (NodeServer.handed_back): the Python path handles it
    IDLE = 6  # nothing came for spin_s: the event loop waits for the socket
    MIRRORED = 7  # a mirrored block computed and answered (NodeServer.served): the caller keeps its partial


class NodeServer:
    """A node's lossy one-token blocks served natively (er_node_serve): per layer, the attention and MLP graphs of
    its share (None: the Python path computes that block), their weight bytes, and whether the layer's blocks come
    by datagram."""

    MAX_S = 0.05  # the longest one call keeps the event loop (its heartbeats)

    def __init__(self, path: FastPath) -> None:
        self.path = path
        self.s = _Node()
        self.s.group_fd = -1
        self.other = _room_for_other(self.s)
        self.joining = _room_for_joins(path, 1)
        self.s.input = ctypes.addressof(self.joining)
        self.s.max_s = self.MAX_S
        self._keep: list = []

    def prepare(self, graphs: Sequence[NativeGraph | None], weight_bytes: Sequence[float],
                by_datagram: Sequence[bool], attn_layers: Sequence[int], hidden: int, index: int, codec: int,
                master: tuple[str, int], send_fd: int, recv_fd: int, backend: int, compute: int, spin_s: float,
                watch: Sequence[int], group_fd: int = -1, mirrored: Sequence[bool] = (), mtu: int = 0) -> None:
        """`graphs` and `weight_bytes`: two per layer (attention, MLP); `group_fd`: the socket of the master's
        multicast group, read beside `recv_fd` (-1: none); `mirrored`: per layer, whether its one-token blocks are
        mirrored (served too, each returning MIRRORED); `mtu`: its path to the master, where its partials are cut
        while its link has parity (inputs cut there are joined), or -1 where they would take more fragments than
        this path cuts (cuts_natively): a lossy link's blocks then go to the Python path."""
        s, n_layers = self.s, len(by_datagram)
        blocks = (_ShareBlock * (2 * n_layers))()
        for slot, graph, nbytes in zip(blocks, graphs, weight_bytes, strict=True):
            if graph is not None:
                slot.graph, slot.graph_in, slot.graph_out = graph.graph, graph.x, graph.out
                slot.pos, slot.rows, slot.mask, slot.n_kv = graph.pos or None, graph.rows or None, \
                    graph.mask or None, graph.n_kv
            slot.bytes = nbytes
        datagram = (ctypes.c_uint8 * n_layers)(*map(int, by_datagram))
        self.mirrored = (ctypes.c_uint8 * n_layers)(*map(int, mirrored or [False] * n_layers))
        self.graphs = graphs  # two per layer, as `blocks` holds them (served() reads a mirrored one's output)
        self.lengths = (ctypes.c_int32 * n_layers)()
        attn = (ctypes.c_int32 * max(1, len(attn_layers)))(*attn_layers)
        if not self._keep or len(self.mlp_taken) != n_layers:
            self.mlp_taken = (ctypes.c_int32 * n_layers)(*([-1] * n_layers))
        watched = (ctypes.c_int32 * max(1, len(watch)))(*watch)
        self._keep = [blocks, datagram, attn, watched]
        s.hidden, s.n_layers, s.blocks, s.datagram, s.lengths = hidden, n_layers, blocks, datagram, self.lengths
        s.mirrored = self.mirrored
        s.attn_layers, s.n_attn, s.mlp_taken = attn, len(attn_layers), self.mlp_taken
        s.index, s.codec, s.send_fd, s.recv_fd, s.backend, s.compute = index, codec, send_fd, recv_fd, backend, compute
        s.group_fd = group_fd
        s.master = addresses([master])[0]
        s.spin_s, s.watch, s.nwatch = spin_s, watched, len(watch)
        s.mtu = mtu

    TRACE_ROOM = 4096  # blocks a call may record: one call serves at most MAX_S of them

    def keep_trace(self) -> None:
        """Record each served block's moments (`traced` hands them over after each `serve`)."""
        if not self.s.trace:
            self._trace = (ctypes.c_double * (7 * self.TRACE_ROOM))()
            self.s.trace, self.s.trace_cap = self._trace, self.TRACE_ROOM

    def traced(self) -> list[tuple[int, int, int, float, float, float, float]]:
        """The blocks served by the last `serve`, as (position, layer, block, received, taken, computed,
        replied): perf_counter times."""
        s = self.s
        if not s.trace:
            return []
        flat = self._trace[:7 * s.trace_len]
        return [(int(flat[i]), int(flat[i + 1]), int(flat[i + 2]), *flat[i + 3:i + 7]) for i in range(0, len(flat), 7)]

    def new_session(self) -> None:
        for layer in range(len(self.mlp_taken)):
            self.mlp_taken[layer] = -1

    def serve(self, session: int, lengths: list[int], latest: tuple[int, int, int], copies: int) -> ServeEnd:
        """Serve until it returns; `lengths` (each layer's cached positions) is updated in place, and the newest
        input seen is `latest` afterwards."""
        s = self.s
        s.session, s.copies = session, copies
        self.lengths[:] = lengths
        s.latest[:] = latest
        s.computed = s.skipped = s.trace_len = 0
        s.seconds = s.bytes = s.bytes_sq = s.cross = 0.0
        end = ServeEnd(self.path.lib.er_node_serve(self.path.ctx, ctypes.byref(s)))
        lengths[:] = self.lengths
        return end

    @property
    def latest(self) -> tuple[int, int, int]:
        return tuple(self.s.latest)

    def served(self) -> tuple[int, int, int, np.ndarray]:
        """After MIRRORED: the block served (position, layer, block) and a copy of its partial."""
        position, layer, block = self.s.served
        graph = self.graphs[2 * layer + block]
        out = (ctypes.c_float * self.s.hidden).from_address(graph.out)
        return position, layer, block, np.array(out, np.float32)

    def handed_back(self) -> tuple[bytes, float, tuple[str, int]]:
        return _handed_back(self.other, self.s)
