"""A pipeline as the engine of a running batch (model.batch.BatchLoop; `edgerun serve --plan dp --parallel N`).

Every ggml stage holds the caches of `PipelineConfig.slots` sequences. A round's one-token step is cut into
micro-batches, one per stage at most, and joining sequences' prompt chunks go beside them, one a stage (`lanes`),
all sent through the stages together: while the second stage computes the first pass, the first computes the
second. `edgerun serve` steps the slots in lanes instead (pipeline_lanes: several engines of a few slots, each
stepping in a thread of its own, one pass each in flight), so that the stages go on with the other lanes' passes
while a lane's tokens are drawn. Each sequence's hidden states are those it gets alone (GgmlEngine.decode_rows), and
the last stage draws its token with its own sampler's settings, as a one-sequence pass does (seeded draws depend
on the position alone): a request gives the same tokens in a batch as alone. Where a draw needs the whole
vocabulary here (a grammar, penalties: model/logits.py) the last stage sends that sequence's logits instead.

The passes go through the master (the star route). A pass that loses a worker marks the pipeline down; the next
round replans over the workers left (one lane at a time), and every lane whose caches were made on another plan
raises PlanChanged, on which its BatchLoop prefills its sequences' context again (BatchLoop.recover).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.generate import EngineLost
from edgerun.model.sampling import Sampler
from edgerun.pp.deployment import PipelineState
from edgerun.pp.master import COMPUTE_TIMEOUT_S, PipelineMaster
from edgerun.pp.messages import BatchComputation, BatchResult, Sampling, SlotCopied, SlotCopy
from edgerun.pp.pass_links import Breach
from edgerun.pp.workers import WorkerConn
from edgerun.sched.pp_plan import PPPlan

Drawn = int | np.ndarray  # a sequence's next token, or its logits where the master draws


class PlanChanged(EngineLost):
    """The pipeline runs on another plan than the one a lane's caches were made on."""


class Lanes:
    """What the lanes over one pipeline share: one of them replans at a time."""

    def __init__(self) -> None:
        self.replanning = asyncio.Lock()


class PipelineBatch:
    """The pipeline master's stages, or `slots` of their slots from `first` on (a lane: pipeline_lanes), as a
    BatchLoop engine that draws (model.batch.DrawingEngine). Several may step at once, from threads of their own."""

    def __init__(self, master: PipelineMaster, first: int = 0, slots: int | None = None,
                 lanes: int | None = None, shared: Lanes | None = None) -> None:
        """`lanes`: prompt chunks a round runs, and micro-batches its step is cut into, at most (None: one a
        stage)."""
        self.master, self.first = master, first
        self.shared = shared or Lanes()
        self.plan: PPPlan | None = None  # the plan this lane's caches were made on
        self.slots = master.config.slots - first if slots is None else slots
        if first < 0 or self.slots < 1 or first + self.slots > master.config.slots:
            raise EdgerunError(f"slots {first}..{first + self.slots - 1} are not the pipeline's "
                               f"{master.config.slots}")
        self._lanes = lanes

    @property
    def max_len(self) -> int:
        return self.master.max_len

    @property
    def lanes(self) -> int:
        """Prompt chunks a round runs at once: one in each stage (or as configured)."""
        return self._lanes or max(1, len(self.master.deployment.stage_workers))

    def round(self, chunks: Sequence[tuple[int, Sequence[int], int, Sampler]], batch: Sequence[tuple[int, int, int]],
              samplers: Sequence[Sampler]) -> tuple[list[Drawn], list[Drawn]]:
        """A round's prompt chunks, (slot, tokens, start, sampler) each, and one step of `batch`'s sequences, (slot,
        position, token) each, through the stages at once: the token after each chunk and each sequence's next
        token (or logits where the master draws)."""
        return self.master.net.run(self._round(list(chunks), list(batch), list(samplers)))

    def copy_cache(self, source: int, target: int, rows: int) -> None:
        """The first `rows` cached positions of slot `source` into slot `target`, on every stage."""
        message = SlotCopy(self.first + source, self.first + target, rows)

        async def copy() -> None:
            workers = self.master.workers
            await asyncio.gather(*(workers.call(workers[name], message, SlotCopied, COMPUTE_TIMEOUT_S)
                                   for names in self.master.deployment.stage_workers for name in names
                                   if workers[name].alive))

        self.master.net.run(self._on_plan())  # rows of a cache made on another plan are not there to copy
        self._check()
        self.master.net.run(copy())

    def _check(self) -> None:
        d = self.master.deployment
        if d.state != PipelineState.UP or d.plan is None:
            raise EdgerunError("the pipeline is not up: start it before batching on it")
        if not d.batched:
            raise EdgerunError("a batch runs on ggml's stages only: a worker of this plan computes on onnxruntime "
                               "(a browser tab, float32 activations or a model ggml does not build)")

    async def _round(self, chunks: list[tuple[int, Sequence[int], int, Sampler]], batch: list[tuple[int, int, int]],
                     samplers: list[Sampler]) -> tuple[list[Drawn], list[Drawn]]:
        """The step's micro-batches (module docstring) and the prompt chunks through the stages at once; the
        micro-batches first, so that a stage takes the running sequences' step before a prompt's chunk."""
        await self._on_plan()
        parts = min(len(batch), self.lanes)
        cuts = np.linspace(0, len(batch), parts + 1).round().astype(int)
        passes = [self._pass([b[0] for b in batch[i:j]], [b[1] for b in batch[i:j]],
                             np.asarray([b[2] for b in batch[i:j]], np.int64), samplers[i:j])
                  for i, j in itertools.pairwise(cuts)]
        passes += [self._pass([slot], [start], np.asarray(tokens, np.int64), [sampler], prompt=True)
                   for slot, tokens, start, sampler in chunks]
        try:
            drawn = await asyncio.gather(*passes)
        except PlanChanged:  # a deployment ended between the round's start and a pass's: the pipeline is up
            raise
        except EngineLost as e:
            self.master.recover(e)  # the pipeline is down: the next round replans
            raise
        steps = [d for part in drawn[:parts] for d in part]
        return [part[0] for part in drawn[parts:]], steps

    async def _on_plan(self) -> None:
        """Replan a pipeline that lost a worker (one lane at a time); PlanChanged where the plan is not the one
        this lane's caches were made on (its BatchLoop then prefills them again: recover)."""
        d = self.master.deployment
        d.busy = True  # no repartition begins while sequences run: BatchLoop's on_idle releases it
        async with self.shared.replanning:
            await self._deployed()
            if d.state != PipelineState.UP or not d.stages_alive():
                self.master.log("a batch's pipeline lost a worker: replanning")
                await d.replan(d.fallback())
        if d.plan is not self.plan:
            known, self.plan = self.plan, d.plan
            if known is not None:
                raise PlanChanged("the pipeline was replanned: its sequences prefill their context again")

    async def _deployed(self) -> None:
        """Until a deployment under way has ended (the repartition loop's, begun as a worker joined, before this
        batch's first round made the pipeline busy): a round that found the pipeline coming up failed at once."""
        d = self.master.deployment
        if d.state != PipelineState.UP:
            async with d.deploying:
                pass

    async def _pass(self, slots: list[int], positions: list[int], ids: np.ndarray, samplers: list[Sampler],
                    prompt: bool = False) -> list[Drawn]:
        """One pass of these sequences through every stage (a prompt's chunk: one sequence, several ids)."""
        await self._deployed()
        if self.master.deployment.plan is not self.plan:
            raise PlanChanged("the pipeline was replanned: its sequences prefill their context again")
        self._check()
        master, stages = self.master, self.master.deployment.stage_workers
        master.deployment.busy = True  # no repartition while sequences run: BatchLoop's on_idle releases it
        message = BatchComputation(tuple(self.first + slot for slot in slots), tuple(positions), prompt,
                                   input_ids=ids)
        rows = len(ids)
        for i, names in enumerate(stages):
            last = i == len(stages) - 1
            if last:
                message = dataclasses.replace(message, sampling=tuple(Sampling.of(s) for s in samplers))
            worker, reply = await master._hedged(names, message, BatchResult)
            worker.served += 1
            if last:
                try:
                    return self._drawn(worker, reply, samplers)
                except Breach as e:
                    await master._settle(e)
                    raise
            hidden = await master.hidden_of(worker, reply.hidden, (rows, master.model.config.hidden))
            message = dataclasses.replace(message, input_ids=None, hidden=hidden)
        raise AssertionError("a plan has at least one stage")

    def _drawn(self, worker: WorkerConn, reply: BatchResult, samplers: list[Sampler]) -> list[Drawn]:
        """The last stage's answer: a token per sequence, and the logits of those whose draw is the master's."""
        tokens, vocab = reply.tokens, self.master.model.config.vocab_size
        wanted = [s.needs_logits for s in samplers]
        logits = reply.logits
        if len(tokens) != len(samplers) or \
                any((t is None) != w or (t is not None and not 0 <= t < vocab)
                    for t, w in zip(tokens, wanted, strict=True)) or \
                (any(wanted) and (logits is None or logits.shape != (sum(wanted), vocab)
                                  or logits.dtype != np.float32)):
            raise Breach(worker, f"returned tokens {tokens!r} for {len(samplers)} sequences")
        rows = iter([] if logits is None else logits)
        return [next(rows) if t is None else t for t in tokens]


def pipeline_lanes(master: PipelineMaster, lanes: int) -> list[PipelineBatch]:
    """The pipeline's slots in `lanes` engines of their own, each with as many slots (the first ones one more where
    they do not divide), each round one chunk and one pass of its step: BatchLoops over them, stepping in threads of
    their own, keep `lanes` passes in flight, so that every stage works while a lane's tokens are drawn and sent
    back; with one lane per stage each stage takes one pass after another."""
    total = master.config.slots
    lanes = max(1, min(lanes, total))
    sizes = [total // lanes + (i < total % lanes) for i in range(lanes)]
    starts = np.cumsum([0, *sizes[:-1]])
    shared = Lanes()
    return [PipelineBatch(master, int(first), size, lanes=1, shared=shared)
            for first, size in zip(starts, sizes, strict=True)]
