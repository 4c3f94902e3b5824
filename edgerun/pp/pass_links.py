"""The master's links to its workers' pass ports (pp.passes): a chained route's passes, sent and awaited on the
thread that asks for them (the generation thread for a decode step), with no event loop in between."""

from __future__ import annotations

import selectors
import socket
import time
from collections.abc import Callable

from edgerun.net.loops import polled_select
from edgerun.net.wire import PpStream, WireError, pp_packet
from edgerun.pp.messages import Computation, ComputationResult, Error, ErrorReason, PassHello, open_frame, seal
from edgerun.pp.passes import CONNECT_TIMEOUT_S, RECV_BYTES, nodelay
from edgerun.pp.workers import BadInput, WorkerConn, WorkerLost

ALIVE_CHECK_S = 0.1  # how often a master waiting on a pass checks whether the control link saw a worker leave


class PortClosed(WorkerLost):
    """A worker's pass port closed or failed: the worker is gone (its WebSocket may say so a little later)."""

    def __init__(self, worker: WorkerConn, reason: str) -> None:
        super().__init__(worker.name)
        self.worker, self.reason = worker, reason


class Breach(Exception):
    """A worker broke the protocol on a pass: the master expels it."""

    def __init__(self, worker: WorkerConn, reason: str) -> None:
        super().__init__(f"{worker.name}: {reason}")
        self.worker, self.reason = worker, reason


class PassLinks:
    """The master's connections to its workers' pass ports, one per worker, made at its first chained pass.
    Used by one thread at a time: a request's passes are sent one after the other."""

    def __init__(self, key: bytes, log: Callable[[str], None], spin_s: float = 0.0) -> None:
        self.key, self.log, self.spin_s = key, log, spin_s
        self.links: dict[str, tuple[WorkerConn, socket.socket, PpStream]] = {}

    def forward(self, chain: list[WorkerConn], request: int, message: Computation, timeout: float
                ) -> ComputationResult:
        """One pass down the chain (`message.chain` empty), blocking: the last stage's result. WorkerLost when a
        worker of the chain leaves, fails the pass or does not answer within `timeout` (BadInput where a stage
        refused the input it was handed); Breach when one answers out of turn."""
        for name in [name for name, (w, _, _) in self.links.items() if not w.alive]:
            self.drop(name)  # workers that left since: their connections go
        lost = [w.name for w in chain if not w.alive]
        if lost:
            raise WorkerLost(lost[0])
        socks = [self._link(w) for w in chain]
        try:
            socks[0].sendall(pp_packet(seal(request, message, self.key)))
        except OSError as e:
            self.drop(chain[0].name)
            raise PortClosed(chain[0], str(e)) from e
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for sock, worker in zip(socks, chain, strict=True):
                selector.register(sock, selectors.EVENT_READ, worker)
            while True:
                ready = polled_select(selector.select, self.spin_s,
                                      min(ALIVE_CHECK_S, max(0.0, deadline - time.monotonic())))
                for key, _ in ready:
                    reply = self._answer(key.data, chain, request)
                    if reply is not None:
                        return reply
                if not ready:
                    lost = [w.name for w in chain if not w.alive]
                    if lost or time.monotonic() >= deadline:
                        raise WorkerLost(lost[0] if lost else chain[0].name)

    def _answer(self, worker: WorkerConn, chain: list[WorkerConn], request: int) -> ComputationResult | None:
        """What came from one worker of the chain: the pass's result, or None while it is still due."""
        _, sock, stream = self.links[worker.name]
        try:
            data = sock.recv(RECV_BYTES)
        except OSError as e:
            self.drop(worker.name)
            raise PortClosed(worker, str(e)) from e
        frames = stream.feed(data)
        if not data or stream.broken is not None:
            self.drop(worker.name)
            if stream.broken is not None:
                raise Breach(worker, f"broke its pass stream ({stream.broken})")
            raise PortClosed(worker, "closed")
        for frame in frames:
            try:
                answered, reply = open_frame(frame, self.key)
            except WireError as e:  # Refused too: an answer no master takes
                raise Breach(worker, f"sent a frame that does not open ({e})") from e
            if answered != request:
                continue  # an answer to a pass given up on
            if isinstance(reply, Error):
                self.log(f"worker {worker.name}: {reply.error}")
                raise (BadInput if reply.reason == ErrorReason.INPUT else WorkerLost)(worker.name)
            if worker is not chain[-1] or not isinstance(reply, ComputationResult):
                raise Breach(worker, f"answered a chained pass with {type(reply).__name__} as stage "
                             f"{chain.index(worker) + 1} of {len(chain)}")
            return reply
        return None

    def _link(self, worker: WorkerConn) -> socket.socket:
        held = self.links.get(worker.name)
        if held is not None and held[0] is worker:
            return held[1]
        self.drop(worker.name)  # a worker of that name that left
        if worker.peer_port is None:
            raise PortClosed(worker, "no pass port")
        stream = PpStream()
        try:
            sock = nodelay(socket.create_connection((worker.host, worker.peer_port), CONNECT_TIMEOUT_S))
            # Answered in kind once the port knows this connection as the master's: a pass sent before that
            # could reach the last stage first, with nowhere to return its token.
            sock.sendall(pp_packet(seal(0, PassHello(), self.key)))
            frames: list[bytes] = []
            while not frames and stream.broken is None:
                data = sock.recv(RECV_BYTES)
                if not data:
                    raise ConnectionError("closed")
                frames = stream.feed(data)
            sock.settimeout(None)
        except OSError as e:
            raise PortClosed(worker, str(e)) from e
        if stream.broken is not None:
            raise Breach(worker, f"broke its pass stream ({stream.broken})")
        try:
            hello = open_frame(frames[0], self.key)[1]
        except WireError as e:
            raise Breach(worker, f"answered PASS_HELLO with a frame that does not open ({e})") from e
        if not isinstance(hello, PassHello):
            raise Breach(worker, f"answered PASS_HELLO with {type(hello).__name__}")
        self.links[worker.name] = (worker, sock, stream)
        return sock

    def drop(self, name: str) -> None:
        held = self.links.pop(name, None)
        if held is not None:
            held[1].close()

    def close(self) -> None:
        for name in list(self.links):
            self.drop(name)
