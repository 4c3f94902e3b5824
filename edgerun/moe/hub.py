"""The MoEx hub (`edgerun master --plan moe`): attention, norms, routers, embedding and LM head here; experts on
workers.

Per layer the hub routes each token (softmax, top k, renormalized where the model says so), groups the tokens per
chosen expert, and sends one DISPATCH per (expert, tokens) to `hedge` of that expert's replicas, the least
loaded-looking first (lowest latency seen). The first RESULT wins; the other replicas get a CANCEL. A dispatch
whose replicas have all gone, or that times out, goes to a replica not tried yet at once (no re-prefill); a
worker that times out three times in a row is left out until it answers again. The outputs come back weighted by
their gates, so the hub only adds them.

Where experts live is `sched.moe.place_experts` over the connected workers' budgets; workers fetch their experts'
blobs from /experts/<sha256> here. The hub's own numbers (attention, norms, routing, the LM head: hub_layers) are
computed as the workers' experts are: on ggml with int8 activations, as the numpy reference with float32.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from edgerun.cache import cache_root
from edgerun.errors import EdgerunError
from edgerun.model.generate import EngineLost, generate
from edgerun.model.loader import Model
from edgerun.model.onnx_graph import Activations, expert_graph, shard_weights_path
from edgerun.model.reference import kept_gate_scale, route
from edgerun.model.sampling import Sampler
from edgerun.moe.experts import expert_blobs
from edgerun.moe.hub_layers import HubLayers, hub_layers
from edgerun.net.channel import EventLoopThread
from edgerun.net.http_server import HttpServer, bind
from edgerun.net.moex import (
    MOEX_MAX_FRAME,
    ExpertCancel,
    ExpertDispatch,
    ExpertHeartbeat,
    ExpertHello,
    ExpertResult,
    ExpertSet,
    ExpertStatus,
    HeldExpert,
    SyncDone,
    WeightSync,
    moex_frame,
    open_moex_frame,
)
from edgerun.net.wire import WireError, WorkerKind
from edgerun.pp.http import ISOLATED, page_routes, say_if_tabs_cannot_join
from edgerun.pp.workers import LinkClosed, WorkerLink
from edgerun.sched.moe import ExpertPlacement, ExpertWorker, place_experts

STRIKES = 3  # consecutive timeouts after which a worker is left out of dispatch
RECENT = 32  # round trips per worker that adaptive hedging takes the median of
RECOVERIES = 3  # placements anew a batch's step tries after losing every replica of an expert, before failing


@dataclass(frozen=True)
class HubConfig:
    host: str = "127.0.0.1"
    port: int = 0
    max_len: int = 1024
    replicas: int = 2  # workers holding each expert
    hedge: int = 1  # replicas each dispatch goes to at once (at most `replicas`)
    expert_timeout_s: float = 5.0  # after this a dispatch goes to another replica
    # Beyond the seed: an expert none of whose replicas answered this long after the layer's dispatch is dropped
    # and the token's other gates scaled up to their full sum (HALO's idea applied to experts). None: wait.
    expert_deadline_s: float | None = None
    sync_timeout_s: float = 300.0  # for workers to fetch and load their experts
    # Adaptive hedging (MoEx §4.1): a dispatch goes to one replica when the fastest-looking one's recent median
    # round trip is within the threshold, else to `hedge` of them. The threshold: hedge_threshold_ms, or (None)
    # 1.5 times the median over the workers' recent medians.
    adaptive_hedge: bool = False
    hedge_threshold_ms: float | None = None
    # The kernels of the hub's own layers and of the native workers' experts: float32 gives the numpy reference's
    # numbers; int8 computes on ggml as the single engine does, 2-4x faster on CPUs, and rounds differently.
    activations: Activations = Activations.F32
    threads: int | None = None  # the hub's own ggml threads (int8 activations); None: the physical cores
    # A batch's sequences (serve --parallel), each in a cache of its own beside the one-request steps' (which
    # probes and `generate` use, so they never disturb what a batch's slot holds); 0: no batch.
    slots: int = 0

    def __post_init__(self) -> None:
        if self.replicas < 1 or not 1 <= self.hedge <= self.replicas:
            raise EdgerunError(f"--hedge {self.hedge} must be between 1 and --replicas {self.replicas}")
        if self.expert_timeout_s <= 0 or (self.expert_deadline_s is not None and self.expert_deadline_s <= 0):
            raise EdgerunError("the expert timeout and deadline must be positive")
        if self.slots < 0:
            raise EdgerunError(f"an expert master's batch holds 0 or more sequences, not {self.slots}")


class ExpertsLost(EngineLost):
    """Every replica of an expert is gone: the hub places the experts again over the workers left."""


@dataclass(eq=False)
class HubWorker:
    name: str
    budget_mb: float
    link: WorkerLink
    kind: WorkerKind = WorkerKind.NATIVE  # a tab takes each expert as an ONNX graph with float32 weights
    alive: bool = True
    strikes: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # its last answers' round trips (s)
    synced: asyncio.Future | None = None  # resolved by its answer to a WEIGHT_SYNC
    sync_seq: int = -1  # that WEIGHT_SYNC's sequence id, which the answer carries
    peak_rss_mb: float = 0.0  # what the worker said in its last heartbeat (0: it does not say)

    @property
    def healthy(self) -> bool:
        return self.alive and self.strikes < STRIKES

    @property
    def p50_s(self) -> float:
        return float(np.median(self.recent)) if self.recent else 0.0


@dataclass
class _Pending:
    future: asyncio.Future
    sent: dict[str, float] = field(default_factory=dict)  # worker -> when


@dataclass
class HubStats:
    dispatches: int = 0  # (expert, tokens) requests
    sent: int = 0  # frames, hedged copies included
    redispatched: int = 0  # after a timeout or a lost replica
    dropped: int = 0  # (expert, tokens) dispatches left out at the expert deadline
    phase_ms: list[float] = field(default_factory=list)  # each one-token layer's expert phase (decode steps)


class MoeHub:
    """An engine (the one generation loop drives it) whose experts run on workers."""

    name = "moe"

    def __init__(self, model: Model, key: bytes, config: HubConfig | None = None,
                 log: Callable[[str], None] = lambda _: None, net: EventLoopThread | None = None) -> None:
        """With `net` (`edgerun serve`'s loop) the hub serves nothing itself: its routes() go beside the server's
        and workers join at config.port, the server's; else it listens on config.host:config.port."""
        if not model.config.is_moe:
            raise EdgerunError(f"--plan moe needs a mixture-of-experts model; {model.path.name} is dense")
        self.model, self.key, self.config, self.log = model, key, config or HubConfig(), log
        say_if_tabs_cannot_join(log)
        self.layers: HubLayers = hub_layers(model, self.config.max_len, self.config.activations,
                                            self.config.threads, 1 + self.config.slots)

        self.blobs = expert_blobs(model.weights)
        self.by_sha = {sha: blob for sha, blob in self.blobs.values()}
        self.expert_mb = max(len(blob) for _, blob in self.blobs.values()) / 2**20
        self.workers: dict[str, HubWorker] = {}
        self.placement: ExpertPlacement | None = None
        self.placement_moves = 0  # replicas the last placement moved to other workers
        self.background: set[asyncio.Task] = set()
        self.pending: dict[int, _Pending] = {}
        self.seqs = itertools.count(1)
        self.stats = HubStats()
        self.joined = asyncio.Event()
        self.files: dict[str, Path] = {}  # browser workers' expert graphs and weights, by sha256
        self.graph_hashes: dict[tuple[int, int], tuple[str, str]] = {}  # (layer, expert) -> those files' sha256
        self.own_net = net is None
        self.net = net or EventLoopThread()
        self.server = None
        if self.own_net:
            self.server = HttpServer(Starlette(routes=self.routes()), bind(self.config.host, self.config.port),
                                     self.net, max_message=MOEX_MAX_FRAME)
        self.port = self.config.port if self.server is None else self.server.port

    def routes(self) -> list[BaseRoute]:
        """Workers' WebSocket (/moe), expert blobs and browser graphs by sha256, and the browser node page."""
        return [WebSocketRoute("/moe", self._serve), Route("/experts/{sha256}", self._blob),
                Route("/files/{sha256}", self._file), *page_routes(self.log)]

    def reconfigure(self, config: HubConfig) -> None:
        """New hedging, timeouts or replication (taking effect at the next dispatch; replicas at the next deploy);
        the host and port stay those it listens on."""
        self.config = config

    def _browser_graph(self, layer: int, expert: int) -> tuple[str, str]:
        """The sha256 of an expert's ONNX graph and of its float32 weights file, built once into the cache and
        hashed once per hub."""
        if (layer, expert) in self.graph_hashes:
            return self.graph_hashes[(layer, expert)]
        sha = self.blobs[(layer, expert)][0]
        out = cache_root() / "moe" / "graphs" / sha / "expert.onnx"
        if not (out.is_file() and shard_weights_path(out).is_file()):
            out.parent.mkdir(parents=True, exist_ok=True)
            expert_graph(self.model.config, self.model.weights.layers[layer].moe.experts[expert], out, 0,
                         dequantized=True)
        graph, weights = (hashlib.sha256(path.read_bytes()).hexdigest() for path in (out, shard_weights_path(out)))
        self.files[graph], self.files[weights] = out, shard_weights_path(out)
        self.graph_hashes[(layer, expert)] = graph, weights
        return graph, weights

    async def _file(self, request: Request) -> Response:
        path = self.files.get(request.path_params["sha256"])
        if path is None:
            return PlainTextResponse("no such file\n", status_code=404)
        return FileResponse(path, media_type="application/octet-stream", headers=ISOLATED)

    # --- workers -------------------------------------------------------------------------------------------
    async def _blob(self, request: Request) -> Response:
        blob = self.by_sha.get(request.path_params["sha256"])
        if blob is None:
            return PlainTextResponse("no such expert\n", status_code=404)
        return Response(blob, media_type="application/octet-stream")

    async def _serve(self, ws: WebSocket) -> None:
        await ws.accept()
        link = WorkerLink(ws)
        worker = None
        try:
            hello = open_moex_frame(await link.receive() or b"", self.key)
            if not isinstance(hello, ExpertHeartbeat) or not isinstance(hello.info, ExpertHello):
                raise WireError("a worker must say its name first")
            name, budget, kind = hello.info.name, hello.info.budget_mb, hello.info.kind
            if name in self.workers and self.workers[name].alive:
                raise WireError(f"a worker named {name} is already connected")
            worker = self.workers[name] = HubWorker(name, budget, link, kind)
            self.log(f"expert worker {name} joined ({kind}, {budget:.0f} MB)")
            self.joined.set()
            while True:
                data = await link.receive()
                if data is not None:
                    self._reply(worker, open_moex_frame(data, self.key))
        except (WireError, LinkClosed, ValueError, TypeError) as e:
            self.log(f"expert worker {worker.name if worker else '?'} left or was refused: {e}")
        finally:
            if worker is not None:
                self._lost(worker)

    def _reply(self, worker: HubWorker, message: object) -> None:
        match message:
            case ExpertResult(seq):
                pending = self.pending.get(seq)
                if pending is None or pending.future.done():
                    return  # a hedged copy that lost the race
                worker.recent.append(time.perf_counter() - pending.sent.get(worker.name, time.perf_counter()))
                worker.strikes = 0
                pending.future.set_result(message.y)
                for other in pending.sent:
                    if other != worker.name and self.workers[other].alive:
                        self._send(self.workers[other], ExpertCancel(seq))
            case ExpertHeartbeat(seq, SyncDone() as done) if seq == worker.sync_seq and \
                    worker.synced is not None and not worker.synced.done():
                worker.synced.set_result(done)  # its answer to the WEIGHT_SYNC
            case ExpertHeartbeat(_, info):  # a periodic one: a worker left out after timeouts is back
                worker.strikes = 0
                if isinstance(info, ExpertStatus):
                    worker.peak_rss_mb = info.peak_rss_mb
            case _:
                self.log(f"expert worker {worker.name}: unexpected {type(message).__name__}")

    def _lost(self, worker: HubWorker) -> None:
        was_placed = self.placement is not None and worker.alive and bool(self.placement.experts_of(worker.name))
        worker.alive = False
        if worker.synced is not None and not worker.synced.done():
            worker.synced.set_result(SyncDone(False, error="left"))
        for pending in self.pending.values():  # dispatches that now have no live replica are retried at once
            if worker.name in pending.sent and not pending.future.done() and \
                    not any(self.workers[n].alive for n in pending.sent):
                pending.future.set_exception(TimeoutError(worker.name))
        if was_placed and any(w.alive for w in self.workers.values()):
            # Its experts are served by their other replicas at once; in the background they get new replicas,
            # so a second loss does not find an expert with none left. Dispatch keeps the old placement until
            # every worker holds the new one.
            task = asyncio.get_running_loop().create_task(self._replicate_again(worker.name))
            self.background.add(task)
            task.add_done_callback(self.background.discard)

    def settle_heartbeats(self) -> None:
        """Let a heartbeat interval pass, so every worker's figures (its memory) are fresh."""
        self.net.run(asyncio.sleep(1.2))

    def settle(self, timeout_s: float = 60.0) -> None:
        """Wait for background work (experts replicated again after a loss) to end."""
        async def settle() -> None:
            while self.background:
                await asyncio.gather(*self.background, return_exceptions=True)
        self.net.run(asyncio.wait_for(settle(), timeout_s))

    async def _replicate_again(self, lost: str) -> None:
        if not any(w.alive for w in self.workers.values()):  # the others left too (a shutdown): nowhere to go
            self.log(f"expert worker {lost} left, and no other is connected")
            return
        try:
            await self._deploy()
            self.log(f"experts of {lost} replicated again: {self.placement_moves} replicas moved")
        except (EdgerunError, TimeoutError) as e:
            self.log(f"replicating the experts of {lost} again failed ({e}); its experts' other replicas serve")

    def _send(self, worker: HubWorker, message: object) -> None:
        async def send() -> None:
            with contextlib.suppress(LinkClosed):
                await worker.link.send(moex_frame(message, self.key))
        asyncio.get_running_loop().create_task(send())

    def wait_for_workers(self, n: int, timeout_s: float = 120.0) -> None:
        async def wait() -> None:
            while len([w for w in self.workers.values() if w.alive]) < n:
                self.joined.clear()
                await self.joined.wait()
        try:
            self.net.run(asyncio.wait_for(wait(), timeout_s))
        except TimeoutError:
            raise EdgerunError(f"{n} expert workers did not join within {timeout_s:.0f} s") from None
        self.deploy()

    def deploy(self) -> ExpertPlacement:
        """Place every expert over the live workers and have each hold its share."""
        return self.net.run(self._deploy())

    async def _deploy(self) -> ExpertPlacement:
        alive = [w for w in self.workers.values() if w.alive]
        if not alive:
            raise EdgerunError("no expert worker is connected to place the experts on")
        c = self.model.config
        # The first placement holds the replicas asked for; after losses, as many as there are workers left.
        replicas = self.config.replicas if self.placement is None else min(self.config.replicas, len(alive))
        placement = place_experts([ExpertWorker(w.name, w.budget_mb) for w in alive], c.n_layers, c.n_experts,
                                  replicas, self.expert_mb)
        loop = asyncio.get_running_loop()
        for w in alive:
            w.synced, w.sync_seq = loop.create_future(), next(self.seqs)
            experts = []
            for layer, e in placement.experts_of(w.name):
                graph = ("", "")
                if w.kind is WorkerKind.BROWSER:  # the graph and its float32 weights, built here once
                    graph = await loop.run_in_executor(None, self._browser_graph, layer, e)
                experts.append(HeldExpert(layer, e, self.blobs[(layer, e)][0], *graph))
            self._send(w, WeightSync(w.sync_seq, ExpertSet(c, tuple(experts), self.config.activations)))
        answers = await asyncio.wait_for(asyncio.gather(*(w.synced for w in alive)), self.config.sync_timeout_s)
        failed = [f"{w.name}: {a.error}" for w, a in zip(alive, answers, strict=True) if not a.ready]
        if failed:
            raise EdgerunError(f"expert workers failed to load their experts ({'; '.join(failed)})")
        self.placement_moves = 0 if self.placement is None else self.placement.moved(placement)
        self.placement = placement
        shares = ", ".join(f"{w.name} {len(placement.experts_of(w.name))} experts ({placement.held_mb[w.name]:.1f} MB)"
                           for w in alive)
        self.log(f"placed {len(placement.replicas)} experts x {replicas} replicas: {shares}")
        return placement

    # --- the engine ----------------------------------------------------------------------------------------
    @property
    def max_len(self) -> int:
        return self.config.max_len

    @property
    def weight_bytes(self) -> int:
        return self.layers.weight_bytes

    def reset(self) -> None:
        self.layers.truncate(0)

    def release(self) -> None:
        """Nothing to let go of between requests."""

    def recover(self, lost: EngineLost) -> None:
        self.log(f"{lost}: placing the experts again over the workers left")
        self.deploy()

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        return self.net.run(self._step(tokens))

    def generate(self, prompt: Sequence[int], max_tokens: int, sampler: Sampler,
                 stop_ids: frozenset[int] = frozenset(), on_token: Callable[[int], None] | None = None) -> list[int]:
        return generate(self, prompt, max_tokens, sampler, stop_ids, on_token).tokens

    # --- a batch (model.batch.BatchEngine): several sequences' steps, each in its slot ----------------------
    @property
    def slots(self) -> int:
        return self.config.slots

    def prefill(self, slot: int, tokens: Sequence[int], start: int) -> np.ndarray:
        """Tokens at positions start.. of the sequence in `slot`: the last one's logits."""
        self._check_slot(slot)
        self._check_room(start + len(tokens))
        return self._recovering(lambda: self._run(tokens,
                                                  lambda i, h: self.layers.attention(i, h, start, 1 + slot)))

    def decode(self, batch: Sequence[tuple[int, int, int]]) -> np.ndarray:
        """One token of each of several sequences, (slot, position, token) each, in one step: their logits, (len(batch),
        vocab). Each expert gets one dispatch of all the batch's tokens that chose it; a sequence's logits are those
        it gets alone."""
        for slot, position, _ in batch:
            self._check_slot(slot)
            self._check_room(position + 1)
        rows = [(1 + slot, position) for slot, position, _ in batch]  # the layers' first cache is generate's
        tokens = [token for _, _, token in batch]
        return self._recovering(lambda: self._run(tokens, lambda i, h: self.layers.attention_rows(i, h, rows),
                                                  each_row=True))

    def copy_cache(self, source: int, target: int, rows: int) -> None:
        for slot in (source, target):
            self._check_slot(slot)
        self.layers.copy_cache(1 + source, 1 + target, rows)

    def _recovering(self, run: Callable[[], object]) -> np.ndarray:
        """A batch's step, run again after the experts are placed anew when every replica of one was lost: the hub
        keeps every sequence's cache, and a step run again writes the same rows, so nothing is prefilled again."""
        for attempt in itertools.count():
            try:
                return self.net.run(run())
            except ExpertsLost as e:
                if attempt >= RECOVERIES:
                    raise
                self.recover(e)
        raise AssertionError("unreachable")

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise EdgerunError(f"slot {slot} is not one of the {self.slots} of the expert master's batch")

    def _check_room(self, end: int) -> None:
        if end > self.layers.max_len:
            raise EdgerunError(f"context of {self.layers.max_len} tokens exceeded")

    async def _step(self, tokens: Sequence[int]) -> np.ndarray:
        own = self.layers
        start = own.length
        self._check_room(start + len(tokens))
        return await self._run(tokens, lambda i, h: own.attention(i, h, start))

    async def _run(self, tokens: Sequence[int], attend: Callable[[int, np.ndarray], np.ndarray],
                   each_row: bool = False) -> np.ndarray:
        """The logits of the tokens' last row, or with `each_row` (a batch's step: one token of each sequence) of
        every row, each as it is alone. `attend`: a layer's attention of its normalized rows."""
        own = self.layers
        x = own.embed(tokens)
        for i in range(self.model.config.n_layers):
            x = x + attend(i, own.attention_norm(i, x))
            x = x + await self._mixture(i, own.moe[i], own.ffn_norm(i, x), each_row)
        return own.logits_rows(x) if each_row else own.logits(x)

    async def _mixture(self, layer: int, moe, x: np.ndarray, each_row: bool = False) -> np.ndarray:
        """The layer's experts on x (tokens, hidden), computed on the workers, weighted and summed. `each_row`:
        the hub's own products (router, shared expert) one row at a time, as each row's are alone (numpy's
        products round a row differently beside other rows; the workers' ggml products do not)."""
        c = self.model.config

        def by_row(f: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
            return np.concatenate([f(x[i:i + 1]) for i in range(len(x))]) if each_row and len(x) > 1 else f(x)

        chosen, weights = route(by_row(lambda r: r @ moe.router.T), c.n_experts_used, c.norm_gates)
        started = time.perf_counter()
        jobs = []
        for e in np.unique(chosen):
            rows, slot = np.nonzero(chosen == e)
            jobs.append((rows, slot, asyncio.ensure_future(self._expert(layer, int(e), x[rows], weights[rows, slot]))))
        tasks = [task for _, _, task in jobs]
        try:
            if self.config.expert_deadline_s is None:
                await asyncio.gather(*tasks)
            else:
                _, late = await asyncio.wait(tasks, timeout=self.config.expert_deadline_s)
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
        except BaseException:  # an expert lost for good: the step's other dispatches stop too (it runs again)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        took = time.perf_counter() - started
        if len(x) == 1:
            self.stats.phase_ms.append(took * 1e3)
        out = np.zeros_like(x)
        answered = np.zeros(weights.shape, bool)  # per token and slot: its expert answered in time
        dropped = 0
        for rows, slot, task in jobs:
            if task.cancelled():
                dropped += 1
                continue
            out[rows] += task.result()
            answered[rows, slot] = True
        self.stats.dropped += dropped
        if dropped:  # the experts that answered stand in for the token's whole mixture (outputs already weighted)
            out *= kept_gate_scale(weights, answered)[:, None]
        # the shared expert every token takes stays on the hub
        return out if moe.shared is None else out + by_row(moe.shared_output)

    async def _expert(self, layer: int, expert: int, x: np.ndarray, gates: np.ndarray) -> np.ndarray:
        """One (expert, tokens) dispatch, hedged, retried on other replicas until one answers."""
        self.stats.dispatches += 1
        tried: set[str] = set()
        while True:
            candidates = [self.workers[n] for n in self.placement.replicas[(layer, expert)]
                          if n not in tried and self.workers[n].healthy]
            if not candidates:  # the unhealthy ones are a last resort before giving up
                candidates = [self.workers[n] for n in self.placement.replicas[(layer, expert)]
                              if n not in tried and self.workers[n].alive]
            if not candidates:
                raise ExpertsLost(f"no live replica of expert {expert} of layer {layer}")
            targets = sorted(candidates, key=lambda w: w.p50_s)[:self._hedge(candidates)]
            seq = next(self.seqs)
            pending = self.pending[seq] = _Pending(asyncio.get_running_loop().create_future())
            for w in targets:
                pending.sent[w.name] = time.perf_counter()
                self._send(w, ExpertDispatch(seq, layer, expert, x, gates))
                tried.add(w.name)
            self.stats.sent += len(targets)
            try:
                return await asyncio.wait_for(pending.future, self.config.expert_timeout_s)
            except asyncio.CancelledError:  # the expert deadline passed: the replicas may stop
                for w in targets:
                    if w.alive:
                        self._send(w, ExpertCancel(seq))
                raise
            except TimeoutError:
                for w in targets:
                    if w.alive and not pending.future.done():
                        w.strikes += 1
                        self._send(w, ExpertCancel(seq))
                self.stats.redispatched += 1
            finally:
                del self.pending[seq]

    def _hedge(self, candidates: list[HubWorker]) -> int:
        """How many replicas this dispatch goes to."""
        if not self.config.adaptive_hedge:
            return self.config.hedge
        fastest = min(candidates, key=lambda w: w.p50_s)
        if self.config.hedge_threshold_ms is not None:
            threshold = self.config.hedge_threshold_ms / 1e3
        else:
            medians = [w.p50_s for w in self.workers.values() if w.healthy and w.recent]
            threshold = 1.5 * float(np.median(medians)) if medians else 0.0
        return 1 if fastest.recent and fastest.p50_s <= threshold else self.config.hedge

    def probe_ms(self, steps: int = 3) -> float:
        """ms per one-token step measured now (after a warm-up step): what a deployment
        predicts, since a MoE step's time is mostly the workers' round trips, which only running shows."""
        self.reset()  # every request starts afresh (the generation loop resets the engine)
        try:
            self.step([1])
            started = time.perf_counter()
            for _ in range(steps):
                self.step([1])
            return (time.perf_counter() - started) / steps * 1e3
        finally:
            self.reset()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.own_net:
            self.net.stop()
