"""`edgerun master --plan dp`: pipeline-parallel generation over WebSocket workers.

The master serves HTTP and WebSocket on one port: workers (native processes, browser pages) connect
to `/ws`, download stage files from `/files/<sha256>`, and browsers load the node page from `/node`.
It plans contiguous layer ranges with the DP planner (memory budgets are hard limits), hands each
stage to a worker (PREPARE_MODEL, then COMMIT_MODEL), and relays every forward pass through the
stages in turn; the last stage samples and returns only the token id.

State (seed 000 §5.3): Down (no complete plan), Preparing (workers fetching files), Committing
(workers loading sessions), Up (serving). When a worker leaves mid-request, the master replans over
the workers left and re-prefills the prompt and the tokens generated so far; since every stage is
deterministic and sampling is seeded per position, the output equals an uninterrupted run.

Two plans wait beside the running one (seed 003 §4.4, §5.2.5), their files already on their workers:
- the staged plan: a better plan found while a request runs. Its workers download their stages in
  the background while the running plan serves; the request then swaps to it at its next token
  (Up -> Committing -> Up: the sessions load and the context is prefilled again).
- the shadow plan: when no better plan is found, a standby plan on other workers (or on the same
  ones, for layers they do not hold). When a worker of the running plan is lost, the master falls
  back to it and only loads sessions, instead of planning and downloading anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from http import HTTPStatus
from pathlib import Path
from typing import Any

import numpy as np
from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from edgerun.errors import EdgerunError
from edgerun.model.generate import EngineLost, generate
from edgerun.model.loader import Model
from edgerun.model.onnx_graph import StageSpec, cached_stage
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.net.channel import EventLoopThread
from edgerun.net.wire import PP_MAX_FRAME, PpMsg, WireError, open_pp_frame, pp_frame
from edgerun.sched.pp_plan import SHADOW_MODES, CostParams, PPPlan, Stage, accept, plan_pp, shadow_plan
from edgerun.sched.profiles import Compute, DeviceProfile, Link, Memory, model_profile

CONNECT_TIMEOUT_S = 10.0
SPEED_SAMPLES = 15  # live compute speed: the median of this many recent decode passes (seed 003)
PINGS = 7  # latency: the median of this many idle WebSocket pings at join (seed 003)
DEFAULT_MBIT = 1000.0  # until a download says otherwise
REPARTITION_PERIOD_S = 30.0  # besides joins and leaves, look for a better plan this often
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript", ".mjs": "text/javascript",
                 ".wasm": "application/wasm"}
PREPARE_TIMEOUT_S = 600.0  # downloading a stage's files
COMPUTE_TIMEOUT_S = 120.0
GREEDY = SamplingParams()


class PipelineState(Enum):
    """The deployment state machine (seed 003): Down -> Preparing (stages download) -> Committing (sessions
    load) -> Up; a hot swap goes from Up through Committing."""

    DOWN = "Down"
    PREPARING = "Preparing"
    COMMITTING = "Committing"
    UP = "Up"

    def __str__(self) -> str:
        return self.value


class WorkerLost(EngineLost):
    """A worker closed its connection or failed a request."""


class PlanSwap(EngineLost):
    """A staged plan is ready mid-request: it takes over at a prefill of the context so far."""


MAX_REQUEST_LOSSES = 8  # workers lost within one request before it gives up


@dataclass
class WorkerConn:
    name: str
    ws: ServerConnection
    memory_mb: float
    speed: float  # weight bytes per second
    capabilities: dict[str, Any]
    cached: set[str]
    alive: bool = True
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    served: int = 0  # forward passes answered
    rtt_ms: float = 1.0
    mbit: float = DEFAULT_MBIT
    speeds: deque[float] = field(default_factory=lambda: deque(maxlen=SPEED_SAMPLES))  # weight bytes/s, decode
    downloads: dict[int, set[str]] = field(default_factory=dict)  # DOWNLOAD_LAYERS request -> files still due

    @property
    def measured_speed(self) -> float:
        """The median of the recent decode passes, or the speed the worker reported until there are 3."""
        return float(np.median(self.speeds)) if len(self.speeds) >= 3 else self.speed


def chat_template_prefix(tokenizer) -> list[int]:
    """The tokens every chat-templated prompt starts with (the system prompt and the user header)."""
    a = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "x"}]))
    b = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "something else"}]))
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def browser_dir() -> Path:
    """The browser node page and its npm packages: $EDGERUN_BROWSER_DIR, else browser/ of this checkout."""
    return Path(os.environ.get("EDGERUN_BROWSER_DIR", Path(__file__).resolve().parents[2] / "browser"))


def _static_file(path: str) -> Path | None:
    """The file behind a page URL, if it is one the master serves."""
    root = browser_dir()
    if path == "/node":
        return root / "node.html"
    if path in ("/node.js", "/frames.js", "/sampling.js"):
        return root / path[1:]
    if path.startswith("/ort/"):
        name = path[len("/ort/"):]
        if "/" not in name and not name.startswith("."):
            return root / "node_modules" / "onnxruntime-web" / "dist" / name
    return None


def describe(plan: PPPlan) -> str:
    return ", ".join(f"{s.worker} layers {s.first_layer}-{s.end_layer - 1}" for s in plan.stages)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class PipelineConfig:
    """How a pipeline master runs."""

    host: str = "0.0.0.0"
    port: int = 0  # workers (WebSocket /ws), browser pages (/node) and stage files; 0: any free port
    max_len: int = 1024  # context length: KV cache per worker
    objective: str = "sum"  # the planner's: "sum" (one token's latency) or "max" (the slowest stage)
    max_frame: int = PP_MAX_FRAME  # the largest WebSocket message
    replicas: int = 1  # workers per stage where spare ones can hold it (hedged: the first answer counts)
    # Prefix cache (seed 000): every deployment runs these tokens once and the workers keep their KV rows; a
    # request that starts with them sends only the rest.
    prefix: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise EdgerunError(f"--replicas must be at least 1, not {self.replicas}")
        if self.objective not in ("sum", "max"):
            raise EdgerunError(f"unknown objective {self.objective!r} (sum or max)")
        if self.max_len < 1:
            raise EdgerunError("the context length must be at least 1")


class PipelineMaster:
    def __init__(self, model: Model, key: bytes, config: PipelineConfig | None = None,
                 log: Callable[[str], None] = lambda _: None) -> None:
        config = config or PipelineConfig()
        self.model, self.key, self.config, self.log = model, key, config, log
        self.max_len = config.max_len  # the generation loop reads it
        self.prefix = list(config.prefix)
        self.stage_workers: list[list[str]] = []  # per stage of the plan: its worker, then its hedging replicas
        self.stragglers: set[asyncio.Task] = set()  # replicas' answers that lost the race, still arriving
        self.overheads: deque[float] = deque(maxlen=SPEED_SAMPLES)  # seconds per stage pass beyond compute
        self.profile = model_profile(model.name, model.config, model.weights, context=config.max_len)
        self.workers: dict[str, WorkerConn] = {}
        self.files: dict[str, Path] = {}  # sha256 -> stage file served over HTTP
        self.plan: PPPlan | None = None
        self.staged: PPPlan | None = None  # a better plan whose files are on its workers: swapped in mid-request
        self.shadow: PPPlan | None = None  # a standby plan whose files are on its workers: taken on a loss
        self.state = PipelineState.DOWN
        self.recovery_seconds: list[float] = []  # from losing a worker to the next token, per recovery
        self.swap_seconds: list[float] = []  # from starting a hot swap to the next token, per swap
        self.requests = itertools.count(1)
        self.membership = asyncio.Event()  # set whenever a worker joins or leaves (for wait_for_workers)
        self.changed = asyncio.Event()  # the same, for the repartition loop
        self.busy = False  # a request is in flight: it deals with lost workers itself
        self.lost_at: float | None = None  # when the request in flight lost a worker, until it has a token again
        self.request_losses = 0  # workers the request in flight lost
        self.deploying = asyncio.Lock()
        self.deployed_at = time.monotonic()
        self.net = EventLoopThread()
        self.server = self.net.run(self._listen(config.host, config.port))
        self.port = self.server.sockets[0].getsockname()[1]

    async def _listen(self, host: str, port: int):
        self.repartitioner = asyncio.get_running_loop().create_task(self._repartition_loop())
        return await serve(self._serve_worker, host, port, process_request=self._http, max_size=self.config.max_frame,
                           compression=None)

    # --- HTTP: stage files ------------------------------------------------------------------------------
    def _http(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == "/ws":
            return None  # the WebSocket handshake goes on
        if path.startswith("/files/") and path[len("/files/"):] in self.files:
            body = self.files[path[len("/files/"):]].read_bytes()
            return Response(200, "OK", Headers({"Content-Type": "application/octet-stream",
                                                "Content-Length": str(len(body))}), body)
        if path == "/status":
            return connection.respond(HTTPStatus.OK, self.status_text())
        static = _static_file(path)
        if static is not None:
            if not static.is_file():
                return connection.respond(HTTPStatus.NOT_FOUND, f"{static} is missing: run `npm install --prefix "
                                          f"{browser_dir()}` for the browser node's packages\n")
            body = static.read_bytes()
            content_type = CONTENT_TYPES.get(static.suffix, "application/octet-stream")
            return Response(200, "OK", Headers({"Content-Type": content_type, "Content-Length": str(len(body)),
                                                "Cache-Control": "no-cache"}), body)
        return connection.respond(HTTPStatus.NOT_FOUND, f"nothing at {path}\n")

    def status_text(self) -> str:
        lines = [f"state {self.state}"]
        stages = {s.worker: s for s in self.plan.stages} if self.plan else {}
        for w in self.workers.values():
            if not w.alive:  # a tab that closed, a worker that died: gone from the list
                continue
            s = stages.get(w.name)
            layers = f"layers {s.first_layer}-{s.end_layer - 1}" if s else "no stage"
            device = w.capabilities.get("device") or w.capabilities.get("backend")  # cpu/cuda, or wasm/webgpu
            lines.append(f"  {w.name}: {w.capabilities.get('kind', '?')}{f' ({device})' if device else ''}, "
                         f"{w.memory_mb:.0f} MB, {layers}, "
                         f"{w.served} passes served")
        for name, plan in (("staged", self.staged), ("shadow", self.shadow)):
            if plan is not None:
                lines.append(f"{name} plan: {describe(plan)}")
        return "\n".join(lines) + "\n"

    # --- workers ------------------------------------------------------------------------------------------
    async def _serve_worker(self, ws: ServerConnection) -> None:
        worker = None
        try:
            await ws.send(pp_frame(PpMsg.INIT, 0, {"config": self.model.config.to_dict(), "max_len": self.max_len},
                                   self.key))
            kind, _, message, _ = open_pp_frame(await asyncio.wait_for(ws.recv(), CONNECT_TIMEOUT_S), self.key)
            if kind != PpMsg.CONNECT:
                raise WireError(f"expected CONNECT, got {kind.name}")
            name = str(message["name"])
            if name in self.workers and self.workers[name].alive:
                raise WireError(f"a worker named {name} is already connected")
            worker = WorkerConn(name, ws, float(message["memory_mb"]), float(message["speed"]),
                                dict(message.get("capabilities", {})), set(message.get("cached", [])))
            rtts = []
            for _ in range(PINGS):
                rtts.append(await asyncio.wait_for(await ws.ping(), CONNECT_TIMEOUT_S))
            worker.rtt_ms = float(np.median(rtts)) * 1e3
            self.workers[name] = worker
            if any(name in names for names in self.stage_workers):  # back, but without the stage it ran
                self.state = PipelineState.DOWN
            self.log(f"worker {name} connected ({worker.capabilities.get('kind', '?')}, {worker.memory_mb:.0f} MB, "
                     f"RTT {worker.rtt_ms:.2f} ms)")
            self.membership.set()
            self.changed.set()
            async for data in ws:
                if isinstance(data, bytes):
                    self._reply(worker, data)
        except (WireError, KeyError, ValueError, TypeError, TimeoutError, ConnectionClosed) as e:
            self.log(f"worker {worker.name if worker else '?'} refused or lost: {e}")
        finally:
            if worker is not None:
                worker.alive = False
                for future in worker.pending.values():
                    if not future.done():
                        future.set_exception(WorkerLost(worker.name))
                self.log(f"worker {worker.name} disconnected")
                self.membership.set()
                self.changed.set()

    def _reply(self, worker: WorkerConn, data: bytes) -> None:
        try:
            kind, request, message, tensors = open_pp_frame(data, self.key)
        except WireError as e:
            self.log(f"worker {worker.name}: dropped a frame ({e})")
            return
        if kind == PpMsg.LAYER_DOWNLOAD:  # progress on a request; the last file of a DOWNLOAD_LAYERS answers it
            sha = str(message.get("sha256"))
            worker.cached.add(sha)
            with contextlib.suppress(TypeError, ValueError, ZeroDivisionError):
                if float(message["bytes"]) > 1 << 20:  # a download big enough to time: the link's bandwidth
                    worker.mbit = float(message["bytes"]) * 8 / float(message["seconds"]) / 1e6
            due = worker.downloads.get(request)
            if due is None:
                return
            due.discard(sha)
            if due:
                return
        future = worker.pending.pop(request, None)
        if future is None or future.done():
            return
        if kind == PpMsg.ERROR:
            self.log(f"worker {worker.name}: {message.get('error')}")
            future.set_exception(WorkerLost(worker.name))
        else:
            future.set_result((kind, message, tensors))

    async def _call(self, worker: WorkerConn, kind: PpMsg, message: dict[str, Any], expect: PpMsg, timeout: float,
                    tensors: dict[str, np.ndarray] | None = None,
                    request: int | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        if not worker.alive:
            raise WorkerLost(worker.name)
        request = request or next(self.requests)
        future = asyncio.get_running_loop().create_future()
        worker.pending[request] = future
        try:
            await worker.ws.send(pp_frame(kind, request, message, self.key, tensors))
            got, reply, out = await asyncio.wait_for(future, timeout)
        except (ConnectionClosed, TimeoutError) as e:
            raise WorkerLost(worker.name) from e
        finally:
            worker.pending.pop(request, None)
        if got != expect:
            raise WorkerLost(f"{worker.name} answered {got.name} to {kind.name}")
        return reply, out

    async def _expel(self, worker: WorkerConn, reason: str) -> None:
        """Drop a worker that broke the protocol; the request then recovers without it."""
        self.log(f"worker {worker.name} expelled: {reason}")
        worker.alive = False
        with contextlib.suppress(ConnectionClosed):
            await worker.ws.close(1008, "protocol violation")
        raise WorkerLost(worker.name)

    # --- planning --------------------------------------------------------------------------------------
    def devices(self) -> list[DeviceProfile]:
        """The live workers as the planner sees them: measured speed, memory budget, latency, bandwidth."""
        return [DeviceProfile(name=w.name, kind=str(w.capabilities.get("kind", "native")), cores=1,
                              compute=Compute(0.0, w.measured_speed),
                              memory=Memory(w.memory_mb, w.memory_mb, w.memory_mb, 0.0),
                              link=Link(w.rtt_ms, w.mbit, w.mbit, 0.0))
                for w in self.workers.values() if w.alive]

    def _spec(self, stage: Stage) -> StageSpec:
        return StageSpec(stage.first_layer, stage.end_layer, lm_head=stage.end_layer == self.model.config.n_layers,
                         embed=stage.first_layer == 0)

    def _stage_files(self, spec: StageSpec) -> list[dict[str, str]]:
        """Build (or reuse) a stage's graph and register its files for download by sha256."""
        directory = cached_stage(self.model.path, self.model.config, self.model.weights, spec)
        files = []
        for name in ("model.onnx", "weights.bin"):
            path = directory / name
            sha_file = directory / f"{name}.sha256"
            if not sha_file.exists():
                sha_file.write_text(_file_sha256(path))
            sha = sha_file.read_text().strip()
            self.files[sha] = path
            files.append({"name": name, "sha256": sha})
        return files

    async def _repartition_loop(self) -> None:
        """On a join, a leave, or every REPARTITION_PERIOD_S: deploy (or stage, while a request runs) a
        better plan if the acceptance rule (seed 003 §5.2.4: C_total(new) < τ·C_exec(current)) takes it, or
        else make sure a shadow plan stands by."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), REPARTITION_PERIOD_S)
            self.changed.clear()
            if self.plan is None:
                continue
            try:
                await self._repartition()
            except (EdgerunError, WorkerLost, ValueError, KeyError) as e:  # the next request replans again
                # A deployment broke off; a failed download leaves the running plan Up.
                if self.state != PipelineState.UP:
                    self.state = PipelineState.DOWN
                self.log(f"repartition failed: {e}")

    async def _repartition(self) -> None:
        if self.state != PipelineState.UP or any(not self.workers[name].alive for names in self.stage_workers
                                                 for name in names):
            if not self.busy:  # a request in flight recovers by itself
                self.log("repartitioning (a worker left)")
                await self.replan(self._fallback())
            return
        devices = self.devices()
        candidate = await self._plan(devices, current=self.plan)
        if accept(candidate, self.plan, self.profile, devices, params=self.cost_params()):
            if self.busy:
                self.log(f"a better plan, prepared beside the running one: {describe(candidate)}")
                await self._download_plan(candidate)
                if self.busy:
                    self.staged = candidate
                    self.log("the better plan is staged: the request swaps to it at its next token")
                    return
            self.log("repartitioning (a better plan)")
            await self.replan(candidate)
        elif not self._ready(self.shadow):
            await self._prepare_shadow(devices)

    def _ready(self, plan: PPPlan | None) -> bool:
        return plan is not None and all(s.worker in self.workers and self.workers[s.worker].alive
                                        for s in plan.stages)

    def _fallback(self) -> PPPlan | None:
        """After a loss: the staged plan, else the shadow plan, if all their workers are alive (their files
        are on them already: only the sessions load). None: plan afresh."""
        for name, plan in (("staged", self.staged), ("shadow", self.shadow)):
            if self._ready(plan):
                self.log(f"falling back to the {name} plan: {describe(plan)}")
                return plan
        return None

    async def _prepare_shadow(self, devices: list[DeviceProfile]) -> None:
        """Seed 003 §5.2.5: first a plan on workers outside the running one (strict), else one where its
        workers take only layers they do not run (redundancy); its workers download their stages now."""
        since = time.monotonic() - self.deployed_at
        for mode in SHADOW_MODES:
            plan = await asyncio.get_running_loop().run_in_executor(None, lambda mode=mode: shadow_plan(
                self.profile, devices, self.plan, mode=mode, objective=self.config.objective,
                seconds_since_redistribution=since, server_up=self.state == PipelineState.UP,
                params=self.cost_params()))
            if plan.complete:
                await self._download_plan(plan)
                self.shadow = plan
                self.log(f"shadow plan ({mode}) standing by: {describe(plan)}")
                return

    async def _download_plan(self, plan: PPPlan) -> None:
        """Every worker of `plan` fetches its stage's files into its cache (DOWNLOAD_LAYERS), in the
        background of whatever it serves now."""
        loop = asyncio.get_running_loop()
        due: dict[str, set[str]] = {}  # worker -> files it lacks
        for s in plan.stages:
            files = await loop.run_in_executor(None, self._stage_files, self._spec(s))
            due[s.worker] = {f["sha256"] for f in files} - self.workers[s.worker].cached
        requests = {name: next(self.requests) for name, files in due.items() if files}
        for name, request in requests.items():
            self.workers[name].downloads[request] = set(due[name])
        try:
            await asyncio.gather(*(self._call(self.workers[name], PpMsg.DOWNLOAD_LAYERS, {"files": sorted(due[name])},
                                              PpMsg.LAYER_DOWNLOAD, PREPARE_TIMEOUT_S, request=request)
                                   for name, request in requests.items()))
        finally:
            for name, request in requests.items():
                self.workers[name].downloads.pop(request, None)

    def cost_params(self) -> CostParams:
        """The cost model's constants, with δ measured once there are decode passes to measure."""
        if len(self.overheads) < 3:
            return CostParams()
        return CostParams(delta_us=float(np.median(self.overheads)) * 1e6)

    async def _plan(self, devices: list[DeviceProfile], current: PPPlan | None = None) -> PPPlan:
        if not devices:
            raise EdgerunError("no workers connected")
        since = time.monotonic() - self.deployed_at
        params = self.cost_params()
        plan = await asyncio.get_running_loop().run_in_executor(None, lambda: plan_pp(
            self.profile, devices, objective=self.config.objective, current=current, seconds_since_redistribution=since,
            server_up=self.state == PipelineState.UP, params=params))
        if not plan.complete:
            raise EdgerunError(f"the {len(devices)} worker(s) cannot hold the model's {self.profile.n_layers} layers "
                               "within their memory budgets")
        return plan

    async def replan(self, plan: PPPlan | None = None, hot: bool = False) -> PPPlan:
        """Plan over the live workers (unless given a plan), prepare and commit every stage; the state
        ends Up, or Down with an EdgerunError when no plan fits. `hot`: a staged plan replaces a running
        one, whose files are already on its workers: Up goes straight to Committing."""
        async with self.deploying:  # one deployment at a time (a request's recovery, the repartition loop)
            return await self._deploy(plan, hot)

    async def _deploy(self, plan: PPPlan | None, hot: bool = False) -> PPPlan:
        loop = asyncio.get_running_loop()
        self.state = PipelineState.COMMITTING if hot else PipelineState.DOWN
        self.staged = self.shadow = None  # both were made for the plan being replaced
        plan = plan or await self._plan(self.devices())
        self.log(f"plan: {describe(plan)}")
        if not hot:
            self.state = PipelineState.PREPARING
        stage_workers = self._with_replicas(plan)
        prepare = []  # (worker, message): every file is built before the first worker is told
        for s, names in zip(plan.stages, stage_workers, strict=True):
            spec = self._spec(s)
            files = await loop.run_in_executor(None, self._stage_files, spec)
            stage = {"first_layer": s.first_layer, "end_layer": s.end_layer, "lm_head": spec.lm_head}
            prepare += [(self.workers[name], {"stage": stage, "files": files}) for name in names]
        await asyncio.gather(*(self._call(worker, PpMsg.PREPARE_MODEL, message, PpMsg.PREPARE_DONE, PREPARE_TIMEOUT_S)
                               for worker, message in prepare))
        self.state = PipelineState.COMMITTING
        await asyncio.gather(*(self._call(self.workers[name], PpMsg.COMMIT_MODEL, {"max_len": self.max_len},
                                          PpMsg.COMMIT_DONE, PREPARE_TIMEOUT_S)
                               for names in stage_workers for name in names))
        in_use = {name for names in stage_workers for name in names}
        for name in {name for names in self.stage_workers for name in names} - in_use:
            worker = self.workers[name]
            if worker.alive:  # out of the plan: its session and caches go
                with contextlib.suppress(ConnectionClosed):
                    await worker.ws.send(pp_frame(PpMsg.RELEASE_SESSION, 0, {}, self.key))
        self.plan, self.stage_workers = plan, stage_workers
        if self.prefix:
            await self._forward(self.prefix, 0, {}, prefix="save")
        self.state, self.deployed_at = PipelineState.UP, time.monotonic()
        self.log("state Up")
        self.changed.set()  # look for a shadow plan for this one
        return plan

    def _with_replicas(self, plan: PPPlan) -> list[list[str]]:
        """Each stage's worker, then up to replicas - 1 spare workers that can hold it (the fastest
        first): hedged replicas (MoEx) compute the same stage and the first answer is taken."""
        spare = sorted((w for w in self.workers.values() if w.alive and w.name not in {s.worker for s in plan.stages}),
                       key=lambda w: -w.measured_speed)
        out = []
        for s in plan.stages:
            need = sum(self.profile.layer_weight_bytes[s.first_layer:s.end_layer]) / 1e6
            extra = [w for w in spare if w.memory_mb >= need][:self.config.replicas - 1]
            spare = [w for w in spare if w not in extra]
            out.append([s.worker] + [w.name for w in extra])
        if self.config.replicas > 1:
            self.log("replicas: " + "; ".join(", ".join(names) for names in out))
        return out

    def _stages_alive(self) -> bool:
        return all(any(self.workers[name].alive for name in names) for names in self.stage_workers)

    async def _hedged(self, names: list[str], message: dict[str, Any],
                      tensors: dict[str, np.ndarray]) -> tuple[WorkerConn, dict[str, Any], dict[str, np.ndarray]]:
        """The first answer from the stage's live workers; the others still compute (their KV caches
        must keep up) and their answers are dropped when they come."""
        calls = {asyncio.ensure_future(self._call(self.workers[name], PpMsg.COMPUTATION, message,
                                                  PpMsg.COMPUTATION_RESULT, COMPUTE_TIMEOUT_S, tensors)): name
                 for name in names if self.workers[name].alive}
        pending = set(calls)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is None:
                    for straggler in pending:
                        self.stragglers.add(straggler)
                        straggler.add_done_callback(self._forget_straggler)
                    return self.workers[calls[task]], *task.result()
        raise WorkerLost(", ".join(names))

    def _forget_straggler(self, task: asyncio.Task) -> None:
        self.stragglers.discard(task)
        if not task.cancelled():
            task.exception()  # a replica lost meanwhile is seen by the next pass

    # --- generation ------------------------------------------------------------------------------------
    async def _forward(self, tokens: Sequence[int], position: int, sampling: dict[str, Any],
                       prefix: str | None = None) -> int:
        """One pass through every stage; the last stage's sampled token. `prefix`: "save" keeps the
        KV of this pass on every worker, "restore" continues from it."""
        tensors = {"input_ids": np.asarray([tokens], np.int64)}
        for i, s in enumerate(self.plan.stages):
            last = i == len(self.plan.stages) - 1
            message = {"position": position, **({"sampling": sampling} if last else {}),
                       **({"prefix": prefix} if prefix else {})}
            sent = time.perf_counter()
            worker, reply, out = await self._hedged(self.stage_workers[i], message, tensors)
            wall = time.perf_counter() - sent
            worker.served += 1
            seconds = reply.get("seconds")
            if len(tokens) == 1 and isinstance(seconds, float) and seconds > 0:  # decode: what plans are priced by
                worker.speeds.append(sum(self.profile.layer_read_bytes[s.first_layer:s.end_layer]) / seconds)
                # δ, the per-stage overhead of the cost model: what the pass took beyond compute and latency
                self.overheads.append(max(0.0, wall - seconds - worker.rtt_ms / 1e3))
            if last:
                token = reply.get("token")
                if not isinstance(token, int) or not 0 <= token < self.model.config.vocab_size:
                    await self._expel(worker, f"returned token {token!r}")
                return token
            expected = (1, len(tokens), self.model.config.hidden)
            if "hidden" not in out or out["hidden"].shape != expected or out["hidden"].dtype != np.float32:
                got = {k: v.shape for k, v in out.items()}
                await self._expel(worker, f"returned {got} where a float32 hidden state of shape {expected} was due")
            tensors = {"hidden": out["hidden"]}
        raise AssertionError("a plan has at least one stage")

    # --- the generation loop's interface (model.generate): a step returns the last stage's sampled token ----
    def reset(self) -> None:
        """A request (or its re-prefill) begins: joins and leaves wait for its end (release)."""
        self.busy = True

    def release(self) -> None:
        self.busy, self.request_losses = False, 0
        self.net.loop.call_soon_threadsafe(self.changed.set)  # joins and leaves during the request are seen now

    def step_token(self, tokens: Sequence[int], start: int, sampler: Sampler) -> int:
        """Run `tokens` from position `start` through every stage; the token the last stage samples after them.
        EngineLost (WorkerLost) when a worker is lost or a staged plan is ready to take over: the generation
        loop then calls recover() and prefills the context again."""
        return self.net.run(self._step_token(tokens, start, sampler))

    async def _step_token(self, tokens: Sequence[int], start: int, sampler: Sampler) -> int:
        sampling = {"temperature": sampler.params.temperature, "top_p": sampler.params.top_p,
                    "top_k": sampler.params.top_k, "seed": sampler.seed}
        if start > 0:
            if self._ready(self.staged):
                raise PlanSwap("a staged plan is ready")
            return await self._forward(tokens, start, sampling)
        swapped_at = None
        if self._ready(self.staged) and self._stages_alive():
            swapped_at = time.perf_counter()
            self.log("hot swap")
            await self.replan(self.staged, hot=True)
        elif self.state != PipelineState.UP or not self._stages_alive():
            await self.replan(self._fallback())
        n = len(self.prefix)
        if n and len(tokens) > n and list(tokens[:n]) == self.prefix:
            token = await self._forward(tokens[n:], n, sampling, prefix="restore")
        else:
            token = await self._forward(tokens, 0, sampling)
        if self.lost_at is not None:  # recovered: the re-prefill produced the next token
            self.recovery_seconds.append(time.perf_counter() - self.lost_at)
            self.lost_at = None
        if swapped_at is not None:
            self.swap_seconds.append(time.perf_counter() - swapped_at)
            self.log(f"hot swap done in {self.swap_seconds[-1]:.2f} s")
        return token

    def recover(self, lost: EngineLost) -> None:
        """After EngineLost: a lost worker marks the pipeline down (the next prefill replans over the workers
        left); a staged plan swaps in at the next prefill."""
        if isinstance(lost, PlanSwap):
            return
        self.lost_at = self.lost_at or time.perf_counter()
        self.state = PipelineState.DOWN
        self.request_losses += 1
        self.log(f"worker {lost} lost mid-request: replanning and prefilling the context again")
        if self.request_losses > MAX_REQUEST_LOSSES:
            raise EdgerunError("the pipeline keeps losing workers; giving up on this request")

    # --- the blocking interface ------------------------------------------------------------------------
    def wait_for_workers(self, n: int, timeout_s: float = 600.0) -> None:
        async def wait() -> None:
            while sum(w.alive for w in self.workers.values()) < n:
                self.membership.clear()
                await self.membership.wait()

        try:
            self.net.run(asyncio.wait_for(wait(), timeout_s))
        except TimeoutError:
            raise EdgerunError(f"only {sum(w.alive for w in self.workers.values())} of {n} workers connected "
                               f"within {timeout_s:.0f} s") from None

    def start(self) -> PPPlan:
        """Plan and load the stages, retrying over the workers left while some fail."""
        async def start() -> PPPlan:
            while True:
                try:
                    return await self.replan()
                except WorkerLost as e:
                    self.log(f"worker {e} failed while loading; replanning")

        return self.net.run(start())

    def generate(self, prompt: Sequence[int], max_tokens: int, params: SamplingParams = GREEDY,
                 stop_ids: frozenset[int] = frozenset(), on_token: Callable[[int], None] | None = None) -> list[int]:
        """Generation on the pipeline (the one generation loop, model.generate)."""
        return generate(self, prompt, max_tokens, Sampler(params), stop_ids, on_token).tokens

    def close(self) -> None:
        async def stop() -> None:
            self.repartitioner.cancel()
            for w in self.workers.values():
                with contextlib.suppress(ConnectionClosed):
                    await w.ws.close()
            self.server.close()

        self.net.run(stop())
        self.net.stop()
