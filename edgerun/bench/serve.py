"""`edgerun bench serve`: concurrent streaming clients against an OpenAI-compatible `edgerun serve`, one row per
number of streams: the aggregate tokens a second, the time to each stream's first text (p50, p95), the time between
its pieces of text (p50), and the aggregate against one stream's.

The server is a process of its own (`edgerun serve --no-cluster [--parallel P]` on a free port, started here and
stopped after), or one already running (--url), so the clients' threads never share an interpreter with it.
Every stream of a row starts at once (a barrier) with the same greedy request, and streams its answer over HTTP as
a user's client does (server-sent events, the usage in the last chunk).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import re
import secrets
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

from edgerun.bench.cores import device_cores
from edgerun.errors import EdgerunError
from edgerun.net.loops import auto_spin_us
from edgerun.serve.client import stream_events
from edgerun.tables import Column, text_table

START_TIMEOUT_S = 300  # loading the model and starting the server
BENCH_PROMPT = "Once upon a time, in a small village by the sea, there lived"
PROMPT_KINDS = ("distinct", "same")
PIPELINE_CONTEXT = 512  # a started pipeline's --max-context: its workers' budgets count that many rows a sequence


@dataclass(frozen=True)
class ServeBenchConfig:
    streams: tuple[int, ...] = (1, 4, 8, 16)
    max_tokens: int = 32  # each stream's answer at most
    url: str | None = None  # a running server's; None: start `edgerun serve --no-cluster` here
    api_key: str | None = None
    model: Path | None = None  # the started server's (None: the shipped model)
    threads: int = 1  # the started server's, and its nodes'
    parallel: int = 1  # the started server's --parallel (requests decoded together)
    nodes: int = 0  # tensor-parallel node processes the started server serves with (--plan `plan`)
    workers: int = 0  # pipeline workers the started server serves with (--plan dp, its own engine kept out)
    experts: int = 0  # expert workers the started server's hub serves a MoE model with (--plan moe, one replica)
    plan: str = "even"  # the started tensor-parallel cluster's planner: even shares, every node computing
    prompt: str = BENCH_PROMPT
    # "distinct": each stream's prompt names the stream and its row, so none is another's; "same": every stream
    # sends `prompt` as it is (a server that shares a prompt's prefill between sequences prefills it once)
    prompts: str = "distinct"
    # Also time one stream on the single engine alone (a server of its own, --no-cluster, one request at a time)
    # before the rows, and give each row's aggregate against it
    baseline: bool = False
    # How long the started cluster's master and members poll for their next message before sleeping (--spin-us);
    # None: auto, AUTO_SPIN_US where this machine has a core for every compute thread of the server and members
    spin_us: float | None = None
    # Cores of its own for every process it starts (bench tp's --pin): the server (and the --baseline one) the first
    # `pin`, member i the next; 0: not pinned
    pin: int = 0
    round_tokens: int | None = None  # the started server's --round-tokens (None: its default)

    def __post_init__(self) -> None:
        if not self.streams or min(self.streams) < 1:
            raise EdgerunError("--streams must be whole numbers of at least 1, comma-separated: 1,4,8,16")
        if self.max_tokens < 1:
            raise EdgerunError("--max-tokens must be at least 1")
        if self.parallel < 1:
            raise EdgerunError("--parallel must be at least 1")
        if min(self.nodes, self.workers, self.experts) < 0 or \
                sum(bool(n) for n in (self.nodes, self.workers, self.experts)) > 1:
            raise EdgerunError("--nodes, --workers or --experts: a tensor-parallel cluster, a pipeline or an expert "
                               "master, one of them")
        if self.url is not None and (self.nodes or self.workers or self.experts or self.parallel > 1
                                     or self.baseline or self.spin_us is not None or self.round_tokens is not None):
            raise EdgerunError("--url measures a running server as it is: --nodes, --workers, --experts, "
                               "--parallel, --round-tokens, --baseline and --spin-us start one")
        if self.round_tokens is not None and self.round_tokens < 1:
            raise EdgerunError(f"--round-tokens must be at least 1, not {self.round_tokens}")
        if self.pin < 0:
            raise EdgerunError(f"--pin must be 0 (not pinned) or a number of cores, not {self.pin}")
        if self.url is not None and self.pin:
            raise EdgerunError("--url measures a running server as it is: --pin pins the processes the bench starts")
        if self.spin_us is not None and not 0 <= self.spin_us < math.inf:
            raise EdgerunError(f"--spin-us must be 0 or more microseconds, not {self.spin_us}")
        if self.prompts not in PROMPT_KINDS:
            raise EdgerunError(f"--prompts is one of {', '.join(PROMPT_KINDS)}, not {self.prompts!r}")
        if self.url is not None and not re.match(r"^https?://[^/]+", self.url):
            raise EdgerunError(f"--url must be a server's http:// address, not {self.url!r}")


@dataclass(frozen=True)
class StreamTiming:
    """One streamed answer as its client saw it (seconds from its request)."""
    first_s: float  # to the first piece of text
    gaps_s: tuple[float, ...]  # between its pieces of text
    tokens: int  # completion tokens (the usage the server reported)
    end_s: float  # to the end of the stream


@dataclass(frozen=True)
class ServeRow:
    streams: int
    tokens: int  # every stream's completion tokens
    wall_s: float  # from the row's start to its last stream's end
    aggregate_tok_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    itl_p50_ms: float  # between pieces of text, over every stream's
    vs_one: float | None  # aggregate_tok_s over the one-stream row's (None without one)
    served_by: str = ""  # what the server said it served from after the row (serving())
    spin_us: float = 0.0  # how long the started cluster's master and members polled before sleeping
    vs_single: float | None = None  # aggregate_tok_s over the single engine's one stream (--baseline)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by the nearest rank: a value that was measured, never an interpolation."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def stream_once(url: str, body: dict, api_key: str | None) -> StreamTiming:
    """POST a streamed completion and time its pieces as they arrive."""
    started = time.perf_counter()
    pieces: list[float] = []
    tokens = None
    for data in stream_events(url.rstrip("/") + "/v1/completions", body, api_key):
        if data.get("usage"):
            tokens = int(data["usage"]["completion_tokens"])
        if data.get("choices") and data["choices"][0].get("text"):
            pieces.append(time.perf_counter() - started)
    if tokens is None or not pieces:
        raise EdgerunError("a stream ended without text or usage")
    return StreamTiming(pieces[0], tuple(b - a for a, b in itertools.pairwise(pieces)), tokens,
                        time.perf_counter() - started)


def run_row(url: str, bodies: Sequence[dict], api_key: str | None) -> tuple[list[StreamTiming], float]:
    """A client per request body, started together; their timings and the row's wall time. The first failure is
    raised."""
    streams = len(bodies)
    barrier = threading.Barrier(streams + 1)
    timings: list[StreamTiming | None] = [None] * streams
    failures: list[BaseException] = []

    def client(i: int) -> None:
        barrier.wait()
        try:
            timings[i] = stream_once(url, bodies[i], api_key)
        except BaseException as e:  # raised in the caller's thread
            failures.append(e)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if failures:
        raise failures[0] if isinstance(failures[0], EdgerunError) else EdgerunError(f"a stream failed: {failures[0]}")
    return [t for t in timings if t is not None], wall


def summarize(streams: int, timings: Sequence[StreamTiming], wall_s: float) -> ServeRow:
    tokens = sum(t.tokens for t in timings)
    firsts = [t.first_s * 1e3 for t in timings]
    gaps = [g * 1e3 for t in timings for g in t.gaps_s]
    return ServeRow(streams, tokens, wall_s, tokens / wall_s, percentile(firsts, 50), percentile(firsts, 95),
                    statistics.median(gaps) if gaps else float("nan"), None)


def _state(url: str, api_key: str | None) -> dict | None:
    """The server's /api/state (None where it has none or refuses)."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/api/state", headers=headers), timeout=30) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, ValueError, OSError):
        return None


def serving(state: dict | None) -> str:
    """What the server serves from, in words: its engine, and the devices of a cluster's plan."""
    if state is None:
        return "a server without /api/state"
    if state.get("mode") != "cluster" or not state.get("plan"):
        return f"the {state.get('mode', 'unknown')} engine"
    plan = state["plan"]
    memory = plan.get("memory_mb") or [1.0] * len(plan["devices"])
    used = [str(d) if isinstance(d, str) else str(d.get("name", d)) for d, m in zip(plan["devices"], memory,
                                                                                      strict=False) if m > 0]
    if plan.get("strategy") == "dp":  # a pipeline's stages, in order: which layers each ran
        holds = {n.get("name"): n.get("holds") for n in state.get("nodes") or []}
        used = [f"{d} ({holds[d]})" if holds.get(d) else d for d in used]
    return f"the cluster, computed on {len(used)} device(s): {', '.join(used)}"


def _cluster_ready(config: ServeBenchConfig, state: dict | None) -> bool:
    if state is None or state.get("mode") != "cluster":
        return False
    if config.workers or config.experts:
        return len(state.get("nodes") or []) >= config.workers + config.experts and bool(state.get("plan"))
    return len((state.get("plan") or {}).get("devices") or []) == config.nodes + 1


def _stage_budget_mb(config: ServeBenchConfig) -> float:
    """A memory budget for each of the pipeline's workers with which the plan must use every one of them (the
    model's layers and their caches, --parallel sequences' of PIPELINE_CONTEXT tokens each, cut in as many stages),
    and, batching, can split the model as a batch is planned (bench.pp.batch_budgets_mb)."""
    from edgerun.bench.pp import batch_budgets_mb, worker_budget_mb
    from edgerun.model.loader import load_model
    from edgerun.sched.profiles import model_profile

    model = load_model(config.model)
    profile = model_profile(model.name, model.config, model.weights, context=PIPELINE_CONTEXT * config.parallel)
    if config.parallel > 1 and config.workers > 1:
        return batch_budgets_mb(profile, config.workers)
    return worker_budget_mb(profile.layer_memory_bytes, config.workers)


def cluster_spin_us(config: ServeBenchConfig) -> float:
    """What the started cluster's master and members poll for (--spin-us, auto resolved); 0 for a server alone,
    which has no member to hear from."""
    members = config.nodes + config.workers + config.experts
    if not members:
        return 0.0
    return auto_spin_us(members + 1, config.threads) if config.spin_us is None else config.spin_us


def member_argv(config: ServeBenchConfig, index: int, cluster_port: str, key: str,
                budget_mb: float | None) -> list[str]:
    """The command line of the bench's member number `index` (a node, a pipeline worker or an expert worker) that
    joins the server's cluster port on this machine."""
    # Members compute on the CPU, as the server's own engine does: a worker's and a node's default takes a GPU
    # where there is one (a node's first builds ggml's CUDA backend, minutes), and every member would share it.
    mode = ["--mode", "pp", "--memory-budget", f"{budget_mb:.1f}", "--device", "cpu"] if config.workers else \
        ["--mode", "moe"] if config.experts else ["--device", "cpu"]
    return [sys.executable, "-m", "edgerun.cli", "node", *mode, "--master", f"127.0.0.1:{cluster_port}", "--key", key,
            "--name", f"bench-{index}", "--threads", str(config.threads), "--spin-us", f"{cluster_spin_us(config):g}"]


def _pinning(config: ServeBenchConfig, device: int) -> Callable[[], None] | None:
    """What a started process runs before its program under --pin: it takes device `device`'s cores (0: the
    server's)."""
    cores = device_cores(device, config.pin)
    return None if cores is None else functools.partial(os.sched_setaffinity, 0, cores)


@contextmanager
def started_server(config: ServeBenchConfig, log: Callable[[str], None]) -> Iterator[str]:
    """`edgerun serve` on free ports of this machine, its queue as deep as the most streams: alone (`--no-cluster
    --parallel P`), or with `nodes` tensor-parallel nodes, `workers` pipeline workers or `experts` expert workers it
    starts beside it (each at `threads`), once its plan takes them all; its URL while the context is open."""
    argv = [sys.executable, "-m", "edgerun.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--no-request-log",
            "--threads", str(config.threads), "--max-queue", str(max(config.streams))]
    key = secrets.token_hex(16)
    budget_mb = None
    members = config.nodes or config.workers or config.experts
    if members:
        argv += ["--cluster-port", "0", "--no-advertise", "--prefer", "cluster", "--key", key]
        if config.workers:
            argv += ["--plan", "dp", "--no-local", "--parallel", str(config.parallel), "--max-context",
                     str(PIPELINE_CONTEXT)]
            budget_mb = _stage_budget_mb(config)
        elif config.experts:
            argv += ["--plan", "moe", "--no-local", "--replicas", "1", "--parallel", str(config.parallel),
                     "--max-context", str(PIPELINE_CONTEXT)]
        else:
            argv += ["--plan", config.plan]
            if config.parallel > 1:  # the batch on the cluster's shares (the master's own among them)
                argv += ["--no-local", "--parallel", str(config.parallel), "--max-context", str(PIPELINE_CONTEXT)]
    else:
        argv += ["--no-cluster", "--parallel", str(config.parallel)]
    if config.round_tokens is not None:
        argv += ["--round-tokens", str(config.round_tokens)]
    if config.model is not None:
        argv += ["--model", str(config.model)]
    if members:
        argv += ["--spin-us", f"{cluster_spin_us(config):g}"]
    if config.api_key:
        argv += ["--api-key", config.api_key]
    procs = [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_pinning(config, 0))]
    lines: list[str] = []
    found: list[tuple[str, str | None]] = []
    ready = threading.Event()

    def read() -> None:
        assert procs[0].stderr is not None
        for line in procs[0].stderr:
            lines.append(line)
            if not found and (m := re.search(r"at (http://[\d.]+:\d+) ", line)):
                cluster = re.search(r"--master HOST:(\d+)", line)
                found.append((m.group(1), cluster.group(1) if cluster else None))
                ready.set()
        ready.set()  # ended: the server stopped

    threading.Thread(target=read, daemon=True).start()
    try:
        what = f"{config.nodes} node(s)" if config.nodes else f"{config.workers} worker(s)" if config.workers else \
            f"{config.experts} expert worker(s)" if config.experts else "its own engine"
        log(f"starting edgerun serve with {what} (the model loads first)...")
        if not ready.wait(START_TIMEOUT_S) or not found:
            raise EdgerunError("edgerun serve did not start:\n" + "".join(lines[-20:]))
        url, cluster_port = found[0]
        for i in range(members):
            procs.append(subprocess.Popen(member_argv(config, i, str(cluster_port), key, budget_mb),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          preexec_fn=_pinning(config, i + 1)))
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(procs) > 1 and not _cluster_ready(config, _state(url, config.api_key)):
            if (ended := [i for i, p in enumerate(procs) if p.poll() is not None]) or time.monotonic() > deadline:
                why = f"process(es) {ended} ended (0: the server)" if ended else f"not within {START_TIMEOUT_S} s"
                raise EdgerunError(f"the cluster did not form over {what}: {why}\n" + "".join(lines[-10:]))
            time.sleep(0.5)
        yield url
    finally:
        for proc in reversed(procs):  # the members first: a server that goes first leaves them rejoining
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def stream_prompts(config: ServeBenchConfig, row: int, streams: int) -> list[str]:
    """The prompts of row number `row` (from 1), one a stream. distinct: no stream's prompt is another's, in this
    row or an earlier one, one of the same count included (a server keeps what it prefilled for the prompts that
    come after)."""
    if config.prompts == "same":
        return [config.prompt] * streams
    return [f"Row {row}, stream {i + 1} of {streams}: {config.prompt}" for i in range(streams)]


def bench_serve(config: ServeBenchConfig, log: Callable[[str], None] = lambda _: None) -> list[ServeRow]:
    """One row per stream count, in the order given, after one unmeasured warm-up request; each row's aggregate
    against the first one-stream row's where there is one."""
    body = {"model": "any", "prompt": config.prompt, "max_tokens": config.max_tokens, "temperature": 0.0,
            "seed": 1, "stream": True, "stream_options": {"include_usage": True}}
    single = None
    if config.baseline:
        alone = replace(config, streams=(1,), parallel=1, nodes=0, workers=0, experts=0, baseline=False)
        log("the single engine's one stream (--baseline)...")
        single = bench_serve(alone, log)[0].aggregate_tok_s
    with started_server(config, log) if config.url is None else nullcontext(config.url.rstrip("/")) as url:
        stream_once(url, body, config.api_key)  # warm-up: first-request allocations stay out of the rows
        rows = []
        for number, streams in enumerate(config.streams, 1):
            log(f"{streams} stream(s)...")
            bodies = [{**body, "prompt": prompt} for prompt in stream_prompts(config, number, streams)]
            row = summarize(streams, *run_row(url, bodies, config.api_key))
            rows.append(replace(row, served_by=serving(_state(url, config.api_key)),
                                spin_us=0.0 if config.url else cluster_spin_us(config)))
    one = next((r.aggregate_tok_s for r in rows if r.streams == 1), None)
    return [replace(r, vs_one=None if one is None else r.aggregate_tok_s / one,
                    vs_single=None if single is None else r.aggregate_tok_s / single) for r in rows]


def serve_table(rows: Sequence[ServeRow]) -> str:
    """The rows as a text table; "x one" is the aggregate tokens a second against one stream's, "x single" (with
    --baseline) against the single engine's one stream alone."""
    single = any(r.vs_single is not None for r in rows)
    lines = text_table((
        Column("streams", lambda r: r.streams),
        Column("tokens", lambda r: r.tokens, width=7),
        Column("wall s", lambda r: r.wall_s, ".2f", width=7),
        Column("aggregate tok/s", lambda r: r.aggregate_tok_s, ".1f"),
        Column("x one", lambda r: "" if r.vs_one is None else f"{r.vs_one:.2f}x", width=6),
        *([Column("x single", lambda r: "" if r.vs_single is None else f"{r.vs_single:.2f}x")] if single else []),
        Column("ttft p50 ms", lambda r: r.ttft_p50_ms, ".0f"),
        Column("ttft p95 ms", lambda r: r.ttft_p95_ms, ".0f"),
        Column("itl p50 ms", lambda r: r.itl_p50_ms, ".1f")), rows)
    lines += [f"{r.streams} stream(s): served from {r.served_by}" for r in rows]
    if single:
        lines.append(f"x single: against one stream on the single engine alone (--baseline), "
                     f"{rows[0].aggregate_tok_s / rows[0].vs_single:.1f} tok/s")
    if rows and any(r.spin_us for r in rows):
        lines.append(f"spin: the cluster's master and members polled {rows[0].spin_us:g} µs before sleeping")
    return "\n".join(lines)
