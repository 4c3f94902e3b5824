"""Experts as a hub hands them out and a worker runs them.

An expert travels as a blob named by its sha256: its three matrices' quantized bytes, exactly as the model file
stores them, in an .npz with their types and shapes (read back without pickle). A worker keeps the blobs it
fetched in its cache, so a restart or a re-placement that gives it an expert it held before costs nothing.

A worker runs each expert it holds as one small graph over the quantized weights, gates * SwiGLU(x), so the hub
only adds what comes back: on ggml, llama.cpp's kernels, with int8 activations (the default, GgmlExperts), or as
an onnxruntime session with float32 ones (ExpertRunner), as the other engines split their work.
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
from edgerun.model import ggml_lib, kernels
from edgerun.model.config import ModelConfig
from edgerun.model.ggml_engine import mlp_block
from edgerun.model.ggml_lib import GgmlBackend, GraphContext, ScratchAllocator, WeightStore
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


def expert_runner(config: ModelConfig, threads: int | None, activations: Activations) -> ExpertRunner | GgmlExperts:
    """The runner for experts computed with these activations: ggml's for int8, onnxruntime's for float32."""
    if activations is Activations.INT8:
        return GgmlExperts(config, threads)
    return ExpertRunner(config, threads, activations)


class GgmlExperts:
    """The experts one worker holds on ggml's CPU backend, each its three matrices as the file stores them; a graph
    per expert and token count (one-token graphs kept)."""

    activations = Activations.INT8

    def __init__(self, config: ModelConfig, threads: int | None = 1) -> None:
        self.config, self.threads = config, threads
        self.backend = GgmlBackend(threads)
        self.experts: dict[tuple[int, int], tuple[WeightStore, tuple[int, int, int]]] = {}
        self._graphs: dict[tuple[int, int, int], _ExpertGraph] = {}
        self._scratch = ScratchAllocator(self.backend)

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self.experts

    def load(self, layer: int, expert: int, weights: ExpertWeights) -> None:
        store = WeightStore(self.backend)
        handles = tuple(store.add(f"{layer}.{expert}.{name}", getattr(weights, name)) for name in MATRICES)
        store.upload()
        self.experts[(layer, expert)] = (store, handles)

    def keep_only(self, wanted: set[tuple[int, int]]) -> None:
        for key in set(self.experts) - wanted:
            del self.experts[key]
        self._graphs = {k: g for k, g in self._graphs.items() if k[:2] in wanted}

    def run(self, layer: int, expert: int, x: np.ndarray, gates: np.ndarray) -> np.ndarray:
        """gates[t] * expert(x[t]) for each token t: (tokens, hidden)."""
        held = self.experts.get((layer, expert))
        if held is None:
            raise KeyError(f"expert {expert} of layer {layer} is not held here")
        x = np.ascontiguousarray(x, np.float32).reshape(-1, self.config.hidden)
        key = (layer, expert, x.shape[0])
        graph = self._graphs.get(key)
        if graph is None:
            # One-token graphs are kept; a prompt's come in every size and are laid out in the scratch buffer.
            keep = x.shape[0] == 1
            graph = _ExpertGraph(self.backend, self.config.hidden, held, x.shape[0], None if keep else self._scratch)
            if keep:
                self._graphs[key] = graph
        return graph.run(x, np.ascontiguousarray(gates, np.float32).reshape(-1))


class _ExpertGraph:
    def __init__(self, backend: GgmlBackend, hidden: int, held: tuple[WeightStore, tuple[int, int, int]],
                 n: int, scratch: ScratchAllocator | None) -> None:
        g = ggml_lib.lib()
        store, (w_gate, w_up, w_down) = held
        self.gc = GraphContext(backend, 16)
        self.x = self.gc.input(ggml_lib.F32, hidden, n)
        self.gates = self.gc.input(ggml_lib.F32, 1, n)
        # a dispatch's tokens are whichever chose the expert (of one prompt or of a batch's sequences): each token's
        # output as it is alone, whatever the weights' type (kernels.each_column_alone)
        with kernels.each_column_alone():
            y = mlp_block(self.gc.ctx, store.tensor, w_gate, w_up, w_down, self.x)
        self.out = g.ggml_mul(self.gc.ctx, y, self.gates)  # each token's column by its gate
        self.gc.expand(self.out)
        self.gc.allocate(scratch)
        self.shape = (n, hidden)

    def run(self, x: np.ndarray, gates: np.ndarray) -> np.ndarray:
        self.gc.set(self.x, x)
        self.gc.set(self.gates, gates)
        self.gc.compute()
        return self.gc.get(self.out, np.empty(self.shape, np.float32))


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

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self.sessions

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
