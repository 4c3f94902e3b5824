"""Sockets carrying wire-format packets: a reliable framed TCP stream and a lossy UDP sender."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from edgerun.net.loss import LossModel, NoLoss
from edgerun.net.wire import Header, WireError, control_frame, frame_length, open_packet, parse_control


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class ReliableChannel:
    """Length-prefixed, MAC-checked control frames over one TCP connection; sends are thread-safe."""

    def __init__(self, sock: socket.socket, key: bytes, session: int = 0) -> None:
        self.sock = sock
        self.key = key
        self.session = session
        self._send_lock = threading.Lock()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, message: dict[str, Any], payload: bytes = b"") -> None:
        frame = control_frame(self.session, message, self.key, payload)
        with self._send_lock:
            self.sock.sendall(frame)

    def receive(self) -> tuple[dict[str, Any], bytes]:
        """The next control message; ConnectionError when the peer is gone, WireError for a bad frame
        (after which the stream cannot be trusted and should be closed)."""
        n = frame_length(_recv_exact(self.sock, 4))
        header, body = open_packet(_recv_exact(self.sock, n), self.key)
        return parse_control(header, body)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@dataclass
class Counters:
    """Packets refused, by reason; shared by a receiver's threads."""

    rejected: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reject(self, reason: str) -> None:
        with self.lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def total(self) -> int:
        with self.lock:
            return sum(self.rejected.values())


class LossyUdp:
    """A UDP socket whose sends pass through an in-process loss model (real kernel loss comes from
    the testbed); received datagrams are authenticated, the rest counted and dropped."""

    def __init__(self, key: bytes, host: str = "0.0.0.0", port: int = 0, loss: LossModel | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind((host, port))
        # A short timeout lets the receiving thread notice close(), which does not wake recvfrom.
        self.sock.settimeout(0.2)
        self.closed = False
        self.port = self.sock.getsockname()[1]
        self.key = key
        self.loss = loss or NoLoss()
        self.sent = 0
        self.dropped = 0
        self._lock = threading.Lock()

    def send_all(self, datagrams: list[bytes], addr: tuple[str, int]) -> None:
        for d in datagrams:
            with self._lock:
                self.sent += 1
                if self.loss.drop():
                    self.dropped += 1
                    continue
            try:
                self.sock.sendto(d, addr)
            except OSError:
                with self._lock:
                    self.dropped += 1

    def packets(self, counters: Counters) -> Iterator[tuple[Header, bytes, tuple[str, int]]]:
        """Authentic datagrams as they arrive, until the socket is closed."""
        while not self.closed:
            try:
                data, addr = self.sock.recvfrom(65535)
            except TimeoutError:
                continue
            except OSError:
                return None
            try:
                header, payload = open_packet(data, self.key)
            except WireError as e:
                counters.reject(str(e).split(" ")[0])
                continue
            yield header, payload, addr

    def close(self) -> None:
        self.closed = True
        self.sock.close()
