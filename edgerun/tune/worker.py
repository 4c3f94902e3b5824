"""A pipeline worker's training role: what `edgerun node --mode pp` does with the TUNE_* messages.

The master names its model file by sha256; the worker fetches it once over HTTP into its cache (or finds it
there), memory-maps it and builds its stage's layers in their quantized form. PyTorch is imported only when a
worker is first given a training stage, so an inference-only worker never needs it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from edgerun.errors import EdgerunError
from edgerun.memory import peak_rss_mb, release_mapped_files, reset_peak_rss
from edgerun.net.model_files import fetch_model
from edgerun.tune.messages import (
    REQUESTS,
    TuneBackward,
    TuneEval,
    TuneForward,
    TuneGrad,
    TuneLoad,
    TuneLoaded,
    TuneOutput,
    TuneReply,
    TuneRequest,
    TuneState,
    TuneStateData,
    TuneStep,
    TuneStepped,
)


def require_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise EdgerunError("tuning needs PyTorch: pip install torch==2.13.0 (the CPU build), or "
                           "pip install 'edgerun[tune]'") from None


class TuneRole:
    """A pipeline worker's role for training stages (pp.worker.Role)."""

    requests = REQUESTS
    def __init__(self, base_url: str, threads: int | None, log) -> None:
        self.base_url, self.threads, self.log = base_url, threads, log
        # One thread computes every request: PyTorch's thread count (OpenMP's) is a per-thread setting, so a pool
        # of several would compute some requests with every core of the machine; and requests run in order.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tune")
        self.trainer = None  # a tune.stage.StageTrainer once loaded
        self.model_sha = ""
        self.model = None

    def _model(self, sha256: str):
        from edgerun.model.loader import load_model

        if self.model is None or self.model_sha != sha256:
            self.model, self.model_sha = load_model(fetch_model(self.base_url, sha256)), sha256
        return self.model

    def handle(self, message: TuneRequest) -> TuneReply:
        """Carry out one tuning request (on a pool thread: it computes for seconds); its reply."""
        if isinstance(message, TuneLoad):
            return self._load(message)
        t = self.trainer
        if t is None:
            raise ValueError("no training stage loaded")
        match message:
            case TuneForward(step, micro, x, labels, denominator) if t.model.is_last:
                if labels is None:
                    raise ValueError("the last stage's forward pass needs labels")
                loss, count, grad = t.forward_loss(x, labels, (step, micro), denominator)
                return TuneOutput(loss, count, grad=grad)
            case TuneForward(step, micro, x):
                return TuneOutput(hidden=t.forward(micro, x, (step, micro)))
            case TuneBackward(micro, grad):
                return TuneGrad(t.backward(micro, grad))
            case TuneEval(x, labels):
                out, loss, count = t.eval_loss(x, labels)
                return TuneOutput(loss, count, hidden=out)
            case TuneStep(lr):
                t.step(lr)
                return TuneStepped(t.compute_s, peak_rss_mb())
            case TuneState():
                state, steps = t.state()
                return TuneStateData(steps, state)
        raise ValueError(f"{type(message).__name__} is not a tuning request")

    def _load(self, message: TuneLoad) -> TuneLoaded:
        require_torch()
        import torch

        from edgerun.tune.stage import OptimConfig, StageTrainer

        if self.threads:
            torch.set_num_threads(self.threads)
        model = self._model(message.model_sha256)
        first, end = message.first_layer, message.end_layer
        self.trainer = None  # the old stage's memory goes first
        self.trainer = StageTrainer(model.config, model.weights, first, end, message.lora,
                                    OptimConfig(lr=message.lr, weight_decay=message.weight_decay),
                                    recompute=message.recompute)
        if message.checkpoint:
            self.trainer.load_state(message.checkpoint, message.steps)
        # The stage copied its layers' codes out of the file: the file's pages it read on the way go, and the peak
        # starts from what the stage holds. (glibc's thresholds stay as they are: fixed ones, as tensor-parallel
        # nodes set, make every tensor of a step a fresh mmap, zeroed page by page: 2.9x slower steps.)
        load_peak = peak_rss_mb()
        release_mapped_files([model.path])
        reset_peak_rss()
        self.log(f"training layers {first}-{end - 1}{' and the LM head' if end == model.config.n_layers else ''}")
        return TuneLoaded(self.trainer.model.frozen_bytes(), load_peak, peak_rss_mb())

    async def answer(self, message: TuneRequest) -> TuneReply:
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.handle, message)
