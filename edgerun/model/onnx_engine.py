"""Single-node generation with onnxruntime: the fast path, and each node's speed reference."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgerun.model.loader import Model
from edgerun.model.onnx_graph import StageSpec, cached_stage, kv_names


def session_options(threads: int | None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    if threads:
        so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return so


class OnnxEngine:
    """The whole model as one onnxruntime graph; KV buffers live in onnxruntime and are updated in place."""

    name = "onnx"

    def __init__(self, model: Model, max_len: int, threads: int | None = None, accuracy_level: int = 0) -> None:
        self.model = model
        self.config = model.config
        self.max_len = max_len
        spec = StageSpec(0, model.config.n_layers, lm_head=True, accuracy_level=accuracy_level)
        graph_dir = cached_stage(model.path, model.config, model.weights, spec)
        self.weight_bytes = int(json.loads((graph_dir / "meta.json").read_text())["weight_bytes"])
        self.session = ort.InferenceSession(str(Path(graph_dir) / "model.onnx"), session_options(threads),
                                            providers=["CPUExecutionProvider"])
        self.reset()

    def reset(self) -> None:
        c = self.config
        self.position = 0
        shape = (1, c.n_kv_heads, self.max_len, c.head_dim)
        self.binding = self.session.io_binding()
        self.binding.bind_output("logits")  # first, so it is output 0
        for i in range(c.n_layers):
            past_k, past_v, present_k, present_v = kv_names(i)
            for past, present in ((past_k, present_k), (past_v, present_v)):
                buffer = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))
                # One buffer as both past and present: the attention kernel appends in place.
                self.binding.bind_ortvalue_input(past, buffer)
                self.binding.bind_ortvalue_output(present, buffer)

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        """Run tokens after those already seen; return the last token's logits, (vocab,)."""
        total = self.position + len(tokens)
        if total > self.max_len:
            raise ValueError(f"context of {self.max_len} tokens exceeded")
        hidden = self.model.weights.token_embd.dequantize_rows(np.asarray(tokens, np.int64))[None]
        self.binding.bind_cpu_input("hidden", np.ascontiguousarray(hidden, np.float32))
        self.binding.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
        self.binding.bind_cpu_input("total_seq_len", np.array(total, np.int32))
        self.session.run_with_iobinding(self.binding)
        self.position = total
        # A copy: onnxruntime reuses the output buffer on the next run.
        return self.binding.get_outputs()[0].numpy()[0, 0].copy()
