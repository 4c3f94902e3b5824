"""The generation loop, shared by every engine that turns tokens into next-token logits."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.config import ModelConfig
from edgerun.model.loader import Model
from edgerun.model.reference import KVCache, ReferenceModel
from edgerun.model.sampling import Sampler

# "onnx-int8" quantizes activations to int8 inside MatMulNBits: faster, no longer bit-close to numpy.
ENGINES = ("numpy", "onnx", "onnx-int8")


class Engine(Protocol):
    name: str
    config: ModelConfig
    max_len: int
    weight_bytes: int  # bytes of weights one decode step reads

    def reset(self) -> None: ...

    def step(self, tokens: Sequence[int]) -> np.ndarray: ...


class ReferenceEngine:
    """The numpy reference forward pass behind the Engine interface."""

    name = "numpy"

    def __init__(self, model: Model, max_len: int, group_size: int = 256) -> None:
        self.reference = ReferenceModel(model.config, model.weights, group_size)
        self.config = model.config
        self.max_len = max_len
        self.weight_bytes = self.reference.weight_bytes
        self.cache: KVCache = self.reference.new_cache(max_len)

    def reset(self) -> None:
        self.cache = self.reference.new_cache(self.max_len)

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        return self.reference.forward(tokens, self.cache)


def make_engine(kind: str, model: Model, max_len: int, threads: int | None = None) -> Engine:
    if kind == "numpy":
        return ReferenceEngine(model, max_len)
    if kind in ("onnx", "onnx-int8"):
        from edgerun.model.onnx_engine import OnnxEngine

        return OnnxEngine(model, max_len, threads=threads, accuracy_level=4 if kind == "onnx-int8" else 0)
    raise EdgerunError(f"unknown engine {kind!r} (choose from {', '.join(ENGINES)})")


@dataclass(frozen=True)
class GenerationResult:
    prompt_tokens: int
    tokens: list[int]
    stop_reason: str  # "stop_token" or "max_tokens"
    prefill_s: float
    decode_s: float  # time for every token after the first

    @property
    def decode_tok_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if len(self.tokens) > 1 and self.decode_s > 0 else 0.0


def generate(engine: Engine, prompt: Sequence[int], max_tokens: int, sampler: Sampler,
             stop_ids: frozenset[int] = frozenset(), on_token: Callable[[int], None] | None = None) -> GenerationResult:
    """Prefill the prompt, then sample up to max_tokens tokens; the engine starts fresh."""
    if not prompt:
        raise EdgerunError("the prompt is empty")
    if len(prompt) + max_tokens > engine.max_len:
        raise EdgerunError(f"prompt ({len(prompt)} tokens) plus --max-tokens {max_tokens} exceeds the "
                           f"context of {engine.max_len} tokens")
    engine.reset()
    start = time.perf_counter()
    logits = engine.step(prompt)
    prefill_s = time.perf_counter() - start
    tokens: list[int] = []
    stop_reason = "max_tokens"
    decode_start = time.perf_counter()
    while len(tokens) < max_tokens:
        token = sampler(logits, len(prompt) + len(tokens))
        if token in stop_ids:
            stop_reason = "stop_token"
            break
        tokens.append(token)
        if on_token:
            on_token(token)
        if len(tokens) < max_tokens:
            logits = engine.step([token])
    return GenerationResult(len(prompt), tokens, stop_reason, prefill_s, time.perf_counter() - decode_start)
