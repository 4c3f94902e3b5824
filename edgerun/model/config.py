"""The shape of a Llama-family model, read from the model file's metadata."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Architectures the forward pass implements. Qwen2 is Llama with biases on Q, K and V.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


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

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def heads_per_kv(self) -> int:
        return self.n_heads // self.n_kv_heads

    def n_params(self) -> int:
        """Parameter count including embeddings (the LM head counted once when tied)."""
        h, f = self.hidden, self.ffn
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.qkv_bias:
            attn += self.q_dim + 2 * self.kv_dim
        layer = attn + 3 * h * f + 2 * h
        embed = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        return self.n_layers * layer + embed + h

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
