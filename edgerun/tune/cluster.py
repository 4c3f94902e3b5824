"""Where `edgerun tune` runs its stages: in this process (`LocalStage`) or on pipeline workers (`RemoteStage`,
driven by `TuneMaster`).

The master serves what a pipeline master serves to workers (`/ws`) plus its model file by sha256
(`/model/<sha256>`); workers are plain `edgerun node --mode pp` processes. It plans the stages with the pipeline
DP (pure, sched.pp_plan) over the workers' memory budgets, pricing each layer's memory as its quantized
weights plus the activations a training step keeps for the backward pass, with the "max" objective: with
micro-batches in flight the slowest stage sets the pace.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from starlette.applications import Starlette

from edgerun.errors import EdgerunError
from edgerun.model.config import ModelConfig
from edgerun.model.loader import Model
from edgerun.net.channel import EventLoopThread
from edgerun.net.http_server import HttpServer, bind
from edgerun.net.model_files import model_routes, model_sha256
from edgerun.net.wire import WorkerKind
from edgerun.pp.http import pipeline_routes
from edgerun.pp.messages import Init
from edgerun.pp.workers import WorkerConn, WorkerLost, Workers
from edgerun.sched.pp_plan import Layers, PPPlan, plan_layers, workers_from_devices
from edgerun.sched.profiles import model_profile
from edgerun.tune.lora import parse_tensor_name
from edgerun.tune.messages import (
    TRAINING,
    TuneBackward,
    TuneEval,
    TuneForward,
    TuneGrad,
    TuneLoad,
    TuneLoaded,
    TuneOutput,
    TuneState,
    TuneStateData,
    TuneStep,
    TuneStepped,
)
from edgerun.tune.stage import OptimConfig, StageTrainer
from edgerun.tune.tuner import Checkpoint, Restart, StageClient, TuneConfig

PROGRESS_S = 15.0  # how often a wait for workers says who joined
CALL_TIMEOUT_S = 600.0  # one stage's forward or backward pass of a micro-batch, on the slowest device
LOAD_TIMEOUT_S = 900.0  # a worker fetching the model file and building its stage


T = TypeVar("T")


class LocalStage:
    """A stage in this process: the single-process run, and tests."""

    def __init__(self, trainer: StageTrainer) -> None:
        self.trainer = trainer
        self.first, self.end = trainer.first, trainer.end

    async def forward(self, step: int, micro: int, x: np.ndarray) -> np.ndarray:
        return self.trainer.forward(micro, x, (step, micro))

    async def forward_loss(self, step: int, micro: int, x: np.ndarray, labels: np.ndarray,
                           denominator: int) -> tuple[float, int, np.ndarray | None]:
        return self.trainer.forward_loss(x, labels, (step, micro), denominator)

    async def backward(self, micro: int, grad: np.ndarray) -> np.ndarray | None:
        return self.trainer.backward(micro, grad)

    async def evaluate(self, x: np.ndarray, labels: np.ndarray | None) -> tuple[np.ndarray | None, float, int]:
        return self.trainer.eval_loss(x, labels)

    async def step(self, lr: float) -> None:
        self.trainer.step(lr)

    async def state(self) -> tuple[dict[str, np.ndarray], int]:
        return self.trainer.state()


def local_restart(model: Model, config: TuneConfig) -> Restart:
    """A single process's stages for a Tuner: one stage of every layer, from a checkpoint where given."""

    async def restart(checkpoint: Checkpoint | None) -> list[StageClient]:
        trainer = StageTrainer(model.config, model.weights, 0, model.config.n_layers, config.lora,
                               OptimConfig(lr=config.lr, weight_decay=config.weight_decay), config.recompute)
        if checkpoint is not None:
            trainer.load_state(checkpoint.tensors, checkpoint.optimizer_steps)
        return [LocalStage(trainer)]

    return restart


class RemoteStage:
    """A stage on a pipeline worker, over its WebSocket; WorkerLost when the worker goes or fails a request."""

    def __init__(self, workers: Workers, worker: WorkerConn, first: int, end: int) -> None:
        self.workers, self.worker, self.first, self.end = workers, worker, first, end
        self.loaded: TuneLoaded | None = None  # its load's report: the frozen weights' bytes, peak RSS
        self.stats: TuneStepped | None = None  # its last step's: compute seconds so far, peak RSS

    async def _call(self, message: Any, expect: type[T]) -> T:
        return await self.workers.call(self.worker, message, expect, CALL_TIMEOUT_S)

    async def forward(self, step: int, micro: int, x: np.ndarray) -> np.ndarray:
        out = await self._call(TuneForward(step, micro, x), TuneOutput)
        return _tensor(out.hidden, "hidden", self.worker)

    async def forward_loss(self, step: int, micro: int, x: np.ndarray, labels: np.ndarray,
                           denominator: int) -> tuple[float, int, np.ndarray | None]:
        out = await self._call(TuneForward(step, micro, x, labels, denominator), TuneOutput)
        grad = None if self.first == 0 else _tensor(out.grad, "grad", self.worker)
        return out.loss, out.count, grad

    async def backward(self, micro: int, grad: np.ndarray) -> np.ndarray | None:
        out = await self._call(TuneBackward(micro, grad), TuneGrad)
        return None if self.first == 0 else _tensor(out.grad, "grad", self.worker)

    async def evaluate(self, x: np.ndarray, labels: np.ndarray | None) -> tuple[np.ndarray | None, float, int]:
        out = await self._call(TuneEval(x, labels), TuneOutput)
        if labels is None:
            return _tensor(out.hidden, "hidden", self.worker), 0.0, 0
        return None, out.loss, out.count

    async def step(self, lr: float) -> None:
        self.stats = await self._call(TuneStep(lr), TuneStepped)

    async def state(self) -> tuple[dict[str, np.ndarray], int]:
        reply = await self._call(TuneState(), TuneStateData)
        return reply.state, reply.steps


def _tensor(x: np.ndarray | None, name: str, worker: WorkerConn) -> np.ndarray:
    if x is None or x.dtype != np.float32:
        raise WorkerLost(f"{worker.name} answered without a float32 {name}")
    return x


def activation_bytes_per_token(config: ModelConfig, recompute: bool = False) -> float:
    """Float32 values one layer keeps per token for the backward pass: the normed inputs, Q, K, V (K and V
    repeated per query head), the attention output, gate, up and their product, the residuals, and the
    attention probabilities (one row per head, as long as the sequence: counted at 256 positions). Recomputing,
    only the layer's input is kept; the one layer being recomputed at a time is left out of the count."""
    c = config
    if recompute:
        return 4.0 * c.hidden
    values = 6 * c.hidden + 3 * c.q_dim + 2 * c.kv_dim + 4 * c.ffn + c.n_heads * 256
    return 4.0 * values


def training_layers(model: Model, tokens_in_flight: int, recompute: bool = False) -> Layers:
    """The planner's per-layer metrics for training: compute in weight bytes (forward and backward stream every
    matrix), memory the quantized weights plus the activations of the micro-batches in flight, and the hidden
    states (forward) and their gradients (backward) crossing each cut."""
    profile = model_profile(model.name, model.config, model.weights)
    saved = activation_bytes_per_token(model.config, recompute) * tokens_in_flight
    crossing = 2 * profile.activation_bytes_per_token * tokens_in_flight
    n = model.config.n_layers
    return Layers(cost=tuple(2 * b for b in profile.layer_read_bytes),
                  weight=profile.layer_weight_bytes,
                  memory=tuple(w + saved for w in profile.layer_weight_bytes),
                  input=(crossing,) * n, output=(crossing,) * n)


def training_plan(model: Model, workers: list[WorkerConn], tokens_in_flight: int,
                  recompute: bool = False) -> PPPlan:
    devices = [w.device(w.memory_mb) for w in workers]
    layers = training_layers(model, tokens_in_flight, recompute)
    plan = plan_layers(layers, workers_from_devices(devices), model_name=model.name, objective="max")
    if not plan.complete:
        mb = sum(layers.memory) / 1e6
        raise EdgerunError(f"the workers' memory ({', '.join(f'{w.name}: {w.memory_mb:.0f} MB' for w in workers)}) "
                           f"cannot hold the model for training (about {mb:.0f} MB with "
                           f"{tokens_in_flight} tokens in flight); add workers, lower --micro-size/--in-flight, or "
                           "--recompute")
    return plan


class TuneMaster:
    """Serves workers and the model file, and builds remote stages for a Tuner."""

    def __init__(self, model: Model, key: bytes, config: TuneConfig, max_len: int, host: str = "0.0.0.0",
                 port: int = 0, expect: int = 1, wait_s: float = 600.0,
                 log: Callable[[str], None] = lambda _: None) -> None:
        self.model, self.config, self.log = model, config, log
        self.expect, self.wait_s, self.max_len = expect, wait_s, max_len
        self.sha256 = model_sha256(model.path)
        self.plans: list[PPPlan] = []
        self.stages: list[RemoteStage] = []
        sock = bind(host, port)
        self.net = EventLoopThread()
        init = Init(model.config, max_len)
        self.workers: Workers = self.net.call(lambda: Workers(key, init, log, lambda worker, joined: None, TRAINING))
        routes = [*pipeline_routes(self.workers, {}, self.status_text), *model_routes(model.path, self.sha256)]
        try:
            self.http = HttpServer(Starlette(routes=routes), sock, self.net)
        except BaseException:
            sock.close()
            raise
        self.port = self.http.port

    def status_text(self) -> str:
        lines = [f"tuning {self.model.name}: {len(self.workers.alive())} workers"]
        lines += [f"  {s.worker.name}: layers {s.first}-{s.end - 1}" for s in self.stages]
        return "\n".join(lines) + "\n"

    async def restart(self, checkpoint: Checkpoint | None) -> list[StageClient]:
        """Plan over the workers present (waiting for `expect` the first time, for any one after a loss) and
        load every stage, from `checkpoint` where given."""
        need = self.expect if not self.plans else 1
        deadline = time.monotonic() + self.wait_s
        while True:  # a line every PROGRESS_S: who joined, how long is left
            try:
                await asyncio.wait_for(self.workers.wait_for(need), min(PROGRESS_S, deadline - time.monotonic()))
                break
            except TimeoutError:
                names = [w.name for w in self.workers.alive()]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EdgerunError(f"{len(names)} of {need} workers connected within {self.wait_s:.0f} s: start "
                                       f"them with `edgerun node --mode pp --master HOST:{self.port} --key ...`, "
                                       "or lower --workers (or raise --wait-s)") from None
                self.log(f"waiting for workers: {len(names)} of {need} joined"
                         f"{' (' + ', '.join(names) + ')' if names else ''}; giving up in {left:.0f} s (--wait-s)")
        # a tab's onnxruntime-web has no autograd
        alive = [w for w in self.workers.alive() if w.kind is WorkerKind.NATIVE]
        if not alive:
            raise EdgerunError("no native worker to train on (browser tabs cannot take a training stage)")
        tokens = self.config.micro_size * self.max_len * self.config.in_flight
        plan = training_plan(self.model, alive, tokens, self.config.recompute)
        self.plans.append(plan)
        self.log("plan: " + ", ".join(f"{s.worker} layers {s.first_layer}-{s.end_layer - 1}" for s in plan.stages))
        stages = [RemoteStage(self.workers, self.workers[s.worker], s.first_layer, s.end_layer) for s in plan.stages]
        started = time.perf_counter()
        await asyncio.gather(*(self._load(s, checkpoint) for s in stages))
        self.log(f"{len(stages)} stages loaded in {time.perf_counter() - started:.1f} s")
        self.stages = stages
        return list(stages)

    async def _load(self, stage: RemoteStage, checkpoint: Checkpoint | None) -> None:
        # This stage's layers' matrices and their moments (named after them: .exp_avg, .exp_avg_sq).
        tensors = {} if checkpoint is None else {
            n: a for n, a in checkpoint.tensors.items()
            if stage.first <= parse_tensor_name(n.removesuffix(".exp_avg_sq").removesuffix(".exp_avg"))[0] < stage.end}
        message = TuneLoad(self.sha256, stage.first, stage.end, self.config.lora, self.config.lr,
                           self.config.weight_decay, checkpoint.optimizer_steps if checkpoint else 0,
                           self.config.recompute, tensors)
        stage.loaded = await self.workers.call(stage.worker, message, TuneLoaded, LOAD_TIMEOUT_S)

    def run(self, coro, timeout: float | None = None):
        return self.net.run(coro, timeout)

    def close(self) -> None:
        self.net.run(self.workers.close())
        self.http.close()
        self.net.stop()
