"""Continuous batching on one engine: sequences join and leave a running batch between steps.

Each round runs the next chunks of joining sequences' prompts (at most `round_tokens` tokens in all, and always one
chunk, so running sequences wait at most that long for their next token) and then one decode step of every running
sequence together:
the engine's matrix products take all their tokens at once, each sequence attends to its own slot's cache. A
sequence's tokens go through the same `Generation.take` as `generate`'s one-sequence loop (stop tokens, max tokens,
cancellation), and its logits are those it gets alone (the engine's batched step computes every sequence's as its
own, on the CPU kernels measured here: the matrix products give the same bits at any column count), so a seeded
request gives the same tokens in a batch as alone.

Prompts that share a prefix share its prefill: a slot's cache keeps the keys and values of the prompt it last ran
(and, where it ran all of it, the last token's logits) until another sequence takes the slot over. A joining
sequence takes the slot that holds most of its prompt, or has the rows copied from the slot that does (the engine's
copy_cache), and prefills only the rest. What is reused is what its own prefill would have computed: the whole
prompt (with its logits), or whole prefill chunks from the start, cut where its own prefill cuts them (a chunk's
keys and values depend on how the prompt is cut into steps); a sequence whose prompt a running one is prefilling
waits for it rather than prefilling it again.

A drawing engine (a pipeline: pp.batch) draws each sequence's token where its last stage holds the logits, with the
sequence's sampler's settings, and gives the logits only where the draw needs them here; its drawn prompts keep no
logits, so a sequence with the same prompt prefills its last chunk itself.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.generate import Generation, GenerationResult, StopReason
from edgerun.model.sampling import Sampler

# Prompt tokens a round runs of one joining sequence: a long prompt is prefilled over several rounds, each followed
# by a decode step of the running sequences (a 2,000-token prompt in one step held every stream for seconds).
PREFILL_CHUNK = 64
# Prompt tokens a round runs in all, of several joining sequences' chunks: a round's fixed costs (each product's pass
# over the weights; on a tensor-parallel cluster, every block's exchange) are paid once for them all. 8 streams of
# ~75-token prompts at 4 tensor-parallel devices (synthetic 1B, one thread a device): 47.8 tok/s against 42.5 with one
# chunk's 64 tokens a round (means of four rows each, alternated); on the single engine 26.3 against 21.3. Running
# sequences wait a round for their token.
ROUND_TOKENS = 256


class BatchEngine(Protocol):
    """An engine holding several sequences' caches (GgmlEngine with slots)."""

    slots: int

    @property
    def max_len(self) -> int: ...

    def prefill(self, slot: int, tokens: Sequence[int], start: int) -> np.ndarray: ...

    def decode(self, batch: Sequence[tuple[int, int, int]]) -> np.ndarray: ...

    def copy_cache(self, source: int, target: int, rows: int) -> None: ...


class FusingEngine(BatchEngine, Protocol):
    """A BatchEngine that runs a round's prompt chunks and decode step as one step where `fuses` (GgmlEngine,
    tp.batch.TpBatch): every sequence's logits those its own steps give it."""

    fuses: bool

    def round_step(self, chunks: Sequence[tuple[int, Sequence[int], int]], batch: Sequence[tuple[int, int, int]]
                   ) -> tuple[list[np.ndarray], np.ndarray]:
        """Prompt chunks, (slot, tokens, start) each, and one token of each sequence of `batch`, (slot, position,
        token) each: each chunk's last token's logits, and each sequence's of the batch."""
        ...


def round_spans(chunks: Sequence[tuple[int, Sequence[int], int]], batch: Sequence[tuple[int, int, int]]
                ) -> tuple[list[tuple[int, int, int]], list[int]]:
    """A round as one step (FusingEngine.round_step): each sequence's (slot, start, tokens), the chunks' first, and
    every token in that order."""
    spans = [(slot, start, len(tokens)) for slot, tokens, start in chunks] + \
        [(slot, position, 1) for slot, position, _ in batch]
    ids = [*itertools.chain.from_iterable(tokens for _, tokens, _ in chunks), *(token for _, _, token in batch)]
    return spans, ids


class GatheringEngine(BatchEngine, Protocol):
    """A BatchEngine whose logits are spread over devices (tp.batch.TpBatch): where `gathers`, its decode step takes
    `top`, the most of the largest logits any row's draw picks from (Sampler.candidates; None: all of them), and may
    gather only that many of each device's, the rest minus infinity (the draws are the same)."""

    gathers: bool

    def decode(self, batch: Sequence[tuple[int, int, int]], top: int | None = None) -> np.ndarray: ...


def most_candidates(samplers: Sequence[Sampler]) -> int | None:
    """The most of the largest logits any of these draws picks from (Sampler.candidates), None where one picks from
    all of them."""
    tops = [s.candidates for s in samplers]
    return None if not tops or None in tops else max(t for t in tops if t is not None)


class DrawingEngine(Protocol):
    """An engine that runs a round's prompt chunks and decode step at once (a pipeline: pp.batch, its stages each
    working on a different part of the round) and draws each sequence's next token itself, with the sequence's
    sampler's settings, giving the logits instead where the draw needs them here (Sampler.needs_logits)."""

    slots: int
    lanes: int  # prompt chunks a round runs at once (a pipeline's stages)

    @property
    def max_len(self) -> int: ...

    def round(self, chunks: Sequence[tuple[int, Sequence[int], int, Sampler]], batch: Sequence[tuple[int, int, int]],
              samplers: Sequence[Sampler]) -> tuple[list[int | np.ndarray], list[int | np.ndarray]]:
        """Prompt chunks, (slot, tokens, start, sampler) each, and one token of each sequence of `batch`, (slot,
        position, token) each: the token (or logits) after each chunk, and each sequence's next one."""
        ...

    def copy_cache(self, source: int, target: int, rows: int) -> None: ...


@dataclass(frozen=True)
class Held:
    """What a slot's cache holds of a prompt: the keys and values of its first tokens, `tokens`, and where the whole
    prompt was prefilled, the last token's logits."""

    tokens: tuple[int, ...]
    logits: np.ndarray | None = None


def reusable(held: Held | None, prompt: tuple[int, ...], chunk: int) -> int:
    """How many of a prompt's first positions a slot holding `held` saves a prefill of: all of them where it holds
    this whole prompt with its logits, else the whole prefill chunks of their common prefix, short of the prompt's
    last token (whose logits the prefill must give)."""
    if held is None:
        return 0
    if held.logits is not None and held.tokens == prompt:
        return len(prompt)
    common = 0
    for a, b in zip(held.tokens, prompt, strict=False):
        if a != b:
            break
        common += 1
    return min(common, len(prompt) - 1) // chunk * chunk


@dataclass
class _Sequence:
    gen: Generation
    slot: int
    done: Callable[[GenerationResult | BaseException], None]
    prefilled: int = 0  # prompt tokens in its cache (of `feed`)
    next_token: int | None = None  # sampled, to be fed by the next decode step
    # After the engine lost its cache (recover): the prompt and the tokens fed since, to prefill again
    context: list[int] | None = None
    waits_for: _Sequence | None = None  # a running sequence prefilling the same prompt, whose cache it will copy
    started: float = field(default_factory=time.perf_counter)
    prefill_s: float = 0.0
    decode_start: float = 0.0

    @property
    def feed(self) -> Sequence[int]:
        """What its prefill runs: the prompt, or after a recovery the context to run again."""
        return self.gen.prompt if self.context is None else self.context

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.feed)


class BatchLoop:
    """The sequences running on one engine, a slot each; `step` runs one round. Not thread-safe: one thread
    adds sequences and steps."""

    def __init__(self, engine: BatchEngine | FusingEngine | GatheringEngine | DrawingEngine,
                 prefill_chunk: int = PREFILL_CHUNK,
                 draws: bool = False, on_idle: Callable[[], None] | None = None,
                 round_tokens: int = ROUND_TOKENS) -> None:
        """`draws`: the engine is a DrawingEngine (its rounds take a chunk a lane, `round_tokens` aside); `on_idle`:
        called when the last running sequence has left (a pipeline's deployment repartitions only then);
        `round_tokens`: prompt tokens a round runs at most (its first chunk runs whatever its size)."""
        if prefill_chunk < 1 or round_tokens < 1:
            raise EdgerunError("a prefill chunk and a round's prompt tokens are at least one token")
        self.engine, self.prefill_chunk, self.draws, self.on_idle = engine, prefill_chunk, draws, on_idle
        self.round_tokens = round_tokens
        # a round's prompt chunks and decode step as one step, where the engine runs them so (FusingEngine): its
        # matrix products read the weights once for every token of the round
        self.fused = not draws and bool(getattr(engine, "fuses", False))
        # a decode step's logits gathered from devices: only as many of each one's largest as the draws can pick
        self.gathers = not draws and bool(getattr(engine, "gathers", False))
        self.running: list[_Sequence] = []
        self.held: dict[int, Held] = {}  # slot: what its cache holds of a prompt
        self.reused_tokens = 0  # prompt tokens not prefilled, their keys and values taken from a slot that held them

    @property
    def free(self) -> int:
        return self.engine.slots - len(self.running)

    def add(self, gen: Generation, done: Callable[[GenerationResult | BaseException], None]) -> None:
        """A sequence joins (its prompt is prefilled over the next rounds); `done` gets its result (or the error that
        ended it) when it ends."""
        gen.check(self.engine.max_len)
        taken = {s.slot for s in self.running}
        free = [i for i in range(self.engine.slots) if i not in taken]
        if not free:
            raise EdgerunError(f"all {self.engine.slots} sequences of the batch are running")
        prompt = tuple(gen.prompt)
        saved = {i: reusable(self.held.get(i), prompt, self.prefill_chunk) for i in range(self.engine.slots)}
        # the free slot holding most of this prompt; else an empty one, so what others hold stays for them
        slot = max(free, key=lambda i: (saved[i], i not in self.held, -i))
        source = max(saved, key=lambda i: (saved[i], i == slot))
        s = _Sequence(gen, slot, done)
        self.running.append(s)
        try:
            self._reuse(s, source, saved[source])
        except BaseException:  # it never joined (the engine failed copying a cache): the caller has the error
            self.running.remove(s)
            raise
        if s.next_token is None:
            s.waits_for = next((r for r in self.running if r is not s and r.waits_for is None
                                and r.next_token is None and tuple(r.gen.prompt) == prompt), None)

    def step(self) -> None:
        """One round: the next prompt chunks of the joining sequences, oldest first, as many as fit in the round's
        prompt tokens (always one), then a decode step of the others."""
        for s in [s for s in self.running if s.gen.cancelled()]:  # a client that went away leaves now
            self._end(s, StopReason.CANCELLED)
        for s in [s for s in self.running if s.waits_for is not None and s.waits_for.next_token is not None]:
            self._copy_prompt(s)
        # A prompt is cut at the same places whatever else runs (multiples of the chunk), so it rounds alike alone
        # and in a batch; prompts that join together share a round, and a drawing engine runs a chunk in each of
        # its lanes.
        budget = self.prefill_chunk * self.engine.lanes if self.draws else self.round_tokens
        prefilled, spent = [], 0
        for s in [s for s in self.running if s.prefilling and s.waits_for is None]:
            size = min(self.prefill_chunk, len(s.feed) - s.prefilled)
            if prefilled and spent + size > budget:
                break
            prefilled.append(s)
            spent += size
        ready = [s for s in self.running if s.next_token is not None and not s.prefilling]
        batch = [(s.slot, s.gen.position, s.next_token) for s in ready]
        chunks = [self._chunk(s) for s in prefilled]
        if self.draws:
            outs, rows = self.engine.round([(s.slot, chunk, s.prefilled, s.gen.sampler)
                                            for s, chunk in zip(prefilled, chunks, strict=True)],
                                           batch, [s.gen.sampler for s in ready])
            for s, chunk, out in zip(prefilled, chunks, outs, strict=True):
                self._prefilled_chunk(s, len(chunk), out)
        elif self.fused and len(chunks) + bool(batch) > 1:
            outs, rows = self.engine.round_step([(s.slot, chunk, s.prefilled)
                                                 for s, chunk in zip(prefilled, chunks, strict=True)], batch)
            for s, chunk, out in zip(prefilled, chunks, outs, strict=True):
                self._prefilled_chunk(s, len(chunk), out)
        else:
            for s, chunk in zip(prefilled, chunks, strict=True):
                self._prefilled_chunk(s, len(chunk), self.engine.prefill(s.slot, chunk, s.prefilled))
            if not batch:
                rows = []
            elif self.gathers:
                rows = self.engine.decode(batch, most_candidates([s.gen.sampler for s in ready]))  # type: ignore[call-arg]
            else:
                rows = self.engine.decode(batch)
        for s, row in zip(ready, rows, strict=True):
            self._take(s, lambda s=s, row=row: _drawn(row, s.gen.sampler, s.gen.position + 1))

    def fail_all(self, error: BaseException) -> None:
        """End every running sequence with `error` (the engine failed)."""
        for s in list(self.running):
            self.running.remove(s)
            s.done(error)
        self._idle()

    def _chunk(self, s: _Sequence) -> Sequence[int]:
        """The sequence's next prompt chunk."""
        return s.feed[s.prefilled:s.prefilled + self.prefill_chunk]

    def _prefilled_chunk(self, s: _Sequence, size: int, logits: int | np.ndarray) -> None:
        """The engine ran the sequence's next `size` prompt tokens: `logits` are the last one's (or the token a
        drawing engine drew after it). A context prefilled again ends with its next token already drawn."""
        feed = s.feed
        s.prefilled += size
        done = s.prefilled == len(feed)
        # a token drawn by the engine is this sequence's alone: another with the same prompt prefills its last chunk
        kept = logits if done and isinstance(logits, np.ndarray) and s.context is None else None
        self.held[s.slot] = Held(tuple(feed[:s.prefilled]), kept)
        if done and s.context is None:
            self._prefilled(s, logits)

    def recover(self) -> None:
        """The engine lost every cache (a pipeline replanned after losing a worker): each running sequence
        prefills again what its cache held, its prompt and the tokens fed since, and goes on with the token it
        drew last. With int8 activations a prefill rounds unlike the one-token steps it replaces, so tokens after
        it may part from an undisturbed run's at a near-tie."""
        self.held.clear()
        for s in self.running:
            s.waits_for = None
            if s.next_token is not None:
                s.context = [*s.gen.prompt, *s.gen.tokens[:-1]]
            s.prefilled = 0

    def _copy_prompt(self, s: _Sequence) -> None:
        """A waiting sequence's prompt from the sequence it waited for: all of it with its logits where that one
        prefilled it, else the whole chunks it got to (it was cancelled); the rest the sequence prefills itself."""
        source, s.waits_for = s.waits_for, None
        assert source is not None
        rows = reusable(self.held.get(source.slot), tuple(s.gen.prompt), self.prefill_chunk)
        if rows > s.prefilled:
            self._reuse(s, source.slot, rows)

    def _reuse(self, s: _Sequence, source: int, rows: int) -> None:
        """The sequence's first `rows` prompt positions from slot `source`'s cache (`reusable` rows of what it
        holds), with the last one's logits where they are the whole prompt: its first token is then drawn."""
        if rows and source != s.slot:
            self.engine.copy_cache(source, s.slot, rows)
        prompt = tuple(s.gen.prompt)
        logits = self.held[source].logits if rows == len(prompt) else None
        self.held[s.slot] = Held(prompt[:rows], logits)
        self.reused_tokens += rows - s.prefilled
        s.prefilled = rows
        if logits is not None:
            self._prefilled(s, logits)

    def _prefilled(self, s: _Sequence, logits: int | np.ndarray) -> None:
        """The whole prompt is in the sequence's cache: its first token from the last one's logits (or the token
        a drawing engine drew)."""
        s.prefill_s = time.perf_counter() - s.started
        s.decode_start = time.perf_counter()
        self._take(s, lambda: _drawn(logits, s.gen.sampler, len(s.gen.prompt)))

    def _take(self, s: _Sequence, draw: Callable[[], int]) -> None:
        """The sequence's next token (`draw` samples it): fed at the next step, or the sequence ends. A draw that
        fails (a grammar that allows no token) ends this sequence alone, with its error."""
        try:
            token = draw()
            going_on = s.gen.take(token)
        except Exception as e:
            self.running.remove(s)
            s.done(e)
            self._idle()
            return
        if going_on:
            s.next_token = token
        else:
            self._end(s)

    def _end(self, s: _Sequence, reason: StopReason | None = None) -> None:
        """The sequence leaves the batch (its slot free for the next): its result to its caller. Those that waited
        for its prompt take it where it was prefilled, else prefill their own."""
        self.running.remove(s)
        for r in [r for r in self.running if r.waits_for is s]:
            self._copy_prompt(r)
        if reason is not None:
            s.gen.reason = reason
        assert s.gen.reason is not None
        decode_s = time.perf_counter() - s.decode_start if s.decode_start else 0.0
        s.done(GenerationResult(len(s.gen.prompt), s.gen.tokens, s.gen.reason, s.prefill_s, decode_s))
        self._idle()

    def _idle(self) -> None:
        if not self.running and self.on_idle is not None:
            self.on_idle()


def _drawn(row: int | np.ndarray, sampler: Sampler, position: int) -> int:
    """The token at `position`: drawn already by a drawing engine, or drawn here from its logits."""
    return row if isinstance(row, int) else sampler(row, position)
