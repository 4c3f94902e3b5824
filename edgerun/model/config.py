"""The shape of a Llama-family model, read from the model file's metadata."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Architectures the forward pass implements. Qwen2 is Llama with biases on Q, K and V. The mixture-of-experts
# ones: "qwen3moe" (RMS norms on each head's queries and keys, top-k routing with renormalized gates), "qwen2moe"
# (Qwen2's biases, gates not renormalized, a shared expert scaled by its own sigmoid gate), and "llama" files
# carrying experts (Mixtral: renormalized gates).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen2moe", "qwen3moe")
MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe")


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
    qk_norm: bool = False  # qwen3moe: RMS norm over each head's query and key before RoPE

    def __post_init__(self) -> None:
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

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

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
        layer = attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.n_layers * layer + embed + h

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def kv_names(layer: int) -> tuple[str, str, str, str]:
    """A layer's KV cache inputs and outputs in every graph (stages, the whole model)."""
    return f"past_key_{layer}", f"past_value_{layer}", f"present_key_{layer}", f"present_value_{layer}"
