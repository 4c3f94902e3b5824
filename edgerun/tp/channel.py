"""The tensor-parallel cluster's control streams: length-prefixed, MAC-checked frames of tp.messages' typed messages
over TCP (net.channel's FrameReader reads the frames)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

from edgerun.net.channel import (
    KERNEL_RTO_MIN_MS,
    TCP_INFO_DSACK_BYTES,
    TCP_RTO_MIN_US,
    Counters,
    FrameReader,
    resent_segments,
)
from edgerun.net.wire import control_frame, open_frame, parse_control
from edgerun.tp import messages
from edgerun.tp.messages import Message


async def connect_channel(host: str, port: int, key: bytes, loop: asyncio.AbstractEventLoop) -> AsyncChannel:
    """A control stream to host:port, on `loop` (the running loop)."""
    _, frames = await loop.create_connection(FrameReader, host, port)
    return AsyncChannel(frames, key, loop)


class AsyncChannel:
    """Length-prefixed, MAC-checked control frames over one TCP stream; `send` and `close` may be
    called from any thread."""

    def __init__(self, frames: FrameReader, key: bytes, loop: asyncio.AbstractEventLoop, session: int = 0) -> None:
        self.frames, self.key, self.loop, self.session = frames, key, loop, session
        self.transport = frames.transport
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._fileno = -1 if sock is None else sock.fileno()  # asked for every block: looked up once

    def segments(self) -> tuple[int, int] | None:
        """(data segments sent, segments sent again for a loss) on this stream so far, as the kernel counts them
        (resent_segments); None where it does not say (not Linux, or the stream is gone)."""
        sock = self.transport.get_extra_info("socket")
        if sock is None or not hasattr(socket, "TCP_INFO"):
            return None
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_DSACK_BYTES)
        except OSError:
            return None
        return resent_segments(info)

    def set_rto_min(self, ms: float | None) -> bool:
        """Lower (or with None restore) this connection's minimum TCP retransmission timeout; False
        where the kernel does not offer it (before Linux 6.15)."""
        sock = self.transport.get_extra_info("socket")
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

    def frame(self, message: Message) -> bytes:
        """The message as this stream sends it: encoded and sealed. Streams of one cluster seal alike, so a frame
        made once goes to every node (send_frame)."""
        return control_frame(self.session, *messages.encode(message), self.key)

    def send(self, message: Message) -> None:
        self.send_frame(self.frame(message))

    def send_frame(self, frame: bytes) -> None:
        if self.transport.is_closing():
            raise ConnectionError("channel closed")
        if self._on_loop():
            self.transport.write(frame)
        else:
            self.loop.call_soon_threadsafe(self.transport.write, frame)

    async def receive(self) -> Message:
        """The next message. WireError for a frame that cannot be trusted (the stream is then to be closed);
        BadMessage for an authentic frame that holds no valid message (the stream stays usable); ConnectionError
        once the stream has ended."""
        header, body = open_frame(await self.frames.next(), self.key)
        return messages.decode(*parse_control(header, body))

    async def messages(self, counters: Counters) -> AsyncIterator[Message]:
        """The stream's messages one by one; an authentic frame that holds no valid message is counted in `counters`
        and skipped. Ends by raising what `receive` raises for a stream that cannot go on."""
        while True:
            try:
                yield await self.receive()
            except messages.BadMessage:
                counters.reject("message")

    def local_address(self) -> str:
        """This end's IP address: the interface that faces the peer."""
        return self.transport.get_extra_info("sockname")[0]

    def fileno(self) -> int:
        """The stream's socket descriptor, -1 once it is gone."""
        return -1 if self._fileno < 0 or self.transport.is_closing() else self._fileno

    def close(self) -> None:
        if self._on_loop():
            self.transport.close()
        else:
            self.loop.call_soon_threadsafe(self.transport.close)
