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
