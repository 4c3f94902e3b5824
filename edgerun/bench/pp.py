"""Pipeline benchmarks on a local cluster (master in this process, workers as processes on loopback):
the cost model's predicted time per token against the measured one, and serving under churn."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from edgerun.bench.single import RequestTiming, cluster_baseline, span, spin_line
from edgerun.errors import EdgerunError
from edgerun.model import kernel_stage
from edgerun.model.generate import generate
from edgerun.model.loader import Model
from edgerun.model.onnx_engine import OnnxEngine
from edgerun.model.onnx_graph import Activations, StageSpec, cached_stage
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.net.loops import auto_spin_us
from edgerun.net.wire import derive_key
from edgerun.pp.config import PipelineConfig, Route
from edgerun.pp.deployment import dequantized_expansion
from edgerun.pp.master import PipelineMaster, PipelineState
from edgerun.pp.messages import TabWeights
from edgerun.sched.pp_plan import PPPlan, Pricing, Stage, layer_costs, plan_exec_us
from edgerun.sched.profiles import ModelProfile, model_profile
from edgerun.tables import Column, text_table

SECRET = "edgerun-bench"
PROMPT = "Distributed inference splits one model across several machines because"
CONTEXT = 512  # tokens of KV cache in every engine of a benchmark


def start_worker(port: int, name: str, budget_mb: float, speed: float | None = None, threads: int = 1,
                 spin_us: float = 0.0, load_threads: int = 1, device: str = "cpu") -> subprocess.Popen:
    args = [sys.executable, "-m", "edgerun.cli", "node", "--mode", "pp", "--master", f"127.0.0.1:{port}", "--key",
            SECRET, "--name", name, "--memory-budget", str(budget_mb), "--threads", str(threads),
            "--spin-us", str(spin_us), "--load-threads", str(load_threads), "--device", device]
    return subprocess.Popen(args + (["--speed", str(speed)] if speed else []), stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def local_pipeline(model: Model, budgets: Sequence[float], max_len: int = 512,
                   log: Callable[[str], None] = lambda _: None, threads: int = 1, spin_us: float = 0.0,
                   load_threads: int = 1, gpu_workers: int = 0,
                   **options: object) -> Iterator[tuple[PipelineMaster, list]]:
    """A pipeline master and one worker process per memory budget (w0, w1, ...), all connected; each worker
    creates a stage's sessions on up to `load_threads` threads (`edgerun node --load-threads`); the first
    `gpu_workers` compute on the GPU (`--device cuda`), the others on the CPU."""
    master = PipelineMaster(model, derive_key(SECRET), PipelineConfig(host="127.0.0.1", max_len=max_len,
                                                                      spin_us=spin_us, **options), log=log)
    workers = [start_worker(master.port, f"w{i}", budget, threads=threads, spin_us=spin_us,
                            load_threads=load_threads, device="cuda" if i < gpu_workers else "cpu")
               for i, budget in enumerate(budgets)]
    try:
        master.wait_for_workers(len(budgets), timeout_s=120)
        yield master, workers
    finally:
        master.close()
        for p in workers:
            p.kill()
            p.wait()


@dataclass(frozen=True)
class CostResult:
    """Seed 003 §7.3: the initial estimate (the plan's exec_s_per_token, from speeds measured before it was
    deployed) against the mean decode time over the requests; and per request, the running estimate (the
    deployed plan re-priced with the metrics measured so far, before that request) against its decode time."""

    budgets: tuple[float, ...]
    stages: int
    predicted_ms: float
    measured_ms: float
    running_predicted_ms: tuple[float, ...]
    running_measured_ms: tuple[float, ...]

    @property
    def error(self) -> float:
        return abs(self.predicted_ms - self.measured_ms) / self.measured_ms

    @property
    def running_error(self) -> float:
        """Mean absolute percentage error of the running estimates over the requests."""
        return float(np.mean([abs(p - m) / m for p, m in zip(self.running_predicted_ms, self.running_measured_ms,
                                                                 strict=True)]))


def _decode_ms(master: PipelineMaster, prompt: list[int], tokens: int) -> float:
    """Mean time per generated token after the first (which includes the prompt)."""
    timings: list[float] = []
    start = time.perf_counter()
    master.generate(prompt, tokens, on_token=lambda _: timings.append(time.perf_counter()))
    return float(np.mean(np.diff([start, *timings])[1:])) * 1e3


def cost_model_accuracy(model: Model, configs: Sequence[Sequence[float]], tokens: int = 32, requests: int = 5,
                        progress: Callable[[str], None] = lambda _: None) -> list[CostResult]:
    """Per configuration of worker budgets: warm up (filling each worker's speed samples), replan with
    the measured speeds, then run `requests` requests, each priced beforehand with what was measured so far."""
    prompt = model.tokenizer.encode(PROMPT)
    results = []
    for budgets in configs:
        progress(f"workers with {', '.join(f'{b:g}' for b in budgets)} MB")
        with local_pipeline(model, budgets) as (master, _):
            try:
                master.start()
            except EdgerunError as e:
                progress(f"skipped: {e}")
                continue
            master.generate(prompt, 24)  # speed samples for every worker in the plan
            plan = master.start()  # replanned with the measured speeds
            master.generate(prompt, 8)  # the new stages warmed up
            running, measured = [], []
            for _ in range(requests):
                d = master.deployment
                running.append(plan_exec_us(plan, d.fit.profile, d.devices(), params=d.cost_params()) / 1e3)
                measured.append(_decode_ms(master, prompt, tokens))
            results.append(CostResult(tuple(budgets), len(plan.stages), plan.exec_s_per_token * 1e3,
                                      float(np.mean(measured)), tuple(running), tuple(measured)))
    return results


def cost_table(results: Sequence[CostResult]) -> str:
    rows = text_table((
        Column("budgets (MB)", lambda r: ",".join(f"{b:g}" for b in r.budgets), width=16),
        Column("stages", lambda r: r.stages),
        Column("initial ms", lambda r: r.predicted_ms, ".1f"),
        Column("measured ms", lambda r: r.measured_ms, ".1f"),
        Column("error", lambda r: r.error, ".1%", width=6),
        Column("running ms", lambda r: np.mean(r.running_predicted_ms), ".1f"),
        Column("error", lambda r: r.running_error, ".1%", width=6)), results)
    rows.append(f"MAPE {np.mean([r.error for r in results]):.1%} initial, "
                f"{np.mean([r.running_error for r in results]):.1%} running, over {len(results)} configurations")
    return "\n".join(rows)


@dataclass(frozen=True)
class ChurnResult:
    seconds: float
    state_shares: dict[PipelineState, float]  # share of samples (every 100 ms) in each state (Table 6.8's columns)
    # The share of all samples not Up, by the number of workers alive then: with fewer alive than any plan needs,
    # the departure schedule, not the deployment, kept the master down.
    down_by_live: dict[int, float]
    tokens: int
    requests: int
    departures: int
    recoveries: int
    mean_recovery_s: float

    @property
    def up_share(self) -> float:
        return self.state_shares[PipelineState.UP]


def churn(model: Model, budgets: Sequence[float], mttf_s: float, duration_s: float, rejoin_s: float = 2.0,
          tokens_per_request: int = 32, seed: int = 0, progress: Callable[[str], None] = lambda _: None,
          log: Callable[[str], None] = lambda _: None, load_threads: int = 1) -> ChurnResult:
    """Workers leave (SIGKILL) after exponential lifetimes of mean `mttf_s` and rejoin `rejoin_s` later,
    while requests run back to back for `duration_s` (the web-inference thesis's Table 6.8). `log` gets the master's
    log (plans, recoveries). Workers create a stage's sessions on up to `load_threads` threads."""
    rng = np.random.default_rng(seed)
    prompt = model.tokenizer.encode(PROMPT)
    with local_pipeline(model, budgets, log=log, load_threads=load_threads) as (master, workers):
        master.start()
        stop = threading.Event()
        samples: list[tuple[PipelineState, int]] = []  # (state, live workers) every 100 ms
        departures = 0

        def sample() -> None:
            while not stop.is_set():
                samples.append((master.state, sum(w.poll() is None for w in workers)))
                time.sleep(0.1)

        def chaos() -> None:
            nonlocal departures
            deaths = {i: time.monotonic() + rng.exponential(mttf_s) for i in range(len(workers))}
            rejoins: dict[int, float] = {}
            while not stop.is_set():
                now = time.monotonic()
                for i, at in list(deaths.items()):
                    if now >= at:
                        workers[i].kill()
                        workers[i].wait()
                        departures += 1
                        progress(f"w{i} left")
                        del deaths[i]
                        rejoins[i] = now + rejoin_s
                for i, at in list(rejoins.items()):
                    if now >= at:
                        workers[i] = start_worker(master.port, f"w{i}", budgets[i], load_threads=load_threads)
                        progress(f"w{i} rejoined")
                        del rejoins[i]
                        deaths[i] = now + rng.exponential(mttf_s)
                time.sleep(0.05)

        threads = [threading.Thread(target=sample, daemon=True), threading.Thread(target=chaos, daemon=True)]
        for t in threads:
            t.start()
        tokens = requests = 0
        start = time.monotonic()
        while time.monotonic() - start < duration_s:
            try:
                tokens += len(master.generate(prompt, tokens_per_request))
                requests += 1
            except EdgerunError as e:  # too few workers for a plan right now: try again shortly
                progress(f"request failed: {e}")
                time.sleep(0.5)
        seconds = time.monotonic() - start
        stop.set()
        for t in threads:
            t.join()
        recoveries = master.recovery_seconds
        n = max(len(samples), 1)
        shares = {state: sum(s == state for s, _ in samples) / n for state in PipelineState}
        down = [live for s, live in samples if s != PipelineState.UP]
        by_live = {live: down.count(live) / n for live in sorted(set(down))}
        return ChurnResult(seconds, shares, by_live, tokens, requests, departures,
                           len(recoveries), float(np.mean(recoveries)) if recoveries else 0.0)


# --- bench pp: a pipeline of 1, 2, 4 ... native workers against the single-process engine ---------------------
@dataclass(frozen=True)
class PpRow:
    workers: int  # native worker processes
    browser: int  # browser tabs in the pipeline
    route: str  # how passes went: "chain" (stage to stage) or "star" (through the master)
    stages: int  # stages the plan used
    ms_per_token: float  # a request's time (prefill included) per generated token
    decode_ms_per_token: float  # its one-token steps alone
    stage_ms_per_token: float  # the stages' own compute per decode step, as the workers report it
    other_ms_per_token: float  # the rest of a decode step: transfers between master and stages, the master's work
    # The single-process engine timed just before and just after this row (their mean): on a shared machine its
    # speed drifts from minute to minute, and a row is compared with the engine as fast as it was around it.
    single_ms_per_token: float
    single_decode_ms_per_token: float
    ratio_to_single: float  # single_ms_per_token over this row's ms/token: above 1 is faster
    decode_ratio_to_single: float  # the same for the one-token steps alone
    # With browser tabs: the first tab's stage, its mean one-token pass in the tab, and a native pass over the same
    # layers at the same threads in this process, with the row's activations and with float32 ones.
    tab_layers: str | None = None
    tab_pass_ms: float | None = None
    native_pass_ms: float | None = None
    native_f32_pass_ms: float | None = None
    tab_weights: str | None = None  # how the tabs computed: "kernels" (edgerun's WebAssembly kernels) or "f32"
    tab_threads: int | None = None  # the threads a tab computed with (the kernels: one)
    spin_us: float = 0.0  # how long the master and workers polled for their next message (--spin-us, auto resolved)


def _fewest_ranges(costs: Sequence[float], memory: Sequence[float], max_cost: float, max_memory: float) -> float:
    """The fewest contiguous ranges of layers, none above max_cost or max_memory in all (taking as many layers
    as both allow each time is optimal: both are sums); inf where one layer alone is above either."""
    ranges, cost, used = 1, 0.0, 0.0
    for c, m in zip(costs, memory, strict=True):
        if c > max_cost or m > max_memory:
            return math.inf
        if cost + c > max_cost or used + m > max_memory:
            ranges, cost, used = ranges + 1, 0.0, 0.0
        cost, used = cost + c, used + m
    return ranges


def _smallest(fits: Callable[[float], bool], low: float, high: float) -> float:
    """The smallest bound in [low, high] that fits (fits(high) holds, fits grows with the bound), to 40 halvings."""
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def stage_budgets_mb(layer_bytes: Sequence[float], parts: int) -> float:
    """The smallest memory budget (MB, with 5% spare) with which `parts` workers can hold the layers as
    contiguous ranges: so a pipeline of that many workers must use all of them (fewer cannot hold the model)."""
    free = [0.0] * len(layer_bytes)
    return _smallest(lambda b: _fewest_ranges(free, layer_bytes, math.inf, b) <= parts, max(layer_bytes),
                     sum(layer_bytes)) * 1.05 / 1e6


def batch_budgets_mb(profile: ModelProfile, parts: int) -> float:
    """A memory budget (MB, with 5% spare) for each of `parts` workers of a batching pipeline: room for a split
    whose slowest stage (by multiply-adds, as a batch is planned: Pricing.MACS) is as fast as any split in `parts`
    stages allows, and no less than stage_budgets_mb, with which the plan must use all of them. The smallest
    budget that holds the model splits it by memory instead: the stage with the embedding table (only indexed,
    not multiplied) then takes a layer or two and the others the rest."""
    costs, memory = layer_costs(profile, Pricing.MACS), profile.layer_memory_bytes
    slowest = _smallest(lambda c: _fewest_ranges(costs, memory, c, math.inf) <= parts, max(costs), sum(costs))
    room = _smallest(lambda b: _fewest_ranges(costs, memory, slowest, b) <= parts, max(memory), sum(memory))
    return max(room * 1.05 / 1e6, stage_budgets_mb(memory, parts))


def worker_budget_mb(layer_bytes: Sequence[float], workers: int) -> float:
    """Each of `workers` benchmark workers' memory budget: one that makes the plan use all of them (stage_budgets_mb),
    or for one worker the whole model with 10% spare."""
    return stage_budgets_mb(layer_bytes, workers) if workers > 1 else sum(layer_bytes) * 1.1 / 1e6


SETTLE_S = 60.0  # the longest a row waits for the pipeline to settle before it is timed
SWAP_TOKENS = 128  # a swap benchmark's request: long enough for the staged plan to load while it runs
WARMUP_TOKENS = 8  # a request before the timed one: sessions, caches, the workers' speed samples


def _pipeline_timing(master: PipelineMaster, prompt: list[int], tokens: int) -> RequestTiming:
    """A request timed as cluster_baseline times the single engine."""
    master.generate(prompt, WARMUP_TOKENS)
    start = time.perf_counter()
    result = generate(master, prompt, tokens, Sampler(SamplingParams()))
    return RequestTiming.of(result, time.perf_counter() - start)


def bench_pp(model: Model, worker_counts: Sequence[int], tokens: int = 32, threads: int = 1,
             activations: Activations = Activations.INT8, routes: Sequence[Route] = (Route.CHAIN, Route.STAR),
             browsers: int = 0, progress: Callable[[str], None] = lambda _: None,
             spin_us: float | None = 0.0, tab_weights: TabWeights = TabWeights.KERNELS,
             gpu_workers: int = 0) -> tuple[list[PpRow], RequestTiming]:
    """Rows for each worker count and route (and, with `browsers`, each worker count with that many Chromium tabs
    added), each against the single engine timed just before and after it, and the median single engine of the
    run; the native stages and the single engine compute with the same activations. `spin_us` None: auto, by the
    row's processes (auto_spin_us). The first `gpu_workers` workers of every row compute on the GPU."""
    prompt = model.tokenizer.encode(PROMPT)

    def single() -> RequestTiming:
        progress(f"single-process engine (ggml, or onnx where ggml does not run the model), {threads} thread(s)")
        return cluster_baseline(model, prompt, tokens, threads, activations, CONTEXT, WARMUP_TOKENS)

    layers = model_profile(model.name, model.config, model.weights, context=CONTEXT).layer_memory_bytes
    singles = [single()]
    rows = []

    def compared(row: PpRow) -> None:
        singles.append(single())
        rows.append(_compared(row, singles[-2:]))

    for n in worker_counts:
        budget = worker_budget_mb(layers, n)
        spin = auto_spin_us(n + 1, threads) if spin_us is None else spin_us
        for route in routes:
            progress(f"{n} worker(s), route {route}")
            with local_pipeline(model, [budget] * n, CONTEXT, threads=threads, activations=activations,
                                route=route, spin_us=spin, gpu_workers=gpu_workers) as (master, _):
                row = _row(master, n, 0, prompt, tokens)
            compared(dataclasses.replace(row, spin_us=spin))
        if browsers:
            progress(f"{n} worker(s) and {browsers} browser tab(s)")
            compared(_browser_row(model, n, browsers, prompt, tokens, threads, activations, layers, tab_weights))
    return rows, RequestTiming(float(np.median([t.ms_per_token for t in singles])),
                               float(np.median([t.decode_ms_per_token for t in singles])))


def _compared(row: PpRow, around: Sequence[RequestTiming]) -> PpRow:
    """The row against the mean of the single engine's timings around it."""
    single = RequestTiming.mean(around)
    return dataclasses.replace(row, single_ms_per_token=single.ms_per_token,
                               single_decode_ms_per_token=single.decode_ms_per_token,
                               ratio_to_single=single.ms_per_token / row.ms_per_token,
                               decode_ratio_to_single=single.decode_ms_per_token / row.decode_ms_per_token)


def _row(master: PipelineMaster, workers: int, browsers: int, prompt: list[int], tokens: int) -> PpRow:
    """A row timed on this pipeline, not yet compared with the single engine (_compared)."""
    plan = master.start()
    # A shadow plan's workers download and load their stages after the start: time the pipeline after that.
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline and not master.deployment.settled:
        time.sleep(0.1)
    before = dataclasses.replace(master.stats)
    timing = _pipeline_timing(master, prompt, tokens)
    passes = master.stats.decode_passes - before.decode_passes
    stage_s = master.stats.decode_stage_s - before.decode_stage_s
    steps = passes / len(plan.stages)  # one-token steps (warm-up included: the per-step mean holds)
    stage_ms = stage_s / steps * 1e3 if steps else 0.0
    taken = Route.CHAIN if master.deployment.chained else Route.STAR
    ms, decode_ms = timing.ms_per_token, timing.decode_ms_per_token
    nan = float("nan")
    return PpRow(workers, browsers, str(taken), len(plan.stages), ms, decode_ms, stage_ms, decode_ms - stage_ms,
                 nan, nan, nan, nan)


def _browser_row(model: Model, workers: int, browsers: int, prompt: list[int], tokens: int, threads: int,
                 activations: Activations, layers: Sequence[float], tab_weights: TabWeights) -> PpRow:
    """A pipeline of native workers and Chromium tabs, each with a budget that makes the plan use all of them
    (a tab's matrices take more bytes than the file's, float32 ones 5-6x, the kernels' 1.2x: its budget is scaled up
    to hold as many layers), and the first tab's stage timed natively in this process."""
    from edgerun.bench.browser import chromium_tabs, stage_pass_ms

    budget = stage_budgets_mb(layers, workers + browsers)
    grown = kernel_stage.expansion(model.weights) if tab_weights == TabWeights.KERNELS else \
        dequantized_expansion(model)
    tab_mb = budget * grown * 1.02
    with local_pipeline(model, [budget] * workers, CONTEXT, threads=threads, activations=activations) as (master, _):
        urls = [f"http://127.0.0.1:{master.port}/node?name=tab{i}&memory={tab_mb:.0f}&threads={threads}"
                f"&weights={tab_weights.value}#key={SECRET}" for i in range(browsers)]
        with chromium_tabs(urls):
            master.wait_for_workers(workers + browsers, timeout_s=120)
            row = _row(master, workers, browsers, prompt, tokens)
            tab = master.workers["tab0"]
            stage = next(s for s in master.plan.stages if s.worker == "tab0")
            tab_ms = tab.decode_s / tab.decode_passes * 1e3 if tab.decode_passes else float("nan")
    native = {}
    for kind in (activations, Activations.F32):
        spec = StageSpec.for_layers(model.config, stage.first_layer, stage.end_layer, kind)
        native[kind] = stage_pass_ms(cached_stage(model.path, model.config, model.weights, spec), model.config, spec,
                                     threads)
    return dataclasses.replace(row, tab_layers=f"{stage.first_layer}-{stage.end_layer - 1}", tab_pass_ms=tab_ms,
                               native_pass_ms=native[activations], native_f32_pass_ms=native[Activations.F32],
                               tab_weights=tab_weights.value, tab_threads=tab.capabilities.threads)


# --- bench pp --swap-context: the pause of a hot swap mid-request ------------------------------------------------
@dataclass(frozen=True)
class SwapRow:
    """One hot swap mid-request at `context` cached positions, on two native workers (w0, w1) running layers
    [0, h) and [h, n). "boundary": the plan moves the boundary (w0 takes [0, h + n/4)), so each worker keeps the
    KV of the layers it still holds and only the quarter that changes hands travels; "new worker": a third
    worker takes every layer, so every layer's KV travels."""

    kind: str
    context: int
    layers_sent: int  # layers whose KV went over the network (old worker -> master -> new worker)
    layers_kept: int  # layers whose KV its worker handed from its old session to its new one
    layers_precopied: int  # of those sent, layers whose rows went before the swap, while the request ran
    swap_ms: float  # from the swap's start to the next token, that token's pass included
    token_ms: float  # the request's mean one-token step before the swap, for comparison
    prefill_ms: float  # the request's prefill of the context: what a swap that prefills again pays at least
    same_tokens: bool  # the request's tokens, swap and all, are the single-process engine's

    @property
    def pause_ms(self) -> float:
        """What the swap adds to the token it precedes."""
        return self.swap_ms - self.token_ms


def _plan_of(plan: PPPlan, stages: Sequence[Stage]) -> PPPlan:
    """`plan` made to run these stages (the bench's own split, not the planner's)."""
    zeros = tuple(0.0 for _ in stages)
    return dataclasses.replace(plan, stages=tuple(stages), stage_compute_s=zeros, stage_network_s=zeros)


def bench_swap(model: Model, context: int, threads: int = 1, activations: Activations = Activations.INT8,
               progress: Callable[[str], None] = lambda _: None) -> list[SwapRow]:
    """Both swaps of SwapRow at `context` positions. Every worker's budget holds two copies of the model, so the
    staged stages load beside the running ones (a swap without that room loads them at the swap)."""
    n = model.config.n_layers
    if n < 4:
        raise EdgerunError(f"a swap benchmark needs a model of at least 4 layers, not {n}")
    words = (PROMPT + " ") * (context // 4 + 8)
    prompt = model.tokenizer.encode(words)[:context]
    if len(prompt) < context:
        raise EdgerunError(f"the benchmark's text makes {len(prompt)} tokens, fewer than --swap-context {context}")
    layers = model_profile(model.name, model.config, model.weights,
                           context=context + SWAP_TOKENS + 8).layer_memory_bytes
    budget = 2.2 * sum(layers) / 1e6
    progress("the single-process engine's tokens for the same request")
    engine = OnnxEngine(model, len(prompt) + SWAP_TOKENS + 8, threads=threads, activations=activations)
    reference = generate(engine, prompt, SWAP_TOKENS, Sampler(SamplingParams())).tokens
    return [_swap_row(model, kind, prompt, reference, budget, threads, activations, progress)
            for kind in ("boundary", "new worker")]


def _swap_row(model: Model, kind: str, prompt: list[int], reference: list[int], budget: float, threads: int,
              activations: Activations, progress: Callable[[str], None]) -> SwapRow:
    n, h = model.config.n_layers, model.config.n_layers // 2
    progress(f"hot swap at {len(prompt)} positions ({kind})")
    with local_pipeline(model, [budget] * 3, len(prompt) + SWAP_TOKENS + 8, threads=threads,
                        activations=activations) as (master, _):
        d = master.deployment
        master.net.call(master.repartitioner.cancel)  # the bench chooses the plans, not the repartition loop
        base = master.start()
        master.net.run(d.replan(_plan_of(base, [Stage("w0", 0, h), Stage("w1", h, n)])))
        target = _plan_of(base, [Stage("w0", 0, h + n // 4), Stage("w1", h + n // 4, n)] if kind == "boundary"
                          else [Stage("w2", 0, n)])
        times: list[float] = []
        staging: list[Future[bool]] = []

        def stage_after_three(_: int) -> None:
            """After the third token the plan is staged in the background of the request (as the repartition
            loop stages one): its workers load their stages and take the rows cached so far while tokens go on."""
            times.append(time.perf_counter())
            if len(times) == 3:
                staging.append(master.net.submit(d.stage(target)))
            elif len(times) == SWAP_TOKENS - 8 and not staging[0].done():  # a slow machine: the swap still comes
                staging[0].result(SETTLE_S)

        started = time.perf_counter()
        tokens = master.generate(prompt, SWAP_TOKENS, on_token=stage_after_three)
        if not staging[0].result(SETTLE_S) or len(master.swap_seconds) != 1 or \
                master.prefill_lengths != [len(prompt)] or \
                [s.worker for s in master.plan.stages] != [s.worker for s in target.stages]:
            raise EdgerunError(f"the hot swap did not happen within the request's {SWAP_TOKENS} tokens (the "
                               "master's log says why)")
        kept = len({layer for layers in d.kept_kv.values() for layer in layers})
        return SwapRow(kind, master.swap_positions[0], n - kept, kept, len(d.precopied), master.swap_seconds[0] * 1e3,
                       (times[2] - times[0]) / 2 * 1e3, (times[0] - started) * 1e3, tokens == reference)


def swap_table(rows: Sequence[SwapRow]) -> str:
    lines = text_table((
        Column("swap", lambda r: r.kind, width=10),
        Column("context", lambda r: r.context),
        Column("KV sent", lambda r: r.layers_sent),
        Column("pre-copied", lambda r: r.layers_precopied),
        Column("KV kept", lambda r: r.layers_kept),
        Column("swap ms", lambda r: r.swap_ms, ".1f"),
        Column("token ms", lambda r: r.token_ms, ".1f"),
        Column("pause ms", lambda r: r.pause_ms, ".1f"),
        Column("prefill ms", lambda r: r.prefill_ms, ".1f"),
        Column("= single", lambda r: "yes" if r.same_tokens else "NO")), rows)
    lines.append("swap ms: from the swap's start to the next token; pause ms: that less a one-token step before it")
    return "\n".join(lines)


def pp_table(rows: Sequence[PpRow], single: RequestTiming, activations: Activations) -> str:
    """ms/token of whole requests (the prompt's prefill included) and of their one-token steps alone ("decode"),
    which are the stages' own compute ("stages") and the rest ("other": transfers, the master)."""
    lines = text_table((
        Column("workers", lambda r: r.workers),
        Column("browser", lambda r: r.browser),
        Column("route", lambda r: r.route),
        Column("stages", lambda r: r.stages),
        Column("ms/token", lambda r: r.ms_per_token, ".1f", width=9),
        Column("vs single", lambda r: f"{r.ratio_to_single:.2f}x"),
        Column("decode", lambda r: r.decode_ms_per_token, ".1f"),
        Column("vs single", lambda r: f"{r.decode_ratio_to_single:.2f}x"),
        Column("stages ms", lambda r: r.stage_ms_per_token, ".1f"),
        Column("other ms", lambda r: r.other_ms_per_token, ".1f")), rows)
    lines.append(f"single-process engine: {single.ms_per_token:.1f} ms/token, decode "
                 f"{single.decode_ms_per_token:.1f} ({activations.value} activations, as the native stages; the "
                 f"median of {len(rows) + 1} runs, one before the first row and one after each: each row is compared "
                 f"with the two around it, decode {span([r.single_decode_ms_per_token for r in rows])})")
    spins = {r.workers + 1: r.spin_us for r in rows if not r.browser}  # tabs' rows do not spin
    if spins:
        lines.append(spin_line(spins))
    for r in rows:
        if r.tab_layers is not None:
            lines.append(f"{r.workers} worker(s) + {r.browser} tab(s): layers {r.tab_layers} take {r.tab_pass_ms:.1f} "
                         f"ms a pass in the tab ({r.tab_weights}, {r.tab_threads} thread(s)), "
                         f"{r.native_pass_ms:.1f} natively ({activations.value}; "
                         f"{r.native_f32_pass_ms:.1f} in float32): {r.tab_pass_ms / r.native_pass_ms:.2f}x")
    return "\n".join(lines)
