"""A pipeline worker's training role: what `edgerun node --mode pp` does with the TUNE_* messages.

The master names its model file by sha256; the worker fetches it once over HTTP into its cache (or finds it
there), memory-maps it and builds its stage's layers in their quantized form. PyTorch is imported only when a
worker is first given a training stage, so an inference-only worker never needs it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.memory import peak_rss_mb, release_mapped_files, reset_peak_rss
from edgerun.net.model_files import fetch_model
from edgerun.net.wire import PpMsg
from edgerun.pp.worker import Reply


def require_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise EdgerunError("tuning needs PyTorch: pip install torch==2.13.0 (the CPU build), or "
                           "pip install 'edgerun[tune]'") from None


class TuneRole:
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

    def handle(self, kind: PpMsg, message: dict[str, Any], tensors: dict[str, np.ndarray]) -> Reply:
        """Carry out one TUNE_* request (on a pool thread: it computes for seconds); its reply."""
        if kind == PpMsg.TUNE_LOAD:
            return self._load(message, tensors)
        t = self.trainer
        if t is None:
            raise ValueError("no training stage loaded")
        if kind == PpMsg.TUNE_FORWARD:
            key = (int(message["step"]), int(message["micro"]))
            if t.model.is_last:
                loss, count, grad = t.forward_loss(tensors["input"], tensors["labels"], key,
                                                   int(message["denominator"]))
                return PpMsg.TUNE_OUTPUT, {"loss": loss, "count": count}, {} if grad is None else {"grad": grad}
            return PpMsg.TUNE_OUTPUT, {}, {"hidden": t.forward(int(message["micro"]), tensors["input"], key)}
        if kind == PpMsg.TUNE_BACKWARD:
            grad = t.backward(int(message["micro"]), tensors["grad"])
            return PpMsg.TUNE_GRAD, {}, {} if grad is None else {"grad": grad}
        if kind == PpMsg.TUNE_EVAL:
            out, loss, count = t.eval_loss(tensors["input"], tensors.get("labels"))
            return PpMsg.TUNE_OUTPUT, {"loss": loss, "count": count}, {} if out is None else {"hidden": out}
        if kind == PpMsg.TUNE_STEP:
            t.step(float(message["lr"]))
            return PpMsg.TUNE_STEPPED, {"compute_s": t.compute_s, "peak_rss_mb": peak_rss_mb()}, {}
        if kind == PpMsg.TUNE_STATE:
            state, steps = t.state()
            return PpMsg.TUNE_STATE_DATA, {"steps": steps}, state
        raise ValueError(f"{kind.name} is not a tuning request")

    def _load(self, message: dict[str, Any], tensors: dict[str, np.ndarray]) -> Reply:
        require_torch()
        import torch

        from edgerun.tune.lora import LoraConfig
        from edgerun.tune.stage import OptimConfig, StageTrainer

        if self.threads:
            torch.set_num_threads(self.threads)
        model = self._model(str(message["model_sha256"]))
        first, end = int(message["first_layer"]), int(message["end_layer"])
        self.trainer = None  # the old stage's memory goes first
        self.trainer = StageTrainer(model.config, model.weights, first, end,
                                    LoraConfig.from_dict(message["lora"]), OptimConfig(**message["optim"]),
                                    recompute=bool(message.get("recompute", False)))
        if tensors:
            self.trainer.load_state(tensors, int(message.get("steps", 0)))
        # The stage copied its layers' codes out of the file: the file's pages it read on the way go, and the peak
        # starts from what the stage holds. (glibc's thresholds stay as they are: fixed ones, as tensor-parallel
        # nodes set, make every tensor of a step a fresh mmap, zeroed page by page: 2.9x slower steps.)
        load_peak = peak_rss_mb()
        release_mapped_files([model.path])
        reset_peak_rss()
        self.log(f"training layers {first}-{end - 1}{' and the LM head' if end == model.config.n_layers else ''}")
        return PpMsg.TUNE_LOADED, {"frozen_bytes": self.trainer.model.frozen_bytes(), "load_peak_rss_mb": load_peak,
                                   "rss_mb": peak_rss_mb()}, {}

    async def answer(self, kind: PpMsg, message: dict[str, Any], tensors: dict[str, np.ndarray]) -> Reply:
        return await asyncio.get_running_loop().run_in_executor(self.executor, self.handle, kind, message, tensors)
