"""What a tensor-parallel cluster's kernels alone allow on this machine (`edgerun bench tp --ceiling`).

Each device's even share of the model (tp.shard.split_spec) runs in a process of its own, a prompt and then
one-token steps of every block, and every block starts on all of them at once, as in a cluster: a barrier in shared
memory stands for the master's input, with no network, no master's sends or sums, nothing but the kernels. A block
lasts as long as its slowest device's kernel, so the ceiling's time per token (and the prompt's), summed over the
blocks, is the slowest device's time in each. Beside a cluster row, the cluster's time over the ceiling's is what
synchronization costs; the ceiling over the single engine is what the machine gives the kernels: devices of one
host share its memory bandwidth, and blocks that stream their weights at the same moment on every device contend
for it at once.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.synchronize
import os
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgerun.tp.trace import BLOCK_KINDS, HEAD

BARRIER_TIMEOUT_S = 120.0  # a device that has not reached a block by then has died or hangs
RESULT_TIMEOUT_S = 900.0  # building the shares and running the steps
WARMUP_TOKENS = 2  # untimed steps before the timed ones (each block's first run allocates)
WARMUP_PROMPTS = 1  # untimed prompts before the timed one, likewise


@dataclass(frozen=True)
class Ceiling:
    devices: int  # run in step (of a split over as many, or more where only some were run)
    tokens: int  # one-token steps timed
    decode_ms_per_token: float  # over the blocks, the slowest device's kernel in each, summed
    device_ms_per_token: tuple[float, ...]  # each device's own kernels per token
    prompt: int = 0  # tokens of the prompt timed (0: none)
    prefill_ms: float = float("nan")  # the prompt's blocks, the slowest device's kernel in each, summed
    # A one-token block of each kind (attention, MLP, LM head: trace.BLOCK_KINDS), the slowest device's kernel in it,
    # in microseconds, the mean over the layers and steps: what a cluster's block of that kind takes beyond it is
    # its synchronization (bench tp --trace --ceiling)
    block_us: tuple[tuple[str, float], ...] = ()

    def ms_per_token(self, tokens: int) -> float:
        """A request of the prompt and `tokens` tokens as a benchmark times one (bench.single.RequestTiming): its
        prefill gives the first token, one-token steps the others, and the whole is spread over the tokens."""
        return (self.prefill_ms + (tokens - 1) * self.decode_ms_per_token) / tokens


class _Barrier:
    """All `parties` processes wait at each call until every one has made as many calls. A spin on a shared
    counter: a block is a few hundred microseconds, and a process woken from a sleep takes longer than that on
    some machines."""

    def __init__(self, parties: int, arrived: object, lock: multiprocessing.synchronize.Lock) -> None:
        self.parties, self.arrived, self.lock, self.calls = parties, arrived, lock, 0

    def wait(self) -> None:
        self.calls += 1
        with self.lock:
            self.arrived.value += 1  # type: ignore[attr-defined]
        target = self.parties * self.calls
        deadline = time.monotonic() + BARRIER_TIMEOUT_S
        while self.arrived.value < target:  # type: ignore[attr-defined]
            if time.monotonic() > deadline:
                raise TimeoutError("a device of the kernel ceiling did not reach its next block")


def _device(model_path: Path | None, devices: int, index: int, parties: int, threads: int, activations: str,
            tokens: int, prompt: int, context: int, cores: set[int] | None, arrived: object,
            lock: multiprocessing.synchronize.Lock, results: mp.Queue) -> None:
    """One device of `devices`: build its share, run the prompts and then the steps in step with the other
    `parties` - 1 processes, put (index, per-block seconds of the one-token steps, of the timed prompt)."""
    try:
        from threadpoolctl import threadpool_limits

        from edgerun.model.loader import load_model
        from edgerun.model.onnx_graph import Activations
        from edgerun.net.wire import Block
        from edgerun.tp.ggml_shard import build_share
        from edgerun.tp.shard import split_spec

        if cores is not None:
            os.sched_setaffinity(0, cores)
        model = load_model(model_path)
        c = model.config
        with threadpool_limits(threads):
            # the share a static cluster's node builds: ggml's with int8 activations, onnxruntime's with float32
            share = build_share(c, model.weights, split_spec(c, devices)[index], context, threads,
                                Activations(activations), mapped_files=[model.path])
            rows = np.random.default_rng(index).standard_normal((max(prompt, 1), c.hidden)).astype(np.float32)
            barrier = _Barrier(parties, arrived, lock)
            blocks = [(layer, block) for layer in range(c.n_layers) for block in (Block.ATTN, Block.MLP)]
            blocks.append((c.n_layers, Block.HEAD))

            def step(x: np.ndarray, position: int) -> list[float]:
                """Every block of one step in step with the others: each one's seconds."""
                seconds = []
                for layer, block in blocks:
                    barrier.wait()
                    started = time.perf_counter()
                    if block == Block.ATTN:
                        share.attention(layer, x, position)
                    elif block == Block.MLP:
                        share.mlp(layer, x)
                    else:
                        share.logits(x[-1:])  # the last token's logits, as a cluster's master asks for
                    seconds.append(time.perf_counter() - started)
                return seconds

            prefill: list[float] = []
            for _ in range(WARMUP_PROMPTS + 1 if prompt else 0):
                prefill = step(rows[:prompt], 0)  # each prompt anew from position 0; the last one's times are kept
            decode: list[float] = []
            for i in range(WARMUP_TOKENS + tokens):
                seconds = step(rows[:1], prompt + i)
                if i >= WARMUP_TOKENS:
                    decode += seconds
        results.put((index, (decode, prefill)))
    except BaseException as e:  # the parent reports it; the others time out at their next barrier
        results.put((index, f"{type(e).__name__}: {e}"))


def _gather(procs: list[mp.Process], which: list[int], results: mp.Queue
            ) -> dict[int, tuple[list[float], list[float]]]:
    """Each device's per-block seconds (one-token steps, prompt); an error for a device that failed or died
    without a word."""
    per_device: dict[int, tuple[list[float], list[float]]] = {}
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while len(per_device) < len(procs):
        try:
            index, seconds = results.get(timeout=0.5)
        except queue.Empty:
            dead = [i for i, p in zip(which, procs, strict=True) if p.exitcode is not None and i not in per_device]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"the kernel ceiling's device {dead[0]} ended without a result" if dead else
                                   "the kernel ceiling's devices did not finish in time") from None
            continue
        if isinstance(seconds, str):
            raise RuntimeError(f"the kernel ceiling's device {index} failed: {seconds}")
        per_device[index] = seconds
    return per_device


def kernel_ceiling(model_path: Path | None, devices: int, threads: int, activations: str, tokens: int,
                   context: int, cores: list[set[int] | None] | None = None,
                   which: Sequence[int] | None = None, prompt: int = 0) -> Ceiling:
    """The kernels-only decode time per token of `devices` even shares run in step (see the module's doc), and
    with `prompt` the time of a prompt of so many tokens before it: of the devices in `which` only, where given
    (device 0's share by itself: the split's own cost without the others' contention). `cores[i]`, where given,
    is device i's CPU affinity."""
    which = list(range(devices)) if which is None else list(which)
    if devices < 1 or tokens < 1 or not which or any(not 0 <= i < devices for i in which):
        raise ValueError("a kernel ceiling needs at least one device of the split and one token")
    if prompt < 0 or prompt + WARMUP_TOKENS + tokens > context:
        raise ValueError(f"a prompt of {prompt} and {WARMUP_TOKENS + tokens} steps do not fit a context of {context}")
    ctx = mp.get_context("spawn")  # a fresh interpreter per device, as a node process is
    arrived, lock, results = ctx.RawValue("q", 0), ctx.Lock(), ctx.Queue()
    procs = [ctx.Process(target=_device, daemon=True,
                         args=(model_path, devices, i, len(which), threads, activations, tokens, prompt, context,
                               None if cores is None else cores[i], arrived, lock, results))
             for i in which]
    for p in procs:
        p.start()
    try:
        per_device = _gather(procs, which, results)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    blocks = np.array([per_device[i][0] for i in which])  # (devices run, tokens * blocks a token)
    prefill = np.array([per_device[i][1] for i in which])  # (devices run, blocks a token), empty without a prompt
    return Ceiling(len(which), tokens, float(blocks.max(axis=0).sum() / tokens * 1e3),
                   tuple(float(s) for s in blocks.sum(axis=1) / tokens * 1e3), prompt,
                   float(prefill.max(axis=0).sum() * 1e3) if prompt else float("nan"),
                   block_kinds_us(blocks.max(axis=0).reshape(tokens, -1)))


def block_kinds_us(in_step: np.ndarray) -> tuple[tuple[str, float], ...]:
    """(tokens, blocks a token) seconds, each layer's attention and MLP blocks and then the LM head (the order
    `_device` runs them in): each kind's mean in microseconds."""
    columns = {BLOCK_KINDS[0]: in_step[:, 0:-1:2], BLOCK_KINDS[1]: in_step[:, 1:-1:2],
               BLOCK_KINDS[HEAD]: in_step[:, -1:]}
    return tuple((kind, float(c.mean() * 1e6)) for kind, c in columns.items())
