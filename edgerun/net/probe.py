"""Link probes between a device and the master: RTT and loss from UDP echo bursts, bandwidth
from timed TCP transfers.

The responder listens on one port for both: UDP datagrams are echoed back unchanged; a TCP client
sends one command byte, b"U" (upload: the client sends, the responder reports what it received)
or b"D" (download: the responder sends `size` bytes), followed by the size as 8 bytes.
"""

from __future__ import annotations

import select
import socket
import statistics
import struct
import threading
import time
from dataclasses import dataclass

PROBE_MAGIC = b"ERPB"
PROBE_HEADER = struct.Struct("!4sId")  # magic, sequence number, send time
TRANSFER_HEADER = struct.Struct("!cQ")
CHUNK = 64 * 1024
POLL_S = 0.2  # how often the responder's threads look for a stop


@dataclass(frozen=True)
class LinkMeasurement:
    rtt_ms: float  # median round trip of the echoes that came back
    loss_rate: float  # one-way estimate from the round-trip loss of the bursts
    up_mbit: float
    down_mbit: float
    probes_sent: int
    probes_lost: int


class ProbeResponder:
    """Echo and transfer endpoint, run by the master (or `edgerun profile --serve-probes`)."""

    def __init__(self, host: str = "0.0.0.0", port: int = 0) -> None:
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind((host, port))
        self.port = self.udp.getsockname()[1]
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind((host, self.port))
        self.tcp.listen(8)
        # A thread blocked in recvfrom or accept is not woken by closing its socket: both poll for the stop.
        self.udp.settimeout(POLL_S)
        self.tcp.settimeout(POLL_S)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._echo, daemon=True),
                         threading.Thread(target=self._accept, daemon=True)]

    def start(self) -> ProbeResponder:
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:  # each wakes within POLL_S and sees the stop
            if t.is_alive():
                t.join(2 * POLL_S)
        self.udp.close()
        self.tcp.close()

    def _echo(self) -> None:
        while not self._stop.is_set():
            try:
                data, addr = self.udp.recvfrom(65535)
            except TimeoutError:
                continue
            except OSError:
                return
            if data.startswith(PROBE_MAGIC):
                self.udp.sendto(data, addr)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.tcp.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            threading.Thread(target=self._transfer, args=(conn,), daemon=True).start()

    @staticmethod
    def _transfer(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(30)
            try:
                head = _recv_exact(conn, TRANSFER_HEADER.size)
                command, size = TRANSFER_HEADER.unpack(head)
                if command == b"U":
                    received = 0
                    while received < size:
                        chunk = conn.recv(CHUNK)
                        if not chunk:
                            return
                        received += len(chunk)
                    conn.sendall(b"K")
                elif command == b"D":
                    _send_bytes(conn, size)
            except (OSError, struct.error):
                return


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise OSError("connection closed")
        data += chunk
    return data


def _send_bytes(conn: socket.socket, size: int) -> None:
    block = bytes(CHUNK)
    sent = 0
    while sent < size:
        n = min(CHUNK, size - sent)
        conn.sendall(block[:n])
        sent += n


def echo_burst(host: str, port: int, count: int = 200, interval_s: float = 0.002, payload: int = 512,
               wait_s: float = 0.5) -> tuple[list[float], int]:
    """Send `count` paced echo requests; return the round trips (s) that came back and the count sent."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    rtts: list[float] = []
    pad = bytes(max(0, payload - PROBE_HEADER.size))
    deadline = None
    try:
        for seq in range(count):
            sock.sendto(PROBE_HEADER.pack(PROBE_MAGIC, seq, time.perf_counter()) + pad, (host, port))
            _drain(sock, rtts, interval_s)
        deadline = time.perf_counter() + wait_s
        while len(rtts) < count and time.perf_counter() < deadline:
            _drain(sock, rtts, deadline - time.perf_counter())
    finally:
        sock.close()
    return rtts, count


def _drain(sock: socket.socket, rtts: list[float], wait_s: float) -> None:
    end = time.perf_counter() + max(wait_s, 0.0)
    while True:
        remaining = end - time.perf_counter()
        readable, _, _ = select.select([sock], [], [], max(remaining, 0.0))
        if not readable:
            return
        data = sock.recv(65535)
        if len(data) >= PROBE_HEADER.size:
            magic, _, sent = PROBE_HEADER.unpack_from(data)
            if magic == PROBE_MAGIC:
                rtts.append(time.perf_counter() - sent)


def transfer_mbit(host: str, port: int, direction: str, size: int) -> float:
    """Megabits per second for one TCP transfer of `size` bytes, "up" (to the responder) or "down"."""
    with socket.create_connection((host, port), timeout=30) as conn:
        start = time.perf_counter()
        if direction == "up":
            conn.sendall(TRANSFER_HEADER.pack(b"U", size))
            _send_bytes(conn, size)
            _recv_exact(conn, 1)
        else:
            conn.sendall(TRANSFER_HEADER.pack(b"D", size))
            _recv_exact_count(conn, size)
        return size * 8 / (time.perf_counter() - start) / 1e6


def _recv_exact_count(conn: socket.socket, size: int) -> None:
    received = 0
    while received < size:
        chunk = conn.recv(CHUNK)
        if not chunk:
            raise OSError("connection closed early")
        received += len(chunk)


def measure_link(host: str, port: int, bursts: int = 3, burst_size: int = 200,
                 transfer_bytes: int = 16 * 1024 * 1024) -> LinkMeasurement:
    rtts: list[float] = []
    sent = 0
    for _ in range(bursts):
        got, n = echo_burst(host, port, burst_size)
        rtts += got
        sent += n
    lost = sent - len(rtts)
    round_trip_loss = lost / sent
    # An echo is lost if either direction drops it: 1 - (1 - p)^2 for a one-way rate p.
    one_way = 1.0 - (1.0 - round_trip_loss) ** 0.5
    return LinkMeasurement(
        rtt_ms=statistics.median(rtts) * 1000 if rtts else float("inf"),
        loss_rate=one_way,
        up_mbit=transfer_mbit(host, port, "up", transfer_bytes),
        down_mbit=transfer_mbit(host, port, "down", transfer_bytes),
        probes_sent=sent,
        probes_lost=lost,
    )
