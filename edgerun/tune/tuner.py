"""The training loop: micro-batches forward through the stages and gradients back, an AdamW step on every stage,
checkpoints, and recovery from a lost worker. One loop serves a single process (one local stage holding every
layer) and a pipeline of workers (remote stages); it only sees `StageClient`s.

A step's micro-batches run concurrently, up to `in_flight` at once (GPipe): while the last stage computes one
micro-batch's loss, the first is already on the next. Each stage answers its requests in order, so the
pipeline fills without any stage running two things at once.

Recovery: a stage lost mid-step (its worker gone, a call timed out) ends the step; the caller's `restart`
builds new stages over the workers left (a new plan) from the last checkpoint, and the loop goes on from that
checkpoint's step. Data order and dropout are functions of the step, so the resumed run repeats the same losses.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.generate import EngineLost
from edgerun.model.hf_dir import read_safetensors_with_metadata, write_safetensors
from edgerun.model.quant import quantize
from edgerun.tune.data import Batch, Example, batches, step_batches
from edgerun.tune.lora import LoraConfig

CHECKPOINT_FILE = "checkpoint.safetensors"


@dataclass(frozen=True)
class TuneConfig:
    steps: int = 200
    micro_size: int = 2  # sequences per micro-batch
    micro_batches: int = 2  # micro-batches per optimizer step (gradient accumulation): two keep two stages busy
    in_flight: int = 2  # micro-batches in the pipeline at once
    lr: float = 5e-5  # AdamW, the DE-LLMIT report's
    weight_decay: float = 0.1  # the DE-LLMIT report's
    seed: int = 0  # data order (dropout and A's initial values: the LoRA config's seed)
    checkpoint_every: int = 10  # steps; 0: never
    eval_examples: int = 48  # held-out examples scored before and after (0: none)
    recompute: bool = False  # stages keep each layer's input only and compute the layer again for backward
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        for name, flag in (("steps", "steps"), ("micro_size", "micro-size"), ("micro_batches", "accumulate"),
                           ("in_flight", "in-flight")):
            if getattr(self, name) < 1:
                raise EdgerunError(f"--{flag} must be at least 1, not {getattr(self, name)}")
        if not self.lr > 0 or self.weight_decay < 0:
            raise EdgerunError("--lr must be positive and --weight-decay at least 0")
        if self.checkpoint_every < 0 or self.eval_examples < 0:
            raise EdgerunError("--checkpoint-every and --eval-examples must be at least 0")

class StageClient(Protocol):
    """One stage as the loop drives it, local or on a worker. Requests to one stage are answered in order."""

    first: int
    end: int

    async def forward(self, step: int, micro: int, x: np.ndarray) -> np.ndarray: ...

    async def forward_loss(self, step: int, micro: int, x: np.ndarray, labels: np.ndarray,
                           denominator: int) -> tuple[float, int, np.ndarray | None]: ...

    async def backward(self, micro: int, grad: np.ndarray) -> np.ndarray | None: ...

    async def evaluate(self, x: np.ndarray, labels: np.ndarray | None) -> tuple[np.ndarray | None, float, int]: ...

    async def step(self, lr: float) -> None: ...

    async def state(self) -> tuple[dict[str, np.ndarray], int]: ...


@dataclass(frozen=True)
class Checkpoint:
    """Where a run stands after `step` steps: every LoRA matrix and AdamW moment by name, and the losses so far."""

    step: int
    optimizer_steps: int
    tensors: dict[str, np.ndarray]
    losses: tuple[float, ...]
    heldout_before: float | None

    def save(self, directory: Path, config: TuneConfig, base_sha256: str) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        meta = {"step": str(self.step), "optimizer_steps": str(self.optimizer_steps),
                "losses": json.dumps(self.losses), "heldout_before": json.dumps(self.heldout_before),
                "base_sha256": base_sha256, "lora": json.dumps(config.lora.to_dict()),
                "config": json.dumps({k: v for k, v in asdict(config).items() if k != "lora"})}
        tensors = {name: quantize(a, "F32") for name, a in self.tensors.items()}
        path = directory / CHECKPOINT_FILE
        partial = path.with_suffix(".partial")
        write_safetensors(partial, tensors, meta)
        partial.replace(path)  # a run killed while writing keeps the previous checkpoint whole
        return path


def load_checkpoint(directory: Path, config: TuneConfig, base_sha256: str) -> Checkpoint | None:
    """The checkpoint in `directory`, or None; EdgerunError when it belongs to another model or LoRA setting."""
    path = directory / CHECKPOINT_FILE
    if not path.is_file():
        return None
    try:
        raw, meta = read_safetensors_with_metadata(path)
        tensors = {name: np.array(t.dequantize(), np.float32) for name, t in raw.items()}
        if meta["base_sha256"] != base_sha256:
            raise EdgerunError(f"{path} is a checkpoint of another model; resume with the model it was trained on "
                               "or choose another --out")
        if json.loads(meta["lora"]) != config.lora.to_dict():
            raise EdgerunError(f"{path} was trained with other LoRA settings ({meta['lora']})")
        return Checkpoint(int(meta["step"]), int(meta["optimizer_steps"]), tensors,
                          tuple(json.loads(meta["losses"])), json.loads(meta["heldout_before"]))
    except EdgerunError:
        raise
    except (KeyError, ValueError, OSError) as e:
        raise EdgerunError(f"cannot read checkpoint {path}: {e}") from e


@dataclass
class StepRecord:
    step: int  # 1-based: steps done after this one
    loss: float  # mean cross-entropy per answer token over the step's micro-batches
    tokens: int  # tokens processed (padding excluded)
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class TuneResult:
    losses: list[float]
    heldout_before: float | None
    heldout_after: float | None
    tokens: int
    seconds: float
    recoveries: int
    resumed_from: int
    final_state: Checkpoint

    def summary(self, window: int) -> dict[str, Any]:
        """initial_loss and final_loss are means over the first and the last `window` steps (one step's
        micro-batches are a handful of sequences: a single step's loss is noisy)."""
        w = max(1, min(window, len(self.losses) // 2))
        return {"initial_loss": float(np.mean(self.losses[:w])), "final_loss": float(np.mean(self.losses[-w:])),
                "first_step_loss": self.losses[0], "last_step_loss": self.losses[-1], "loss_window": w,
                "heldout_before": self.heldout_before, "heldout_after": self.heldout_after,
                "steps": len(self.losses), "tokens": self.tokens, "seconds": round(self.seconds, 2),
                "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds else 0.0,
                "recoveries": self.recoveries, "resumed_from": self.resumed_from}


Restart = Callable[[Checkpoint | None], Awaitable[list[StageClient]]]


class Tuner:
    """Runs `config.steps` steps over `train`, scoring `heldout` before and after."""

    def __init__(self, config: TuneConfig, train: Sequence[Example], heldout: Sequence[Example], base_sha256: str,
                 out: Path | None, log: Callable[[str], None] = lambda _: None,
                 on_step: Callable[[StepRecord], None] = lambda _: None) -> None:
        if not train:
            raise EdgerunError("the training set is empty")
        self.config, self.train, self.base_sha256, self.out = config, list(train), base_sha256, out
        self.heldout = list(heldout)[:config.eval_examples]
        self.log, self.on_step = log, on_step
        self.max_recoveries = 8

    async def run(self, restart: Restart, resume: Checkpoint | None = None) -> TuneResult:
        """Train from `resume` (or from the start) to `config.steps`. A stage lost at any point (a step, a
        checkpoint, an evaluation, loading) means new stages from the last checkpoint and the steps since again."""
        c = self.config
        checkpoint = resume
        recoveries = 0
        stages: list[StageClient] = []

        async def recover(e: EngineLost | None) -> None:
            nonlocal recoveries, stages
            while True:
                if e is not None:
                    recoveries += 1
                    if recoveries > self.max_recoveries:
                        raise EdgerunError(f"gave up after {self.max_recoveries} recoveries ({e})") from e
                    self.log(f"lost a stage ({e}); resuming from step {checkpoint.step if checkpoint else 0}")
                try:
                    stages = await restart(checkpoint)
                    return
                except EngineLost as lost:
                    e = lost

        async def evaluate() -> float:
            while True:
                try:
                    return await self.evaluate(stages)
                except EngineLost as e:
                    await recover(e)

        await recover(None)
        losses = list(checkpoint.losses) if checkpoint else []
        before = checkpoint.heldout_before if checkpoint else None
        if checkpoint is None and self.heldout:
            before = await evaluate()
            self.log(f"held-out loss before tuning: {before:.4f} ({len(self.heldout)} examples)")
        step = checkpoint.step if checkpoint else 0
        started, tokens = time.perf_counter(), 0
        while step < c.steps or checkpoint is None or checkpoint.step != step:
            try:
                if step < c.steps:
                    record = await self._step(stages, step)
                    step += 1
                    losses.append(record.loss)
                    tokens += record.tokens
                    self.on_step(record)
                if (c.checkpoint_every and step % c.checkpoint_every == 0) or step == c.steps:
                    checkpoint = await self._checkpoint(stages, step, losses, before)
            except EngineLost as e:
                await recover(e)
                step = checkpoint.step if checkpoint else 0
                losses = list(checkpoint.losses) if checkpoint else []
        after = await evaluate() if self.heldout else None
        if after is not None:
            self.log(f"held-out loss after tuning: {after:.4f}")
        return TuneResult(losses, before, after, tokens, time.perf_counter() - started, recoveries,
                          resume.step if resume else 0, checkpoint)

    async def _step(self, stages: list[StageClient], step: int) -> StepRecord:
        c = self.config
        start = time.perf_counter()
        micro = step_batches(self.train, step, c.micro_batches, c.micro_size, c.seed)
        denominator = sum(b.n_labels for b in micro)
        gate = asyncio.Semaphore(c.in_flight)

        async def one(m: int, batch: Batch) -> float:
            async with gate:
                return await self._micro_batch(stages, step, m, batch, denominator)

        # Fail fast: the first lost stage ends the step (the other micro-batches are cancelled).
        tasks = [asyncio.ensure_future(one(m, b)) for m, b in enumerate(micro)]
        try:
            loss_sums = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        await asyncio.gather(*(s.step(self.lr(step)) for s in stages))
        tokens = sum(int((b.tokens != 0).sum()) for b in micro)
        return StepRecord(step + 1, sum(loss_sums) / denominator, tokens, time.perf_counter() - start)

    def lr(self, step: int) -> float:
        """The learning rate of step `step`: constant (the DE-LLMIT report's schedule)."""
        return self.config.lr

    async def _micro_batch(self, stages: list[StageClient], step: int, m: int, batch: Batch,
                           denominator: int) -> float:
        x: np.ndarray = batch.tokens
        for s in stages[:-1]:
            x = await s.forward(step, m, x)
        loss, _, grad = await stages[-1].forward_loss(step, m, x, batch.labels, denominator)
        for s in reversed(stages[:-1]):
            grad = await s.backward(m, grad)
        return loss

    async def evaluate(self, stages: list[StageClient]) -> float:
        """Mean cross-entropy per answer token over the held-out examples, without dropout."""
        total, count = 0.0, 0
        for batch in batches(self.heldout, self.config.micro_size):
            x: np.ndarray | None = batch.tokens
            for s in stages[:-1]:
                x, _, _ = await s.evaluate(x, None)
            _, loss, n = await stages[-1].evaluate(x, batch.labels)
            total, count = total + loss, count + n
        return total / max(count, 1)

    async def _checkpoint(self, stages: list[StageClient], step: int, losses: list[float],
                          before: float | None) -> Checkpoint:
        tensors: dict[str, np.ndarray] = {}
        steps = 0
        for part, n in await asyncio.gather(*(s.state() for s in stages)):
            tensors.update(part)
            steps = max(steps, n)
        checkpoint = Checkpoint(step, steps, tensors, tuple(losses), before)
        if self.out is not None:
            checkpoint.save(self.out, self.config, self.base_sha256)
        return checkpoint


def eta_text(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"
