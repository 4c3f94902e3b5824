"""Sockets carrying wire-format packets on an event loop (uvloop where installed): reliable framed
TCP streams, an authenticating UDP receiver, and a lossy UDP sender usable from any thread."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from edgerun.net.loss import LossModel, NoLoss
from edgerun.net.wire import (
    Added,
    Header,
    Reassembly,
    WireError,
    control_frame,
    frame_length,
    is_parity,
    open_packet,
    parse_control,
)

T = TypeVar("T")

# Linux 6.15+ lets a socket lower TCP's minimum retransmission timeout (default 200 ms), which is
# also what a lone lost segment waits before its tail-loss probe.
TCP_RTO_MIN_US = 45
KERNEL_RTO_MIN_MS = 200.0


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


def add_fragment(reassembly: Reassembly, header: Header, payload: bytes, counters: Counters) -> bool:
    """Take one fragment into its vector, counting a misfit or a duplicate as rejected; True the one
    time the fragment completes the vector."""
    try:
        added = reassembly.add(header, payload)
    except WireError:
        counters.reject("misfit")
        return False
    if added is Added.DUPLICATE and not is_parity(header):  # parity may come in several copies on purpose
        counters.reject("duplicate")
    return added is Added.COMPLETED


class LossyUdp:
    """A UDP socket for sending, through an in-process loss model (real kernel loss comes from the
    testbed). Datagrams are received by `listen_datagrams` on the event loop."""

    def __init__(self, key: bytes, host: str = "0.0.0.0", port: int = 0, loss: LossModel | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind((host, port))
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

    def close(self) -> None:
        self.sock.close()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed, asyncio's own otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class EventLoopThread:
    """An event loop running in its own thread: the network side of a master or node. Other threads
    (generation, compute) hand it coroutines with `run` and send through thread-safe channels."""

    def __init__(self) -> None:
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        """Run a plain function on the loop thread and return its result."""

        async def call() -> T:
            return fn()

        return self.run(call())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


class AsyncChannel:
    """Length-prefixed, MAC-checked control frames over one TCP stream; `send` and `close` may be
    called from any thread."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: bytes,
                 loop: asyncio.AbstractEventLoop, session: int = 0) -> None:
        self.reader, self.writer, self.key, self.loop, self.session = reader, writer, key, loop, session
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def set_rto_min(self, ms: float | None) -> bool:
        """Lower (or with None restore) this connection's minimum TCP retransmission timeout; False
        where the kernel does not offer it (before Linux 6.15)."""
        sock = self.writer.get_extra_info("socket")
        if sock is None:
            return False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US, int((ms or KERNEL_RTO_MIN_MS) * 1000))
        except OSError:
            return False
        return True

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def send(self, message: dict[str, Any], payload: bytes = b"") -> None:
        frame = control_frame(self.session, message, self.key, payload)
        if self.writer.is_closing():
            raise ConnectionError("channel closed")
        if self._on_loop():
            self.writer.write(frame)
        else:
            self.loop.call_soon_threadsafe(self.writer.write, frame)

    async def receive(self) -> tuple[dict[str, Any], bytes]:
        try:
            n = frame_length(await self.reader.readexactly(4))
            header, body = open_packet(await self.reader.readexactly(n), self.key)
        except asyncio.IncompleteReadError as e:
            raise ConnectionError("connection closed") from e
        return parse_control(header, body)

    def close(self) -> None:
        if self._on_loop():
            self.writer.close()
        else:
            self.loop.call_soon_threadsafe(self.writer.close)


class DatagramReceiver(asyncio.DatagramProtocol):
    """Hands authentic datagrams to a callback on the loop thread; counts and drops the rest."""

    def __init__(self, key: bytes, counters: Counters,
                 on_packet: Callable[[Header, bytes, tuple[str, int]], None]) -> None:
        self.key, self.counters, self.on_packet = key, counters, on_packet

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            header, payload = open_packet(data, self.key)
        except WireError as e:
            self.counters.reject(str(e).split(" ")[0])
            return
        self.on_packet(header, payload, addr)


async def listen_datagrams(host: str, key: bytes, counters: Counters,
                           on_packet: Callable[[Header, bytes, tuple[str, int]], None]) -> asyncio.DatagramTransport:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(lambda: DatagramReceiver(key, counters, on_packet),
                                                       local_addr=(host, 0))
    sock = transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    return transport
