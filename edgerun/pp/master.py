"""`edgerun master --plan dp`: pipeline-parallel generation over WebSocket workers.

Workers (native processes, browser pages) connect to `/ws`, download stage files from `/files/<sha256>`, and
browsers load the node page from `/node`: the routes of pp.http, on the master's own port or, under `edgerun
serve`, beside the API on the server's. The master is split by concern:

- pp.workers: the WebSockets (handshake, request/reply calls, who is present);
- pp.deployment: the state machine that plans layer ranges and moves between plans (running, staged, shadow);
- pp.pass_links: a chained route's passes, over plain TCP to the workers' pass ports;
- this module: generation. Every forward pass goes through the stages in turn; the last stage samples and
  returns only the token id. When a worker leaves mid-request, the deployment replans over the workers left
  (or falls back to its shadow plan) and the generation loop prefills the context again; since every stage is
  deterministic and sampling is seeded per position, the output equals an uninterrupted run.

All of it runs on one event loop (the HTTP server's), in a thread of its own; the generation loop calls in
from its thread and blocks on each step. A decode step on a chained route is the exception: the generation
thread sends it and waits for its token itself (the loop's turn and two thread hand-offs cost about as much as a
hop between stages).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from starlette.applications import Starlette
from starlette.routing import BaseRoute

from edgerun.errors import EdgerunError
from edgerun.model.generate import EngineLost, generate
from edgerun.model.loader import Model
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.net.channel import EventLoopThread
from edgerun.net.http_server import HttpServer, bind
from edgerun.pp.config import PipelineConfig, Route
from edgerun.pp.deployment import Deployment, PipelineState, describe
from edgerun.pp.http import browser_dir, pipeline_routes, say_if_tabs_cannot_join
from edgerun.pp.messages import BatchComputation, Computation, ComputationResult, Init, Prefix, Sampling
from edgerun.pp.pass_links import Breach, PassLinks, PortClosed
from edgerun.pp.workers import BadInput, WorkerConn, WorkerLost, Workers
from edgerun.sched.pp_plan import PPPlan, Stage

T = TypeVar("T")

__all__ = ["PipelineConfig", "PipelineMaster", "PipelineState", "PlanSwap", "Route", "WorkerLost", "browser_dir",
           "chat_template_prefix", "describe"]

COMPUTE_TIMEOUT_S = 120.0
GREEDY = SamplingParams()
MAX_REQUEST_LOSSES = 8  # workers lost within one request before it gives up


@dataclass
class PassStats:
    """One-token passes through the stages since the master started, and the stages' own compute in them (what
    workers report), for benchmarks: the rest of a token's time is transfer and the master."""

    decode_passes: int = 0  # stage passes of one-token steps
    decode_stage_s: float = 0.0


class PlanSwap(EngineLost):
    """A staged plan is ready mid-request: it takes over at a prefill of the context so far."""


def chat_template_prefix(tokenizer) -> list[int]:
    """The tokens every chat-templated prompt starts with (the system prompt and the user header)."""
    a = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "x"}]))
    b = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "something else"}]))
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


class PipelineMaster:
    """A pipeline master. With `net` None it serves its routes itself on config.host:config.port (a port in use
    is an EdgerunError); given the loop thread of an HTTP server, it runs there and that server serves
    `routes()` (config.port then names that server's port)."""

    def __init__(self, model: Model, key: bytes, config: PipelineConfig | None = None,
                 log: Callable[[str], None] = lambda _: None, net: EventLoopThread | None = None) -> None:
        config = config or PipelineConfig()
        self.model, self.key, self.config, self.log = model, key, config, log
        say_if_tabs_cannot_join(log)
        self.max_len = config.max_len  # the generation loop reads it
        self.prefix = list(config.prefix)
        self.stragglers: set[asyncio.Task] = set()  # replicas' answers that lost the race, still arriving
        self.recovery_seconds: list[float] = []  # from losing a worker to the next token, per recovery
        self.swap_seconds: list[float] = []  # from starting a hot swap to the next token, per swap
        self.swap_positions: list[int] = []  # the positions whose KV moved, per swap that moved KV
        # The context length of every pass from position 0: a request's prefill, then one per recovery or swap that
        # prefilled its context again (with int8 activations a prefill of many tokens rounds unlike the one-token
        # steps that first made them, so tokens after it may differ from an uninterrupted run's at near-ties).
        self.prefill_lengths: list[int] = []
        self.cached_length: int | None = None  # positions the stages' caches hold when a plan swap interrupts
        self.lost_at: float | None = None  # when the request in flight lost a worker, until it has a token again
        self.request_losses = 0  # workers the request in flight lost
        self.stats = PassStats()
        self.links = PassLinks(key, log, config.spin_us / 1e6)
        self.http: HttpServer | None = None
        sock = bind(config.host, config.port) if net is None else None  # first: a port in use fails at once
        self.net = net or EventLoopThread(config.spin_us / 1e6)
        self.net.call(self._on_loop)
        if sock is None:
            self.port = config.port
        else:
            try:
                self.http = HttpServer(Starlette(routes=self.routes()), sock, self.net, config.max_frame)
            except BaseException:
                sock.close()
                raise
            self.port = self.http.port

    def _on_loop(self) -> None:
        """What is made on the master's loop: the workers, the deployment, the repartition task."""
        init = Init(self.model.config, self.max_len)
        self.workers = Workers(self.key, init, self.log, lambda worker, joined: self.deployment.on_change(worker,
                                                                                                          joined))
        self.deployment = Deployment(self.model, self.workers, self.config, self.log, self._warm)
        self.repartitioner = asyncio.get_running_loop().create_task(self.deployment.repartition_loop())

    def routes(self) -> list[BaseRoute]:
        return pipeline_routes(self.workers, self.deployment.files, self.deployment.status_text, self.log)

    async def _warm(self) -> None:
        """A plan was committed: with a prefix cache, run the prefix once so every worker keeps its KV rows."""
        if self.prefix:
            await self._forward(self.prefix, 0, Sampling(), Prefix.SAVE)

    # --- what the deployment holds, read by callers ---------------------------------------------------------
    @property
    def plan(self) -> PPPlan | None:
        return self.deployment.plan

    @property
    def state(self) -> PipelineState:
        return self.deployment.state

    @property
    def staged(self) -> PPPlan | None:
        return self.deployment.staged

    @property
    def shadow(self) -> PPPlan | None:
        return self.deployment.shadow

    def status_text(self) -> str:
        return self.deployment.status_text()

    async def _hedged(self, names: list[str], message: Computation | BatchComputation, expect: type[T]
                      ) -> tuple[WorkerConn, T]:
        """The first answer from the stage's live workers; the others still compute (their KV caches
        must keep up) and their answers are dropped when they come."""
        calls = {asyncio.ensure_future(self.workers.call(self.workers[name], message, expect,
                                                         COMPUTE_TIMEOUT_S)): name
                 for name in names if self.workers[name].alive}
        pending = set(calls)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is None:
                    for straggler in pending:
                        self.stragglers.add(straggler)
                        straggler.add_done_callback(self._forget_straggler)
                    return self.workers[calls[task]], task.result()
        raise WorkerLost(", ".join(names))

    def _forget_straggler(self, task: asyncio.Task) -> None:
        self.stragglers.discard(task)
        if not task.cancelled():
            task.exception()  # a replica lost meanwhile is seen by the next pass

    # --- generation ------------------------------------------------------------------------------------
    async def _forward(self, tokens: Sequence[int], position: int, sampling: Sampling,
                       prefix: Prefix | None = None) -> int | np.ndarray:
        """One pass through every stage; the last stage's sampled token, or its logits where `sampling` asks for
        them (a request whose draw needs the whole vocabulary: model/logits.py; these go by the star route, whose
        replies carry tensors). `prefix`: SAVE keeps the KV of this pass on every worker, RESTORE continues
        from it."""
        if self.deployment.chained and not sampling.logits:
            try:
                return await asyncio.get_running_loop().run_in_executor(None, self._chained_pass, tokens, position,
                                                                        sampling, prefix)
            except (Breach, PortClosed) as e:
                await self._settle(e)
                raise
        message = Computation(position, input_ids=np.asarray([tokens], np.int64), prefix=prefix)
        plan = self.deployment.plan
        for i, s in enumerate(plan.stages):
            last = i == len(plan.stages) - 1
            if last:
                message = dataclasses.replace(message, sampling=sampling)
            sent = time.perf_counter()
            worker, reply = await self._hedged(self.deployment.stage_workers[i], message, ComputationResult)
            wall = time.perf_counter() - sent
            worker.served += 1
            if len(tokens) == 1 and reply.seconds > 0:  # decode: what plans are priced by
                self._observe(worker, s, reply.seconds, wall - worker.rtt_ms / 1e3)
            if last:
                return await self._token(worker, reply, sampling.logits)
            hidden = await self.hidden_of(worker, reply.hidden, (1, len(tokens), self.model.config.hidden))
            message = dataclasses.replace(message, input_ids=None, hidden=hidden)
        raise AssertionError("a plan has at least one stage")

    async def hidden_of(self, worker: WorkerConn, hidden: np.ndarray | None, expected: tuple[int, ...]
                        ) -> np.ndarray:
        """A middle stage's answer: float32 hidden states of the shape expected; a worker that answered anything
        else is expelled (WorkerLost)."""
        if hidden is None or hidden.shape != expected or hidden.dtype != np.float32:
            got = "nothing" if hidden is None else f"{hidden.dtype} {hidden.shape}"
            await self.workers.expel(worker, f"returned {got} where a float32 hidden state of shape {expected} "
                                     "was due")
        return hidden

    def _chained_pass(self, tokens: Sequence[int], position: int, sampling: Sampling,
                      prefix: Prefix | None = None) -> int:
        """One pass down the chained route, blocking the calling thread: the first stage gets the tokens, the last
        returns the sampled token and every stage's compute seconds. Breach for a worker to expel."""
        plan, d = self.deployment.plan, self.deployment
        chain = [self.workers[names[0]] for names in d.stage_workers]
        message = Computation(position, np.asarray([tokens], np.int64), sampling=sampling, prefix=prefix, chain=())
        sent = time.perf_counter()
        try:
            reply = self.links.forward(chain, self.workers.next_request(), message, COMPUTE_TIMEOUT_S)
        except BadInput as e:  # the stage before the one that refused its input sent it
            index = [w.name for w in chain].index(e.worker)
            if index > 0:
                raise Breach(chain[index - 1], f"handed {e.worker} an input it cannot take") from e
            raise
        wall = time.perf_counter() - sent
        seconds = reply.stage_seconds
        if len(seconds) != len(chain) or not all(t >= 0 for t in seconds):
            raise Breach(chain[-1], f"returned stage times {seconds!r}")
        for worker in chain:
            worker.served += 1
        if len(tokens) == 1 and all(t > 0 for t in seconds):
            # The pass's time beyond compute and the links' latency, shared evenly by its stages.
            beyond = (wall - sum(seconds) - sum(w.rtt_ms for w in chain) / 1e3) / len(chain)
            for worker, stage, t in zip(chain, plan.stages, seconds, strict=True):
                self._observe(worker, stage, t, t + beyond)
        return self._checked_token(chain[-1], reply)

    def _observe(self, worker: WorkerConn, stage: Stage, seconds: float, wall: float) -> None:
        """A decode pass of one stage (what plans are priced by): `seconds` its compute, `wall` its time in
        the pass without the link's latency."""
        self.stats.decode_passes += 1
        self.stats.decode_stage_s += seconds
        # in the units the planner prices the stage in, so that the speed it learns predicts that price
        cost = self.deployment.fit.costs
        worker.observe_decode(sum(cost[stage.first_layer:stage.end_layer]), seconds)
        # δ, the per-stage overhead of the cost model: what the pass took beyond compute and latency
        self.deployment.overheads.append(max(0.0, wall - seconds))

    async def _token(self, worker: WorkerConn, reply: ComputationResult, logits: bool) -> int | np.ndarray:
        try:
            if logits:
                return self._checked_logits(worker, reply.logits)
            return self._checked_token(worker, reply)
        except Breach as e:
            await self._settle(e)
            raise

    async def _settle(self, failure: Breach | PortClosed) -> None:
        """What a pass's failure says about its worker: one that broke the protocol is expelled (WorkerLost, as
        expel raises), one whose pass port closed counts as gone at once (the caller raises the PortClosed)."""
        if isinstance(failure, Breach):
            await self.workers.expel(failure.worker, failure.reason)
        else:
            await self.workers.drop(failure.worker, f"pass port lost ({failure.reason})")

    def _checked_logits(self, worker: WorkerConn, logits: np.ndarray | None) -> np.ndarray:
        vocab = self.model.config.vocab_size
        if logits is None or logits.shape != (vocab,) or logits.dtype != np.float32:
            got = "nothing" if logits is None else f"{logits.dtype} {logits.shape}"
            raise Breach(worker, f"returned {got} where float32 logits of shape ({vocab},) were due")
        return logits

    def _checked_token(self, worker: WorkerConn, reply: ComputationResult) -> int:
        token = reply.token
        if token is None or not 0 <= token < self.model.config.vocab_size:
            raise Breach(worker, f"returned token {token!r}")
        return token

    # --- moving KV caches on a hot swap ---------------------------------------------------------------
    def _kv_movable(self, plan: PPPlan, context: int) -> bool:
        """Whether a swap to `plan` can move the running stages' KV caches to its stages instead of prefilling
        `context` tokens again: the caches hold all but the last of them, and every worker of both plans is
        native (the browser page does not take part in moves)."""
        return self.cached_length is not None and self.cached_length == context - 1 > 0 and \
            self.deployment.all_native(plan)

    # --- the generation loop's interface (model.generate): a step returns the last stage's sampled token ----
    def reset(self) -> None:
        """A request (or its re-prefill) begins: joins and leaves wait for its end (release)."""
        self.deployment.busy = True

    def release(self) -> None:
        self.deployment.busy, self.request_losses, self.cached_length = False, 0, None
        # Joins and leaves during the request are seen now.
        self.net.loop.call_soon_threadsafe(self.deployment.changed.set)

    def step_token(self, tokens: Sequence[int], start: int, sampler: Sampler) -> int:
        """Run `tokens` from position `start` through every stage; the token the last stage samples after them.
        EngineLost (WorkerLost) when a worker is lost or a staged plan is ready to take over: the generation
        loop then calls recover() and prefills the context again."""
        d = self.deployment
        if start > 0 and d.chained and not d.ready(d.staged) and not sampler.needs_logits:
            try:  # a decode step: on this thread (module docstring)
                return self._chained_pass(tokens, start, Sampling.of(sampler))
            except (Breach, PortClosed) as e:
                self.net.run(self._settle(e))
                raise
        out = self.net.run(self._step_token(tokens, start, sampler))
        # The last stage's logits where the draw needs them here (the request's grammar, penalties, logprobs).
        return out if isinstance(out, int) else sampler(out, start + len(tokens))

    async def _step_token(self, tokens: Sequence[int], start: int, sampler: Sampler) -> int | np.ndarray:
        d = self.deployment
        sampling = Sampling.of(sampler)
        if start > 0:
            if d.ready(d.staged):
                self.cached_length = start  # every stage's KV cache holds the positions before this one
                raise PlanSwap("a staged plan is ready")
            return await self._forward(tokens, start, sampling)
        swapped_at = None
        if d.ready(d.staged) and d.stages_alive():
            swapped_at = time.perf_counter()
            self.log("hot swap")
            # The layers that change workers: their rows since the pre-copy (all of them without one).
            since = d.precopied_rows()
            staying = d.kv_staying(d.staged)
            moving = [layer for layer in range(self.model.config.n_layers) if layer not in staying]
            moved = await d.fetch_kv(moving, since, self.cached_length) \
                if self._kv_movable(d.staged, len(tokens)) else None
            fetched_at = time.perf_counter()
            await d.replan(d.staged, hot=True)
            deployed_at = time.perf_counter()
            if moved is not None and await d.load_kv(moved, since):  # the new stages go on where the old ones stood
                loaded_at = time.perf_counter()
                token = await self._forward(tokens[-1:], len(tokens) - 1, sampling)
                self.swap_seconds.append(time.perf_counter() - swapped_at)
                self.swap_positions.append(len(tokens) - 1)
                kept = sorted({layer for layers in d.kept_kv.values() for layer in layers})
                self.log(f"hot swap done in {self.swap_seconds[-1] * 1e3:.0f} ms: the KV cache of {len(tokens) - 1} "
                         f"positions moved to the new stages ({len(moved)} layers sent, {len(since)} of them "
                         f"pre-copied, {len(kept)} kept by their workers; fetch "
                         f"{(fetched_at - swapped_at) * 1e3:.0f} ms, deploy {(deployed_at - fetched_at) * 1e3:.0f} "
                         f"ms, load {(loaded_at - deployed_at) * 1e3:.0f} ms, "
                         f"the next token {(time.perf_counter() - loaded_at) * 1e3:.0f} ms)")
                return token
        elif d.state != PipelineState.UP or not d.stages_alive():
            await d.replan(d.fallback())
        self.prefill_lengths.append(len(tokens))
        n = len(self.prefix)
        if n and len(tokens) > n and list(tokens[:n]) == self.prefix:
            token = await self._forward(tokens[n:], n, sampling, Prefix.RESTORE)
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
        self.deployment.state = PipelineState.DOWN
        self.request_losses += 1
        self.log(f"worker {lost} lost mid-request: replanning and prefilling the context again")
        if self.request_losses > MAX_REQUEST_LOSSES:
            raise EdgerunError("the pipeline keeps losing workers; giving up on this request")

    # --- the blocking interface ------------------------------------------------------------------------
    def wait_for_workers(self, n: int, timeout_s: float = 600.0) -> None:
        try:
            self.net.run(asyncio.wait_for(self.workers.wait_for(n), timeout_s))
        except TimeoutError:
            raise EdgerunError(f"only {len(self.workers.alive())} of {n} workers connected "
                               f"within {timeout_s:.0f} s") from None

    def start(self) -> PPPlan:
        """Plan and load the stages, retrying over the workers left while some fail."""
        async def start() -> PPPlan:
            for _ in range(MAX_REQUEST_LOSSES):
                try:
                    return await self.deployment.replan()
                except WorkerLost as e:
                    self.log(f"worker {e} failed while loading; replanning")
            raise EdgerunError(f"workers failed to load their stages {MAX_REQUEST_LOSSES} times in a row (the log "
                               "says why)")

        return self.net.run(start())

    def generate(self, prompt: Sequence[int], max_tokens: int, params: SamplingParams = GREEDY,
                 stop_ids: frozenset[int] = frozenset(), on_token: Callable[[int], None] | None = None) -> list[int]:
        """Generation on the pipeline (the one generation loop, model.generate)."""
        return generate(self, prompt, max_tokens, Sampler(params), stop_ids, on_token).tokens

    def close(self) -> None:
        async def stop() -> None:
            self.repartitioner.cancel()
            await self.workers.close()

        with contextlib.suppress(Exception):
            self.net.run(stop(), timeout=10)
        self.links.close()
        if self.http is not None:  # its own server and loop; a server's loop that it shares runs on
            self.http.close()
            self.net.stop()
