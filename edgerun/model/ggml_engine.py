"""Single-node generation on ggml, llama.cpp's kernel library: the file's blocks computed as stored.

ggml is built from llama.cpp's source for this machine's CPU (edgerun.llamacpp, once). The weights go
into ggml buffers in their GGUF types (Q4_0 and Q4_K rows that the CPU's repacked kernels take are interleaved
for them, as llama.cpp does); every matrix product quantizes its activations per block exactly as llama.cpp's
CPU backend does, attention runs ggml's flash attention over an F16 KV cache, as llama.cpp's default (decode
tokens' and short prompt chunks' through kernels.c's op, which gives its bits several times faster:
edgerun.model.kernels). The graph
of a decode step depends only on how many cache rows it reads (a multiple of KV_STEP), so it is built once per
such length and run again with new inputs: a step costs one native call beside its four small inputs.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.memory import huge_pages, release_mapped_files
from edgerun.model import ggml_lib, kernels
from edgerun.model.batch import round_spans
from edgerun.model.config import Activation, ModelConfig
from edgerun.model.ggml_lib import GgmlBackend, GraphContext, ScratchAllocator, WeightStore, head
from edgerun.model.loader import Model
from edgerun.model.quant import QuantTensor
from edgerun.model.weights import LayerWeights, rope_rows_from_interleaved, rope_rows_to_interleaved

# The attention of a step reads the cache in whole multiples of this many rows (the rest masked), so one decode
# graph serves KV_STEP consecutive positions (llama.cpp pads its cache view the same way).
KV_STEP = 256
# The LM head is loaded in parts of at most this many bytes (whole groups of 64 rows), each repacked on its own: a
# repacking copy takes a tensor's bytes at once, so the file's pages of a 128k-row head (150-270 MB) would all be
# resident beside the copies made so far. In parts, loading never holds more than this beyond the weights.
HEAD_PART_BYTES = 32 << 20
# Nodes in one step's graph: a Llama layer takes about 30; MoE layers are not built here.
GRAPH_NODES_PER_LAYER = 48
# Batched decode graphs kept (one per make-up of slots and cache lengths); past that many they are all let go.
BATCH_GRAPHS_KEPT = 32


@dataclass(frozen=True)
class AttnTensors:
    """Handles of one layer's attention weights (all of them, or a share's heads) and its KV cache."""

    wq: int
    wk: int
    wv: int
    wo: int
    bq: int | None
    bk: int | None
    bv: int | None
    q_norm: int | None
    k_norm: int | None
    k_cache: int
    v_cache: int
    n_heads: int  # query heads, and KV heads, these weights hold
    n_kv_heads: int
    layer: int = 0  # the model's layer (its sliding window and RoPE base)
    rope_freqs: int | None = None  # Llama 3's RoPE frequency factors


@dataclass(frozen=True)
class LayerTensors:
    attn_norm: int
    attn: AttnTensors
    ffn_norm: int
    w_gate: int
    w_up: int
    w_down: int
    attn_post_norm: int | None = None
    ffn_post_norm: int | None = None


@dataclass(frozen=True)
class StepInputs:
    """A graph's per-step inputs beside its hidden states: positions, the cache rows written, the causal mask."""

    pos: int
    rows: int
    mask: int
    n: int  # tokens
    n_kv: int  # cache rows read
    window: int = 0  # a model with windowed layers: how far they reach back, their mask `window_mask`
    window_mask: int | None = None

    @classmethod
    def of(cls, gc: GraphContext, n: int, n_kv: int, window: int = 0) -> StepInputs:
        return cls(gc.input(ggml_lib.I32, n), gc.input(ggml_lib.I64_TYPE, n), gc.input(ggml_lib.F16, n_kv, n), n,
                   n_kv, window, gc.input(ggml_lib.F16, n_kv, n) if window else None)

    def set(self, gc: GraphContext, start: int, mask: np.ndarray, base: int = 0) -> None:
        """Positions start.., written to cache rows base + start.., and a mask where token i sees the rows of
        positions 0..start+i (written straight into the graph's memory on the CPU; through `mask`, (n, n_kv),
        elsewhere), and the windowed layers' mask. `base`: the sequence's first cache row (its slot's, in an
        engine of several)."""
        pos, rows = gc.view(self.pos), gc.view(self.rows)
        # the masks its attention reads (a graph of windowed layers only, or of none, leaves one unallocated)
        masks = [(t, w) for t, w in ((self.mask, 0), (self.window_mask, self.window)) if t and gc.allocated(t)]
        if pos is None or rows is None:
            positions = np.arange(start, start + self.n, dtype=np.int32)
            gc.set(self.pos, positions)
            gc.set(self.rows, positions.astype(np.int64) + base)
            for t, window in masks:
                gc.set(t, fill_mask(mask, start, window))
            return
        if self.n == 1:  # a decode step: a few scalar writes and the masks' fills
            pos[0] = start
            rows[0] = base + start
        else:
            pos[:] = np.arange(start, start + self.n)
            rows[:] = np.arange(base + start, base + start + self.n)
        for t, window in masks:
            fill_mask(gc.view(t).reshape(self.n, self.n_kv), start, window)


def fill_mask(mask: np.ndarray, start: int, window: int) -> np.ndarray:
    """Token i (at position start + i) sees the rows of positions 0..start+i, or with a window the last `window`
    of them (its own included), as llama.cpp's standard sliding window masks."""
    mask[:] = -np.inf
    for i in range(mask.shape[0]):
        mask[i, max(0, start + i - window + 1) if window else 0:start + i + 1] = 0
    return mask


def linear(ctx: int, w: int, x: int, bias: int | None, t) -> int:
    g = ggml_lib.lib()
    y = kernels.product(ctx, t(w), x)
    return y if bias is None else g.ggml_add(ctx, y, t(bias))


@dataclass(frozen=True)
class Span:
    """One sequence's tokens in a step of several sequences: columns [col, col + n) of the step's hidden states,
    whose keys and values lie in cache rows from `base` on (its slot's), `n_kv` of them read through its causal
    `mask` ((n_kv, n) F16)."""

    col: int
    n: int
    base: int
    n_kv: int
    mask: int
    window_mask: int | None = None  # the windowed layers' (a model with any)


@dataclass(frozen=True)
class BatchInputs:
    """A step's inputs for several sequences, (slot, cache rows read, tokens) each (one token of each of a batch's
    sequences, or a round's prompt chunks beside them): their tokens' positions and cache rows (`inputs`; its mask
    is the first sequence's), each one's causal mask over its own slot's rows."""

    inputs: StepInputs
    masks: tuple[int, ...]
    spans: tuple[Span, ...]
    bases: tuple[int, ...]  # each sequence's first cache row

    @classmethod
    def of(cls, gc: GraphContext, make_up: Sequence[tuple[int, int, int]], max_len: int,
           window: int = 0) -> BatchInputs:
        masks = tuple(gc.input(ggml_lib.F16, n_kv, n) for _, n_kv, n in make_up)
        windows = tuple(gc.input(ggml_lib.F16, n_kv, n) if window else None for _, n_kv, n in make_up)
        tokens = sum(n for _, _, n in make_up)
        inputs = StepInputs(gc.input(ggml_lib.I32, tokens), gc.input(ggml_lib.I64_TYPE, tokens), masks[0], tokens,
                            max(n_kv for _, n_kv, _ in make_up), window, windows[0])
        bases = tuple(slot * max_len for slot, _, _ in make_up)
        cols = itertools.accumulate((n for _, _, n in make_up[:-1]), initial=0)
        spans = tuple(Span(col, n, base, n_kv, mask, window_mask) for col, base, (_, n_kv, n), mask, window_mask
                      in zip(cols, bases, make_up, masks, windows, strict=True))
        return cls(inputs, masks, spans, bases)

    def set(self, gc: GraphContext, starts: Sequence[int]) -> None:
        """Each sequence's positions from its start, the cache rows they write and its masks (a token sees the rows
        of positions 0..its own; the windowed layers' the last `window` of them)."""
        if self.inputs.n == len(self.spans):  # one token each
            positions = np.asarray(starts, np.int32)
            rows = positions.astype(np.int64) + np.asarray(self.bases, np.int64)
        else:
            positions = np.concatenate([np.arange(start, start + span.n, dtype=np.int32)
                                        for span, start in zip(self.spans, starts, strict=True)])
            rows = positions.astype(np.int64) + np.repeat(np.asarray(self.bases, np.int64),
                                                          [span.n for span in self.spans])
        gc.set(self.inputs.pos, positions)
        gc.set(self.inputs.rows, rows)
        for span, start in zip(self.spans, starts, strict=True):
            mask = np.empty((span.n, span.n_kv), np.float16)
            for t, window in ((span.mask, 0), (span.window_mask, self.inputs.window)):
                if t and gc.allocated(t):
                    gc.set(t, fill_mask(mask, start, window))


def copy_rows(store: WeightStore, caches: Sequence[int], source: int, target: int, rows: int) -> None:
    """Rows source..source+rows of each of these cache matrices into rows target.. of the same matrix."""
    if rows == 0 or source == target:
        return
    g = ggml_lib.lib()
    for cache in caches:
        t = store.tensor(cache)
        row = head(t).nb[1]
        data = np.empty(rows * row, np.uint8)
        g.ggml_backend_tensor_get(t, data.ctypes.data, source * row, data.nbytes)
        g.ggml_backend_tensor_set(t, data.ctypes.data, target * row, data.nbytes)


def attention_block(gc: GraphContext, t, c: ModelConfig, a: AttnTensors, h: int, inputs: StepInputs,
                    rope_mode: int, spans: Sequence[Span] | None = None) -> int:
    """Attention of normalized hidden states h, (hidden, n), through these heads: wo's product with their output,
    (hidden, n) (llama.cpp's graph for Llama and Qwen2). This step's keys and values go into their cache rows
    first (inputs.rows). `spans`: the step's sequences, each attending to its own cache rows (a batched decode);
    by default one sequence of every column from cache row 0."""
    g, ctx = ggml_lib.lib(), gc.ctx
    n, hd, eps = inputs.n, c.head_dim, c.norm_eps
    q = g.ggml_reshape_3d(ctx, linear(ctx, a.wq, h, a.bq, t), hd, a.n_heads, n)
    k = g.ggml_reshape_3d(ctx, linear(ctx, a.wk, h, a.bk, t), hd, a.n_kv_heads, n)
    v = linear(ctx, a.wv, h, a.bv, t)
    if a.q_norm is not None:
        q = g.ggml_mul(ctx, g.ggml_rms_norm(ctx, q, eps), t(a.q_norm))
        k = g.ggml_mul(ctx, g.ggml_rms_norm(ctx, k, eps), t(a.k_norm))
    factors, base, scale = None if a.rope_freqs is None else t(a.rope_freqs), c.rope_base_of(a.layer), \
        c.rope_scale_of(a.layer)
    q = g.ggml_rope_ext(ctx, q, inputs.pos, factors, hd, rope_mode, c.context_length, base, scale, 0.0, 1.0, 0.0, 0.0)
    k = g.ggml_rope_ext(ctx, k, inputs.pos, factors, hd, rope_mode, c.context_length, base, scale, 0.0, 1.0, 0.0, 0.0)
    if c.query_scale:  # as llama.cpp's Gemma graph: the queries scaled, the scores not
        q = g.ggml_scale(ctx, q, c.query_scale)
    windowed = c.window(a.layer) > 0
    # into the cache before the attention that reads it (graph order)
    kc, vc = t(a.k_cache), t(a.v_cache)
    k_set = g.ggml_set_rows(ctx, kc, g.ggml_reshape_2d(ctx, k, a.n_kv_heads * hd, n), inputs.rows)
    v_set = g.ggml_set_rows(ctx, vc, v, inputs.rows)
    gc.expand(k_set)
    gc.expand(v_set)
    spans = spans or (Span(0, n, 0, inputs.n_kv, inputs.mask, inputs.window_mask),)
    if not windowed and all(span.n < kernels.FA_TILE_Q for span in spans) \
            and [span.col for span in spans] == list(itertools.accumulate((span.n for span in spans[:-1]), initial=0)) \
            and kernels.attention_available(hd, a.n_heads, a.n_kv_heads, n) \
            and g.ggml_backend_buffer_is_host(head(kc).buffer):
        # decode tokens and short prompt chunks: kernels.c's attention, every sequence's in one op, the same bits as
        # ggml's below (a decode token's view decides how ggml splits its rows among threads; a chunk's it never does)
        views = [span.n_kv if span.n == 1 else 0 for span in spans for _ in range(span.n)]
        out = kernels.attention(gc, q, k_set, v_set, inputs.pos, inputs.rows, a.n_kv_heads, c.score_scale, views)
        return kernels.product(ctx, t(a.wo), out)
    row, per_head = head(kc).nb[1], g.ggml_row_size(ggml_lib.F16, hd)
    outs = []
    for span in spans:
        qs = q if span.n == n else \
            g.ggml_view_3d(ctx, q, hd, a.n_heads, span.n, head(q).nb[1], head(q).nb[2], span.col * head(q).nb[2])
        keys, values = (g.ggml_permute(ctx, g.ggml_view_3d(ctx, cache, hd, a.n_kv_heads, span.n_kv, per_head, row,
                                                           span.base * row), 0, 2, 1, 3) for cache in (kc, vc))
        out = g.ggml_flash_attn_ext(ctx, g.ggml_permute(ctx, qs, 0, 2, 1, 3), keys, values,
                                    span.window_mask if windowed else span.mask, c.score_scale, 0.0, 0.0)
        g.ggml_prec_set_acc(out, ggml_lib.PREC_F32)
        outs.append(g.ggml_reshape_2d(ctx, out, a.n_heads * hd, span.n))
    joined = functools.reduce(lambda x, y: g.ggml_concat(ctx, x, y, 1), outs)
    return kernels.product(ctx, t(a.wo), joined)


def cache_rows(end: int, max_len: int) -> int:
    """Cache rows a step ending at position `end` reads: the next multiple of KV_STEP, at most the cache."""
    return min(max_len, -(-end // KV_STEP) * KV_STEP)


def lm_head(ctx: int, store: WeightStore, output: int, h: int) -> int:
    """The LM head's rows (WeightStore.add_rows) times h, one column of logits per token."""
    g = ggml_lib.lib()
    whole = store.joined(output)
    if whole is not None:
        return kernels.product(ctx, whole, h)
    products = [kernels.product(ctx, store.tensor(p), h) for p in store.parts(output)]
    return functools.reduce(lambda a, b: g.ggml_concat(ctx, a, b, 0), products)


def mlp_block(ctx: int, t, w_gate: int, w_up: int, w_down: int, h: int,
              activation: Activation = Activation.SILU) -> int:
    """SwiGLU (or GeGLU) of normalized hidden states h through these rows of gate and up and columns of down."""
    g = ggml_lib.lib()
    gate, up = kernels.product(ctx, t(w_gate), h), kernels.product(ctx, t(w_up), h)
    glu = g.ggml_geglu_split if activation == Activation.GELU_TANH else g.ggml_swiglu_split
    return kernels.product(ctx, t(w_down), glu(ctx, gate, up))


def file_interleaved(layer: LayerWeights, config: ModelConfig) -> bool:
    """Whether a layer's Q and K rows are a file's interleaved rows put in Hugging Face order (and no per-head
    norm, whose weights would need the same reordering)."""
    return (layer.q_norm is None and layer.wq.row_order is not None and layer.wk.row_order is not None
            and np.array_equal(layer.wq.row_order, rope_rows_from_interleaved(config.n_heads, config.q_dim))
            and np.array_equal(layer.wk.row_order, rope_rows_from_interleaved(config.n_kv_heads, config.kv_dim)))


def as_stored(t: QuantTensor) -> QuantTensor:
    """The tensor's rows in the order its file stores them."""
    return QuantTensor(t.qtype, t.shape, t.stored)


def unsupported(model: Model) -> str | None:
    """Why this engine does not build a model, or None when it does."""
    if model.config.is_moe:
        return "the ggml engine runs dense models; a mixture-of-experts model takes --engine onnx"
    if any(layer.lora for layer in model.weights.layers):
        return "the ggml engine does not apply LoRA adapters; take --engine onnx"
    return None


def check_supported(model: Model) -> None:
    """Refuse, in one line, a model this engine does not build (the caller picks another engine)."""
    reason = unsupported(model)
    if reason is not None:
        raise EdgerunError(reason)


class GgmlEngine:
    """The whole model on a ggml backend (the CPU's, or a CUDA GPU's with device="cuda"), one graph per step; or,
    with `layers`, a pipeline stage: those layers, the embedding where they start at 0 and the final norm and LM
    head where they end at the last (GgmlEngine.run)."""

    name = "ggml"

    def __init__(self, model: Model, max_len: int, threads: int | None = None, device: str = "cpu",
                 layers: range | None = None, head: bool = True, slots: int = 1) -> None:
        """`head=False`: no LM head even where the layers reach the last, so run() gives the last layer's hidden
        states (an embedding model's). `slots`: sequences whose caches it holds at once (max_len rows each), for
        batched decoding (prefill, decode); step and run use the first."""
        check_supported(model)
        if slots < 1:
            raise EdgerunError("an engine holds at least one sequence")
        self.slots = slots
        self.model = model
        self.config: ModelConfig = model.config
        self.max_len = max_len
        self.backend = GgmlBackend(threads, device)
        c = self.config
        w = model.weights
        self.layer_range = range(c.n_layers) if layers is None else layers
        if not (0 <= self.layer_range.start < self.layer_range.stop <= c.n_layers and self.layer_range.step == 1):
            raise EdgerunError(f"layers {self.layer_range} are not a run of the model's {c.n_layers}")
        self.embeds = self.layer_range.start == 0
        self.has_head = head and self.layer_range.stop == c.n_layers
        self.weights = WeightStore(self.backend)
        add = self.weights.add
        # Embedding rows are converted from the file's pages (a few rows a step, by ggml's own code for the type):
        # the table lives in ggml only as the LM head, so a tied head is repacked for the product without a second
        # copy for the lookup.
        self.output = self.weights.add_rows("output", w.output, HEAD_PART_BYTES) if self.has_head else None
        self.output_norm = add("output_norm", w.output_norm) if self.has_head else None
        self.layers: list[LayerTensors] = []
        # A GGUF Llama file keeps Q and K rows interleaved for llama.cpp's pairwise rotation (ROPE_NORM): taken as
        # the file stores them, each of attention's dot products adds in llama.cpp's order, and the answers are
        # its answers. Rows in Hugging Face order (Qwen2, safetensors) rotate halves (ROPE_NEOX), as llama.cpp does.
        # Decided on every layer, so every stage of one model rotates alike.
        interleaved = all(file_interleaved(layer, c) for layer in w.layers)
        self.rope_mode = ggml_lib.ROPE_NORM if interleaved else ggml_lib.ROPE_NEOX
        rope_freqs = None if w.rope_freqs is None else add("rope_freqs", w.rope_freqs)
        for i in self.layer_range:
            layer = w.layers[i]
            def opt(name: str, value: np.ndarray | None, i: int = i) -> int | None:
                return None if value is None else add(f"blk.{i}.{name}", value)

            wq, wk, bq, bk = layer.wq, layer.wk, layer.bq, layer.bk
            if interleaved:
                wq, wk = as_stored(wq), as_stored(wk)
                bq = None if bq is None else bq[rope_rows_to_interleaved(c.n_heads, c.q_dim)]
                bk = None if bk is None else bk[rope_rows_to_interleaved(c.n_kv_heads, c.kv_dim)]
            attn = AttnTensors(
                wq=add(f"blk.{i}.wq", wq), wk=add(f"blk.{i}.wk", wk), wv=add(f"blk.{i}.wv", layer.wv),
                wo=add(f"blk.{i}.wo", layer.wo), bq=opt("bq", bq), bk=opt("bk", bk), bv=opt("bv", layer.bv),
                q_norm=opt("q_norm", layer.q_norm), k_norm=opt("k_norm", layer.k_norm),
                k_cache=self.weights.cache(f"blk.{i}.k_cache", c.kv_dim, max_len * slots),
                v_cache=self.weights.cache(f"blk.{i}.v_cache", c.kv_dim, max_len * slots),
                n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, layer=i, rope_freqs=rope_freqs)
            self.layers.append(LayerTensors(
                attn_norm=add(f"blk.{i}.attn_norm", layer.attn_norm), attn=attn,
                ffn_norm=add(f"blk.{i}.ffn_norm", layer.ffn_norm),
                w_gate=add(f"blk.{i}.w_gate", layer.w_gate), w_up=add(f"blk.{i}.w_up", layer.w_up),
                w_down=add(f"blk.{i}.w_down", layer.w_down), attn_post_norm=opt("attn_post_norm",
                                                                                layer.attn_post_norm),
                ffn_post_norm=opt("ffn_post_norm", layer.ffn_post_norm)))
        self.weights.upload(release=lambda: release_mapped_files([model.path]))
        self.embed = embedding(model) if self.embeds else None
        if device == "cpu":  # in huge pages, as the onnx engine's repacked weights: streamed every token, 4 KB
            # pages miss the TLB once a page and stop the prefetchers at every page's end
            huge_pages()
        self.weight_bytes = w.matrix_bytes() if layers is None else \
            sum(t.nbytes for i in self.layer_range for _, t in w.layers[i].matrices()) + \
            (w.output.nbytes if self.has_head else 0)
        self.position = 0
        self._graphs: dict[tuple[int, int, int], StepGraph] = {}
        self._batches: dict[tuple[tuple[int, int, int], ...], BatchGraph] = {}
        self._scratch = ScratchAllocator(self.backend)

    def reset(self) -> None:
        self.position = 0

    def release(self) -> None:
        """Nothing to let go of between requests."""

    def step(self, tokens: Sequence[int]) -> np.ndarray:
        """Run tokens after those already seen; return the last token's logits, (vocab,)."""
        if self.embed is None or not self.has_head:
            raise EdgerunError("a stage's steps are runs of hidden states (GgmlEngine.run)")
        return self.run(self.embed(np.asarray(tokens, np.int64)))

    def run(self, embd: np.ndarray) -> np.ndarray:
        """Run n positions' hidden states (n, hidden) after those already seen through this engine's layers:
        the last position's logits, (vocab,), where it holds the LM head, else every position's hidden state
        after its last layer, (n, hidden)."""
        out = self._forward(embd, self.position, 0)
        self.position += embd.shape[0]
        return out

    def prefill(self, slot: int, tokens: Sequence[int], start: int) -> np.ndarray:
        """Run tokens at positions start.. of the sequence in `slot` (its cache rows before `start` hold its
        earlier tokens); the last one's logits, (vocab,)."""
        if self.embed is None or not self.has_head:
            raise EdgerunError("a stage's steps are runs of hidden states (GgmlEngine.run)")
        if not 0 <= slot < self.slots:
            raise EdgerunError(f"slot {slot} is not one of this engine's {self.slots}")
        return self._forward(self.embed(np.asarray(tokens, np.int64)), start, slot)

    def decode(self, batch: Sequence[tuple[int, int, int]]) -> np.ndarray:
        """One token of each of several sequences, (slot, position, token) each, in one step: their logits,
        (len(batch), vocab). Each reads only its own slot's cache; a sequence's logits are those it gets alone."""
        if self.embed is None or not self.has_head:
            raise EdgerunError("a stage's steps are runs of hidden states (GgmlEngine.run)")
        return self.decode_rows([(slot, position) for slot, position, _ in batch],
                                self.embed(np.asarray([b[2] for b in batch], np.int64)))

    def decode_rows(self, batch: Sequence[tuple[int, int]], embd: np.ndarray) -> np.ndarray:
        """One position of each of several sequences, (slot, position) each, from their hidden states before this
        engine's layers (len(batch), hidden), in one step: their logits (len(batch), vocab) where the engine holds
        the LM head, else their hidden states after its last layer (a pipeline stage's). Each reads only its own
        slot's cache; a sequence's rows are those it gets alone."""
        return self.span_rows([(slot, position, 1) for slot, position in batch], embd)

    def round_step(self, chunks: Sequence[tuple[int, Sequence[int], int]], batch: Sequence[tuple[int, int, int]]
                   ) -> tuple[list[np.ndarray], np.ndarray]:
        """A round's prompt chunks, (slot, tokens, start) each, and one token of each sequence of `batch`, (slot,
        position, token) each, as one step (where `fuses`): each chunk's last token's logits, and the batch's
        logits (len(batch), vocab), each sequence's as its own step gives them."""
        if not self.fuses:
            raise EdgerunError("this engine runs a round's prompt chunks and decode step as steps of their own "
                               "(GgmlEngine.fuses)")
        spans, ids = round_spans(chunks, batch)
        out = self.span_rows(spans, self.embed(np.asarray(ids, np.int64)))
        return list(out[:len(chunks)]), out[len(chunks):]

    @functools.cached_property
    def fuses(self) -> bool:
        """Whether a round's prompt chunks and decode step run as one step (round_step) on this engine: the whole
        model here, its products giving every column the bits it gets in a product of any other columns."""
        return self.embeds and self.has_head and invariant_products(self.model)

    def span_rows(self, spans: Sequence[tuple[int, int, int]], embd: np.ndarray) -> np.ndarray:
        """Tokens of several sequences in one step, (slot, start, tokens) each, from their hidden states before
        this engine's layers (all the tokens', in order): each sequence's last token's logits (len(spans), vocab)
        where the engine holds the LM head, else every token's hidden state after its last layer. Each reads only
        its own slot's cache; a sequence's rows are those it gets alone."""
        if any(not 0 <= slot < self.slots for slot, _, _ in spans) or len({s[0] for s in spans}) != len(spans):
            raise EdgerunError(f"a batch takes distinct slots of this engine's {self.slots}")
        if any(n < 1 or start < 0 for _, start, n in spans):
            raise EdgerunError("a batch's sequences each take at least one token from a position of theirs")
        if any(start + n > self.max_len for _, start, n in spans):
            raise EdgerunError(f"the context holds {self.max_len} tokens")
        tokens = sum(n for _, _, n in spans)
        if embd.shape != (tokens, self.config.hidden):
            raise EdgerunError(f"a batch of {tokens} takes hidden states ({tokens}, {self.config.hidden}), "
                               f"not {embd.shape}")
        key = tuple((slot, cache_rows(start + n, self.max_len), n) for slot, start, n in spans)
        if tokens > len(spans):  # prompt chunks in every length: laid out in the scratch buffer, as a prompt's
            graph = BatchGraph(self, key, self._scratch)
        else:
            graph = self._batches.get(key)
            if graph is None:
                if len(self._batches) >= BATCH_GRAPHS_KEPT:  # the batch's make-up changes as sequences come and go
                    self._batches.clear()
                graph = self._batches[key] = BatchGraph(self, key)
        return graph.run(np.ascontiguousarray(embd, np.float32), [start for _, start, _ in spans])

    def run_slot(self, slot: int, embd: np.ndarray, start: int) -> np.ndarray:
        """Run n positions' hidden states (n, hidden) of the sequence in `slot` from position `start` (a prompt's
        chunk on a pipeline stage): as run does for the first slot."""
        if not 0 <= slot < self.slots:
            raise EdgerunError(f"slot {slot} is not one of this engine's {self.slots}")
        return self._forward(embd, start, slot)

    def copy_cache(self, source: int, target: int, rows: int) -> None:
        """The keys and values of the first `rows` positions of the sequence in slot `source` into slot `target`'s
        rows (a prompt's prefix prefilled once for sequences that share it)."""
        if not (0 <= source < self.slots and 0 <= target < self.slots) or not 0 <= rows <= self.max_len:
            raise EdgerunError(f"a cache copy takes slots of this engine's {self.slots}, at most {self.max_len} rows")
        for layer in self.layers:
            copy_rows(self.weights, (layer.attn.k_cache, layer.attn.v_cache), source * self.max_len,
                      target * self.max_len, rows)

    def _forward(self, embd: np.ndarray, start: int, slot: int) -> np.ndarray:
        n = embd.shape[0]
        if n < 1:
            raise EdgerunError("a step needs at least one token")
        if start + n > self.max_len:
            raise EdgerunError(f"the context holds {self.max_len} tokens; this step would reach {start + n}")
        n_kv = cache_rows(start + n, self.max_len)
        key = (n, n_kv, slot)
        graph = self._graphs.get(key)
        if graph is None:
            # Prompts come in every length: only decode graphs are worth keeping, a prompt's is laid out in the
            # engine's scratch buffer.
            graph = StepGraph(self, n, n_kv, None if n == 1 else self._scratch, base=slot * self.max_len)
            if n == 1:
                self._graphs[key] = graph
        return graph.run(np.ascontiguousarray(embd, np.float32), start)


def _layers(gc: GraphContext, engine: GgmlEngine, x: int, inputs: StepInputs, spans: Sequence[Span] | None,
            last_only: bool) -> int:
    """The engine's layers over hidden states x, (hidden, n): their output; with `last_only`, the last
    position's alone (after the last attention, which every position's keys and values fed, the other positions
    are done and skip the last MLP, as llama.cpp's graph does with its output rows)."""
    g, c, t, ctx = ggml_lib.lib(), engine.config, engine.weights.tensor, gc.ctx
    def normed(y: int, weight: int | None) -> int:
        return y if weight is None else g.ggml_mul(ctx, g.ggml_rms_norm(ctx, y, c.norm_eps), t(weight))

    for i, layer in enumerate(engine.layers):
        out = attention_block(gc, t, c, layer.attn, normed(x, layer.attn_norm), inputs, engine.rope_mode, spans)
        if last_only and i == len(engine.layers) - 1 and inputs.n > 1:
            stride = head(x).nb[1]
            x = g.ggml_view_2d(ctx, x, c.hidden, 1, stride, (inputs.n - 1) * stride)
            out = g.ggml_view_2d(ctx, out, c.hidden, 1, head(out).nb[1], (inputs.n - 1) * head(out).nb[1])
        x = g.ggml_add(ctx, x, normed(out, layer.attn_post_norm))
        out = mlp_block(ctx, t, layer.w_gate, layer.w_up, layer.w_down, normed(x, layer.ffn_norm), c.activation)
        x = g.ggml_add(ctx, x, normed(out, layer.ffn_post_norm))
    return x


def invariant_products(model: Model) -> bool:
    """Whether every matrix product of the model gives a column the bits it gets in a product of any other columns
    here (kernels.invariant_products): a step may then run several sequences' prompt chunks and decode tokens."""
    w = model.weights
    matrices = [t for layer in w.layers for _, t in layer.matrices()] + [w.output]
    return all(isinstance(t, QuantTensor) for t in matrices) and kernels.invariant_products(t.qtype for t in matrices)


def embedding(model: Model):
    """Token ids -> their rows of the embedding, float32 (times the model's embedding scale: Gemma's sqrt(hidden),
    as llama.cpp scales them in float32)."""
    rows = ggml_lib.rows_to_float(model.weights.token_embd)
    scale = np.float32(model.config.embed_scale)
    return rows if scale == 1.0 else lambda ids: rows(ids) * scale


def _logits(gc: GraphContext, engine: GgmlEngine, x: int) -> int:
    """The LM head over the final norm of x: a column of logits per column of x."""
    g = ggml_lib.lib()
    h = g.ggml_mul(gc.ctx, g.ggml_rms_norm(gc.ctx, x, engine.config.norm_eps), engine.weights.tensor(
        engine.output_norm))
    assert engine.output is not None
    return lm_head(gc.ctx, engine.weights, engine.output, h)


class StepGraph:
    """One step's graph over n tokens of one sequence reading n_kv cache rows from `base` on, allocated once and
    run with new inputs."""

    def __init__(self, engine: GgmlEngine, n: int, n_kv: int, scratch: ScratchAllocator | None = None,
                 base: int = 0) -> None:
        c = engine.config
        self.base = base
        self.gc = GraphContext(engine.backend, len(engine.layers) * GRAPH_NODES_PER_LAYER + 64)
        self.embd = self.gc.input(ggml_lib.F32, c.hidden, n)
        self.inputs = StepInputs.of(self.gc, n, n_kv, c.sliding_window)
        x = _layers(self.gc, engine, self.embd, self.inputs,
                    (Span(0, n, base, n_kv, self.inputs.mask, self.inputs.window_mask),), last_only=engine.has_head)
        if engine.has_head:  # x is the last position's hidden state
            self.out, self.shape = _logits(self.gc, engine, x), (c.vocab_size,)
        else:  # a stage's hidden states go on to the next stage
            self.out, self.shape = x, (n, c.hidden)
        self.gc.expand(self.out)
        self.gc.allocate(scratch)
        self._mask = np.zeros((n, n_kv), np.float16)

    def run(self, embd: np.ndarray, start: int) -> np.ndarray:
        self.gc.set(self.embd, embd)
        self.inputs.set(self.gc, start, self._mask, self.base)
        self.gc.compute()
        return self.gc.get(self.out, np.empty(self.shape, np.float32))


class BatchGraph:
    """A step of several sequences, (slot, cache rows read, tokens) each: one token each of a batch's sequences at
    their own positions, or beside them a round's prompt chunks. The matrix products take every token's column at
    once (the weights read once for all of them), attention is each sequence's own over its own slot's cache; the
    LM head's logits are each sequence's last token's."""

    def __init__(self, engine: GgmlEngine, make_up: tuple[tuple[int, int, int], ...],
                 scratch: ScratchAllocator | None = None) -> None:
        c, b = engine.config, len(make_up)
        tokens = sum(n for _, _, n in make_up)
        # each sequence adds its attention's views, permutes, flash attention, reshape and concat to every layer
        self.gc = GraphContext(engine.backend, len(engine.layers) * (GRAPH_NODES_PER_LAYER + 12 * b) + 64 + b)
        self.embd = self.gc.input(ggml_lib.F32, c.hidden, tokens)
        self.batch = BatchInputs.of(self.gc, make_up, engine.max_len, c.sliding_window)
        self.last = None  # each sequence's last column, where a chunk has more than one
        with kernels.each_column_alone():  # each sequence's numbers as it gets them alone, whatever its weights' type
            x = _layers(self.gc, engine, self.embd, self.batch.inputs, self.batch.spans, last_only=False)
            if engine.has_head and tokens > b:
                self.last = self.gc.input(ggml_lib.I32, b)
                x = ggml_lib.lib().ggml_get_rows(self.gc.ctx, x, self.last)
            # logits where the engine holds the LM head, else the hidden states go on to the next stage
            self.out = _logits(self.gc, engine, x) if engine.has_head else x
        self.gc.expand(self.out)
        self.gc.allocate(scratch)
        self.shape = (b, c.vocab_size) if engine.has_head else (tokens, c.hidden)

    def run(self, embd: np.ndarray, starts: Sequence[int]) -> np.ndarray:
        gc = self.gc
        gc.set(self.embd, embd)
        self.batch.set(gc, starts)
        if self.last is not None:
            gc.set(self.last, np.cumsum([span.n for span in self.batch.spans], dtype=np.int32) - 1)
        gc.compute()
        return gc.get(self.out, np.empty(self.shape, np.float32))
