"""The generation loop, shared by every engine that turns tokens into next-token logits."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.config import ModelConfig
from edgerun.model.sampling import Sampler

if TYPE_CHECKING:  # the GGUF reader and the numpy model load with a model, not with this module (every command's
    # parser reads ENGINES from it)
    from edgerun.model.loader import Model
    from edgerun.model.reference import KVCache

# "ggml" computes on llama.cpp's kernel library, the file's blocks as stored and activations quantized per block as
# llama.cpp quantizes them (its answers are llama.cpp's); "onnx" quantizes activations to int8 inside MatMulNBits
# (Activations.INT8: fast, close to but not bit-close to numpy); "onnx-f32" keeps them float32 (what the numpy
# reference computes, to rounding).
ENGINES = ("ggml", "numpy", "onnx", "onnx-f32")
DEFAULT_ENGINE = "ggml"


class Stepper(Protocol):
    """What the generation loop drives: a KV cache of max_len positions, reset (a prefill from position 0
    follows), a step that runs tokens after those already seen and returns the last one's next-token logits,
    and release at the end of a request."""

    @property
    def max_len(self) -> int: ...

    def reset(self) -> None: ...

    def step(self, tokens: Sequence[int]) -> np.ndarray: ...

    def release(self) -> None: ...


@runtime_checkable
class TokenStepper(Protocol):
    """An engine that samples where the logits are (a pipeline's last stage): its step returns the token the
    sampler picks after `tokens`, run from position `start`."""

    @property
    def max_len(self) -> int: ...

    def reset(self) -> None: ...

    def step_token(self, tokens: Sequence[int], start: int, sampler: Sampler) -> int: ...

    def release(self) -> None: ...


class Engine(Stepper, Protocol):
    """A single-process engine."""

    name: str
    config: ModelConfig
    weight_bytes: int  # bytes of weights one decode step reads


class ReferenceEngine:
    """The numpy reference forward pass behind the Engine interface."""

    name = "numpy"

    def __init__(self, model: Model, max_len: int, group_size: int = 256) -> None:
        from edgerun.model.reference import ReferenceModel

        self.reference = ReferenceModel(model.config, model.weights, group_size)
        self.config = model.config
        self.max_len = max_len
        self.weight_bytes = self.reference.weight_bytes
        self.cache: KVCache = self.reference.new_cache(max_len)

    def reset(self) -> None:
        self.cache = self.reference.new_cache(self.max_len)

    def release(self) -> None:
        """Nothing to let go of between requests."""

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        return self.reference.forward(tokens, self.cache)


def default_engine(model: Model, activations_f32: bool = False) -> str:
    """The fastest engine that runs this model with these activations: ggml, except where it does not build
    the model (mixtures of experts, LoRA adapters) or float32 activations are asked for (onnx-f32)."""
    if activations_f32:
        return "onnx-f32"
    from edgerun.model.ggml_engine import unsupported

    return "onnx" if unsupported(model) else "ggml"


def make_engine(kind: str, model: Model, max_len: int, threads: int | None = None, device: str = "cpu",
                slots: int = 1) -> Engine:
    """An engine of this kind; `device` "cuda" runs ggml's CUDA backend, `slots` > 1 holds that many sequences'
    caches for batched decoding (the ggml engine only, both)."""
    if device != "cpu" and kind != "ggml":
        raise EdgerunError(f"--device {device} runs the ggml engine, not {kind}")
    if slots > 1 and kind != "ggml":
        raise EdgerunError(f"batched decoding (--parallel) runs on the ggml engine, not {kind}")
    if kind == "numpy":
        return ReferenceEngine(model, max_len)
    if kind == "ggml":
        from edgerun.model.ggml_engine import GgmlEngine

        return GgmlEngine(model, max_len, threads=threads, device=device, slots=slots)
    if kind in ("onnx", "onnx-f32"):
        from edgerun.model.onnx_engine import OnnxEngine
        from edgerun.model.onnx_graph import Activations

        return OnnxEngine(model, max_len, threads=threads,
                          activations=Activations.F32 if kind == "onnx-f32" else Activations.INT8)
    raise EdgerunError(f"unknown engine {kind!r} (choose from {', '.join(ENGINES)})")


class StopReason(Enum):
    STOP_TOKEN = "stop_token"  # the model ended its answer
    MAX_TOKENS = "max_tokens"
    CANCELLED = "cancelled"  # the caller asked to stop (a client went away, a stop string appeared)


class EngineLost(Exception):
    """An engine lost part of itself mid-step (a node died). After `engine.recover()` the generation loop
    prefills the prompt and the tokens so far again and goes on: with a position-seeded sampler the tokens
    are those an undisturbed run gives."""


@dataclass(frozen=True)
class GenerationResult:
    prompt_tokens: int
    tokens: list[int]
    stop_reason: StopReason
    prefill_s: float
    decode_s: float  # time for every token after the first
    recoveries: int = 0

    @property
    def decode_tok_s(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if len(self.tokens) > 1 and self.decode_s > 0 else 0.0


@dataclass
class Generation:
    """One sequence's answer as the generation loop makes it: the tokens taken so far, and why it ended. Both
    loops (generate's, one sequence at a time on any engine, and BatchLoop's, several on one engine) take their
    sampled tokens through `take`, so a sequence ends alike in either."""

    prompt: Sequence[int]
    max_tokens: int
    sampler: Sampler
    stop_ids: frozenset[int] = frozenset()
    on_token: Callable[[int], None] | None = None
    cancelled: Callable[[], bool] = lambda: False
    tokens: list[int] = field(default_factory=list)
    reason: StopReason | None = None

    def check(self, max_len: int) -> None:
        """One line for a request the engine cannot run."""
        if not self.prompt:
            raise EdgerunError("the prompt is empty")
        if self.max_tokens < 1:
            raise EdgerunError("max tokens must be at least 1")
        if len(self.prompt) + self.max_tokens > max_len:
            raise EdgerunError(f"prompt ({len(self.prompt)} tokens) plus --max-tokens {self.max_tokens} exceeds the "
                               f"context of {max_len} tokens")

    def take(self, token: int) -> bool:
        """The token sampled next: whether the sequence goes on (else `reason` says why it ended)."""
        if token in self.stop_ids:
            self.reason = StopReason.STOP_TOKEN
            return False
        self.tokens.append(token)
        if self.on_token:
            self.on_token(token)
        if len(self.tokens) >= self.max_tokens:
            self.reason = StopReason.MAX_TOKENS
            return False
        if self.cancelled():
            self.reason = StopReason.CANCELLED
            return False
        return True

    @property
    def position(self) -> int:
        """The position of the last token taken: the next step's input."""
        return len(self.prompt) + len(self.tokens) - 1


def generate(engine: Stepper | TokenStepper, prompt: Sequence[int], max_tokens: int, sampler: Sampler,
             stop_ids: frozenset[int] = frozenset(), on_token: Callable[[int], None] | None = None,
             cancelled: Callable[[], bool] = lambda: False) -> GenerationResult:
    """Prefill the prompt, then sample up to max_tokens tokens; the engine starts fresh. The one generation
    loop of every engine: the single-process ones, a tensor-parallel master, a pipeline (which samples at its
    last stage) and `edgerun serve`'s switch between them (BatchLoop runs several sequences on one engine).
    `cancelled` is asked before every step; an engine that raises EngineLost is recovered and re-prefilled."""
    gen = Generation(prompt, max_tokens, sampler, stop_ids, on_token, cancelled)
    gen.check(engine.max_len)
    if isinstance(engine, TokenStepper):
        def next_token(tokens: list[int], start: int) -> int:
            return engine.step_token(tokens, start, sampler)
    else:
        def next_token(tokens: list[int], start: int) -> int:
            return sampler(engine.step(tokens), start + len(tokens))

    recoveries = 0
    start = time.perf_counter()
    prefill_s = 0.0
    decode_start = start
    try:
        while True:
            try:
                engine.reset()
                token = next_token(list(prompt) + gen.tokens, 0)
                if not gen.tokens:
                    prefill_s = time.perf_counter() - start
                    decode_start = time.perf_counter()
                while gen.take(token):
                    token = next_token([token], gen.position)
                assert gen.reason is not None
                return GenerationResult(len(prompt), gen.tokens, gen.reason, prefill_s,
                                        time.perf_counter() - decode_start, recoveries)
            except EngineLost as lost:
                recoveries += 1
                engine.recover(lost)  # type: ignore[union-attr]  # only engines that can lose a part raise it
    finally:
        engine.release()
