"""An expert worker (`edgerun node --mode moe`): holds the experts its hub places on it and computes them.

It connects to the hub's WebSocket, says who it is (a HEARTBEAT with its name, memory budget and kind), and then
answers frames: WEIGHT_SYNC names the experts to hold with their blobs' sha256 (fetched over HTTP from the hub
unless cached, checked, then loaded); DISPATCH asks for one expert on some tokens, answered by a RESULT with the
gate-weighted output; CANCEL drops a dispatch that another replica has answered. Dispatches wait in arrival order
and run one at a time in an executor (onnxruntime releases the GIL, so frames keep being read meanwhile): a
cancelled one that has not started is never computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import websockets

from edgerun.memory import peak_rss_mb
from edgerun.moe.experts import ExpertRunner, GgmlExperts, blob_dir, expert_runner, read_expert_blob
from edgerun.net.backoff import Backoff
from edgerun.net.model_files import fetch_checked
from edgerun.net.moex import (
    MOEX_MAX_FRAME,
    ExpertCancel,
    ExpertDispatch,
    ExpertHeartbeat,
    ExpertHello,
    ExpertResult,
    ExpertSet,
    ExpertStatus,
    SyncDone,
    WeightSync,
    moex_frame,
    open_moex_frame,
)
from edgerun.net.wire import WireError, not_admitted, wrong_key
from edgerun.sched.moe import LogNormal

CONNECT_TIMEOUT_S = 10.0
HEARTBEAT_S = 1.0  # a worker the hub left out after timeouts is taken back at its next heartbeat


def fetch_blob(base_url: str, sha256: str) -> Path:
    """The expert blob with this sha256: from the cache, or fetched from the hub and checked."""
    target = blob_dir() / sha256
    if not target.is_file():
        fetch_checked(f"{base_url}/experts/{sha256}", target, sha256)
    return target


CANCELS_KEPT = 4096  # cancelled sequence ids remembered, for replies still held back by injected latency


class ExpertWorkerNode:
    def __init__(self, url: str, key: bytes, name: str, budget_mb: float, threads: int | None = 1,
                 log: Callable[[str], None] = print, latency: LogNormal | None = None,
                 seed: int | None = 0) -> None:
        """`latency`: a delay drawn per dispatch and added before its reply (a benchmark's slow or jittery device;
        replies wait concurrently, so one slow draw does not hold back the next dispatch)."""
        self.url, self.key, self.name, self.budget_mb, self.threads, self.log = url, key, name, budget_mb, threads, log
        self.latency, self.rng = latency, np.random.default_rng(seed)
        self.cancelled: OrderedDict[int, None] = OrderedDict()
        self.held_back: set[asyncio.Task] = set()
        scheme, _, rest = url.partition("://")
        self.base_url = f"{'https' if scheme == 'wss' else 'http'}://{rest.split('/', 1)[0]}"
        self.runner: ExpertRunner | GgmlExperts | None = None
        self.queue: OrderedDict[int, ExpertDispatch] = OrderedDict()  # seq -> dispatch not started yet
        self.ready = asyncio.Event()
        self.computed = 0
        self.preempted = 0  # stale dispatches dropped unstarted
        self.heard = False  # a frame from the hub passed this worker's check

    async def run(self, wait_s: float = 60.0) -> None:
        """Serve until the hub closes the connection."""
        backoff = Backoff(wait_s)
        while True:
            try:
                ws = await asyncio.wait_for(websockets.connect(self.url, max_size=MOEX_MAX_FRAME, compression=None),
                                            CONNECT_TIMEOUT_S)
                break
            except (OSError, TimeoutError, websockets.InvalidHandshake) as e:
                delay = backoff.next_delay()
                if delay is None:
                    raise OSError(f"no master answered at {self.url} within {wait_s:.0f} s") from e
                await asyncio.sleep(delay)
        self.log(f"expert worker {self.name}: connected to {self.url}")
        async with ws:
            await ws.send(moex_frame(ExpertHeartbeat(0, ExpertHello(self.name, self.budget_mb)), self.key))
            computing = asyncio.create_task(self._compute(ws))
            beating = asyncio.create_task(self._heartbeats(ws))
            try:
                async for data in ws:
                    if isinstance(data, bytes):
                        await self._received(ws, data)
            except websockets.ConnectionClosed as e:
                if not self.heard:
                    raise not_admitted(e) from e
            finally:
                computing.cancel()
                beating.cancel()
        if not self.heard:
            raise not_admitted(None)
        self.log(f"expert worker {self.name}: the master closed the connection")

    async def _heartbeats(self, ws: websockets.ClientConnection) -> None:
        seq = 0
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            seq += 1
            with contextlib.suppress(websockets.ConnectionClosed):
                status = ExpertStatus(self.computed, len(self.queue), self.preempted, peak_rss_mb())
                await ws.send(moex_frame(ExpertHeartbeat(seq, status), self.key))

    async def _received(self, ws: websockets.ClientConnection, data: bytes) -> None:
        try:
            message = open_moex_frame(data, self.key)
        except WireError as e:
            if not self.heard:  # the hub's first frame: the keys differ
                raise wrong_key(e) from e
            self.log(f"expert worker {self.name}: dropped a frame ({e})")
            return
        self.heard = True
        match message:
            case ExpertDispatch():
                # The MoEx paper's preemption: the hub sends a layer's dispatches only once the last layer's are done,
                # so what still waits here from another layer (a hedged copy whose cancel has not come, a dispatch
                # given up on) is stale: dropped, so a slow worker does not fall further behind.
                for seq in [s for s, d in self.queue.items() if d.layer != message.layer]:
                    del self.queue[seq]
                    self.preempted += 1
                self.queue[message.seq] = message
                self.ready.set()
            case ExpertCancel(seq):
                if self.queue.pop(seq, None) is None and self.latency is not None:
                    self.cancelled[seq] = None  # a reply held back by injected latency is not sent
                    while len(self.cancelled) > CANCELS_KEPT:
                        self.cancelled.popitem(last=False)
            case WeightSync(seq, info):
                await self._sync(ws, seq, info)
            case _:
                self.log(f"expert worker {self.name}: unexpected {type(message).__name__}")

    async def _sync(self, ws: websockets.ClientConnection, seq: int, info: ExpertSet) -> None:
        """Hold exactly the experts the hub lists: fetch and load the new ones, drop the others."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            config, activations = info.config, info.activations
            if self.runner is None or self.runner.config != config or self.runner.activations != activations:
                self.runner = expert_runner(config, self.threads, activations)
            wanted = {(e.layer, e.expert): e.sha256 for e in info.experts}
            self.runner.keep_only(set(wanted))
            for key, sha in wanted.items():
                if key not in self.runner:
                    path = await loop.run_in_executor(None, fetch_blob, self.base_url, sha)
                    weights = read_expert_blob(path.read_bytes())
                    await loop.run_in_executor(None, self.runner.load, *key, weights)
            reply = SyncDone(True, len(wanted), time.perf_counter() - started)
        except (KeyError, TypeError, ValueError, OSError) as e:
            reply = SyncDone(False, error=f"{type(e).__name__}: {e}")
        self.log(f"expert worker {self.name}: {reply}")
        await ws.send(moex_frame(ExpertHeartbeat(seq, reply), self.key))

    async def _compute(self, ws: websockets.ClientConnection) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.ready.wait()
            if not self.queue:
                self.ready.clear()
                continue
            _, d = self.queue.popitem(last=False)
            try:
                y = await loop.run_in_executor(None, self.runner.run, d.layer, d.expert, d.x, d.gates)
            except (KeyError, AttributeError, ValueError) as e:  # not held (a stale placement) or a bad shape
                self.log(f"expert worker {self.name}: cannot compute expert {d.expert} of layer {d.layer} ({e})")
                continue
            self.computed += 1
            frame = moex_frame(ExpertResult(d.seq, d.layer, d.expert, y), self.key)
            if self.latency is None:
                with contextlib.suppress(websockets.ConnectionClosed):
                    await ws.send(frame)
                continue
            task = asyncio.create_task(self._send_after(ws, d.seq, frame, self.latency.draw_ms(self.rng) / 1e3))
            self.held_back.add(task)
            task.add_done_callback(self.held_back.discard)

    async def _send_after(self, ws: websockets.ClientConnection, seq: int, frame: bytes, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if seq not in self.cancelled:
            with contextlib.suppress(websockets.ConnectionClosed):
                await ws.send(frame)


def run_expert_worker(url: str, key: bytes, name: str, budget_mb: float, threads: int | None = 1,
                      log: Callable[[str], None] = print, latency: LogNormal | None = None,
                      seed: int | None = 0, wait_s: float = 60.0) -> None:
    asyncio.run(ExpertWorkerNode(url, key, name, budget_mb, threads, log, latency, seed).run(wait_s))
