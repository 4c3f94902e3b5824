"""What a MoEx hub computes itself: the embedding, each layer's attention and norms, the routers, the shared experts
and the LM head (the experts are the workers').

Two kinds, chosen by the cluster's activations as the workers' experts are: with int8 activations (the default)
attention and the LM head run on ggml, llama.cpp's kernels on the file's own blocks (a GgmlShard holding every
attention unit and every vocabulary row, no MLP), so the hub computes as the single engine and the workers do;
with float32 they are the numpy reference's, whose tokens a float32 cluster then gives. Norms, routers and the
shared experts are small and stay in numpy in both.

Both hold `slots` sequences' caches for a batch (`edgerun serve --plan moe --parallel N`): a prompt's chunk runs in
its sequence's slot (attention's `slot`), and a batched decode step's rows each attend to their own
(attention_rows), each row computed as it is alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgerun.model import kernels
from edgerun.model.loader import Model
from edgerun.model.onnx_graph import Activations
from edgerun.model.reference import DenseMoe, ReferenceModel, rms_norm, rope_tables
from edgerun.model.weights import embed_rows
from edgerun.tp.ggml_shard import GgmlShard
from edgerun.tp.shard import ShardSpec, n_groups


class HubLayers:
    """The hub's own layers over a context of `max_len` positions, `length` of them filled (of the first slot's
    sequence: the one-request steps')."""

    def __init__(self, model: Model, max_len: int, moe: Sequence[DenseMoe], slots: int = 1) -> None:
        self.config, self.weights, self.max_len, self.slots = model.config, model.weights, max_len, slots
        self.moe = list(moe)  # per layer: its router and shared expert
        self.length = 0

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        return embed_rows(self.config, self.weights, tokens)

    def attention_norm(self, layer: int, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.weights.layers[layer].attn_norm, self.config.norm_eps)

    def ffn_norm(self, layer: int, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.weights.layers[layer].ffn_norm, self.config.norm_eps)

    def attention(self, layer: int, x_norm: np.ndarray, start: int, slot: int = 0) -> np.ndarray:
        """A layer's attention output for tokens at positions start.. (seq, hidden) of the sequence in `slot`;
        their keys and values are cached."""
        raise NotImplementedError

    def attention_rows(self, layer: int, x_norm: np.ndarray, rows: Sequence[tuple[int, int]]) -> np.ndarray:
        """A layer's attention output for one token of each of several sequences, (slot, position) each: row i
        of x_norm is rows[i]'s, and its output is the one it gets alone."""
        raise NotImplementedError

    def logits(self, x: np.ndarray) -> np.ndarray:
        """The LM head's logits, (vocab,), of the last row of hidden states x (before the final norm)."""
        return self.logits_rows(x[-1:])[0]

    def logits_rows(self, x: np.ndarray) -> np.ndarray:
        """The LM head's logits of every row of hidden states x (before the final norm), (rows, vocab)."""
        raise NotImplementedError

    def copy_cache(self, source: int, target: int, rows: int) -> None:
        """The keys and values of the first `rows` positions of slot `source`'s sequence into slot `target`'s."""
        raise NotImplementedError

    def truncate(self, length: int) -> None:
        """Forget cached positions >= length."""
        self.length = min(self.length, length)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the hub's own matrices one decode step reads."""
        raise NotImplementedError

    def _moe_bytes(self) -> int:
        total = 0
        for moe in self.moe:
            total += moe.router.nbytes
            if moe.shared is not None:
                total += moe.shared.w_gate.nbytes + moe.shared.w_up.nbytes + moe.shared.w_down.nbytes
        return total


class ReferenceLayers(HubLayers):
    """The numpy reference's float32 numbers."""

    def __init__(self, model: Model, max_len: int, slots: int = 1) -> None:
        self.reference = ReferenceModel(model.config, model.weights, experts=False)
        super().__init__(model, max_len, [layer.moe for layer in self.reference.layers], slots)
        self.caches = [self.reference.new_cache(max_len) for _ in range(slots)]

    def attention(self, layer: int, x_norm: np.ndarray, start: int, slot: int = 0) -> np.ndarray:
        c, seq = self.config, x_norm.shape[0]
        cos, sin = rope_tables(c.head_dim, c.rope_base, np.arange(start, start + seq))
        cache = self.caches[slot]
        cache.length = start
        out = self.reference.attention(layer, self.reference.layers[layer], x_norm, cache, cos, sin, None)
        if slot == 0:
            self.length = start + seq
        return out

    def attention_rows(self, layer: int, x_norm: np.ndarray, rows: Sequence[tuple[int, int]]) -> np.ndarray:
        # one row at a time: numpy's products round a row differently beside others
        return np.concatenate([self.attention(layer, x_norm[i:i + 1], position, slot)
                               for i, (slot, position) in enumerate(rows)])

    def logits_rows(self, x: np.ndarray) -> np.ndarray:
        ref = self.reference
        return np.concatenate([rms_norm(row[None], ref.output_norm, self.config.norm_eps) @ ref.output.T
                               for row in x])

    def copy_cache(self, source: int, target: int, rows: int) -> None:
        for which in ("k", "v"):
            getattr(self.caches[target], which)[:, :, :rows] = getattr(self.caches[source], which)[:, :, :rows]

    @property
    def weight_bytes(self) -> int:
        first = self.reference.layers[0]
        attention = sum(getattr(first, f).nbytes for f in ("wq", "wk", "wv", "wo"))
        return attention * self.config.n_layers + self._moe_bytes() + self.reference.output.nbytes


class GgmlLayers(HubLayers):
    """Attention and the LM head on ggml, llama.cpp's kernels and numerics (int8 activations)."""

    def __init__(self, model: Model, max_len: int, threads: int | None = None, slots: int = 1) -> None:
        c = model.config
        super().__init__(model, max_len, [DenseMoe.from_weights(w.moe, experts=False) for w in model.weights.layers],
                         slots)
        spec = ShardSpec((tuple(range(c.n_kv_heads)),) * c.n_layers, ((),) * c.n_layers,
                         tuple(range(n_groups(c.vocab_size, 4096))), vocab_block=4096)
        self.share = GgmlShard(c, model.weights, spec, max_len, threads, [model.path], slots=slots)

    def attention(self, layer: int, x_norm: np.ndarray, start: int, slot: int = 0) -> np.ndarray:
        out = self.share.attention(layer, x_norm, start, slot=slot)
        assert out is not None
        if slot == 0:
            self.length = start + x_norm.shape[0]
        return out

    def attention_rows(self, layer: int, x_norm: np.ndarray, rows: Sequence[tuple[int, int]]) -> np.ndarray:
        return self.share.attention_rows(layer, x_norm, rows)

    def logits_rows(self, x: np.ndarray) -> np.ndarray:
        with kernels.each_column_alone():  # each row a sequence's (or a request's last), as it is alone
            return self.share.logits(rms_norm(x, self.weights.output_norm, self.config.norm_eps))[1]

    def copy_cache(self, source: int, target: int, rows: int) -> None:
        self.share.copy_cache(source, target, rows)

    def truncate(self, length: int) -> None:
        super().truncate(length)
        self.share.truncate(length)

    @property
    def weight_bytes(self) -> int:
        return self.share.weight_bytes + self._moe_bytes()


def hub_layers(model: Model, max_len: int, activations: Activations, threads: int | None = None,
               slots: int = 1) -> HubLayers:
    """The hub's own layers for a cluster whose experts compute with these activations, holding `slots`
    sequences' caches."""
    if activations is Activations.F32:
        return ReferenceLayers(model, max_len, slots)
    return GgmlLayers(model, max_len, threads, slots)
