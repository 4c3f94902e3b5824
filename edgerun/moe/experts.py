"""Experts as a hub hands them out and a worker runs them.

An expert travels as a blob named by its sha256: its three matrices' quantized bytes, exactly as the model file
stores them, in an .npz with their types and shapes (read back without pickle). A worker keeps the blobs it
fetched in its cache, so a restart or a re-placement that gives it an expert it held before costs nothing.

A worker runs each expert it holds as one small onnxruntime graph over the quantized weights (the same kernels
as every other engine): gates * SwiGLU(x), so the hub only adds what comes back.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgerun.cache import cache_root
from edgerun.model.config import ModelConfig
from edgerun.model.onnx_graph import Activations, expert_graph
from edgerun.model.quant import QuantTensor
from edgerun.model.session import session_options
from edgerun.model.weights import ExpertWeights, ModelWeights

MATRICES = ("w_gate", "w_up", "w_down")


def expert_blob(expert: ExpertWeights) -> bytes:
    """The expert's matrices as stored, in one .npz."""
    arrays = {name: np.ascontiguousarray(getattr(expert, name).raw) for name in MATRICES}
    meta = {name: {"qtype": getattr(expert, name).qtype, "shape": list(getattr(expert, name).shape)}
            for name in MATRICES}
    buffer = io.BytesIO()
    np.savez(buffer, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    return buffer.getvalue()


def read_expert_blob(data: bytes) -> ExpertWeights:
    """An expert from its blob; ValueError for anything that is not one."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            meta = json.loads(npz["meta"].tobytes())
            return ExpertWeights(*(QuantTensor(meta[name]["qtype"], tuple(meta[name]["shape"]), npz[name])
                                   for name in MATRICES))
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not an expert blob: {e}") from e


def expert_blobs(weights: ModelWeights) -> dict[tuple[int, int], tuple[str, bytes]]:
    """Every (layer, expert)'s sha256 and blob."""
    blobs = {}
    for layer, w in enumerate(weights.layers):
        if w.moe is None:
            continue
        for e, expert in enumerate(w.moe.experts):
            blob = expert_blob(expert)
            blobs[(layer, e)] = (hashlib.sha256(blob).hexdigest(), blob)
    return blobs


def blob_dir() -> Path:
    return cache_root() / "moe" / "experts"


class ExpertRunner:
    """The experts one worker holds, each an onnxruntime session."""

    def __init__(self, config: ModelConfig, threads: int | None = 1,
                 activations: Activations = Activations.F32) -> None:
        self.config, self.threads, self.activations = config, threads, activations
        self.sessions: dict[tuple[int, int], ort.InferenceSession] = {}

    def load(self, layer: int, expert: int, weights: ExpertWeights) -> None:
        build = Path(tempfile.mkdtemp(prefix="expert-", dir=cache_root()))
        try:
            path = build / "expert.onnx"
            expert_graph(self.config, weights, path, self.activations.accuracy_level)
            self.sessions[(layer, expert)] = ort.InferenceSession(str(path), session_options(self.threads),
                                                                  providers=["CPUExecutionProvider"])
        finally:
            shutil.rmtree(build, ignore_errors=True)

    def keep_only(self, wanted: set[tuple[int, int]]) -> None:
        for key in set(self.sessions) - wanted:
            del self.sessions[key]

    def run(self, layer: int, expert: int, x: np.ndarray, gates: np.ndarray) -> np.ndarray:
        """gates[t] * expert(x[t]) for each token t: (tokens, hidden)."""
        session = self.sessions.get((layer, expert))
        if session is None:
            raise KeyError(f"expert {expert} of layer {layer} is not held here")
        feeds = {"hidden": np.ascontiguousarray(x, np.float32)[None],
                 "gates": np.ascontiguousarray(gates, np.float32).reshape(1, -1, 1)}
        return session.run(None, feeds)[0][0]
