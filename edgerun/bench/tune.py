"""`edgerun bench tune`: LoRA training steps in one process and across local pipelines of worker processes.

Each row runs the same steps (same data, same settings) and reports steps/s and tokens/s after a warm-up step,
its ratio to the single process at the same thread count measured in the same run, and per worker its layers,
the frozen quantized weights it holds and its peak RSS.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from edgerun.bench.pp import SECRET, start_worker
from edgerun.memory import peak_rss_mb
from edgerun.model.loader import Model
from edgerun.net.model_files import model_sha256
from edgerun.net.wire import derive_key
from edgerun.tables import Column, text_table
from edgerun.tune.cluster import LocalStage, TuneMaster, local_restart, training_layers
from edgerun.tune.data import Example
from edgerun.tune.tuner import Checkpoint, StageClient, StepRecord, TuneConfig, Tuner

WARMUP_STEPS = 1  # not timed: the first step pays for allocations and lazily built kernels


@dataclass(frozen=True)
class WorkerMemory:
    name: str
    layers: str
    frozen_mb: float  # the stage's frozen quantized weights
    peak_rss_mb: float  # while training (from the end of loading on)
    load_peak_rss_mb: float  # while building the stage from the model file


@dataclass(frozen=True)
class TuneRow:
    workers: int  # 0: the single process
    steps_per_s: float
    tokens_per_s: float
    ratio_to_single: float  # tokens/s over the single process's
    memory: list[WorkerMemory] = field(default_factory=list)


def _timed(records: list[StepRecord]) -> tuple[float, float]:
    timed = records[WARMUP_STEPS:] or records
    seconds = sum(r.seconds for r in timed)
    return len(timed) / seconds, sum(r.tokens for r in timed) / seconds


def bench_tune(model: Model, counts: Sequence[int], examples: Sequence[Example], config: TuneConfig, threads: int,
               max_len: int, progress: Callable[[str], None] = lambda _: None) -> list[TuneRow]:
    config = replace(config, eval_examples=0, checkpoint_every=0)
    sha = model_sha256(model.path)
    records: list[StepRecord] = []
    progress(f"single process, {threads} thread(s)")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    restart = local_restart(model, config)
    stage: list[LocalStage] = []

    async def local(checkpoint: Checkpoint | None) -> list[StageClient]:
        stage[:] = await restart(checkpoint)  # kept for its size below
        return list(stage)

    try:
        asyncio.run(Tuner(config, examples, [], sha, None, on_step=records.append).run(local))
    finally:
        torch.set_num_threads(previous)
    steps_s, tokens_s = _timed(records)
    rows = [TuneRow(0, steps_s, tokens_s, 1.0, [WorkerMemory("this process", f"0-{model.config.n_layers - 1}",
                                                             stage[0].trainer.model.frozen_bytes() / 1e6,
                                                             peak_rss_mb(),
                                                             peak_rss_mb())])]
    del stage[:]
    single = tokens_s
    tokens_in_flight = config.micro_size * max_len * config.in_flight
    total_mb = sum(training_layers(model, tokens_in_flight).memory) / 1e6
    for n in counts:
        progress(f"{n} worker(s)")
        # A budget that only n workers together can meet: the plan uses every one.
        budget = total_mb / n * 1.3 if n > 1 else total_mb * 2
        master = TuneMaster(model, derive_key(SECRET), config, max_len, "127.0.0.1", 0, expect=n, wait_s=300)
        procs = [start_worker(master.port, f"w{i}", budget, threads=threads) for i in range(n)]
        records = []
        try:
            master.run(Tuner(config, examples, [], sha, None, on_step=records.append).run(master.restart))
            memory = [WorkerMemory(s.worker.name, f"{s.first}-{s.end - 1}", s.loaded.frozen_bytes / 1e6,
                                   s.stats.peak_rss_mb if s.stats else 0.0, s.loaded.load_peak_rss_mb)
                      for s in master.stages]
        finally:
            with contextlib.suppress(Exception):
                master.close()
            for p in procs:
                p.kill()
                p.wait()
        steps_s, tokens_s = _timed(records)
        rows.append(TuneRow(n, steps_s, tokens_s, tokens_s / single, memory))
        time.sleep(0.5)  # the killed workers' memory is returned before the next row starts
    return rows


def tune_table(rows: Sequence[TuneRow], config: TuneConfig, threads: int) -> str:
    lines = [f"LoRA rank {config.lora.rank} on {','.join(t.value for t in config.lora.targets)}, steps of "
             f"{config.micro_batches} x {config.micro_size} sequences, {config.in_flight} in flight, {threads} "
             "thread(s) per process",
             *text_table(TUNE_COLUMNS, rows)]
    return "\n".join(lines)


TUNE_COLUMNS: tuple[Column[TuneRow], ...] = (
    Column("workers", lambda r: "single" if r.workers == 0 else str(r.workers), width=8),
    Column("steps/s", lambda r: r.steps_per_s, ".3f", width=8),
    Column("tok/s", lambda r: r.tokens_per_s, ".1f", width=8),
    Column("x single", lambda r: r.ratio_to_single, ".2f"),
    Column(" memory per worker (layers: frozen MB, peak RSS MB training / loading)", lambda r: " " + "; ".join(
        f"{m.name} {m.layers}: {m.frozen_mb:.0f}, {m.peak_rss_mb:.0f} / {m.load_peak_rss_mb:.0f}" for m in r.memory),
        left=True),
)
