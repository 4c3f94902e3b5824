"""`edgerun bench single`: one engine on one machine, prefill and decode speed against memory bandwidth.

Each engine runs in a fresh process so that its peak RSS is its own.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from edgerun.memory import memory_read_bandwidth, peak_rss_mb
from edgerun.model.generate import GenerationResult, default_engine, generate, make_engine
from edgerun.model.loader import Model, load_model
from edgerun.model.onnx_graph import Activations
from edgerun.model.sampling import Sampler, SamplingParams
from edgerun.tables import Column, text_table

BENCH_TEXT = (
    "Distributed inference splits one model across several machines. Each machine holds part of the "
    "weights, computes its share of every token, and exchanges activations with the others. "
)


@dataclass(frozen=True)
class SingleResult:
    engine: str
    model: str
    threads: int
    prompt_tokens: int
    decode_tokens: int
    load_s: float
    prefill_tok_s: float
    decode_tok_s: float
    weight_bytes: int  # read once per decode step
    weight_read_gb_s: float
    memory_read_gb_s: float  # this machine, same thread count, measured in the same run
    bandwidth_share: float  # weight_read / memory_read
    peak_rss_mb: float


def _run_engine(engine: str, model_path: str | None, threads: int, prompt_tokens: int,
                decode_tokens: int, device: str = "cpu") -> dict[str, float]:
    start = time.perf_counter()
    model = load_model(model_path)
    eng = make_engine(engine, model, prompt_tokens + decode_tokens + 1, threads=threads, device=device)
    load_s = time.perf_counter() - start
    ids = model.tokenizer.encode(BENCH_TEXT * (prompt_tokens // 20 + 1))[:prompt_tokens]
    eng.reset()
    eng.step(ids[:8])  # warm-up: first-run allocations stay out of the timings
    eng.reset()
    start = time.perf_counter()
    logits = eng.step(ids)
    prefill_s = time.perf_counter() - start
    token = int(logits.argmax())
    start = time.perf_counter()
    for _ in range(decode_tokens):
        token = int(eng.step([token]).argmax())
    decode_s = time.perf_counter() - start
    return {
        "load_s": load_s,
        "prefill_tok_s": len(ids) / prefill_s,
        "decode_tok_s": decode_tokens / decode_s,
        "weight_bytes": eng.weight_bytes,
        "peak_rss_mb": peak_rss_mb(),
    }


def bench_single(engines: list[str], model_path: Path | None, threads: int, prompt_tokens: int,
                 decode_tokens: int, device: str = "cpu") -> list[SingleResult]:
    memory_bw = memory_read_bandwidth(threads)
    ctx = multiprocessing.get_context("spawn")
    results = []
    for engine in engines:
        with ctx.Pool(1) as pool:
            r = pool.apply(_run_engine, (engine, None if model_path is None else str(model_path), threads,
                                         prompt_tokens, decode_tokens, device))
        read = r["weight_bytes"] * r["decode_tok_s"]
        results.append(SingleResult(
            engine=engine if device == "cpu" else f"{engine}@{device}",
            model=str(model_path or "default"), threads=threads, prompt_tokens=prompt_tokens,
            decode_tokens=decode_tokens, load_s=r["load_s"], prefill_tok_s=r["prefill_tok_s"],
            decode_tok_s=r["decode_tok_s"], weight_bytes=int(r["weight_bytes"]), weight_read_gb_s=read / 1e9,
            memory_read_gb_s=memory_bw / 1e9, bandwidth_share=read / memory_bw, peak_rss_mb=r["peak_rss_mb"],
        ))
    return results


RESULT_COLUMNS: tuple[Column[SingleResult], ...] = (
    Column("engine", lambda r: r.engine, width=10, left=True),
    Column("prefill tok/s", lambda r: r.prefill_tok_s, ".1f"),
    Column("decode tok/s", lambda r: r.decode_tok_s, ".2f"),
    Column("weights MB", lambda r: r.weight_bytes / 1e6, ".1f"),
    Column("read GB/s", lambda r: r.weight_read_gb_s, ".2f"),
    Column("mem GB/s", lambda r: r.memory_read_gb_s, ".2f"),
    Column("share", lambda r: r.bandwidth_share, ".0%", width=6),
    Column("peak RSS MB", lambda r: r.peak_rss_mb, ".0f"),
)


def results_table(results: list[SingleResult]) -> str:
    return "\n".join(text_table(RESULT_COLUMNS, results))


def results_json(results: list[SingleResult]) -> list[dict[str, object]]:
    return [asdict(r) for r in results]


@dataclass(frozen=True)
class RequestTiming:
    """One timed request: its whole time over its tokens (what the cluster benchmarks compare), and its one-token
    steps alone (the prompt's prefill, compute-bound, scales over devices unlike decoding: both are shown)."""

    ms_per_token: float  # prefill included
    decode_ms_per_token: float  # every token after the first
    prefill_ms: float = float("nan")  # the prompt's prefill and first token: the time to the first token

    @classmethod
    def of(cls, result: GenerationResult, elapsed_s: float) -> RequestTiming:
        steps = len(result.tokens) - 1
        return cls(elapsed_s / max(1, len(result.tokens)) * 1e3,
                   result.decode_s / steps * 1e3 if steps > 0 else float("nan"), result.prefill_s * 1e3)

    @classmethod
    def mean(cls, timings: Sequence[RequestTiming]) -> RequestTiming:
        """The mean of several timings: a benchmark row's single engine, timed just before and just after the row
        (on a shared machine its speed drifts from minute to minute)."""
        return cls(statistics.fmean(t.ms_per_token for t in timings),
                   statistics.fmean(t.decode_ms_per_token for t in timings),
                   statistics.fmean(t.prefill_ms for t in timings))


def cluster_baseline(model: Model, prompt: list[int], tokens: int, threads: int, activations: Activations,
                     max_len: int, warmup: int) -> RequestTiming:
    """The single-process engine a user would run alone (default_engine: ggml, llama.cpp's kernels, with int8
    activations) timed as the cluster benchmarks (bench tp, bench pp) time their clusters: a warm-up request of
    `warmup` tokens, then one of `tokens`, prefill included."""
    engine = make_engine(default_engine(model, activations == Activations.F32), model, max_len, threads=threads)
    greedy = Sampler(SamplingParams())
    generate(engine, prompt, warmup, greedy)
    start = time.perf_counter()
    result = generate(engine, prompt, tokens, greedy)
    return RequestTiming.of(result, time.perf_counter() - start)


def cluster_baseline_ms(model: Model, prompt: list[int], tokens: int, threads: int, activations: Activations,
                        max_len: int, warmup: int) -> float:
    """ms per output token of the single-process engine, prefill included (see cluster_baseline)."""
    return cluster_baseline(model, prompt, tokens, threads, activations, max_len, warmup).ms_per_token


def span(values: Sequence[float]) -> str:
    """Timings' range as a table prints it: "12.3-14.0", one figure where they agree, "-" for none."""
    if not values:
        return "-"
    low, high = f"{min(values):.1f}", f"{max(values):.1f}"
    return low if low == high else f"{low}-{high}"


def spin_line(spins: dict[int, float]) -> str:
    """Which rows polled their sockets (--spin-us), by processes on this machine."""
    if len(set(spins.values())) == 1:
        spin = next(iter(spins.values()))
        return f"spin: {spin:.0f} µs in every process" if spin else "spin: off"
    return "spin: " + ", ".join(f"{spin:.0f} µs with {n} processes" if spin else f"off with {n} processes"
                                for n, spin in sorted(spins.items()))
