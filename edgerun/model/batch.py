"""Continuous batching on one engine: sequences join and leave a running batch between steps.

Each round runs the next chunks of joining sequences' prompts (at most `prefill_chunk` tokens in all, so running
sequences wait at most one chunk for their next token) and then one decode step of every running sequence together:
the engine's matrix products take all their tokens at once, each sequence attends to its own slot's cache. A
sequence's tokens go through the same `Generation.take` as `generate`'s one-sequence loop (stop tokens, max tokens,
cancellation), and its logits are those it gets alone (the engine's batched step computes every sequence's as its
own, on the CPU kernels measured here: the matrix products give the same bits at any column count), so a seeded
request gives the same tokens in a batch as alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.generate import Generation, GenerationResult, StopReason

# Prompt tokens a round runs of one joining sequence: a long prompt is prefilled over several rounds, each followed
# by a decode step of the running sequences (a 2,000-token prompt in one step held every stream for seconds).
PREFILL_CHUNK = 64


class BatchEngine(Protocol):
    """An engine holding several sequences' caches (GgmlEngine with slots)."""

    slots: int

    @property
    def max_len(self) -> int: ...

    def prefill(self, slot: int, tokens: Sequence[int], start: int) -> np.ndarray: ...

    def decode(self, batch: Sequence[tuple[int, int, int]]) -> np.ndarray: ...


@dataclass
class _Sequence:
    gen: Generation
    slot: int
    done: Callable[[GenerationResult | BaseException], None]
    prefilled: int = 0  # prompt tokens in its cache
    next_token: int | None = None  # sampled, to be fed by the next decode step
    started: float = field(default_factory=time.perf_counter)
    prefill_s: float = 0.0
    decode_start: float = 0.0


class BatchLoop:
    """The sequences running on one engine, a slot each; `step` runs one round. Not thread-safe: one thread
    adds sequences and steps."""

    def __init__(self, engine: BatchEngine, prefill_chunk: int = PREFILL_CHUNK) -> None:
        if prefill_chunk < 1:
            raise EdgerunError("a prefill chunk is at least one token")
        self.engine, self.prefill_chunk = engine, prefill_chunk
        self.running: list[_Sequence] = []

    @property
    def free(self) -> int:
        return self.engine.slots - len(self.running)

    def add(self, gen: Generation, done: Callable[[GenerationResult | BaseException], None]) -> None:
        """A sequence joins (its prompt is prefilled over the next rounds); `done` gets its result (or the error that
        ended it) when it ends."""
        gen.check(self.engine.max_len)
        taken = {s.slot for s in self.running}
        slot = next((i for i in range(self.engine.slots) if i not in taken), None)
        if slot is None:
            raise EdgerunError(f"all {self.engine.slots} sequences of the batch are running")
        self.running.append(_Sequence(gen, slot, done))

    def step(self) -> None:
        """One round: the next prompt chunks of the joining sequences, oldest first, as many as fit in one chunk's
        tokens (always one), then a decode step of the others."""
        for s in [s for s in self.running if s.gen.cancelled()]:  # a client that went away leaves now
            self._end(s, StopReason.CANCELLED)
        prefilled, spent = [], 0
        for s in [s for s in self.running if s.next_token is None]:
            # A prompt is cut at the same places whatever else runs (multiples of the chunk), so it rounds alike
            # alone and in a batch; short prompts that join together share a round.
            size = min(self.prefill_chunk, len(s.gen.prompt) - s.prefilled)
            if prefilled and spent + size > self.prefill_chunk:
                break
            prefilled.append(s)
            spent += size
            self._prefill(s)
        ready = [s for s in self.running if s.next_token is not None and s not in prefilled]
        if ready:
            logits = self.engine.decode([(s.slot, s.gen.position, s.next_token) for s in ready])
            for s, row in zip(ready, logits, strict=True):
                self._take(s, lambda s=s, row=row: s.gen.sampler(row, s.gen.position + 1))

    def fail_all(self, error: BaseException) -> None:
        """End every running sequence with `error` (the engine failed)."""
        for s in list(self.running):
            self.running.remove(s)
            s.done(error)

    def _prefill(self, s: _Sequence) -> None:
        prompt = s.gen.prompt
        chunk = prompt[s.prefilled:s.prefilled + self.prefill_chunk]
        logits = self.engine.prefill(s.slot, chunk, s.prefilled)
        s.prefilled += len(chunk)
        if s.prefilled == len(prompt):
            s.prefill_s = time.perf_counter() - s.started
            s.decode_start = time.perf_counter()
            self._take(s, lambda: s.gen.sampler(logits, len(prompt)))

    def _take(self, s: _Sequence, draw: Callable[[], int]) -> None:
        """The sequence's next token (`draw` samples it): fed at the next step, or the sequence ends. A draw that
        fails (a grammar that allows no token) ends this sequence alone, with its error."""
        try:
            token = draw()
            going_on = s.gen.take(token)
        except Exception as e:
            self.running.remove(s)
            s.done(e)
            return
        if going_on:
            s.next_token = token
        else:
            self._end(s)

    def _end(self, s: _Sequence, reason: StopReason | None = None) -> None:
        """The sequence leaves the batch (its slot free for the next): its result to its caller."""
        self.running.remove(s)
        if reason is not None:
            s.gen.reason = reason
        assert s.gen.reason is not None
        decode_s = time.perf_counter() - s.decode_start if s.decode_start else 0.0
        s.done(GenerationResult(len(s.gen.prompt), s.gen.tokens, s.gen.reason, s.prefill_s, decode_s))
