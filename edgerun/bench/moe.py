"""`edgerun bench moe`: a local MoEx cluster (a hub in this process, expert workers as processes on loopback),
its expert phase per layer measured at each hedging factor beside what the latency model predicts (the MoEx paper
Eqs. 8 and 18), and the single-process onnx engine's speed on the same model in the same run.

With `--latency lognormal:MEDIAN:SIGMA` every worker holds each reply back by a delay drawn from that
distribution. A first row at h = 1 without injected latency measures the cluster's own expert phase (the
dispatch, the workers' kernels, the replies): the model's prediction for the other rows is that base plus the
expected slowest of k experts, each the fastest of h replicas, of the injected delay.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from edgerun.bench.single import cluster_baseline_ms
from edgerun.model.generate import generate
from edgerun.model.loader import Model
from edgerun.model.onnx_graph import Activations
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.moe.hub import HubConfig, MoeHub
from edgerun.net.wire import derive_key
from edgerun.sched.moe import LogNormal, expected_expert_phase_ms, expert_phase_quantile_ms, worker_memory_bytes
from edgerun.tables import Column, text_table

SECRET = "edgerun-bench"
PROMPT = "Distributed inference splits one model across several machines because"
WARMUP_TOKENS = 4
CONTEXT = 512


@dataclass(frozen=True)
class MoeRow:
    hedge: int
    latency: str  # the injected distribution, or "none"
    workers: int
    replicas: int
    k: int  # experts each token takes per layer
    tokens: int
    expert_mean_ms: float  # the expert phase of a decode step's layer, measured
    expert_p50_ms: float
    expert_p99_ms: float
    model_mean_ms: float  # the latency model's prediction (the base row's mean plus Eq. 18)
    model_p99_ms: float
    tokens_per_s: float  # decode
    ms_per_token: float
    frames_per_dispatch: float  # hedged copies sent per (expert, tokens)
    redispatched: int
    worker_held_mb: float  # the most expert weights (MiB) the placement gave one worker
    eq3_mb: float  # the MoEx paper's Eq. 3 per-worker figure: r * E / N experts per layer, all layers
    worker_rss_mb: float  # the largest peak RSS (MiB) a worker reported


def start_worker(port: int, name: str, latency: LogNormal | None, seed: int, threads: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "edgerun.cli", "node", "--mode", "moe", "--master", f"127.0.0.1:{port}", "--key",
            SECRET, "--name", name, "--memory-budget", "100000", "--threads", str(threads), "--loss-seed", str(seed)]
    if latency is not None:
        argv += ["--inject-latency", f"lognormal:{latency.median_ms:g}:{latency.sigma:g}"]
    return subprocess.Popen(argv, stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def local_hub(model: Model, workers: int, replicas: int, latency: LogNormal | None, threads: int = 1,
              activations: Activations = Activations.F32) -> Iterator[MoeHub]:
    hub = MoeHub(model, derive_key(SECRET), HubConfig(max_len=CONTEXT, replicas=replicas, activations=activations,
                                                        threads=threads))
    procs = [start_worker(hub.port, f"e{i}", latency, i + 1, threads) for i in range(workers)]
    try:
        hub.wait_for_workers(workers)
        yield hub
    finally:
        hub.close()
        for p in procs:
            p.kill()
            p.wait()


def _measure(hub: MoeHub, model: Model, tokens: int, hedge: int, latency: LogNormal | None,
             base_ms: float | None) -> MoeRow:
    hub.reconfigure(replace(hub.config, hedge=hedge))
    greedy = Sampler(SamplingParams())
    prompt = model.tokenizer.encode(PROMPT)
    generate(hub, prompt, WARMUP_TOKENS, greedy)
    before = (hub.stats.dispatches, hub.stats.sent, hub.stats.redispatched)
    hub.stats.phase_ms.clear()
    result = generate(hub, prompt, tokens, greedy)
    phases = np.array(hub.stats.phase_ms)
    k = model.config.n_experts_used
    if latency is None:
        model_mean = model_p99 = float(phases.mean())
    else:
        base = base_ms or 0.0
        model_mean = base + expected_expert_phase_ms(latency, k, hedge)
        model_p99 = base + expert_phase_quantile_ms(latency, k, hedge, 0.99)
    dispatches = hub.stats.dispatches - before[0]
    c, placement = model.config, hub.placement
    hub.settle_heartbeats()
    return MoeRow(
        hedge=hedge, latency="none" if latency is None else f"lognormal:{latency.median_ms:g}:{latency.sigma:g}",
        workers=len(hub.workers), replicas=hub.config.replicas, k=k, tokens=len(result.tokens),
        expert_mean_ms=float(phases.mean()), expert_p50_ms=float(np.percentile(phases, 50)),
        expert_p99_ms=float(np.percentile(phases, 99)), model_mean_ms=model_mean, model_p99_ms=model_p99,
        tokens_per_s=result.decode_tok_s, ms_per_token=(result.prefill_s + result.decode_s) / len(result.tokens) * 1e3,
        frames_per_dispatch=(hub.stats.sent - before[1]) / max(1, dispatches),
        redispatched=hub.stats.redispatched - before[2],
        worker_held_mb=max(placement.held_mb.values()),
        eq3_mb=worker_memory_bytes(hub.config.replicas, c.n_experts, len(hub.workers), c.n_layers, 1.0,
                                   placement.expert_mb),
        worker_rss_mb=max(w.peak_rss_mb for w in hub.workers.values()))


def bench_moe(model: Model, workers: int, replicas: int, hedges: list[int], latency: LogNormal | None, tokens: int,
              threads: int = 1, progress: Callable[[str], None] = lambda _: None,
              activations: Activations = Activations.INT8) -> tuple[list[MoeRow], float]:
    """Rows: the base (h = 1, no injected latency), then each hedge with `latency`; and the single engine's
    ms/token on the same model and prompt."""
    progress(f"single-process onnx engine, {threads} thread(s)")
    single = cluster_baseline_ms(model, model.tokenizer.encode(PROMPT), tokens, threads, activations, CONTEXT,
                                 WARMUP_TOKENS)
    rows = []
    progress(f"master + {workers} expert workers, {replicas} replicas, no injected latency")
    with local_hub(model, workers, replicas, None, threads, activations) as hub:
        rows.append(_measure(hub, model, tokens, 1, None, None))
    if latency is not None:
        progress(f"master + {workers} expert workers, injected latency "
                 f"lognormal:{latency.median_ms:g}:{latency.sigma:g}")
        with local_hub(model, workers, replicas, latency, threads, activations) as hub:
            for h in hedges:
                progress(f"hedge {h}")
                rows.append(_measure(hub, model, tokens, h, latency, rows[0].expert_mean_ms))
    return rows, single


def moe_table(rows: list[MoeRow], single_ms: float) -> str:
    lines = text_table((
        Column("hedge", lambda r: r.hedge),
        Column("latency", lambda r: r.latency, width=18),
        Column("workers", lambda r: r.workers),
        Column("r", lambda r: r.replicas, width=2),  # replicas of each expert
        Column("k", lambda r: r.k, width=2),  # experts a token takes
        Column("expert ms mean", lambda r: r.expert_mean_ms, ".2f"),
        Column("p50", lambda r: r.expert_p50_ms, ".2f", width=7),
        Column("p99", lambda r: r.expert_p99_ms, ".2f", width=7),
        Column("model mean", lambda r: r.model_mean_ms, ".2f"),
        Column("model p99", lambda r: r.model_p99_ms, ".2f"),
        Column("tok/s", lambda r: r.tokens_per_s, ".1f", width=7),
        Column("ms/token", lambda r: r.ms_per_token, ".1f"),
        Column("vs single", lambda r: f"{single_ms / r.ms_per_token:.2f}x"),
        Column("frames/disp", lambda r: r.frames_per_dispatch, ".2f"),
        Column("redisp", lambda r: r.redispatched),
        Column("worker MiB held/Eq.3/rss",
               lambda r: f"{r.worker_held_mb:.0f}/{r.eq3_mb:.0f}/{r.worker_rss_mb:.0f}")), rows)
    lines.append(f"single-process onnx engine: {single_ms:.1f} ms/token, prefill included as in the rows' ms/token "
                 "(tok/s: decode only)")
    return "\n".join(lines)


def default_moe_model() -> Path:
    """moe-tiny, written once into the cache: the benchmark's model when none is given."""
    from edgerun.cache import cache_root
    from edgerun.model.synth import SHAPES, SynthSpec, write_synthetic

    path = cache_root() / "models" / "moe-tiny.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic(SynthSpec(SHAPES["moe-tiny"], "Q4_0"), path, "gguf")
    return path
