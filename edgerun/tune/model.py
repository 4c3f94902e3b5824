"""A range of a model's layers as a PyTorch module that trains LoRA adapters over frozen, quantized weights.

PyTorch (its CPU build, the optional `tune` extra) gives the autograd; nothing here differentiates by hand.
Base matrices stay in their quantized form: 4-bit codes two to a byte (8-bit codes one to a byte) with a
float32 scale and offset per block, the form the file's blocks take exactly (quant.to_affine_blocks). A
projection dequantizes its matrix when it runs and again for the backward pass, so only one float32 matrix
exists at a time, and no gradient is ever taken for it.

The arithmetic is the reference's (model/reference.py): rotate-half RoPE on Hugging Face-ordered rows, grouped
KV heads, RMSNorm, SwiGLU. Sequences are right-padded: with a causal mask no real token sees a pad, and pads
carry no label.

Dropout masks and A's initial values come from generators seeded by (seed, layer, target) and, for dropout,
the step and micro-batch: a run gives the same numbers however its layers are split into stages.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from edgerun.errors import EdgerunError
from edgerun.model import reference
from edgerun.model.config import ModelConfig
from edgerun.model.quant import AffineBlocks, QuantTensor, to_affine_blocks
from edgerun.model.weights import LayerWeights, ModelWeights, lacking
from edgerun.tune.lora import Adapter, LoraConfig, Target, tensor_name

CHUNK_VALUES = 1 << 22  # a frozen matrix is dequantized this many values at a time (16 MB of float32)
IGNORE = -100  # the label of a position whose prediction is not trained (prompt tokens, padding)


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & (2**63 - 1)


class FrozenMatrix:
    """A frozen (rows, cols) weight kept quantized; `weight()` is its float32 value."""

    def __init__(self, t: QuantTensor) -> None:
        self.shape = t.shape
        form = to_affine_blocks(t) if len(t.shape) == 2 else None
        self.dense: torch.Tensor | None = None
        if form is None:  # float types and the few without an affine form: kept as stored
            self.dense = torch.from_numpy(np.array(t.dequantize(), np.float32))
            return
        self.bits, self.block = form.bits, form.block
        self.codes = torch.from_numpy(_pack(form))
        self.scales = torch.from_numpy(np.ascontiguousarray(form.scales, np.float32))
        self.offsets = None if form.offsets is None else torch.from_numpy(np.ascontiguousarray(form.offsets,
                                                                                             np.float32))

    @property
    def nbytes(self) -> int:
        if self.dense is not None:
            return self.dense.nbytes
        return self.codes.nbytes + self.scales.nbytes + (0 if self.offsets is None else self.offsets.nbytes)

    def chunks(self) -> list[slice]:
        """Row ranges of about CHUNK_VALUES values each: a large matrix (an LM head) is dequantized a range at a
        time, so its float32 copy never exists whole."""
        rows = max(1, CHUNK_VALUES // self.shape[1])
        return [slice(r, min(r + rows, self.shape[0])) for r in range(0, self.shape[0], rows)]

    def weight(self, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """The matrix (or the given rows of it) as float32."""
        if self.dense is not None:
            return self.dense if rows is None else self.dense[rows]
        codes, scales = self.codes, self.scales
        offsets = self.offsets
        if rows is not None:
            codes, scales = codes[rows], scales[rows]
            offsets = None if offsets is None else offsets[rows]
        if self.bits == 4:
            codes = torch.stack((codes & 15, codes >> 4), dim=-1).reshape(codes.shape[0], -1)
        n, cols = codes.shape
        values = (codes.float() - 2 ** (self.bits - 1)).view(n, cols // self.block, self.block) * scales[..., None]
        if offsets is not None:
            values = values + offsets[..., None]
        return values.view(n, cols)


def _pack(form: AffineBlocks) -> np.ndarray:
    if form.bits == 4:
        return np.ascontiguousarray(form.codes[:, 0::2] | (form.codes[:, 1::2] << 4))
    return np.ascontiguousarray(form.codes)


class _FrozenLinear(torch.autograd.Function):
    """x @ W.T with W dequantized (a range of rows at a time) for the forward pass and again for the backward one,
    never stored."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, matrix: FrozenMatrix) -> torch.Tensor:  # type: ignore[override]
        ctx.matrix = matrix
        parts = matrix.chunks()
        if len(parts) == 1:
            return x @ matrix.weight().T
        return torch.cat([x @ matrix.weight(rows).T for rows in parts], dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        parts = ctx.matrix.chunks()
        if len(parts) == 1:
            return grad @ ctx.matrix.weight(), None
        out = grad[..., parts[0]] @ ctx.matrix.weight(parts[0])
        for rows in parts[1:]:
            out += grad[..., rows] @ ctx.matrix.weight(rows)
        return out, None


def frozen_linear(x: torch.Tensor, matrix: FrozenMatrix) -> torch.Tensor:
    return _FrozenLinear.apply(x, matrix)


class Projection(torch.nn.Module):
    """A frozen projection (with its bias), plus a LoRA pair when it is a target."""

    def __init__(self, weight: QuantTensor, bias: np.ndarray | None, lora: LoraConfig | None, key: tuple) -> None:
        super().__init__()
        self.matrix = FrozenMatrix(weight)
        self.bias = None if bias is None else torch.from_numpy(np.array(bias, np.float32))
        self.lora, self.key = lora, key
        if lora is not None:
            out, inp = weight.shape
            generator = torch.Generator().manual_seed(_seed(lora.seed, "A", *key))
            # PEFT's initialisation: A uniform with Kaiming's bound for a = sqrt(5), B zero, so B @ A starts at 0.
            bound = 1.0 / math.sqrt(inp)
            self.lora_A = torch.nn.Parameter(torch.rand(lora.rank, inp, generator=generator) * 2 * bound - bound)
            self.lora_B = torch.nn.Parameter(torch.zeros(out, lora.rank))

    def forward(self, x: torch.Tensor, dropout_key: tuple | None) -> torch.Tensor:
        y = frozen_linear(x, self.matrix)
        if self.bias is not None:
            y = y + self.bias
        if self.lora is None:
            return y
        h = x
        if self.lora.dropout > 0 and dropout_key is not None:
            generator = torch.Generator().manual_seed(_seed(self.lora.seed, "dropout", *self.key, *dropout_key))
            keep = torch.rand(x.shape, generator=generator) >= self.lora.dropout
            h = x * keep / (1.0 - self.lora.dropout)
        return y + (h @ self.lora_A.T) @ self.lora_B.T * self.lora.scale


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); pairs (i, i + head_dim/2) rotate together."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_tables(config: ModelConfig, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's tables (float64 angles, rounded to float32) as tensors."""
    cos, sin = reference.rope_tables(config.head_dim, config.rope_base, np.arange(seq))
    return torch.from_numpy(cos), torch.from_numpy(sin)


class Layer(torch.nn.Module):
    def __init__(self, config: ModelConfig, w: LayerWeights, index: int, lora: LoraConfig | None) -> None:
        super().__init__()
        self.config, self.index = config, index
        targets = set(lora.targets) if lora is not None else set()

        def proj(target: Target, bias: np.ndarray | None = None) -> Projection:
            lora_here = lora if target in targets else None
            return Projection(getattr(w, target.field), bias, lora_here, (index, target.value))

        self.q, self.k, self.v = proj(Target.Q, w.bq), proj(Target.K, w.bk), proj(Target.V, w.bv)
        self.o, self.gate, self.up, self.down = proj(Target.O), proj(Target.GATE), proj(Target.UP), proj(Target.DOWN)
        self.attn_norm = torch.from_numpy(np.array(w.attn_norm, np.float32))
        self.ffn_norm = torch.from_numpy(np.array(w.ffn_norm, np.float32))

    def projections(self) -> dict[Target, Projection]:
        return {Target.Q: self.q, Target.K: self.k, Target.V: self.v, Target.O: self.o, Target.GATE: self.gate,
                Target.UP: self.up, Target.DOWN: self.down}

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key: tuple | None) -> torch.Tensor:
        c = self.config
        b, s, _ = x.shape
        h = rms_norm(x, self.attn_norm, c.norm_eps)
        q = self.q(h, key).view(b, s, c.n_heads, c.head_dim).transpose(1, 2)
        k = self.k(h, key).view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v(h, key).view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        # Heads h = kv * heads_per_kv + g share KV head kv.
        k, v = k.repeat_interleave(c.heads_per_kv, dim=1), v.repeat_interleave(c.heads_per_kv, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(c.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        attn = (probs @ v).transpose(1, 2).reshape(b, s, c.q_dim)
        x = x + self.o(attn, key)
        h = rms_norm(x, self.ffn_norm, c.norm_eps)
        return x + self.down(F.silu(self.gate(h, key)) * self.up(h, key), key)


class StageModel(torch.nn.Module):
    """Layers [first, end) of a model; the first stage embeds token ids, the last one (end == n_layers) also holds
    the final norm and the LM head and turns hidden states into a loss."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, first: int, end: int,
                 lora: LoraConfig | None, recompute: bool = False) -> None:
        """`recompute`: keep only each layer's input for the backward pass and compute the layer again there
        (about a third more compute for a fraction of the activations' memory). Dropout masks are seeded, so the
        second pass draws the same ones."""
        super().__init__()
        if config.is_moe:
            raise EdgerunError("tuning a mixture-of-experts model is not supported")
        reason = lacking(config, weights, "tuning")
        if reason is not None:
            raise EdgerunError(reason)
        if not 0 <= first < end <= config.n_layers:
            raise ValueError(f"layers [{first}, {end}) are not a range of this {config.n_layers}-layer model")
        self.config, self.first, self.end, self.lora, self.recompute = config, first, end, lora, recompute
        self.layers = torch.nn.ModuleList(Layer(config, weights.layers[i], i, lora) for i in range(first, end))
        self.embed = FrozenMatrix(weights.token_embd) if first == 0 else None
        self.head = None
        if end == config.n_layers:
            same = weights.output is weights.token_embd and self.embed is not None
            self.head = self.embed if same else FrozenMatrix(weights.output)
            self.output_norm = torch.from_numpy(np.array(weights.output_norm, np.float32))

    @property
    def is_first(self) -> bool:
        return self.first == 0

    @property
    def is_last(self) -> bool:
        return self.head is not None

    def frozen_bytes(self) -> int:
        matrices = {id(m): m for layer in self.layers for m in (p.matrix for p in layer.projections().values())}
        for m in (self.embed, self.head):
            if m is not None:
                matrices[id(m)] = m
        return sum(m.nbytes for m in matrices.values())

    def named_lora(self) -> dict[str, torch.nn.Parameter]:
        """Every LoRA matrix by its PEFT name."""
        out = {}
        for layer in self.layers:
            for target, p in layer.projections().items():
                if p.lora is not None:
                    out[tensor_name(layer.index, target, "A")] = p.lora_A
                    out[tensor_name(layer.index, target, "B")] = p.lora_B
        return out

    def load_adapter(self, adapter: Adapter) -> None:
        """Set this stage's LoRA matrices from an adapter (resuming, or testing with B != 0)."""
        with torch.no_grad():
            for layer in self.layers:
                for target, (a, b) in adapter.for_layer(layer.index).items():
                    p = layer.projections()[target]
                    if p.lora is None:
                        raise ValueError(f"the adapter has {target.value} of layer {layer.index}, not a target here")
                    p.lora_A.copy_(torch.from_numpy(a))
                    p.lora_B.copy_(torch.from_numpy(b))

    def forward(self, x: torch.Tensor, key: tuple | None = None) -> torch.Tensor:
        """x: int64 token ids (batch, seq) for the first stage, else float32 hidden states (batch, seq, hidden).
        `key` (step, micro-batch) seeds dropout; None: no dropout (evaluation)."""
        if self.is_first:
            flat = x.reshape(-1)
            x = self.embed.weight(flat).view(*x.shape, self.config.hidden)
        cos, sin = rope_tables(self.config, x.shape[1])
        for layer in self.layers:
            if self.recompute and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, key, use_reentrant=False)
            else:
                x = layer(x, cos, sin, key)
        return x

    def loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Summed cross-entropy of the labelled positions (labels[b, t] is the token after position t, IGNORE
        where untrained), and how many there are. Logits are computed for those positions only."""
        mask = labels != IGNORE
        picked = rms_norm(hidden[mask], self.output_norm, self.config.norm_eps)
        logits = frozen_linear(picked, self.head)
        return F.cross_entropy(logits, labels[mask], reduction="sum"), int(mask.sum())

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every position's logits (for checks against the reference)."""
        return frozen_linear(rms_norm(hidden, self.output_norm, self.config.norm_eps), self.head)
