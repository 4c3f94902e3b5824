"""The pipeline's deployment state machine (the partitioning thesis): plan contiguous layer ranges over the workers
present with the DP planner (memory budgets are hard limits), hand each stage to its workers (PREPARE_MODEL, then
COMMIT_MODEL), and keep two plans beside the running one, their files already on their workers:

- the staged plan: a better plan found while a request runs. Its workers download their stages in the
  background while the running plan serves; the request then swaps to it at its next token
  (Up -> Committing -> Up: the sessions load and the context is prefilled again).
- the shadow plan: when no better plan is found, a standby plan on other workers (or on the same ones, for
  layers they do not hold). When a worker of the running plan is lost, the master falls back to it and only
  loads sessions, instead of planning and downloading anew.

States (the web-inference thesis §5.3): Down (no complete plan), Preparing (workers fetching files), Committing
(workers loading sessions), Up (serving). Everything here runs on the master's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from enum import Enum
from pathlib import Path

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model import ggml_engine, kernel_stage
from edgerun.model.ggml_stage import GGML_STAGE_FILE
from edgerun.model.kernel_stage import KERNEL_STAGE_FILE
from edgerun.model.loader import Model
from edgerun.model.onnx_graph import Activations, StageSpec, cached_stage
from edgerun.net.model_files import file_sha256
from edgerun.net.wire import WorkerKind
from edgerun.pp.config import PipelineConfig, Route
from edgerun.pp.messages import (
    CommitDone,
    CommitModel,
    DownloadLayers,
    KvData,
    KvFetch,
    KvLoad,
    KvLoaded,
    LayerDownload,
    NextStage,
    PrepareDone,
    PrepareModel,
    ReleaseSession,
    StageFile,
    StageLayers,
    TabWeights,
)
from edgerun.pp.workers import SPEED_SAMPLES, WorkerConn, WorkerLost, Workers
from edgerun.sched.pp_plan import (
    MAX_STAGE_PARTS,
    SHADOW_MODES,
    CostParams,
    PPPlan,
    Stage,
    accept,
    cover_stages,
    layer_costs,
    plan_pp,
    replacement_plan,
    shadow_plan,
    stage_parts,
)
from edgerun.sched.profiles import DeviceProfile, ModelProfile, model_profile

REPARTITION_PERIOD_S = 30.0  # besides joins and leaves, look for a better plan this often
PREPARE_TIMEOUT_S = 600.0  # downloading a stage's files
KV_TIMEOUT_S = 120.0  # one layer's KV rows fetched or loaded


def dequantized_expansion(model: Model) -> float:
    """How many times its quantized bytes the model's matrices take dequantized (float32), as tabs that ask for
    float32 weights hold them: such a tab's memory budget holds that many times fewer layers."""
    matrices = [t for layer in model.weights.layers for _, t in layer.matrices()] + [model.weights.output]
    return sum(4 * int(np.prod(t.shape)) for t in matrices) / model.weights.matrix_bytes()


class PipelineState(Enum):
    """Down -> Preparing (stages download) -> Committing (sessions load) -> Up; a hot swap goes from Up
    through Committing."""

    DOWN = "Down"
    PREPARING = "Preparing"
    COMMITTING = "Committing"
    UP = "Up"

    def __str__(self) -> str:
        return self.value


class Move(Enum):
    """What the repartition loop does next (next_move)."""

    NOTHING = "nothing"
    RECOVER = "recover"  # a stage's worker left: replan from the fallback
    STAGE = "stage"  # a better plan while a request runs: prepare it beside the running one, swapped in mid-request
    DEPLOY = "deploy"  # a better plan between requests: deploy it
    SHADOW = "shadow"  # nothing better: make sure a plan stands by for a loss


def next_move(whole: bool, busy: bool, better: bool, standing_by: bool) -> Move:
    """The repartition loop's decision. `whole`: the pipeline is Up with every stage's workers alive; `busy`: a
    request runs; `better`: a plan over the workers present passes the acceptance rule against the running one;
    `standing_by`: a shadow plan or covers are ready for a loss."""
    if not whole:
        return Move.NOTHING if busy else Move.RECOVER  # a request in flight recovers by itself
    if better:
        return Move.STAGE if busy else Move.DEPLOY
    return Move.NOTHING if standing_by else Move.SHADOW


def describe(plan: PPPlan) -> str:
    return ", ".join(f"{s.worker} layers {s.first_layer}-{s.end_layer - 1}" for s in plan.stages)


@dataclasses.dataclass(frozen=True)
class ModelFit:
    """What the model allows each kind of worker, found once a deployment."""

    profile: ModelProfile  # as the planner sees it; a stage's memory holds the KV cache of every slot's sequence
    expansion: float  # a float32 stage's bytes over the file's (a tab on onnxruntime-web's WebAssembly)
    # Why tabs that ask for the WebAssembly kernels get float32 ONNX stages instead (None: they get kernels).
    # The kernels compute with int8 activations: a deployment asked for float32 ones gets them everywhere.
    kernels_unsupported: str | None
    kernel_expansion: float  # how many times the file's bytes a stage takes in stage.bin (float32 scales, offsets)
    # Why native workers run onnxruntime's stages instead of ggml's (None: they run ggml's, llama.cpp's kernels,
    # from the model's own GGUF file): ggml computes with int8 activations and builds dense models without
    # adapters.
    ggml_unsupported: str | None
    # Each layer's cost as the plans price it (config.pricing): what a stage's measured decode time is divided by
    costs: tuple[float, ...]

    @classmethod
    def of(cls, model: Model, config: PipelineConfig) -> ModelFit:
        f32 = "float32 activations (--activations f32)" if config.activations == Activations.F32 else None
        kernels_unsupported = f32 or kernel_stage.unsupported(model.config, model.weights)
        profile = model_profile(model.name, model.config, model.weights, context=config.max_len * config.slots)
        return cls(profile, dequantized_expansion(model), kernels_unsupported,
                   kernel_stage.expansion(model.weights) if kernels_unsupported is None else 1.0,
                   f32 or ggml_engine.unsupported(model), layer_costs(profile, config.pricing))


class Deployment:
    """Which plan runs, on which workers, and the moves between plans. `warm` runs once a plan is committed,
    before it counts as Up (the prefix pass)."""

    def __init__(self, model: Model, workers: Workers, config: PipelineConfig, log: Callable[[str], None],
                 warm: Callable[[], Awaitable[None]]) -> None:
        """`config`: the master's (its context, objective, replicas, activations, route and slots serve here)."""
        self.model, self.workers, self.config = model, workers, config
        self.fit = ModelFit.of(model, config)
        self.batched = False  # whether the running plan's stages are all ggml's (they run a batch's passes)
        self.chained = False  # whether the running plan takes the configured route (config.route)
        self.log, self.warm = log, warm
        self._model_file: StageFile | None = None  # the GGUF file ggml stages are built from, once hashed
        self.files: dict[str, Path] = {}  # sha256 -> stage file served over HTTP
        self.plan: PPPlan | None = None
        self.stage_workers: list[list[str]] = []  # per stage of the plan: its worker, then its hedging replicas
        self.staged: PPPlan | None = None  # a better plan whose files are on its workers: swapped in mid-request
        self.shadow: PPPlan | None = None  # a standby plan whose files are on its workers: taken on a loss
        self.preloaded: set[str] = set()  # workers holding the staged (or shadow) plan's stage loaded beside theirs
        self.covers: dict[str, Stage] = {}  # spare workers holding a running stage loaded ahead (cover_stages)
        self.shadow_stale = False  # a worker joined since the shadow plan was made
        self.kept_kv: dict[str, list[int]] = {}  # per worker, the layers whose KV it handed over itself (hot swap)
        # Per (worker, layer), the KV rows copied into its staged stage while the request ran (hot swap).
        self.precopied: dict[tuple[str, int], int] = {}
        self.state = PipelineState.DOWN
        self.overheads: deque[float] = deque(maxlen=SPEED_SAMPLES)  # seconds per stage pass beyond compute
        self.changed = asyncio.Event()  # a worker joined or left: the repartition loop looks again
        self.busy = False  # a request is in flight: it deals with lost workers itself
        self.deploying = asyncio.Lock()
        self.looking = False  # the repartition loop is planning, downloading or deploying
        self.deployed_at = time.monotonic()

    @property
    def settled(self) -> bool:
        """Up, and the repartition loop neither at work nor about to be (no background downloads or loads)."""
        return self.state == PipelineState.UP and not self.looking and not self.changed.is_set()

    def on_change(self, worker: WorkerConn, joined: bool) -> None:
        """A worker joined or left. One that comes back without the stage it ran leaves the plan Down."""
        if joined and any(worker.name in names for names in self.stage_workers):
            self.state = PipelineState.DOWN
        if joined:  # a spare worker may make a better shadow plan: one off the running plan's workers, preloaded
            self.shadow_stale = True
        self.changed.set()

    def kernel_tab(self, worker: WorkerConn) -> bool:
        """A tab that runs its stages on edgerun's WebAssembly kernels (stage.bin): it asked for them and they run
        this model."""
        return worker.tab_weights == TabWeights.KERNELS and self.fit.kernels_unsupported is None

    def dequantized(self, worker: WorkerConn) -> bool:
        """A tab whose stages hold float32 matrices (onnxruntime-web's WebAssembly: see StageSpec): it asked for
        them, or asked for the kernels, which do not run this model."""
        weights = worker.tab_weights
        return weights == TabWeights.F32 or (weights == TabWeights.KERNELS and self.fit.kernels_unsupported is not None)

    def budget_mb(self, worker: WorkerConn) -> float:
        """The worker's memory budget in the planner's units, the quantized bytes of the layers it can hold (a tab
        holds its stages' matrices grown: float32, or the kernels' float32 scales and offsets)."""
        if self.dequantized(worker):
            return worker.memory_mb / self.fit.expansion
        return worker.memory_mb / self.fit.kernel_expansion if self.kernel_tab(worker) else worker.memory_mb

    def devices(self) -> list[DeviceProfile]:
        """The live workers that can compute this model's stages, as the planner sees them: measured speed, memory
        budget, latency, bandwidth."""
        return [w.device(self.budget_mb(w)) for w in self.workers.alive()]

    def spec(self, stage: Stage, worker: str) -> StageSpec:
        """The stage this worker runs. Native workers compute with the configured activations. A tab on edgerun's
        WebAssembly kernels gets stage.bin and computes with int8 activations, as the native kernels do by default.
        Other tabs (onnxruntime-web) compute with float32, whatever is configured: its MatMulNBits has no
        int8-activation kernel to match the native one, and a tab's stage must compute what a native replica of it
        computes where both are f32. A plan mixing int8 and f32 stages gives tokens close to, but not always equal
        to, either reference's. A tab that asks for float32 weights gets its matrices dequantized."""
        conn = self.workers[worker]
        if self.kernel_tab(conn):  # int8 activations, as the native kernels compute them
            return dataclasses.replace(StageSpec.for_layers(self.model.config, stage.first_layer, stage.end_layer,
                                                            Activations.INT8), kernels=True)
        activations = self.config.activations if conn.kind is WorkerKind.NATIVE else Activations.F32
        return StageSpec.for_layers(self.model.config, stage.first_layer, stage.end_layer, activations,
                                    dequantized=self.dequantized(conn))

    def ggml_stages(self, worker: str) -> bool:
        """Whether `worker` runs its stages on ggml: a native worker that offers it, for a model ggml builds."""
        conn = self.workers[worker]
        return conn.kind is WorkerKind.NATIVE and conn.capabilities.ggml \
            and self.fit.ggml_unsupported is None and self.model.path.suffix == ".gguf"

    def model_file(self) -> StageFile:
        """The model's GGUF file as a stage file (hashed once): a ggml stage reads its layers from it."""
        if self._model_file is None:
            sha = file_sha256(self.model.path)
            self.files[sha] = self.model.path
            self._model_file = StageFile(GGML_STAGE_FILE, sha)
        return self._model_file

    def part_bounds(self, stage: Stage, worker: str) -> list[int]:
        """Where the parts after the first of `stage` begin on `worker` (StageSession): a native worker that creates
        sessions on several threads at once (`load_threads`) gets its stage as that many graphs (at most
        MAX_STAGE_PARTS), split so that the weights the largest part's session repacks (a load's main cost) are
        fewest; anything else one graph."""
        conn = self.workers[worker]
        threads = max(1, conn.capabilities.load_threads)
        if conn.kind is not WorkerKind.NATIVE or self.ggml_stages(worker):
            return []
        return stage_parts(self.fit.profile.layer_read_bytes, stage.first_layer, stage.end_layer,
                           min(threads, MAX_STAGE_PARTS))

    def _files(self, stage: Stage, worker: str) -> tuple[list[int], list[StageFile]]:
        """The stage's part bounds and its files as `worker` gets them (built, or reused): a stage in parts has
        each part's files under the part's number (0/model.onnx, 1/model.onnx, ...)."""
        if self.ggml_stages(worker):  # one graph over the stage's layers (part_bounds: none)
            return [], [self.model_file()]
        spec = self.spec(stage, worker)
        bounds = self.part_bounds(stage, worker)
        if not bounds:
            return [], self._stage_files(spec)
        edges = [stage.first_layer, *bounds, stage.end_layer]
        return bounds, [dataclasses.replace(f, name=f"{i}/{f.name}")
                        for i, (a, b) in enumerate(itertools.pairwise(edges))
                        for f in self._stage_files(dataclasses.replace(spec, first_layer=a, end_layer=b,
                                                                       embed=a == 0 and spec.embed,
                                                                       lm_head=b == stage.end_layer and spec.lm_head))]

    async def _prepare_message(self, stage: Stage, worker: str, preload: int | None = None,
                               keep_kv: bool = False) -> PrepareModel:
        """The PrepareModel handing `stage` to `worker`: its layers, its parts and its files (built, or reused, off
        the loop)."""
        bounds, files = await asyncio.get_running_loop().run_in_executor(None, self._files, stage, worker)
        return PrepareModel(StageLayers(stage.first_layer, stage.end_layer,
                                        stage.end_layer == self.model.config.n_layers, tuple(bounds)),
                            tuple(files), preload, keep_kv)

    def _stage_files(self, spec: StageSpec) -> list[StageFile]:
        """Build (or reuse) a stage's graph and register its files for download by sha256."""
        directory = cached_stage(self.model.path, self.model.config, self.model.weights, spec)
        files = []
        for name in (KERNEL_STAGE_FILE,) if spec.kernels else ("model.onnx", "weights.bin"):
            path = directory / name
            sha_file = directory / f"{name}.sha256"
            if not sha_file.exists():
                sha_file.write_text(file_sha256(path))
            sha = sha_file.read_text().strip()
            self.files[sha] = path
            files.append(StageFile(name, sha))
        return files

    def cost_params(self) -> CostParams:
        """The cost model's constants, with δ measured once there are decode passes to measure."""
        if len(self.overheads) < 3:
            return CostParams(include_init=self.config.init_cost)
        return CostParams(delta_us=float(np.median(self.overheads)) * 1e6, include_init=self.config.init_cost)

    def ready(self, plan: PPPlan | None) -> bool:
        return plan is not None and all(s.worker in self.workers and self.workers[s.worker].alive
                                        for s in plan.stages)

    def stages_alive(self) -> bool:
        return all(any(self.workers[name].alive for name in names) for names in self.stage_workers)

    def fallback(self) -> PPPlan | None:
        """After a loss: the staged plan, else the shadow plan, if all their workers are alive (their files
        are on them already: only the sessions load); else the running plan with the lost stages handed to spare
        workers, which load at most those (nothing where a spare covers its stage). None: plan afresh."""
        for name, plan in (("staged", self.staged), ("shadow", self.shadow)):
            if self.ready(plan):
                self.log(f"falling back to the {name} plan: {describe(plan)}")
                return plan
        if self.plan is None:
            return None
        alive = {w.name for w in self.workers.alive()}
        replacement = replacement_plan(self.plan, alive, self._spares(), self._fits, self.covers)
        if replacement is not None:
            handed = [f"{new.worker} takes {old.worker}'s layers {new.first_layer}-{new.end_layer - 1}"
                      + (" (loaded ahead)" if self.covers.get(new.worker) == new else "")
                      for old, new in zip(self.plan.stages, replacement.stages, strict=True) if old != new]
            self.log(f"replacing lost workers: {'; '.join(handed)}")
        return replacement

    def _covered(self) -> bool:
        """Spare workers hold running stages loaded ahead, and are still spare and alive."""
        spares = set(self._spares())
        running = {(s.first_layer, s.end_layer) for s in self.plan.stages} if self.plan else set()
        return bool(self.covers) and all(w in spares and (s.first_layer, s.end_layer) in running
                                         for w, s in self.covers.items())

    def _spares(self) -> list[str]:
        """Live workers that serve no stage of the running plan, fastest first."""
        serving = {name for names in self.stage_workers for name in names}
        return [w.name for w in sorted(self.workers.alive(), key=lambda w: -w.measured_speed) if w.name not in serving]

    def _fits(self, worker: str, stage: Stage) -> bool:
        return self._stage_mb(stage.first_layer, stage.end_layer) <= self.budget_mb(self.workers[worker])

    # --- looking for better plans ----------------------------------------------------------------------
    async def repartition_loop(self) -> None:
        """On a join, a leave, or every REPARTITION_PERIOD_S: deploy (or stage, while a request runs) a
        better plan if the acceptance rule (partitioning thesis §5.2.4: C_total(new) < τ·C_exec(current)) takes it, or
        else make sure a shadow plan stands by."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), REPARTITION_PERIOD_S)
            self.changed.clear()
            if self.plan is None:
                continue
            self.looking = True
            try:
                await self._repartition()
            except (EdgerunError, WorkerLost, ValueError, KeyError) as e:  # the next request replans again
                # A deployment broke off; a failed download leaves the running plan Up.
                if self.state != PipelineState.UP:
                    self.state = PipelineState.DOWN
                self.log(f"repartition failed: {e}")
            finally:
                self.looking = False

    async def _repartition(self) -> None:
        whole = self.state == PipelineState.UP and all(self.workers[name].alive for names in self.stage_workers
                                                       for name in names)
        devices, candidate, better = self.devices(), None, False
        if whole:
            candidate = await self._plan(devices, current=self.plan)
            better = accept(candidate, self.plan, self.fit.profile, devices, params=self.cost_params())
        standing_by = not self.shadow_stale and (self.ready(self.shadow) or self._covered())
        match next_move(whole, self.busy, better, standing_by):
            case Move.RECOVER:
                self.log("repartitioning (a worker left)")
                await self.replan(self.fallback())
            case Move.STAGE:
                self.log(f"a better plan, prepared beside the running one: {describe(candidate)}")
                if not await self.stage(candidate):  # the request ended meanwhile
                    self.log("repartitioning (a better plan)")
                    await self.replan(candidate)
            case Move.DEPLOY:
                self.log("repartitioning (a better plan)")
                await self.replan(candidate)
            case Move.SHADOW:
                await self._prepare_shadow(devices)

    async def _prepare_shadow(self, devices: list[DeviceProfile]) -> None:
        """Stand by for a loss. Where the spare workers can hold every running stage, they load those stages ahead
        (covers): a loss is recovered by handing the lost stage over as it is loaded, the other stages keep
        serving where they are, and the other covers stay loaded for the next loss (a standby plan of other
        boundaries would serve only while all its workers live, and its stages cover nothing). Else the thesis'
        §5.2.5: a plan on workers outside the running one (strict), else the running stages the spares can hold
        (covers, the slowest to load first), else a plan where workers take only layers they do not run
        (redundancy): its workers serve already and rarely have room to load anything ahead, and a worker holds
        one stage loaded ahead."""
        self.shadow_stale = False
        if self.plan is not None and await self._prepare_covers(whole=True):
            self.shadow = None
            return
        since = time.monotonic() - self.deployed_at
        for mode in SHADOW_MODES:
            if mode == "redundancy" and self.plan is not None and await self._prepare_covers():
                return
            plan = await asyncio.get_running_loop().run_in_executor(None, lambda mode=mode: shadow_plan(
                self.fit.profile, devices, self.plan, mode=mode, objective=self.config.objective,
                pricing=self.config.pricing,
                seconds_since_redistribution=since, server_up=self.state == PipelineState.UP,
                params=self.cost_params()))
            if plan.complete:
                await self._download_plan(plan)
                await self._preload(plan)  # a fallback to it then loads nothing where its workers had room
                self.covers = {}  # the spares' preloads are the shadow plan's now (kept for a loss until then)
                self.shadow = plan
                self.log(f"shadow plan ({mode}) standing by: {describe(plan)}")
                return

    async def _prepare_covers(self, whole: bool = False) -> bool:
        """Spare workers load running stages ahead (cover_stages), those that hold one already keeping it; True if
        any holds one then. `whole`: only where they can cover every running stage (nothing loads otherwise)."""
        native = [name for name in self._spares() if self.workers[name].kind is WorkerKind.NATIVE
                  and not self.dequantized(self.workers[name])]
        # A stage's load is mostly onnxruntime repacking the weights its products read (the LM head's 8-bit rows
        # among them, the embedding table, only indexed, not): the shipped model's first half loads in 100-180 ms
        # here, its second half with the head in 200-330 (in one graph; in two parts at once, about 1.5x less).
        read = self.fit.profile.layer_read_bytes
        covers = cover_stages(self.plan, native, self._fits, lambda s: sum(read[s.first_layer:s.end_layer]),
                              self.covers)
        if not covers or (whole and len(covers) < len(self.plan.stages)):
            return False
        kept = {s.worker: s for s in covers if self.covers.get(s.worker) == s}
        due = [s for s in covers if s.worker not in kept]
        self.covers = kept  # a recovery may hand these over while the others load
        if due:
            plan = dataclasses.replace(self.plan, stages=tuple(due), complete=False, method="cover")
            await self._download_plan(plan)
            await self._preload(plan)
            self.covers = kept | {s.worker: s for s in due if s.worker in self.preloaded}
            self.log("running stages loaded ahead on spare workers: " + "; ".join(
                f"{s.worker} layers {s.first_layer}-{s.end_layer - 1}" for s in self.covers.values()))
        return bool(self.covers)

    async def _download_plan(self, plan: PPPlan) -> None:
        """Every worker of `plan` fetches its stage's files into its cache (DOWNLOAD_LAYERS), in the
        background of whatever it serves now."""
        loop = asyncio.get_running_loop()
        due: dict[str, set[str]] = {}  # worker -> files it lacks
        for s in plan.stages:
            _, files = await loop.run_in_executor(None, self._files, s, s.worker)
            due[s.worker] = {f.sha256 for f in files} - self.workers[s.worker].cached
        requests = {name: self.workers.next_request() for name, files in due.items() if files}
        for name, request in requests.items():
            self.workers[name].downloads[request] = set(due[name])
        try:
            await asyncio.gather(*(self.workers.call(self.workers[name], DownloadLayers(tuple(sorted(due[name]))),
                                                     LayerDownload,
                                                     PREPARE_TIMEOUT_S, request=request)
                                   for name, request in requests.items()))
        finally:
            for name, request in requests.items():
                self.workers[name].downloads.pop(request, None)

    async def stage(self, plan: PPPlan) -> bool:
        """Prepare `plan` beside the running one while a request runs (its workers fetch their files and, where
        their budgets allow, load its sessions); True when it is staged: the request swaps to it at its next
        token. False when the request ended meanwhile (the caller deploys it plainly)."""
        await self._download_plan(plan)
        await self._preload(plan)
        if self.busy:
            await self._precopy_kv(plan)
        if not self.busy:
            return False
        self.staged = plan
        self.log("the better plan is staged: the request swaps to it at its next token")
        return True

    def _stage_mb(self, first: int, end: int) -> float:
        return sum(self.fit.profile.layer_weight_bytes[first:end]) / 1e6

    async def _preload(self, plan: PPPlan) -> None:
        """Every native worker of `plan` whose budget holds its new stage beside the one it serves loads the new
        one's session now, in the background of whatever runs (PREPARE_MODEL with `preload`): a swap to `plan` (a
        staged plan) or a fallback to it (a shadow plan) then hands over sessions instead of loading them. A
        worker holds one such stage: the last plan prepared."""
        self.preloaded = set()
        serving = {s.worker: self._stage_mb(s.first_layer, s.end_layer) for s in self.plan.stages} if self.plan \
            else {}
        due = []
        for s in plan.stages:
            worker = self.workers[s.worker]
            if worker.kind is not WorkerKind.NATIVE or self.dequantized(worker) or \
                    serving.get(s.worker, 0.0) + self._stage_mb(s.first_layer, s.end_layer) > self.budget_mb(worker):
                continue
            due.append((worker, await self._prepare_message(s, s.worker, preload=self.config.max_len)))
        replies = await asyncio.gather(*(self.workers.call(worker, message, PrepareDone, PREPARE_TIMEOUT_S)
                                         for worker, message in due),
                                       return_exceptions=True)
        for (worker, _), reply in zip(due, replies, strict=True):
            if isinstance(reply, PrepareDone) and reply.loaded:
                self.preloaded.add(worker.name)
        if self.preloaded:
            self.log(f"stages loaded ahead on {', '.join(sorted(self.preloaded))}")

    def kv_staying(self, plan: PPPlan) -> set[int]:
        """The layers whose KV stays on its worker in a hot swap to `plan`: held by the same worker before and
        after, where that worker keeps its stage as it is or has its new stage preloaded (it hands them from its
        old session to its new one itself)."""
        if self.plan is None:
            return set()
        before = {layer: names[0] for s, names in zip(self.plan.stages, self.stage_workers, strict=True)
                  for layer in range(s.first_layer, s.end_layer)}
        serving = {(s.worker, s.first_layer, s.end_layer) for s in self.plan.stages}
        return {layer for s in plan.stages
                if s.worker in self.preloaded or (s.worker, s.first_layer, s.end_layer) in serving
                for layer in range(s.first_layer, s.end_layer) if before.get(layer) == s.worker}

    # --- moving KV caches on a hot swap ---------------------------------------------------------------------
    def all_native(self, plan: PPPlan) -> bool:
        """Every worker of the running plan and of `plan` is native (the browser page does not take part in KV
        moves)."""
        names = [name for names in self.stage_workers for name in names] + [s.worker for s in plan.stages]
        return all(self.workers[name].kind is WorkerKind.NATIVE for name in names)

    async def fetch_kv(self, layers: Iterable[int], since: dict[int, int],
                       length: int | None = None) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """The keys and values of these layers from position since[layer] on (0 where absent) up to `length` (all
        the worker holds: None), each from a live worker of the running stage that holds it, one frame per layer
        (authenticated, as every frame)."""
        holders = {layer: next(self.workers[name] for name in names if self.workers[name].alive)
                   for s, names in zip(self.plan.stages, self.stage_workers, strict=True)
                   for layer in range(s.first_layer, s.end_layer)}
        wanted = {layer: holders[layer] for layer in layers}
        replies = await asyncio.gather(*(self.workers.call(worker, KvFetch(layer, since.get(layer, 0)), KvData,
                                                           KV_TIMEOUT_S)
                                         for layer, worker in wanted.items()))
        moved = {}
        for (layer, worker), reply in zip(wanted.items(), replies, strict=True):
            keys, values = reply.keys, reply.values
            if keys.shape != values.shape or keys.ndim != 4 or \
                    (length is not None and keys.shape[2] != length - since.get(layer, 0)):
                await self.workers.expel(worker, f"returned KV rows of layer {layer} that do not fit")
            moved[layer] = (keys, values)
        return moved

    async def load_kv(self, moved: dict[int, tuple[np.ndarray, np.ndarray]], since: dict[int, int]) -> bool:
        """After a hot swap's deployment: every worker of the new plan goes on from the moved rows of its stage's
        layers (placed from since[layer] on, after the rows pre-copied into its staged stage), or from those
        it kept itself. False, loading nothing, if some layer's rows are in neither."""
        due = [(name, layer) for s, names in zip(self.plan.stages, self.stage_workers, strict=True)
               for name in names for layer in range(s.first_layer, s.end_layer)
               if layer not in self.kept_kv.get(name, ())]
        if any(layer not in moved or (since.get(layer, 0) and self.precopied.get((name, layer)) != since[layer])
               for name, layer in due):
            return False
        await self._send_kv(due, moved, since)
        return True

    async def _send_kv(self, due: list[tuple[str, int]], moved: dict[int, tuple[np.ndarray, np.ndarray]],
                       since: dict[int, int], staged: bool = False) -> None:
        """Each (worker, layer)'s moved rows, placed from since[layer] on (0 where absent), into the stage it
        serves or, `staged`, into its preloaded one (KV_LOAD, one frame per layer)."""
        await asyncio.gather(*(self.workers.call(self.workers[name],
                                                 KvLoad(layer, *moved[layer], since.get(layer, 0), staged), KvLoaded,
                                                 KV_TIMEOUT_S)
                               for name, layer in due))

    async def _precopy_kv(self, plan: PPPlan) -> None:
        """While the request runs, the rows cached so far of every layer that a swap to `plan` moves to a
        preloaded worker go into that worker's staged stage: the swap then sends only the rows after them."""
        self.precopied = {}
        if self.plan is None or not self.all_native(plan):
            return
        staying = self.kv_staying(plan)
        targets = {layer: s.worker for s in plan.stages if s.worker in self.preloaded
                   for layer in range(s.first_layer, s.end_layer) if layer not in staying}
        if not targets:
            return
        moved = await self.fetch_kv(targets, {})
        await self._send_kv([(name, layer) for layer, name in targets.items()], moved, {}, staged=True)
        self.precopied = {(name, layer): int(moved[layer][0].shape[2]) for layer, name in targets.items()}

    def precopied_rows(self) -> dict[int, int]:
        """Per layer pre-copied to the staged plan's worker, the rows it holds there."""
        return {layer: rows for (_, layer), rows in self.precopied.items()}

    async def _plan(self, devices: list[DeviceProfile], current: PPPlan | None = None) -> PPPlan:
        if not devices:
            raise EdgerunError("no workers connected")
        since = time.monotonic() - self.deployed_at
        params = self.cost_params()
        plan = await asyncio.get_running_loop().run_in_executor(None, lambda: plan_pp(
            self.fit.profile, devices, objective=self.config.objective, pricing=self.config.pricing, current=current,
            seconds_since_redistribution=since,
            server_up=self.state == PipelineState.UP, params=params))
        if not plan.complete:
            raise EdgerunError(f"the {len(devices)} worker(s) cannot hold the model's {self.fit.profile.n_layers} "
                               "layers "
                               "within their memory budgets")
        return plan

    # --- deploying ---------------------------------------------------------------------------------------
    async def replan(self, plan: PPPlan | None = None, hot: bool = False) -> PPPlan:
        """Plan over the live workers (unless given a plan), prepare and commit every stage; the state
        ends Up, or Down with an EdgerunError when no plan fits. `hot`: a staged plan replaces a running
        one, whose files are already on its workers: Up goes straight to Committing."""
        async with self.deploying:  # one deployment at a time (a request's recovery, the repartition loop)
            return await self._deploy(plan, hot)

    async def _deploy(self, plan: PPPlan | None, hot: bool = False) -> PPPlan:
        self.state = PipelineState.COMMITTING if hot else PipelineState.DOWN
        self.staged = self.shadow = None  # both were made for the plan being replaced
        covers, self.preloaded, self.kept_kv, self.covers = self.covers, set(), {}, {}
        precopied, self.precopied = self.precopied, {}
        plan = plan or await self._plan(self.devices())
        self.log(f"plan: {describe(plan)}")
        if not hot:
            self.state = PipelineState.PREPARING
        stage_workers = self._with_replicas(plan)
        prepare = []  # (worker, message): every file is built before the first worker is told
        for s, names in zip(plan.stages, stage_workers, strict=True):
            for name in names:  # replicas of one stage may be of different kinds, with different files
                # A hot swap: a worker keeps the KV of the layers it holds in both plans (its stage as it is, or
                # handed to its preloaded new stage).
                prepare.append((self.workers[name], await self._prepare_message(s, name, keep_kv=hot)))
        replies = await asyncio.gather(*(self.workers.call(worker, message, PrepareDone, PREPARE_TIMEOUT_S)
                                         for worker, message in prepare))
        self.kept_kv = {worker.name: list(reply.kept) for (worker, _), reply in zip(prepare, replies, strict=True)}
        # Rows pre-copied into a staged stage count where its worker took that stage.
        took = {worker.name for (worker, _), reply in zip(prepare, replies, strict=True) if reply.preloaded}
        self.precopied = {key: rows for key, rows in precopied.items() if key[0] in took}
        self.state = PipelineState.COMMITTING
        chained = self._chainable(stage_workers)
        # A batch runs where every stage is ggml's (pp.batch); its stages hold `slots` sequences' caches.
        self.batched = all(self.ggml_stages(name) for names in stage_workers for name in names)
        slots = self.config.slots if self.batched else 1
        # On a chained route each stage but the last connects to the next one's listener.
        following = [NextStage(self.workers[names[0]].host, self.workers[names[0]].peer_port or 0) if chained
                     else None for names in stage_workers[1:]] + [None]
        commits = [CommitModel(self.config.max_len, slots, f) for f in following]
        await asyncio.gather(*(self.workers.call(self.workers[name], commit, CommitDone, PREPARE_TIMEOUT_S)
                               for commit, names in zip(commits, stage_workers, strict=True)
                               for name in names))
        self.chained = chained
        if self.config.route == Route.CHAIN and not chained:
            self.log("passes go through the master (star): a stage has replicas, a browser tab or no peer port")
        in_use = {name for names in stage_workers for name in names}
        for name in {name for names in self.stage_workers for name in names} - in_use:
            worker = self.workers[name]
            if worker.alive:  # out of the plan: its session and caches go
                await self.workers.tell(worker, ReleaseSession())
        self.plan, self.stage_workers = plan, stage_workers
        # Spares that hold a stage of the new plan loaded ahead go on covering it (their sessions stay loaded).
        running = {(s.first_layer, s.end_layer) for s in plan.stages}
        self.covers = {name: s for name, s in covers.items() if name not in in_use and name in self.workers
                       and self.workers[name].alive
                       and (s.first_layer, s.end_layer) in running}
        await self.warm()
        self.state, self.deployed_at = PipelineState.UP, time.monotonic()
        self.log("state Up")
        self.changed.set()  # look for a shadow plan for this one
        return plan

    def _chainable(self, stage_workers: list[list[str]]) -> bool:
        """Whether passes go stage to stage (Route): configured so, one worker per stage, every one native with
        a port for its predecessor."""
        return self.config.route == Route.CHAIN and all(
            len(names) == 1 and self.workers[names[0]].kind is WorkerKind.NATIVE and self.workers[names[0]].peer_port
            is not None for names in stage_workers)

    def _with_replicas(self, plan: PPPlan) -> list[list[str]]:
        """Each stage's worker, then up to replicas - 1 spare workers that can hold it (the fastest
        first): hedged replicas (MoEx) compute the same stage and the first answer is taken."""
        spare = sorted((w for w in self.workers.alive() if w.name not in {s.worker for s in plan.stages}),
                       key=lambda w: -w.measured_speed)
        out = []
        for s in plan.stages:
            need = self._stage_mb(s.first_layer, s.end_layer)
            extra = [w for w in spare if self.budget_mb(w) >= need][:self.config.replicas - 1]
            spare = [w for w in spare if w not in extra]
            out.append([s.worker] + [w.name for w in extra])
        if self.config.replicas > 1:
            self.log("replicas: " + "; ".join(", ".join(names) for names in out))
        return out

    def status_text(self) -> str:
        route = f", route {Route.CHAIN if self.chained else Route.STAR}" if self.plan else ""
        lines = [f"state {self.state}{route}"]
        stages = {s.worker: s for s in self.plan.stages} if self.plan else {}
        for w in self.workers.alive():  # a tab that closed, a worker that died: gone from the list
            s = stages.get(w.name)
            layers = f"layers {s.first_layer}-{s.end_layer - 1}" if s else "no stage"
            device = w.capabilities.device or w.capabilities.backend  # cpu/cuda, or wasm/webgpu
            weights = ", float32 weights" if self.dequantized(w) else ", wasm kernels" if self.kernel_tab(w) else ""
            lines.append(f"  {w.name}: {w.kind}{f' ({device})' if device else ''}{weights}, {w.memory_mb:.0f} MB, "
                         f"{layers}, {w.served} passes served")
        for name, plan in (("staged", self.staged), ("shadow", self.shadow)):
            if plan is not None:
                lines.append(f"{name} plan: {describe(plan)}")
        if self.covers:
            lines.append("loaded ahead: " + ", ".join(f"{w} layers {s.first_layer}-{s.end_layer - 1}"
                                                      for w, s in sorted(self.covers.items())))
        return "\n".join(lines) + "\n"
