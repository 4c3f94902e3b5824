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

from edgerun.net.wire import HEADER, NONCE_SIZE, TRAILER, Codec, Header, payload_bytes

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
                ("other_port", ctypes.c_uint16)]


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
    lib.er_send_vector.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Head), ctypes.c_char_p,
                                   ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Addr), ctypes.c_int,
                                   ctypes.c_int]
    lib.er_gather_run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Gather)]
    lib.er_sum.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.er_sum.restype = None
    lib.er_run_blocks.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.er_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float]
    lib.er_rms_norm.restype = None
    return lib


def _floats(x: np.ndarray) -> ctypes._Pointer:
    return x.ctypes.data_as(_f32p)


def fits(codec: Codec, elements: int, prefix: int, datagram_bytes: int) -> bool:
    """Whether a vector of this many elements (after `prefix` bytes) goes as one datagram of at most
    `datagram_bytes`: what send_vector sends."""
    return HEADER.size + prefix + payload_bytes(codec, elements) + TRAILER <= datagram_bytes


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
        self._pointers: dict[tuple[int, ...], ctypes.Array] = {}  # sum's arrays of addresses, by the addresses

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
                    prefix: bytes = b"") -> int:
        """x (float32, C order) as one datagram and copies - 1 parity copies to every address of `to`
        (addresses()): the bytes wire.fragment seals for a vector that fits one datagram. The datagrams sent; -1
        where x does not fit one datagram."""
        h = self._head
        h.session, h.position, h.layer, h.type = header.session, header.position, header.layer, header.type
        h.block, h.node, h.codec, h.tokens = header.block, header.node, header.codec, header.tokens
        return self.lib.er_send_vector(self.ctx, fd, self._head_ref, prefix, len(prefix), x.ctypes.data, x.size, to,
                                       len(to), copies)

    def sum(self, own: np.ndarray, parts: Sequence[np.ndarray]) -> np.ndarray:
        """own + parts[0] + parts[1] + ..., in that order (float32, a new array of own's shape)."""
        out = np.empty_like(own)
        where = tuple(p.ctypes.data for p in parts)
        pointers = self._pointers.get(where)
        if pointers is None:  # the same buffers block after block (Gather's rows): one array for them
            if len(self._pointers) > 64:
                self._pointers.clear()
            pointers = self._pointers[where] = (ctypes.c_void_p * max(1, len(parts)))(*where)
        self.lib.er_sum(out.ctypes.data, own.ctypes.data, pointers, len(parts), own.size)
        return out

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

    def decode(self, codec: Codec, payload: bytes, n: int) -> np.ndarray:
        out = np.empty(n, np.float32)
        self.lib.er_decode(int(codec), payload, n, _floats(out))
        return out


class Gather:
    """A master's reusable state for er_gather_run: a block's participants, their partials' buffers and arrival
    times, and room for a datagram handed back."""

    OTHER_BYTES = 65536

    def __init__(self, path: FastPath) -> None:
        self.path = path
        self.g = _Gather()
        self.other = ctypes.create_string_buffer(self.OTHER_BYTES)
        self.g.other = ctypes.cast(self.other, _u8p)
        self.g.other_cap = self.OTHER_BYTES
        self._shape: tuple[tuple[int, ...], int] = ((), 0)
        self._watch = (ctypes.c_int32 * 0)()

    def start(self, key: tuple[int, int, int, int], nodes: Sequence[int], size: int, deadline: float,
              lag_bound: float | None, spin_s: float, watch: Sequence[int]) -> None:
        """A new block: every participant's partial is `size` elements."""
        g = self.g
        g.session, g.position, g.layer, g.block = key
        n = g.n = len(nodes)
        if self._shape != (tuple(nodes), size):  # the same participants block after block: set up once for them
            self._shape = (tuple(nodes), size)
            self.buffer = np.zeros((n, size), np.float32)
            self.nodes = (ctypes.c_uint8 * n)(*nodes)
            self.sizes = (ctypes.c_int32 * n)(*([size] * n))
            self.parts = (_f32p * n)(*[_floats(self.buffer[i]) for i in range(n)])
            self.arrived = np.full(n, math.nan)
            g.nodes, g.sizes, g.parts = self.nodes, self.sizes, self.parts
            g.arrived = self.arrived.ctypes.data_as(ctypes.POINTER(ctypes.c_double))
        else:
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
        g = self.g
        return (self.other.raw[:g.other_len], g.other_at,
                (socket.inet_ntoa(struct.pack("=I", g.other_ip)), socket.ntohs(g.other_port)))


class _Block(ctypes.Structure):
    _fields_ = [("layer", ctypes.c_uint16), ("block", ctypes.c_uint8), ("pad", ctypes.c_uint8),
                ("norm", ctypes.c_void_p), ("graph", ctypes.c_void_p), ("graph_in", ctypes.c_void_p),
                ("graph_out", ctypes.c_void_p), ("first", ctypes.c_int32), ("count", ctypes.c_int32),
                ("after_send", ctypes.c_double), ("lag_bound", ctypes.c_double), ("input", ctypes.c_void_p),
                ("arrived", ctypes.c_void_p), ("sent", ctypes.c_double), ("computed", ctypes.c_double),
                ("merged", ctypes.c_double), ("own_s", ctypes.c_double), ("outstanding", ctypes.c_int32),
                ("from_parity", ctypes.c_int32), ("skipped", ctypes.c_int32), ("done", ctypes.c_int32)]


class _Runner(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int32), ("nblocks", ctypes.c_int32), ("next", ctypes.c_int32),
                ("phase", ctypes.c_int32), ("eps", ctypes.c_float), ("x", ctypes.c_void_p),
                ("blocks", ctypes.POINTER(_Block)), ("addrs", ctypes.POINTER(_Addr)), ("node_index", _u8p),
                ("session", ctypes.c_uint32), ("position", ctypes.c_uint32), ("codec", ctypes.c_uint8),
                ("pad", ctypes.c_uint8 * 3), ("send_fd", ctypes.c_int32), ("recv_fd", ctypes.c_int32),
                ("backend", ctypes.c_void_p), ("compute", ctypes.c_void_p), ("parts", ctypes.c_void_p),
                ("sum", ctypes.c_void_p), ("g", _Gather)]


class RunEnd(IntEnum):
    """Why er_run_blocks returned."""

    STREAM = 2  # a watched stream has data: the event loop must read it, then run on
    OTHER = 3  # a datagram it does not take (Runner.handed_back): the Python path handles it, then run on
    INCOMPLETE = 4  # a block ended without every partial: noted, then run on
    DONE = 5  # every block ran


@dataclass(frozen=True)
class NativeBlock:
    """One block of a step as the runner takes it: its RMS norm's weight (float32), the master's graph for its share
    (None: it holds no unit of it) with the addresses of the graph's input and output, its participants (indices
    into the runner's slots), and its deadline and lag bound (Timeouts)."""

    layer: int
    block: int
    norm: np.ndarray
    graph: int | None
    graph_in: int
    graph_out: int
    slots: range
    after_send: float
    lag_bound: float | None


class Runner:
    """A step's lossy blocks run natively (er_run_blocks), with the records the caller accounts them by."""

    def __init__(self, path: FastPath) -> None:
        self.path = path
        self.r = _Runner()
        self.other = ctypes.create_string_buffer(Gather.OTHER_BYTES)
        self.r.g.other = ctypes.cast(self.other, _u8p)
        self.r.g.other_cap = Gather.OTHER_BYTES
        self._keep: list = []  # what the C structures point into, alive while they do

    def start(self, x: np.ndarray, blocks: Sequence[NativeBlock], peers: Sequence[tuple[str, int]],
              node_index: Sequence[int], session: int, position: int, codec: int, eps: float, send_fd: int,
              recv_fd: int, backend: int, compute: int, spin_s: float, watch: Sequence[int]) -> None:
        """A step's blocks, run on the hidden state x (float32, (hidden,), updated in place)."""
        r, hidden = self.r, x.size
        n = len(blocks)
        self.x = x
        self.inputs = np.empty((n, hidden), np.float32)  # each block's input, kept for the nodes' fetches
        most = max((len(b.slots) for b in blocks), default=0)
        self.arrived = np.full((n, max(1, most)), math.nan)
        parts, total = np.empty((max(1, most), hidden), np.float32), np.empty(hidden, np.float32)
        self.records = (_Block * n)()
        for rec, b, i in zip(self.records, blocks, range(n), strict=True):
            rec.layer, rec.block, rec.norm = b.layer, b.block, b.norm.ctypes.data
            rec.graph, rec.graph_in, rec.graph_out = b.graph or None, b.graph_in, b.graph_out
            rec.first, rec.count = (b.slots.start, len(b.slots)) if len(b.slots) else (0, 0)
            rec.after_send = b.after_send
            rec.lag_bound = -1.0 if b.lag_bound is None else b.lag_bound
            rec.input, rec.arrived = self.inputs[i].ctypes.data, self.arrived[i].ctypes.data
        addrs = addresses(peers) if peers else (_Addr * 1)()
        index = (ctypes.c_uint8 * max(1, len(node_index)))(*node_index)
        watched = (ctypes.c_int32 * max(1, len(watch)))(*watch)
        self._keep = [blocks, addrs, index, watched, parts, total]
        r.hidden, r.nblocks, r.next, r.phase, r.eps = hidden, n, 0, 0, eps
        r.x, r.blocks, r.addrs, r.node_index = x.ctypes.data, self.records, addrs, index
        r.session, r.position, r.codec, r.send_fd, r.recv_fd = session, position, codec, send_fd, recv_fd
        r.backend, r.compute, r.parts, r.sum = backend, compute, parts.ctypes.data, total.ctypes.data
        self.parts = parts
        r.g.spin_s, r.g.watch, r.g.nwatch = spin_s, watched, len(watch)

    def run(self) -> RunEnd:
        end = self.path.lib.er_run_blocks(self.path.ctx, ctypes.byref(self.r))
        if end < 0:
            raise RuntimeError("ggml's graph failed in a native step")
        return RunEnd(end)

    def handed_back(self) -> tuple[bytes, float, tuple[str, int]]:
        g = self.r.g
        return (self.other.raw[:g.other_len], g.other_at,
                (socket.inet_ntoa(struct.pack("=I", g.other_ip)), socket.ntohs(g.other_port)))


def rms_norm(path: FastPath, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """The runner's RMS norm of one row (float32 (1, hidden) or (hidden,)): the sum of squares in double."""
    out = np.empty_like(x)
    path.lib.er_rms_norm(x.ctypes.data, weight.ctypes.data, out.ctypes.data, x.size, eps)
    return out
