"""Continuous batching on a tensor-parallel cluster: model.batch.BatchLoop's engine over a master and its nodes.

Every device's share holds `slots` sequences' caches (MasterConfig.slots, Assign.slots). A batch runs in a batch
session of its own (Master.start_batch): its steps are numbered, and each step's rows are told to the nodes before
its inputs (BatchStep): one sequence's prompt chunk, or one token of each running sequence. Every block of the step
carries all its rows at once, so one exchange a block serves the whole batch, and the matrix products read each
share's weights once for all of them; each row attends to its own slot's cache, and gets the numbers it gets alone.
A batch's blocks go over the streams, as a prompt's do (their inputs are tens of kilobytes).

A request alone, a replan or a rebalance makes a new session, and the batch's caches are gone with it: the next
step says so (CachesLost), and BatchLoop.recover prefills each running sequence's context again. A node lost during
a step is replanned around here, likewise.
"""

from __future__ import annotations

import functools
from collections.abc import Coroutine, Sequence
from typing import Any

import numpy as np

from edgerun.model.batch import round_spans
from edgerun.model.generate import EngineLost
from edgerun.model.ggml_engine import invariant_products
from edgerun.tp.master import Master


class CachesLost(EngineLost):
    """The batch's caches on the cluster are gone (a new session): its sequences prefill their context again."""


class TpBatch:
    """A tensor-parallel master as a batch engine (model.batch.BatchEngine): prefill a slot's chunk, decode one
    token of several slots, copy a prompt's cache rows between slots."""

    gathers = True  # model.batch.GatheringEngine: a decode step's nodes send each row's `top` largest logits

    def __init__(self, master: Master) -> None:
        self.master = master
        self.started = False  # a batch session ran: a new one means its caches are gone

    @property
    def slots(self) -> int:
        return self.master.config.slots

    @property
    def max_len(self) -> int:
        return self.master.config.max_len

    def prefill(self, slot: int, tokens: Sequence[int], start: int) -> np.ndarray:
        """Tokens at positions start.. of the sequence in `slot`: the last one's logits."""
        self._check(slot, start + len(tokens))
        return self._run(self.master.batch_step(tokens, (slot,), (start,)))[-1]

    def decode(self, batch: Sequence[tuple[int, int, int]], top: int | None = None) -> np.ndarray:
        """One token of each of several sequences, (slot, position, token) each, in one step: their logits, (len(batch),
        vocab), each as it is alone; with `top`, of each node's vocabulary rows only its `top` largest (the others
        minus infinity: a draw from `top` candidates at most is the same), so its partial is a few numbers a row,
        not its share of the vocabulary."""
        for slot, position, _ in batch:
            self._check(slot, position + 1)
        if len({slot for slot, _, _ in batch}) != len(batch):
            raise ValueError("a batch's step takes distinct slots")
        slots, positions, tokens = zip(*batch, strict=True)
        return self._run(self.master.batch_step(tokens, slots, positions, top=top)).reshape(len(batch), -1)

    @functools.cached_property
    def fuses(self) -> bool:
        """Whether a round's prompt chunks and decode step go as one step (round_step): where every product of the
        model gives a column its bits at any column count here (the nodes' products are taken to do as the
        master's, as a batch's decode step takes them to)."""
        return invariant_products(self.master.model)

    def round_step(self, chunks: Sequence[tuple[int, Sequence[int], int]], batch: Sequence[tuple[int, int, int]]
                   ) -> tuple[list[np.ndarray], np.ndarray]:
        """Prompt chunks, (slot, tokens, start) each, and one token of each sequence of `batch`, (slot, position,
        token) each, in one step (its blocks carry all their tokens): each chunk's last token's logits, and each
        sequence's of the batch, as their own steps give them."""
        spans, ids = round_spans(chunks, batch)
        for slot, start, n in spans:
            self._check(slot, start + n)
        if len({slot for slot, _, _ in spans}) != len(spans):
            raise ValueError("a round's sequences take distinct slots")
        slots, starts, counts = zip(*spans, strict=True)
        out = self._run(self.master.batch_step(ids, slots, starts, counts)).reshape(len(spans), -1)
        return list(out[:len(chunks)]), out[len(chunks):]

    def copy_cache(self, source: int, target: int, rows: int) -> None:
        for slot in (source, target):
            self._check(slot, rows)
        self._session()
        self.master.copy_batch_cache(source, target, rows)

    def _check(self, slot: int, end: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not one of the batch's {self.slots}")
        if end > self.max_len:
            raise ValueError(f"context of {self.max_len} tokens exceeded")

    def _session(self) -> None:
        """The batch session its caches are in; CachesLost where a new one had to start after one had run."""
        self._began(self.master.start_batch())

    def _began(self, fresh: bool) -> None:
        if fresh and self.started:
            raise CachesLost("the cluster made a new session")
        self.started = True

    def _run(self, step: Coroutine[Any, Any, np.ndarray]) -> np.ndarray:
        """The step in the master's turn, its batch session begun in the same turn (Master.begin_batch)."""
        master = self.master

        async def in_session() -> np.ndarray:
            try:
                self._began(master.begin_batch())
            except CachesLost:
                step.close()
                raise
            return await step

        try:
            return master.net.run_in_turn(in_session(), master.config.spin_us / 1e6)
        except CachesLost:
            raise
        except EngineLost as lost:  # a node went: plan over those left, in a batch session at once
            master.recover(lost)
            master.start_batch()
            raise CachesLost(str(lost)) from lost
