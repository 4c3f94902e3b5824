"""The native datagram path (fastpath.c): a block's datagrams sent to every node in one system call, and a master's
merge of a block's one-datagram partials (receive, check, authenticate, add) without the interpreter. Here (2 slow
vCPUs) the Python path took 5.7 µs to receive and open a partial and about 18 more to merge it; the native drain
takes 5.8 µs in all. (A node's receive and send were tried natively too: their system calls are most of their
cost, and they were no faster.)

The C file is compiled once per machine with the system's C compiler into edgerun's cache directory and loaded
through ctypes; it takes GMAC from the system's OpenSSL. Where either is missing, or EDGERUN_NATIVE=0, `load`
gives None and every caller keeps its Python path, which does the same work (and is what the native one is
tested against)."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterable
from enum import IntEnum
from pathlib import Path

import numpy as np

from edgerun.cache import cache_root

SOURCE = Path(__file__).with_name("fastpath.c")
MAX_DATAGRAM = 65600  # fastpath.c's receive buffer: more than any UDP payload
MAX_WATCHED = 16  # streams a drain watches at most (fastpath.c)
MAX_NODES = 256  # node indices are a header's u8

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


class Drained(IntEnum):
    """How a native drain ended (fastpath.c's er_drain)."""

    DONE = 0  # every wanted partial is in
    TIMEOUT = 1  # the deadline passed
    WATCHED = 2  # a watched stream has data: the event loop must read it
    OTHER = 3  # another datagram came, for the Python path


def _compile() -> Path | None:
    """The library built from SOURCE (once per source and machine), or None where it cannot be."""
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + os.uname().machine.encode()).hexdigest()[:16]
    built = cache_root() / "native" / f"fastpath-{tag}.so"
    if built.exists():
        return built
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    built.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: processes starting together (a master and its nodes) never load
    # a half-written file.
    with tempfile.TemporaryDirectory(dir=built.parent) as scratch:
        out = Path(scratch) / built.name
        result = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(out), str(SOURCE), "-ldl"],
                                capture_output=True, timeout=120)
        if result.returncode != 0:
            return None
        os.replace(out, built)
    return built


def load() -> ctypes.CDLL | None:
    """The native library, or None (EDGERUN_NATIVE=0, no C compiler, no libcrypto). Compiled on first use."""
    global _library, _tried
    if os.environ.get("EDGERUN_NATIVE", "1") == "0":
        return None
    with _lock:
        if _tried:
            return _library
        _tried = True
        try:
            path = _compile()
            library = None if path is None else ctypes.CDLL(str(path))
        except (OSError, subprocess.SubprocessError):
            return None
        if library is None:
            return None
        p, i = ctypes.c_void_p, ctypes.c_int
        library.er_new.restype, library.er_new.argtypes = p, [p]
        library.er_free.restype, library.er_free.argtypes = None, [p]
        library.er_authentic.restype, library.er_authentic.argtypes = i, [p, p, i]
        library.er_send_many.restype, library.er_send_many.argtypes = i, [i, p, i, p, p, i]
        library.er_drain.restype, library.er_drain.argtypes = i, [p, p]
        _library = library
        return library


class Destinations:
    """Addresses (IPv4) as the native send takes them: packed once, sent to every block."""

    def __init__(self, addrs: list[tuple[str, int]]) -> None:
        self.addrs = list(addrs)
        self.count = len(addrs)
        self.ips = np.array([int.from_bytes(socket.inet_aton(socket.gethostbyname(host)), "little")
                             for host, _ in addrs], np.uint32)
        self.ports = np.array([socket.htons(port) for _, port in addrs], np.uint16)


def send_many(library: ctypes.CDLL, fd: int, datagram: bytes, to: Destinations) -> int:
    """One datagram to every destination in one system call (sendmmsg): how many went out. Any thread."""
    return library.er_send_many(fd, datagram, len(datagram), to.ips.ctypes.data, to.ports.ctypes.data, to.count)


class Merge(ctypes.Structure):
    """fastpath.c's er_merge: one block's merge, as er_drain reads and writes it."""

    _fields_ = [("fd", ctypes.c_int), ("n", ctypes.c_int), ("nodes", ctypes.c_int), ("outstanding", ctypes.c_int),
                ("first", ctypes.c_int), ("n_watch", ctypes.c_int), ("other_len", ctypes.c_int),
                ("pad", ctypes.c_int), ("deadline", ctypes.c_double), ("lag_bound", ctypes.c_double),
                ("spin_s", ctypes.c_double), ("other_at", ctypes.c_double), ("total", ctypes.c_void_p),
                ("parts", ctypes.c_void_p), ("other", ctypes.c_void_p), ("other_cap", ctypes.c_int),
                ("watch", ctypes.c_int * MAX_WATCHED), ("match", ctypes.c_uint8 * 16),
                ("want", ctypes.c_uint8 * MAX_NODES), ("parity", ctypes.c_uint8 * MAX_NODES),
                ("arrived", ctypes.c_double * MAX_NODES)]


class NativeDatagrams:
    """The native path for one cluster key, used by one thread: its ciphers and its buffers are its own. A block's
    merge is `begin`, `drain` as often as it takes, and `take` for each node merged; the vectors `take` gives are
    views of this object's buffer, valid until the next `begin`."""

    def __init__(self, library: ctypes.CDLL, key: bytes) -> None:
        self.lib = library
        self.ctx = library.er_new(key)
        if not self.ctx:
            raise OSError("libcrypto's AES-256-GCM is not available")
        self.other = ctypes.create_string_buffer(MAX_DATAGRAM)
        self.merge = Merge(other=ctypes.addressof(self.other), other_cap=MAX_DATAGRAM)
        self.merge_at = ctypes.byref(self.merge)
        self.parts = np.empty((MAX_NODES, 0), np.float32)
        self.watched: list[int] = []

    @classmethod
    def for_key(cls, key: bytes) -> NativeDatagrams | None:
        library = load()
        if library is None:
            return None
        with contextlib.suppress(OSError):
            return cls(library, key)
        return None

    def close(self) -> None:
        if self.ctx:
            self.lib.er_free(self.ctx)
            self.ctx = None

    def authentic(self, datagram: bytes) -> bool:
        return bool(self.lib.er_authentic(self.ctx, datagram, len(datagram)))

    def begin(self, fd: int, match: bytes, total: np.ndarray, nodes: Iterable[int], first: bool,
              lag_bound: float | None, watch: list[int], spin_s: float) -> None:
        """A block's merge on socket fd: its partials' first header bytes (`match`, wire.HEADER's first 15), its sum
        (`total`: float32, C order, added into in place), the node indices awaited (each < MAX_NODES), whether a
        partial of it came already (the deadline moved then) and how long after the first the others may come."""
        m, n = self.merge, total.size
        if self.parts.shape[1] != n:
            self.parts = np.empty((MAX_NODES, n), np.float32)
            m.parts = self.parts.ctypes.data
        ctypes.memset(m.want, 0, MAX_NODES)
        count, top = 0, -1
        for index in nodes:
            m.want[index] = 1
            count, top = count + 1, max(top, index)
        m.fd, m.n, m.nodes, m.outstanding, m.first = fd, n, top + 1, count, first
        m.total = total.ctypes.data
        m.match[:15] = match
        m.lag_bound = -1.0 if lag_bound is None else lag_bound
        m.spin_s = spin_s
        if watch != self.watched:
            self.watched = list(watch[:MAX_WATCHED])
            m.watch[:len(self.watched)] = self.watched
            m.n_watch = len(self.watched)

    def drain(self, deadline: float) -> Drained:
        """fastpath.c's er_drain on the block begun; `merge.deadline` holds the deadline after it (the first partial
        may bring it earlier), `other_datagram` an OTHER datagram."""
        self.merge.deadline = deadline
        return Drained(self.lib.er_drain(self.ctx, self.merge_at))

    def awaited(self, index: int) -> bool:
        return bool(self.merge.want[index])

    def drop(self, index: int) -> None:
        """Stop waiting for this node's partial here (the Python path took it up)."""
        if self.merge.want[index]:
            self.merge.want[index] = 0
            self.merge.outstanding -= 1

    def take(self, index: int) -> tuple[np.ndarray, float, bool]:
        """A merged partial: its vector, when it came (perf_counter time) and whether as its parity copy."""
        return self.parts[index], self.merge.arrived[index], bool(self.merge.parity[index])

    def other_datagram(self) -> bytes:
        return self.other.raw[:self.merge.other_len]
