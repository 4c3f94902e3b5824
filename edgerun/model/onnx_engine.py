"""Single-node generation with onnxruntime: the fast path, and each node's speed reference."""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from edgerun.model.loader import Model
from edgerun.model.onnx_graph import Activations, StageSpec, cached_stage
from edgerun.model.session import StageSession
from edgerun.model.weights import embed_rows


class OnnxEngine:
    """The whole model as one onnxruntime graph; KV buffers live in onnxruntime and are updated in place."""

    name = "onnx"

    def __init__(self, model: Model, max_len: int, threads: int | None = None,
                 activations: Activations = Activations.INT8) -> None:
        self.model = model
        self.config = model.config
        self.max_len = max_len
        self.activations = activations
        spec = StageSpec(0, model.config.n_layers, lm_head=True, accuracy_level=activations.accuracy_level)
        graph_dir = cached_stage(model.path, model.config, model.weights, spec)
        self.weight_bytes = int(json.loads((graph_dir / "meta.json").read_text())["weight_bytes"])
        self.stage = StageSession(graph_dir, model.config, 0, model.config.n_layers, max_len, threads)

    @property
    def position(self) -> int:
        return self.stage.position

    def reset(self) -> None:
        self.stage.reset()

    def release(self) -> None:
        """Nothing to let go of between requests."""

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        """Run tokens after those already seen; return the last token's logits, (vocab,)."""
        hidden = embed_rows(self.config, self.model.weights, tokens)[None]
        return self.stage.run(hidden)[0, 0]
