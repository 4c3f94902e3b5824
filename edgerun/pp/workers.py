"""The pipeline master's side of its workers' WebSockets: the handshake that admits a worker (INIT, CONNECT,
latency pings), request/reply calls matched by request id, and who is present. Everything here runs on the
master's event loop, the loop that serves the WebSockets."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect

from edgerun.model.generate import EngineLost
from edgerun.net.wire import WireError, WorkerKind
from edgerun.pp.messages import (
    PIPELINE,
    Capabilities,
    Connect,
    Error,
    ErrorReason,
    Init,
    LayerDownload,
    Ping,
    Pong,
    Table,
    TabWeights,
    open_frame,
    seal,
)
from edgerun.sched.profiles import Compute, DeviceProfile, Link, Memory

CONNECT_TIMEOUT_S = 10.0
SPEED_SAMPLES = 15  # live compute speed: the median of this many recent decode passes (the partitioning thesis)
PINGS = 7  # latency: the median of this many PING/PONG round trips at join (the partitioning thesis)
DEFAULT_MBIT = 1000.0  # until a download says otherwise
POLICY_VIOLATION = 1008  # WebSocket close code for a worker that broke the protocol


T = TypeVar("T")


class WorkerLost(EngineLost):
    """A worker closed its connection or failed a request."""


class BadInput(WorkerLost):
    """A worker refused a pass's input as malformed: on a chained route, the stage before it sent that input."""

    def __init__(self, worker: str) -> None:
        super().__init__(worker)
        self.worker = worker


class LinkClosed(ConnectionError):
    """A worker's WebSocket is gone."""


class WorkerLink:
    """A worker's WebSocket as the master uses it: whole binary messages in and out, and one exception
    (LinkClosed) for a connection that is gone, whichever side closed it."""

    def __init__(self, ws: WebSocket) -> None:
        self.ws = ws

    async def send(self, data: bytes) -> None:
        try:
            await self.ws.send_bytes(data)
        except (WebSocketDisconnect, RuntimeError, OSError) as e:  # RuntimeError: Starlette's "already closed"
            raise LinkClosed(str(e) or type(e).__name__) from e

    async def receive(self) -> bytes | None:
        """The next binary message; None for a text message (no part of the protocol)."""
        try:
            message = await self.ws.receive()
        except (RuntimeError, OSError) as e:
            raise LinkClosed(str(e) or type(e).__name__) from e
        if message["type"] == "websocket.disconnect":
            raise LinkClosed(f"closed (code {message.get('code')})")
        return message.get("bytes")

    async def close(self, code: int = 1000, reason: str = "") -> None:
        with contextlib.suppress(RuntimeError, OSError, WebSocketDisconnect):
            await self.ws.close(code, reason)

    @property
    def host(self) -> str:
        """The worker's address as the master sees it: where the other workers reach it too."""
        return self.ws.client.host if self.ws.client is not None else "127.0.0.1"


@dataclass
class WorkerConn:
    name: str
    link: WorkerLink
    memory_mb: float
    speed: float  # weight bytes per second
    capabilities: Capabilities
    cached: set[str]
    alive: bool = True
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    served: int = 0  # forward passes answered
    decode_passes: int = 0  # one-token passes timed (what plans are priced by), and their compute
    decode_s: float = 0.0
    rtt_ms: float = 1.0
    mbit: float = DEFAULT_MBIT
    # Weight bytes per second of decode compute beyond the session overhead (the cost model's CS_w), per pass.
    speeds: deque[float] = field(default_factory=lambda: deque(maxlen=SPEED_SAMPLES))
    session_overhead_ms: float = Compute.session_overhead_ms  # SO_w: a stage pass's fixed cost, whatever its layers
    downloads: dict[int, set[str]] = field(default_factory=dict)  # DOWNLOAD_LAYERS request -> files still due

    def observe_decode(self, read_bytes: float, seconds: float) -> None:
        """A one-token pass over stage layers streaming `read_bytes` took `seconds` of compute. The speed sample
        leaves the session overhead out, as the cost model adds it to every stage (SO_w + ΣC/CS_w): a sample of
        the whole time counted it twice, and a four-stage plan was priced ~0.8 ms (6%) above what it took. A
        pass hardly longer than the overhead keeps a tenth of its time, so a tiny stage cannot give an endless speed."""
        self.decode_passes += 1
        self.decode_s += seconds
        variable = max(seconds - self.session_overhead_ms / 1e3, seconds / 10)
        self.speeds.append(read_bytes / variable)

    @property
    def measured_speed(self) -> float:
        """The median of the recent decode passes, or the speed the worker reported until there are 3."""
        return float(np.median(self.speeds)) if len(self.speeds) >= 3 else self.speed

    @property
    def kind(self) -> WorkerKind:
        """A browser tab, or a native worker (what else a worker says it is)."""
        return self.capabilities.kind

    @property
    def tab_weights(self) -> TabWeights | None:
        """How a browser tab asked for its stages' matrices (None for native workers)."""
        return self.capabilities.weights if self.kind is WorkerKind.BROWSER else None

    @property
    def host(self) -> str:
        return self.link.host

    def device(self, budget_mb: float) -> DeviceProfile:
        """The worker as the planners see it: measured speed, `budget_mb` of memory, its latency and bandwidth."""
        return DeviceProfile(name=self.name, kind=self.kind, cores=1,
                             compute=Compute(0.0, self.measured_speed, session_overhead_ms=self.session_overhead_ms),
                             memory=Memory(budget_mb, budget_mb, budget_mb, 0.0),
                             link=Link(self.rtt_ms, self.mbit, self.mbit, 0.0))

    @property
    def peer_port(self) -> int | None:
        """Where the previous stage of a chained route reaches this worker; None where it offers none (tabs)."""
        port = self.capabilities.peer_port
        return port if 0 < port < 65536 else None


class Workers:
    """The workers connected to one master, by name. `on_change(worker, joined)` is called after a worker
    joins and after one leaves."""

    def __init__(self, key: bytes, init: Init, log: Callable[[str], None],
                 on_change: Callable[[WorkerConn, bool], None], kinds: Table = PIPELINE) -> None:
        """`kinds`: the messages its workers answer with (a tuning master's: tune.messages.TRAINING)."""
        self.key, self.init, self.log, self.on_change, self.kinds = key, init, log, on_change, kinds
        self.by_name: dict[str, WorkerConn] = {}
        self.requests = itertools.count(1)
        self.membership = asyncio.Event()  # set whenever a worker joins or leaves (for wait_for)

    def __getitem__(self, name: str) -> WorkerConn:
        return self.by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self.by_name)

    def alive(self) -> list[WorkerConn]:
        return [w for w in self.by_name.values() if w.alive]

    def next_request(self) -> int:
        return next(self.requests)

    # --- a worker's connection, from handshake to close -------------------------------------------------------
    async def serve(self, link: WorkerLink) -> None:
        """Admit the worker on `link` and route its replies until it leaves."""
        worker = None
        try:
            worker = await self._admit(link)
            while True:
                data = await link.receive()
                if data is not None:
                    self._reply(worker, data)
        except (WireError, KeyError, ValueError, TypeError, TimeoutError, LinkClosed) as e:
            reason = str(e) or type(e).__name__
            if worker is None:  # not admitted: its hello failed (another key, a malformed hello) or never came
                self.log(f"a worker was refused before joining: {reason}")
            else:
                self.log(f"worker {worker.name} lost: {reason}")
        finally:
            if worker is not None:
                worker.alive = False
                for future in worker.pending.values():
                    if not future.done():
                        future.set_exception(WorkerLost(worker.name))
                self.log(f"worker {worker.name} disconnected")
                self.membership.set()
                self.on_change(worker, False)
            await link.close()

    async def _admit(self, link: WorkerLink) -> WorkerConn:
        await link.send(seal(0, self.init, self.key))
        data = await asyncio.wait_for(link.receive(), CONNECT_TIMEOUT_S)
        if data is None:
            raise WireError("a text message where CONNECT was due")
        _, hello = open_frame(data, self.key)
        if not isinstance(hello, Connect):
            raise WireError(f"expected CONNECT, got {type(hello).__name__}")
        name = hello.name
        if name in self.by_name and self.by_name[name].alive:
            raise WireError(f"a worker named {name} is already connected")
        worker = WorkerConn(name, link, hello.memory_mb, hello.speed, hello.capabilities, set(hello.cached))
        worker.rtt_ms = await self._rtt_ms(worker)
        self.by_name[name] = worker
        self.log(f"worker {name} connected ({worker.kind}, {worker.memory_mb:.0f} MB, RTT {worker.rtt_ms:.2f} ms)")
        self.membership.set()
        self.on_change(worker, True)
        return worker

    async def _rtt_ms(self, worker: WorkerConn) -> float:
        """The median of PINGS round trips, each a PING the worker answers at once: the link's latency as the
        stage passes will see it (the frames are sealed and opened as theirs are). Replies are read here, before
        the worker is admitted, since nothing else reads its link yet."""
        rtts = []
        for _ in range(PINGS):
            request = self.next_request()
            sent = time.perf_counter()
            await worker.link.send(seal(request, Ping(), self.key))
            while True:
                data = await asyncio.wait_for(worker.link.receive(), CONNECT_TIMEOUT_S)
                if data is None:
                    continue
                answered, pong = open_frame(data, self.key)
                if isinstance(pong, Pong) and answered == request:
                    break
            rtts.append(time.perf_counter() - sent)
        return float(np.median(rtts)) * 1e3

    def _reply(self, worker: WorkerConn, data: bytes) -> None:
        try:
            request, message = open_frame(data, self.key, self.kinds)
        except WireError as e:
            self.log(f"worker {worker.name}: dropped a frame ({e})")
            return
        if isinstance(message, LayerDownload):  # progress on a request; the last file of a DOWNLOAD_LAYERS answers it
            worker.cached.add(message.sha256)
            if message.bytes > 1 << 20 and message.seconds > 0:  # a download big enough to time: the bandwidth
                worker.mbit = message.bytes * 8 / message.seconds / 1e6
            due = worker.downloads.get(request)
            if due is None:
                return
            due.discard(message.sha256)
            if due:
                return
        future = worker.pending.pop(request, None)
        if future is None or future.done():
            return
        if isinstance(message, Error):
            self.log(f"worker {worker.name}: {message.error}")
            future.set_exception((BadInput if message.reason == ErrorReason.INPUT else WorkerLost)(worker.name))
        else:
            future.set_result(message)

    # --- requests -----------------------------------------------------------------------------------------
    async def call(self, worker: WorkerConn, message: Any, expect: type[T], timeout: float,
                   request: int | None = None) -> T:
        """Send a request and wait for its answer, a message of class `expect`; WorkerLost when the worker leaves,
        fails it, times out or answers with another kind of message."""
        if not worker.alive:
            raise WorkerLost(worker.name)
        request = request or self.next_request()
        future = asyncio.get_running_loop().create_future()
        worker.pending[request] = future
        try:
            await worker.link.send(seal(request, message, self.key))
            reply = await asyncio.wait_for(future, timeout)
        except (LinkClosed, TimeoutError) as e:
            raise WorkerLost(worker.name) from e
        finally:
            worker.pending.pop(request, None)
        if not isinstance(reply, expect):
            raise WorkerLost(f"{worker.name} answered {type(reply).__name__} to {type(message).__name__}")
        return reply

    async def tell(self, worker: WorkerConn, message: Any) -> None:
        """A message that has no answer; nothing happens when the worker is gone."""
        with contextlib.suppress(LinkClosed):
            await worker.link.send(seal(0, message, self.key))

    async def expel(self, worker: WorkerConn, reason: str) -> None:
        """Drop a worker that broke the protocol; the request then recovers without it."""
        self.log(f"worker {worker.name} expelled: {reason}")
        worker.alive = False
        await worker.link.close(POLICY_VIOLATION, "protocol violation")
        raise WorkerLost(worker.name)

    async def drop(self, worker: WorkerConn, reason: str) -> None:
        """A worker found gone other than by its WebSocket (its pass port closed): it counts as lost at once, and
        its WebSocket closes (serve then says it left)."""
        self.log(f"worker {worker.name}: {reason}")
        worker.alive = False
        await worker.link.close()

    async def wait_for(self, n: int) -> None:
        while len(self.alive()) < n:
            self.membership.clear()
            await self.membership.wait()

    async def close(self) -> None:
        for worker in self.by_name.values():
            await worker.link.close()
