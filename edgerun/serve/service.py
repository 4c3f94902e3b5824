"""The requests of `edgerun serve`, in the order they came (a bounded FIFO queue), on one generation thread that
owns the engines: one at a time through the engine switch, or, with a batch (`--parallel`), several at once on this
machine's engine, joining and leaving the running batch between its steps (model.batch). Each request is a Job: its
tokens go back to the HTTP handler's event loop as they are made, and the handler may cancel it (a client that went
away, a stop string seen), which the generation loop notices before its next step."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from edgerun.errors import EdgerunError
from edgerun.model.batch import BatchLoop
from edgerun.model.generate import EngineLost, Generation, GenerationResult, StopReason, generate
from edgerun.model.logits import LogitShaper
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.serve.metrics import Metrics
from edgerun.serve.openai_api import ApiError
from edgerun.serve.switch import EngineSwitch, NoCapacity

IDLE_CHECK_S = 1.0  # how often an idle generation thread looks for nodes that joined or left
CAPACITY_POLL_S = 0.5  # how often a request waiting for capacity looks again
TOKENS_KEPT = 100_000  # token times kept for the dashboard's chart of the last two minutes
# A 503's Retry-After: nodes that join or come back are planned over within seconds.
NO_CAPACITY_RETRY_S = 5
RETRY_AFTER_S = 1  # a full queue's Retry-After: requests leave it as each one's generation ends, often within a second


def _cancelled(job: Job) -> GenerationResult:
    """The answer of a job cancelled before it ran: no tokens (its handler, whose client left, counts it)."""
    return GenerationResult(len(job.prompt), [], StopReason.CANCELLED, 0.0, 0.0)


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    shaper: LogitShaper | None = None  # the request's grammar, penalties, biases and logprobs
    # Tokens as they come, then the GenerationResult (or the exception) as the last item.
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)

    def put(self, item: object) -> None:
        with contextlib.suppress(RuntimeError):  # the handler's loop closed: nobody is listening
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)

    def cancel(self) -> None:
        self.cancelled.set()


class Service:
    def __init__(self, switch: EngineSwitch, stop_ids: frozenset[int], max_queue: int, wait_s: float,
                 metrics: Metrics, log: Callable[[str], None] = lambda _: None,
                 batch: BatchLoop | Sequence[BatchLoop] | None = None) -> None:
        """`batch`: several requests at once on one engine (None: one at a time); several batches (a pipeline's
        lanes, pp.batch) step each in a thread of its own."""
        self.switch, self.stop_ids, self.max_queue, self.wait_s, self.metrics, self.log = \
            switch, stop_ids, max_queue, wait_s, metrics, log
        self.lanes: list[BatchLoop] = [] if batch is None else [batch] if isinstance(batch, BatchLoop) else list(batch)
        self.lane_lock = threading.Lock()  # the lanes' joins: a lane that starts the first batch checks capacity
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.waiting = 0  # jobs queued or running
        self.count_lock = threading.Lock()
        self.busy = False
        self.tokens_log: deque[float] = deque(maxlen=TOKENS_KEPT)  # when each token came, for the dashboard
        self.thread = threading.Thread(target=self._run, name="generation", daemon=True)
        self.thread.start()

    @property
    def running(self) -> int:
        """Requests generating now."""
        return sum(len(b.running) for b in self.lanes) if self.lanes else int(self.busy)

    @property
    def reused_prompt_tokens(self) -> int:
        """Prompt tokens not prefilled, their keys and values taken from a sequence that shared them (--parallel)."""
        return sum(b.reused_tokens for b in self.lanes)

    @property
    def parallel(self) -> int:
        """Requests it generates at once at most."""
        return sum(b.engine.slots for b in self.lanes) if self.lanes else 1

    def submit(self, prompt: list[int], max_tokens: int, sampling: SamplingParams,
               shaper: LogitShaper | None = None) -> Job:
        """Queue a generation; 429 when the queue is full."""
        return self.submit_many(prompt, max_tokens, [(sampling, shaper)])[0]

    def submit_many(self, prompt: list[int], max_tokens: int,
                    choices: Sequence[tuple[SamplingParams, LogitShaper | None]]) -> list[Job]:
        """Queue a generation of one prompt per choice (a request's n), all or none: 429 when the queue has no room
        for all of them (400 when it never could)."""
        if len(choices) > self.max_queue:
            raise ApiError(400, f"n = {len(choices)} is more than the server queues ({self.max_queue})", param="n")
        with self.count_lock:
            if self.waiting + len(choices) > self.max_queue:
                raise ApiError(429, f"the queue is full ({self.max_queue} requests); try again shortly",
                               kind="rate_limit_error", code="queue_full", retry_after_s=RETRY_AFTER_S)
            self.waiting += len(choices)
        loop = asyncio.get_running_loop()
        jobs = [Job(prompt, max_tokens, sampling, loop, shaper) for sampling, shaper in choices]
        for job in jobs:
            self.queue.put(job)
        return jobs

    def close(self) -> None:
        for _ in range(max(1, len(self.lanes))):  # one each for the lanes' threads
            self.queue.put(None)
        self.thread.join(timeout=30)

    def _run(self) -> None:
        if self.lanes:
            for lane in self.lanes[1:]:
                threading.Thread(target=self._run_batched, args=(lane,), name="generation-lane", daemon=True).start()
            self._run_batched(self.lanes[0])
            return
        while True:
            try:
                job = self.queue.get(timeout=IDLE_CHECK_S)
            except queue.Empty:
                self._update()
                continue
            if job is None:
                return
            try:
                if job.cancelled.is_set():
                    job.put(_cancelled(job))
                elif self._capacity(job):
                    self.busy = True
                    job.put(self._generate(job))
            except NoCapacity as e:
                job.put(ApiError(503, f"no capacity: {e}", kind="server_error", code="no_capacity",
                                 retry_after_s=NO_CAPACITY_RETRY_S))
            except Exception as e:  # the handler reports it; the service goes on
                job.put(e)
            finally:
                self.busy = False
                self._left()

    def _left(self) -> None:
        """A job is answered: its place in the queue is free."""
        with self.count_lock:
            self.waiting -= 1

    def _run_batched(self, batch: BatchLoop) -> None:
        """Jobs join the batch while it has free slots (waiting on the queue only while nothing runs); each round
        is one of the batch's steps."""
        while True:
            while batch.free:
                try:
                    job = self.queue.get_nowait() if batch.running else self.queue.get(timeout=IDLE_CHECK_S)
                except queue.Empty:
                    if batch is self.lanes[0]:
                        with self.lane_lock:
                            if not self.running:  # no lane runs a batch: nodes may be replanned
                                self._update()
                    break
                if job is None:
                    batch.fail_all(EdgerunError("the server is stopping"))
                    return
                self._join(batch, job)
            if batch.running:
                self.busy = True
                try:
                    batch.step()
                except EngineLost as e:  # a pipeline replanned after losing a worker: its caches are gone
                    self.log(f"a batch's engine lost its caches ({e}): its sequences prefill their context again")
                    batch.recover()
                except Exception as e:  # the engine failed: every running request gets it; the service goes on
                    self.log(f"a batched step failed: {e}")
                    batch.fail_all(e)
            self.busy = self.running > 0

    def _join(self, batch: BatchLoop, job: Job) -> None:
        if job.cancelled.is_set():
            job.put(_cancelled(job))
            self._left()
            return
        with self.lane_lock:  # one lane at a time: the first to run checks capacity, no replan while any runs
            self._join_locked(batch, job)

    def _join_locked(self, batch: BatchLoop, job: Job) -> None:
        if not self.running and not self._capacity(job):  # a pipeline's batch: its workers may not be there yet
            if job.cancelled.is_set():
                job.put(_cancelled(job))
            self._left()
            return

        def done(result: GenerationResult | BaseException) -> None:
            try:  # answered whatever the counting does: a job left unanswered would hold its queue place for ever
                if isinstance(result, GenerationResult):
                    self._measured(result)
            finally:
                job.put(result)
                self._left()

        try:
            gen = Generation(job.prompt, job.max_tokens, Sampler(job.sampling, job.shaper), self.stop_ids,
                             functools.partial(self._token, job), job.cancelled.is_set)
            try:
                batch.add(gen, done)
            except EngineLost:  # the caches it would copy from are gone: the batch's sequences prefill again
                batch.recover()
                batch.add(gen, done)
        except Exception as e:  # a request the engine cannot run: its handler reports it
            job.put(e)
            self._left()

    def _token(self, job: Job, token: int) -> None:
        job.put(token)
        self.tokens_log.append(time.time())

    def _capacity(self, job: Job) -> bool:
        """Whether something can generate, waiting up to wait_s for nodes to join when nothing can; a 503 for
        the job when none came."""
        self._update()
        deadline = time.monotonic() + self.wait_s
        while not self.switch.has_capacity and not job.cancelled.is_set():
            if time.monotonic() >= deadline:
                job.put(ApiError(503, f"no capacity: no nodes hold the model, and none joined within "
                                      f"{self.wait_s:.0f} s", kind="server_error", code="no_capacity",
                                 retry_after_s=NO_CAPACITY_RETRY_S))
                return False
            time.sleep(CAPACITY_POLL_S)
            self._update()
        return not job.cancelled.is_set()

    def _update(self) -> None:
        try:
            self.switch.update()
        except EdgerunError as e:
            self.log(f"replanning failed: {e}")

    def _generate(self, job: Job) -> GenerationResult:
        sampler = Sampler(job.sampling, job.shaper)
        result = generate(self.switch, job.prompt, job.max_tokens, sampler, self.stop_ids,
                          functools.partial(self._token, job), cancelled=job.cancelled.is_set)
        self._measured(result)
        return result

    def _measured(self, result: GenerationResult) -> None:
        ms = result.decode_s / (len(result.tokens) - 1) * 1e3 if len(result.tokens) > 1 else None
        if ms is not None and not self.lanes:  # the switch compares one request's speed alone
            self.switch.measured(ms)
        self.metrics.generation(result.prompt_tokens, len(result.tokens), ms, result.recoveries)
