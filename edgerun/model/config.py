"""The shape of a Llama-family model, read from the model file's metadata."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import StrEnum

# Architectures the forward pass implements, each a Llama block with some of the switches below. Qwen2 is Llama
# with biases on Q, K and V; Qwen3 adds an RMS norm over each head's queries and keys; Phi-3 is Llama whose files
# fuse Q, K and V into one matrix and gate and up into another (split on load); Gemma 3 scales the embedding by
# sqrt(hidden), normalizes each head's queries and keys, normalizes the attention's and the MLP's outputs again
# before adding them, gates with GELU (tanh approximation), and attends within a sliding window in five layers of
# every six (with their own RoPE base). Llama 3.1/3.2 files carry RoPE frequency factors (ModelWeights.rope_freqs).
# The mixture-of-experts ones: "qwen3moe" (query/key norms, top-k routing with renormalized gates), "qwen2moe"
# (Qwen2's biases, gates not renormalized, a shared expert scaled by its own sigmoid gate), and "llama" files
# carrying experts (Mixtral: renormalized gates).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3", "qwen2moe", "qwen3moe")
MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe")


class Activation(StrEnum):
    """The MLP's gate: act(x . gate) * (x . up)."""

    SILU = "silu"  # SwiGLU (Llama, Qwen, Phi)
    GELU_TANH = "gelu_tanh"  # GeGLU with GELU's tanh approximation (Gemma)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_base: float
    norm_eps: float
    context_length: int
    tied_embeddings: bool
    qkv_bias: bool
    # Mixture of experts (0 experts: a dense model). Every layer of an MoE model routes each token to
    # `n_experts_used` of its `n_experts` SwiGLU experts of width `expert_ffn`; `ffn` is then unused.
    n_experts: int = 0
    n_experts_used: int = 0
    expert_ffn: int = 0
    shared_expert_ffn: int = 0  # qwen2moe: an expert every token takes, scaled by sigmoid(x . its gate)
    norm_gates: bool = True  # the chosen experts' softmax weights renormalized to sum to one
    qk_norm: bool = False  # qwen3, qwen3moe, gemma3: RMS norm over each head's query and key before RoPE
    activation: Activation = Activation.SILU
    embed_scale: float = 1.0  # gemma3: sqrt(hidden), the embedding rows' factor
    post_norms: bool = False  # gemma3: RMS norms of attention's and the MLP's outputs before the residual adds
    # gemma3: layers that attend to the last `sliding_window` positions only (their own included); with a pattern
    # of n, layer i does unless i % n == n - 1 (Gemma 3: five windowed layers, then one over the whole context).
    sliding_window: int = 0
    window_pattern: int = 0
    rope_base_window: float = 10000.0  # the windowed layers' RoPE base
    # Linear RoPE scaling (Gemma 3 4B and larger: 1/8): the other layers rotate by position times this
    rope_scale: float = 1.0
    # Queries multiplied by this before attention instead of scores by 1/sqrt(head_dim) inside it (0: the latter),
    # as llama.cpp's Gemma graph does.
    query_scale: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "activation", Activation(self.activation))  # a str from a dict crosses the wire
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in ("n_layers", "hidden", "ffn", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "context_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} attention heads do not divide into {self.n_kv_heads} KV heads")
        if self.head_dim % 2:
            raise ValueError(f"head dimension {self.head_dim} must be even for RoPE")
        if self.architecture in MOE_ARCHITECTURES and not self.n_experts:
            raise ValueError(f"a {self.architecture} model needs experts (expert_count in its metadata)")
        if self.n_experts and not (0 < self.n_experts_used <= self.n_experts and self.expert_ffn > 0):
            raise ValueError(f"{self.n_experts} experts need 1 to {self.n_experts} used per token and a positive "
                             f"expert width (got {self.n_experts_used} used, width {self.expert_ffn})")

        if self.sliding_window < 0 or self.window_pattern < 0:
            raise ValueError("a sliding window and its pattern are counts of positions and layers, not negative")

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def window(self, layer: int) -> int:
        """How many positions this layer's attention reaches back, its own included (0: the whole context)."""
        if not self.sliding_window:
            return 0
        n = self.window_pattern
        return self.sliding_window if n == 0 or layer % n < n - 1 else 0

    def rope_base_of(self, layer: int) -> float:
        return self.rope_base_window if self.window(layer) else self.rope_base

    def rope_scale_of(self, layer: int) -> float:
        """The factor of positions in this layer's rotation (llama.cpp's freq_scale; windowed layers take none)."""
        return 1.0 if self.window(layer) else self.rope_scale

    def rotation_of(self, layer: int) -> tuple[float, float]:
        """This layer's rotation: (RoPE base, factor of positions). Layers of one rotation share its cos/sin tables
        (Gemma 3's windowed and global layers have two)."""
        return self.rope_base_of(layer), self.rope_scale_of(layer)

    @property
    def score_scale(self) -> float:
        """The factor of attention's scores inside the softmax (1 where the queries were scaled instead)."""
        return 1.0 if self.query_scale else 1.0 / math.sqrt(self.head_dim)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def heads_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    def kv_cache_bytes(self, positions: int) -> int:
        """The ggml engine's keys and values of `positions` positions, every layer (F16, as llama.cpp keeps them)."""
        return positions * self.kv_dim * 2 * 2 * self.n_layers

    def n_params(self) -> int:
        """Parameter count including embeddings (the LM head counted once when tied)."""
        h, f = self.hidden, self.ffn
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attn += 2 * self.head_dim
        if self.is_moe:
            mlp = self.n_experts * (h + 3 * h * self.expert_ffn)
            mlp += 3 * h * self.shared_expert_ffn + (h if self.shared_expert_ffn else 0)
        else:
            mlp = 3 * h * f
        layer = attn + mlp + (4 if self.post_norms else 2) * h
        embed = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.n_layers * layer + embed + h

    def to_dict(self) -> dict[str, object]:
        return asdict(self) | {"activation": self.activation.value}


def kv_names(layer: int) -> tuple[str, str, str, str]:
    """A layer's KV cache inputs and outputs in every graph (stages, the whole model)."""
    return f"past_key_{layer}", f"past_value_{layer}", f"present_key_{layer}", f"present_value_{layer}"
