"""Chained passes over plain TCP: a worker's pass port (PassPort; the master's links to them: pp.pass_links).

On a chained route the master sends a pass to the first stage, each stage hands its output straight to the next,
and the last returns the sampled token to the master: one hop per stage plus one, on every token's critical path.
Each hop here is a blocking socket read by a thread that does nothing else (the worker's pass port thread, the
master's generation thread), so a hop costs the kernel's wake-up, opening the frame, the stage's compute and
sealing the next frame. Over the WebSockets (an event loop on each side, frame parsing in Python, and on the master
Starlette's queues and a hand-off between its loop and the generation thread) each hop cost about 1 ms more on a
2-core VM, where a raw TCP round trip to an idle process takes 0.2-0.4 ms.

Frames are the pipeline's own (wire.pp_frame, sealed with the cluster key), length-prefixed (wire.pp_packet).
Control (plans, loads, KV moves, pings) and star-route passes stay on the worker's WebSocket to the master.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from collections.abc import Callable
from typing import Any

from edgerun.net.loops import polled_select
from edgerun.net.wire import PpMsg, PpStream, WireError, pp_packet
from edgerun.pp.messages import Computation, Error, ErrorReason, PassHello, Refused, open_frame, seal, table

CONNECT_TIMEOUT_S = 3.0
RECV_BYTES = 1 << 20

# A worker's pass: the pass -> (its answer, onward), where onward says the answer is the next stage's input (else
# it goes back to the master). Never raises: a failed pass answers an Error.
PassCompute = Callable[[Computation], tuple[Any, bool]]
PASS_PORT = table(PassHello, Computation)  # what comes to a pass port


def nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


class PassPort:
    """A worker's listener for chained passes, served by a thread of its own. The master's connection says
    PASS_HELLO first (answered in kind); results and errors go back on it. A stage's output goes to the next
    stage's port (connect_next, at a commit). Frames that fail to open, and messages other than passes, are
    dropped."""

    def __init__(self, host: str, port: int, key: bytes, compute: PassCompute, log: Callable[[str], None],
                 name: str, spin_s: float = 0.0) -> None:
        self.listener = socket.create_server((host, port))  # OSError where the port is taken
        self.port = int(self.listener.getsockname()[1])
        self.key, self.compute, self.log, self.name, self.spin_s = key, compute, log, name, spin_s
        self.master: socket.socket | None = None
        self.next: socket.socket | None = None
        self.lock = threading.Lock()  # next is swapped by the worker's event loop at a commit
        self.waker, self.wake = socket.socketpair()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self.waker, selectors.EVENT_READ)
        self.streams: dict[socket.socket, PpStream] = {}
        self.closed = False
        self.thread = threading.Thread(target=self._serve, name=f"pass port {self.port}", daemon=True)
        self.thread.start()

    def connect_next(self, host: str, port: int) -> None:
        """Where this stage's outputs go from now on (blocks: call it from an executor)."""
        sock = nodelay(socket.create_connection((host, port), CONNECT_TIMEOUT_S))
        sock.settimeout(None)
        self._swap_next(sock)

    def drop_next(self) -> None:
        self._swap_next(None)

    def _swap_next(self, sock: socket.socket | None) -> None:
        with self.lock:
            old, self.next = self.next, sock
        if old is not None:
            old.close()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.wake.send(b"\0")
        self.thread.join(timeout=5)
        self.drop_next()
        for sock in [self.listener, self.waker, self.wake, *self.streams]:
            sock.close()
        self.selector.close()

    def _serve(self) -> None:
        busy = False
        while not self.closed:
            events = polled_select(self.selector.select, self.spin_s if busy else 0.0, None)
            busy = False
            for key, _ in events:
                sock = key.fileobj
                if sock is self.listener:
                    conn, _ = self.listener.accept()
                    self.selector.register(nodelay(conn), selectors.EVENT_READ)
                    self.streams[conn] = PpStream()
                elif sock is not self.waker:
                    busy = self._read(sock) or busy

    def _read(self, sock: socket.socket) -> bool:
        """Serve what came on one connection; False when it closed."""
        stream = self.streams[sock]
        try:
            data = sock.recv(RECV_BYTES)
        except OSError as e:
            stream.broken = str(e)
            data = b""
        for frame in stream.feed(data):
            self._frame(sock, frame)
        if data and stream.broken is None:
            return True
        if stream.broken is not None:
            self.log(f"worker {self.name}: dropped a pass port connection ({stream.broken})")
        self.selector.unregister(sock)
        del self.streams[sock]
        if sock is self.master:
            self.master = None
        sock.close()
        return False

    def _frame(self, sock: socket.socket, frame: bytes) -> None:
        try:
            request, message = open_frame(frame, self.key, PASS_PORT)
        except Refused as e:
            self.log(f"worker {self.name}: refused a frame on the pass port ({e})")
            if e.kind == PpMsg.COMPUTATION:  # a malformed pass: its sender's fault, said to the master
                self._hand_on(e.request, Error(str(e), ErrorReason.INPUT), False)
            return
        except WireError as e:
            self.log(f"worker {self.name}: dropped a frame on the pass port ({e})")
            return
        if isinstance(message, PassHello):
            self.master = sock
            with contextlib.suppress(OSError):
                sock.sendall(pp_packet(seal(0, PassHello(), self.key)))
            return
        self._hand_on(request, *self.compute(message))

    def _hand_on(self, request: int, answer: Any, onward: bool) -> None:
        """A pass's answer to the next stage (onward) or back to the master."""
        packet = pp_packet(seal(request, answer, self.key))
        with self.lock:
            target = self.next if onward else self.master
            if target is None:
                self.log(f"worker {self.name}: no {'next stage' if onward else 'master'} to hand a pass to")
                return
            try:
                target.sendall(packet)
            except OSError as e:  # the master sees the next stage's end on its own link to it
                self.log(f"worker {self.name}: cannot hand on a pass ({e})")
