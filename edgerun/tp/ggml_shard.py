"""A tensor-parallel share on ggml, llama.cpp's kernels: QuantShard's interface, one small ggml graph per block.

A share holds its attention units (KV heads with their query heads: rows of wq, wk, wv and the matching columns
of wo), its MLP groups (rows of gate and up, columns of down) and its vocabulary rows of the LM head, all in the
file's quantized blocks. Rows are whole GGUF rows; a column range of wo or down is the bytes of each row's blocks
that cover it when it starts and ends on the type's block boundary (down's 256-wide groups always do), and is
otherwise requantized to Q8_0 (a 64-column head inside a K-quant's 256-wide blocks). Each block's graph is built
once per token count and cache length and rerun with new inputs, as the whole-model engine's steps are.
"""

from __future__ import annotations

import ctypes
import functools
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from edgerun.errors import EdgerunError
from edgerun.memory import huge_pages, release_mapped_files
from edgerun.model import ggml_lib, kernels
from edgerun.model.config import ModelConfig
from edgerun.model.ggml_engine import (
    HEAD_PART_BYTES,
    AttnTensors,
    BatchInputs,
    Span,
    StepInputs,
    attention_block,
    cache_rows,
    copy_rows,
    lm_head,
    mlp_block,
)
from edgerun.model.ggml_lib import GgmlBackend, GraphContext, ScratchAllocator, WeightStore
from edgerun.model.onnx_graph import Activations
from edgerun.model.quant import QuantTensor, block_shape, dequantize_columns, quantize
from edgerun.model.weights import ModelWeights, lacking
from edgerun.net.fastpath import NativeGraph
from edgerun.net.wire import Q8_BLOCK, Q8_BLOCK_BYTES, Block, Codec, as_f32, decode_vector, encode_vector
from edgerun.tp.shard import DynamicQuantShard, QuantShard, ShardSpec, _rows, _ShareBase

BLOCK_GRAPH_NODES = 64
# Batched attention graphs kept (a layer's one per make-up of slots and cache lengths), this many make-ups' worth for
# every layer; past that they are all let go.
BATCH_GRAPHS_KEPT = 32
# The graph key's first field of a batched attention block (beside Block's members)
ROWS = "rows"
SPANS = "spans"  # a round's prompt chunks beside its decode tokens (BatchStep.counts)
SHARE_ROPE = ggml_lib.ROPE_NEOX  # a share's rows are in Hugging Face order (each head's halves rotate)


def column_ranges(t: QuantTensor, ranges: Sequence[tuple[int, int]]) -> QuantTensor:
    """Columns [start, stop) of each range side by side: the file's own blocks where every range is on the type's
    block boundaries, else the float columns requantized to Q8_0 (F32 where not a multiple of its 32)."""
    block, size = block_shape(t.qtype)
    cols = sum(b - a for a, b in ranges)
    if all(a % block == 0 and b % block == 0 for a, b in ranges):
        raw = t.raw
        parts = [raw[:, a // block * size:b // block * size] for a, b in ranges]
        return QuantTensor(t.qtype, (t.rows, cols), np.ascontiguousarray(np.concatenate(parts, axis=1)))
    floats = dequantize_columns(t, ranges)
    return quantize(floats, "Q8_0" if cols % 32 == 0 else "F32")


def _spans(units: Sequence[int], width: int) -> list[tuple[int, int]]:
    return [(u * width, (u + 1) * width) for u in units]


# ggml's type for a product's activations whose block is wire's Q8 block: an f16 scale and 32 int8. (Q8_1, Q4_1's,
# is not: the sum it keeps beside them is taken with the scale before its f16 rounding, which the decoded block no
# longer holds, and a Q8 input gave the shipped model's Q4_1 products other bits.)
Q8_ACTIVATIONS = (int(kernels.Q8_0),)


def _ggml_quantized(activations: int, x: np.ndarray) -> bytes:
    """x (a multiple of 32 floats) as ggml's CPU backend quantizes a product's activations of this type."""
    traits = kernels.TypeTraitsCpu.from_address(ggml_lib.lib().ggml_get_type_traits_cpu(activations))
    out = ctypes.create_string_buffer(x.size // Q8_BLOCK * Q8_BLOCK_BYTES)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(traits.from_float)(
        np.ascontiguousarray(x, np.float32).ctypes.data, ctypes.addressof(out), x.size)
    return out.raw


def wire_q8(x: np.ndarray) -> bytes:
    """x as wire's Q8 (encode_vector's bytes) by ggml's vectorized quantizer, where ggml_quantizes_as_wire: a
    64-token prompt's input of a 1B (2048 wide) took 0.1 ms so against 0.6-1 ms by numpy's encode_vector, once a
    block on the master's path before any node could start."""
    x = as_f32(x).reshape(-1)
    if x.size % Q8_BLOCK:
        return encode_vector(x, Codec.Q8)
    return _ggml_quantized(int(kernels.Q8_0), x)


@functools.cache
def ggml_quantizes_as_wire() -> bool:
    """Whether this machine's ggml quantizes a product's activations (Q8_0) into the very bytes wire's Q8 encodes,
    and a block decoded from them back into them: then an input that travels as Q8 gives a share's products the
    bits its float32 gives. ggml's x86 quantizer computes what wire.encode_vector does (quantize_row_q8_0 and its
    repacked layouts' ggml_quantize_mat_q8_0: read, and checked here); another CPU's may not (ARM's scales by
    1 / d, not 127 / max, which differ in their last bit now and then: samples would rarely show it), and such a
    node takes float32 inputs. Checked on seeded blocks of every magnitude and on the edges: zero blocks, ties
    halfway between two steps, one large value, a block too small for an f16 scale."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((512, Q8_BLOCK)) * 10.0 ** rng.uniform(-6, 4, (512, 1))).astype(np.float32)
    x[0] = 0.0
    x[1] = np.arange(Q8_BLOCK) - 15.5  # a step of 1 (max 127): every other value halfway between two steps
    x[1, 0] = 127
    x[2] = x[1] / 8  # the same ties at another scale
    x[3, 0], x[3, 1:] = 1e4, 1e-3
    x[4] *= 1e-7  # a block under f16's range: its scale is 0
    x = x.reshape(-1)
    wire = encode_vector(x, Codec.Q8)
    back = decode_vector(wire, Codec.Q8, x.size)
    return all(_ggml_quantized(t, x) == wire and _scaled(_ggml_quantized(t, back)) == _scaled(wire)
               for t in Q8_ACTIVATIONS)


def _scaled(q8: bytes) -> bytes:
    """Q8 blocks with the values of those whose scale is zero (a block under f16's range) taken as zeros: such a
    block decodes to zeros, and ggml quantizes those into zeros; either way it adds nothing to a product."""
    blocks = np.frombuffer(q8, np.uint8).reshape(-1, Q8_BLOCK_BYTES).copy()
    blocks[(blocks[:, :2].view("<u2")[:, 0] & 0x7FFF) == 0, 2:] = 0
    return blocks.tobytes()


def _qtype(t: QuantTensor | np.ndarray) -> int:
    """A weight's ggml type (float32 for an array)."""
    return int(GGMLQuantizationType[t.qtype]) if isinstance(t, QuantTensor) else int(GGMLQuantizationType.F32)


def _activations_type(qtype: int) -> int:
    """The type ggml quantizes a product's activations to for weights of this type."""
    return kernels.TypeTraitsCpu.from_address(ggml_lib.lib().ggml_get_type_traits_cpu(qtype)).vec_dot_type


class GgmlShard(_ShareBase):
    """One device's units on a ggml backend, the CPU's or a CUDA GPU's (QuantShard's interface, static shares)."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, spec: ShardSpec, max_len: int,
                 threads: int | None = 1, mapped_files: Sequence[Path] = (), device: str = "cpu",
                 slots: int = 1) -> None:
        """`slots`: sequences whose caches it holds at once (max_len rows each), for batched steps
        (attention_rows); the one-sequence calls take the first unless told another."""
        super().__init__(config, spec, max_len)
        if slots < 1:
            raise ValueError(f"a share holds at least one sequence's cache, not {slots}")
        self.slots = slots
        self.slot_lengths += [[0] * config.n_layers for _ in range(slots - 1)]
        c = config
        self.backend = GgmlBackend(threads, device)
        store = self.store = WeightStore(self.backend)
        add = store.add
        hd, per_kv = c.head_dim, c.heads_per_kv
        self.attn: list[AttnTensors | None] = []
        self.mlp_tensors: list[tuple[int, int, int] | None] = []
        self._bytes: dict[tuple[int, Block], int] = {}
        self._input_types: set[int] = set()  # the weights the layers' inputs are multiplied with
        rope_freqs = None if weights.rope_freqs is None else add("rope_freqs", weights.rope_freqs)
        for layer, w in enumerate(weights.layers):
            units, groups = spec.attn_units[layer], spec.mlp_groups[layer]
            if units:
                q_spans, kv_spans = _spans(units, per_kv * hd), _spans(units, hd)
                q_rows, kv_rows = _index(q_spans), _index(kv_spans)
                wq, wk, wv = w.wq.take_rows(q_rows), w.wk.take_rows(kv_rows), w.wv.take_rows(kv_rows)
                wo = column_ranges(w.wo, q_spans)
                self.attn.append(AttnTensors(
                    wq=add(f"{layer}.wq", wq), wk=add(f"{layer}.wk", wk), wv=add(f"{layer}.wv", wv),
                    wo=add(f"{layer}.wo", wo),
                    bq=None if w.bq is None else add(f"{layer}.bq", w.bq[q_rows]),
                    bk=None if w.bk is None else add(f"{layer}.bk", w.bk[kv_rows]),
                    bv=None if w.bv is None else add(f"{layer}.bv", w.bv[kv_rows]),
                    q_norm=None if w.q_norm is None else add(f"{layer}.q_norm", w.q_norm),
                    k_norm=None if w.k_norm is None else add(f"{layer}.k_norm", w.k_norm),
                    k_cache=store.cache(f"{layer}.k_cache", len(units) * hd, max_len * slots),
                    v_cache=store.cache(f"{layer}.v_cache", len(units) * hd, max_len * slots),
                    n_heads=len(units) * per_kv, n_kv_heads=len(units), layer=layer, rope_freqs=rope_freqs))
                self._bytes[layer, Block.ATTN] = wq.nbytes + wk.nbytes + wv.nbytes + wo.nbytes
                self._input_types.update(_qtype(t) for t in (wq, wk, wv))
            else:
                self.attn.append(None)
            if groups:
                ranges = self._group_ranges(groups)
                gate, up = w.w_gate.take_rows(_index(ranges)), w.w_up.take_rows(_index(ranges))
                down = column_ranges(w.w_down, ranges)
                self.mlp_tensors.append((add(f"{layer}.gate", gate), add(f"{layer}.up", up),
                                         add(f"{layer}.down", down)))
                self._bytes[layer, Block.MLP] = gate.nbytes + up.nbytes + down.nbytes
                self._input_types.update(_qtype(t) for t in (gate, up))
            else:
                self.mlp_tensors.append(None)
        self.head: int | None = None
        if len(self.vocab_rows):
            rows = weights.output.take_rows(self.vocab_rows)
            self.head = store.add_rows("head", rows, HEAD_PART_BYTES)
            self._bytes[0, Block.HEAD] = rows.nbytes
        store.upload(release=lambda: release_mapped_files(mapped_files))
        # Its layers' inputs may travel as wire's Q8 at no cost to its bits where, on the CPU, every weight they are
        # multiplied with takes Q8_0 activations (Q4_0, Q8_0, Q5_0, IQ4_NL: not Q4_1's Q8_1, not K-quants' Q8_K,
        # nor float weights) and this ggml quantizes those as wire.encode_vector does: ggml then quantizes
        # the decoded input into the bytes it quantizes the float32 input into, and computes the same.
        self.takes_q8_inputs = device == "cpu" and all(
            _activations_type(t) in Q8_ACTIVATIONS for t in self._input_types) and ggml_quantizes_as_wire()
        if device == "cpu":
            huge_pages()
        self._graphs: dict[tuple, _BlockGraph] = {}
        self._scratch = ScratchAllocator(self.backend)
        # One-token calls and their time beyond ggml's graph computation (inputs in, outputs out, Python): a
        # share call's fixed cost, as bench tp reports it.
        self.calls = CallCost()

    @property
    def weight_bytes(self) -> int:
        return sum(self._bytes.values())

    @property
    def cache_bytes(self) -> int:
        c = self.config
        return sum(2 * len(units) * c.head_dim * self.max_len * self.slots * 2
                   for units in self.spec.attn_units if units)

    def block_bytes(self, layer: int, block: Block, units: int | None = None) -> int:
        return self._bytes.get((0 if block == Block.HEAD else layer, block), 0)

    def _graph(self, key: tuple, build) -> _BlockGraph:
        # a batch's rows, each its sequence's alone, or a prompt's tokens (kernels.each_column_alone): other products
        key = (*key, kernels.columns_alone())
        graph = self._graphs.get(key)
        if graph is None:
            # One-token graphs and batched steps' are kept (the batches' attention up to BATCH_GRAPHS_KEPT make-ups,
            # their MLP and LM head for every row count up to the slots'); prompts come in every length and are
            # laid out in the scratch buffer.
            keep = key[2] == 1 or key[0] == ROWS or (key[0] in (Block.MLP, Block.HEAD) and key[2] <= self.slots)
            if key[0] == ROWS and \
                    sum(k[0] == ROWS for k in self._graphs) >= BATCH_GRAPHS_KEPT * self.config.n_layers:
                self._graphs = {k: g for k, g in self._graphs.items() if k[0] != ROWS}
            graph = build(None if keep else self._scratch)
            if keep:
                self._graphs[key] = graph
        return graph

    def attention(self, layer: int, x_norm: np.ndarray, start: int, *, output: bool = True,
                  units: Sequence[int] | None = None, slot: int = 0) -> np.ndarray | None:
        """The attention partial of tokens at positions start.. of the sequence in `slot`."""
        began = time.perf_counter()
        self._check_slot(slot)
        x, end = self._static_attention_input(layer, x_norm, start, units, slot)
        seq = x.shape[0]
        tensors = self.attn[layer]
        if tensors is None:
            return np.zeros((seq, self.config.hidden), np.float32) if output else None
        n_kv, base = cache_rows(end, self.max_len), slot * self.max_len
        graph = self._graph((Block.ATTN, layer, seq, n_kv, slot),
                            lambda scratch: _BlockGraph.attention(self, tensors, seq, n_kv, scratch, base))
        graph.inputs.set(graph.gc, start, graph.mask, base)
        out = graph.run(x)
        self.calls.add(graph, began)
        return out if output else None

    def attention_rows(self, layer: int, x_norm: np.ndarray, rows: Sequence[tuple[int, int]]) -> np.ndarray:
        """One position of each of several sequences, (slot, position) each, in one graph: row i of x_norm (and
        of the partial returned) is the sequence in rows[i]'s slot at its position; each attends to its own cache,
        and its row is the one it gets alone."""
        x = _rows(x_norm, self.config.hidden)
        if len(rows) != x.shape[0] or len({slot for slot, _ in rows}) != len(rows):
            raise ValueError(f"{x.shape[0]} rows for a batch of {len(rows)} distinct slots")
        for slot, position in rows:
            self._check_slot(slot)
            self._advance(layer, position, 1, slot)
        tensors = self.attn[layer]
        if tensors is None:
            return np.zeros((x.shape[0], self.config.hidden), np.float32)
        make_up = tuple((slot, cache_rows(position + 1, self.max_len), 1) for slot, position in rows)
        with kernels.each_column_alone():  # every row is a sequence's, its numbers as it gets them alone
            graph = self._graph((ROWS, layer, make_up),
                                lambda _: _BlockGraph.attention_rows(self, tensors, make_up))
        graph.batch.set(graph.gc, [position for _, position in rows])
        return graph.run(x)

    def attention_spans(self, layer: int, x_norm: np.ndarray, spans: Sequence[tuple[int, int, int]]) -> np.ndarray:
        """Tokens of several sequences in one graph, (slot, start, tokens) each (a round's prompt chunks beside its
        decode tokens): x_norm's rows are theirs in that order; each attends to its own cache, and its rows are
        those its own step gives it (where every product gives a column its bits at any column count)."""
        x = _rows(x_norm, self.config.hidden)
        if sum(n for _, _, n in spans) != x.shape[0] or len({slot for slot, _, _ in spans}) != len(spans):
            raise ValueError(f"{x.shape[0]} rows for the tokens of {len(spans)} distinct slots")
        for slot, start, n in spans:
            self._check_slot(slot)
            self._advance(layer, start, n, slot)
        tensors = self.attn[layer]
        if tensors is None:
            return np.zeros((x.shape[0], self.config.hidden), np.float32)
        make_up = tuple((slot, cache_rows(start + n, self.max_len), n) for slot, start, n in spans)
        with kernels.each_column_alone():
            # chunks in every length: built in the scratch buffer each time, as a prompt's
            graph = self._graph((SPANS, layer, make_up), lambda scratch: _BlockGraph.attention_rows(
                self, tensors, make_up, scratch))
        graph.batch.set(graph.gc, [start for _, start, _ in spans])
        return graph.run(x)

    def copy_cache(self, source: int, target: int, rows: int, layers: Sequence[int] | None = None) -> None:
        """The keys and values of the first `rows` positions of the sequence in slot `source` into slot
        `target`'s (a prompt's prefix computed once for sequences that share it), in every layer or in `layers`."""
        self._check_slot(source)
        self._check_slot(target)
        if source == target:
            return
        if not 0 <= rows <= self.max_len:
            raise ValueError(f"a cache copy takes at most {self.max_len} rows, not {rows}")
        for layer in range(self.config.n_layers) if layers is None else layers:
            if (tensors := self.attn[layer]) is not None:
                copy_rows(self.store, (tensors.k_cache, tensors.v_cache), source * self.max_len,
                          target * self.max_len, rows)
            self.slot_lengths[target][layer] = rows

    def step_attention(self, layer: int, x_norm: np.ndarray, slots: Sequence[int], starts: Sequence[int],
                       copy: Sequence[int] = (), counts: Sequence[int] = ()) -> np.ndarray:
        """A batched step's attention partial (tp.messages.BatchStep): one sequence's tokens from starts[0] of the
        sequence in slots[0], or one token of each of several, or with `counts` that many tokens of each; `copy`'s
        (source, target, rows) first, at this layer."""
        for i in range(0, len(copy), 3):
            self.copy_cache(*copy[i:i + 3], layers=(layer,))
        if counts:
            return self.attention_spans(layer, x_norm, list(zip(slots, starts, counts, strict=True)))
        if len(slots) == 1:
            out = self.attention(layer, x_norm, starts[0], slot=slots[0])
            assert out is not None
            return out
        return self.attention_rows(layer, x_norm, list(zip(slots, starts, strict=True)))

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not one of this share's {self.slots}")

    def mlp(self, layer: int, x_norm: np.ndarray, groups: Sequence[int] | None = None) -> np.ndarray:
        if groups is not None:
            raise ValueError("a static share computes its own groups; dynamic mapping runs on DynamicQuantShard")
        began = time.perf_counter()
        x = _rows(x_norm, self.config.hidden)
        tensors = self.mlp_tensors[layer]
        if tensors is None:
            return np.zeros((x.shape[0], self.config.hidden), np.float32)
        graph = self._graph((Block.MLP, layer, x.shape[0]),
                            lambda scratch: _BlockGraph.mlp(self, tensors, x.shape[0], scratch))
        out = graph.run(x)
        self.calls.add(graph, began)
        return out

    @property
    def native(self) -> bool:
        """Whether the native data path can compute this share's blocks: it writes one causal mask a step, which a
        model with windowed layers (Gemma's) does not take."""
        return self.config.sliding_window == 0

    def native_graph(self, layer: int, block: Block, n_kv: int) -> NativeGraph | None:
        """This block's one-token graph for a step that reads n_kv cache rows, as the native runner computes it
        (net.fastpath.Runner, which writes the attention's position and mask itself); None where this share holds
        no unit of the block. Only for a share in this process's memory (on the CPU)."""
        if block == Block.ATTN:
            tensors = self.attn[layer]
            if tensors is None:
                return None
            graph = self._graph((Block.ATTN, layer, 1, n_kv, 0),
                                lambda scratch: _BlockGraph.attention(self, tensors, 1, n_kv, scratch))
        else:
            tensors = self.mlp_tensors[layer]
            if tensors is None:
                return None
            graph = self._graph((Block.MLP, layer, 1), lambda scratch: _BlockGraph.mlp(self, tensors, 1, scratch))
        graph.fresh = False
        gc = graph.gc

        def at(t: int) -> int:
            return gc.view(t).ctypes.data

        if block != Block.ATTN:
            return NativeGraph(gc.graph, at(graph.x), at(graph.out))
        inputs = graph.inputs
        # attention on kernels.c's op reads no mask (the graph leaves it unallocated)
        mask = at(inputs.mask) if gc.allocated(inputs.mask) else 0
        return NativeGraph(gc.graph, at(graph.x), at(graph.out), at(inputs.pos), at(inputs.rows), mask, n_kv)

    def advance(self, layers: Sequence[int], start: int) -> None:
        """These layers' caches take the token at `start` (a step the native runner computes)."""
        for layer in layers:
            self._advance(layer, start, 1)

    def logits(self, x_norm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        began = time.perf_counter()
        x = _rows(x_norm, self.config.hidden)
        if self.head is None:
            return self.vocab_rows, np.zeros((x.shape[0], 0), np.float32)
        graph = self._graph((Block.HEAD, 0, x.shape[0]), lambda scratch: _BlockGraph.head(self, x.shape[0], scratch))
        out = graph.run(x)
        self.calls.add(graph, began)
        return self.vocab_rows, out


def ggml_compute_address() -> int:
    """The address of ggml's graph computation (ggml_backend_graph_compute), for the native runner to call."""
    return ctypes.cast(ggml_lib.lib().ggml_backend_graph_compute, ctypes.c_void_p).value


def build_share(config: ModelConfig, weights: ModelWeights, spec: ShardSpec, max_len: int, threads: int | None,
                activations: Activations, *, dynamic: bool = False, mapped_files: Sequence[Path] = (),
                device: str = "cpu", slots: int = 1) -> GgmlShard | QuantShard:
    """The share a device computes: on ggml, llama.cpp's kernels and numerics, for a static share with int8
    activations (the default); on onnxruntime where ggml has no graph for it yet: dynamic mapping, whose blocks
    take per-token unit flags, and float32 activations, which compute what the numpy reference does. A dynamic
    share's `spec` holds every unit (every_unit_spec). `device` "cuda" computes on ggml's CUDA backend, which
    only the ggml share has; `slots` sequences' caches (batch sessions) only the ggml share holds."""
    if device != "cpu" and (dynamic or activations is Activations.F32):
        raise EdgerunError(f"a share on {device} runs on ggml: static mapping and int8 activations only")
    if slots > 1 and (dynamic or activations is Activations.F32):
        raise EdgerunError("a batch of sequences runs on ggml shares: static mapping and int8 activations only")
    if (dynamic or activations is Activations.F32) and (reason := lacking(config, weights, "an onnxruntime share")):
        raise EdgerunError(f"{reason}: ggml's shares do (static mapping, int8 activations)")
    if dynamic:
        return DynamicQuantShard(config, weights, spec, max_len, threads, activations, mapped_files)
    if activations is Activations.F32:
        return QuantShard(config, weights, spec, max_len, threads, activations, mapped_files)
    return GgmlShard(config, weights, spec, max_len, threads, mapped_files, device, slots)


def _index(ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    return np.concatenate([np.arange(a, b) for a, b in ranges]).astype(np.int64)


class CallCost:
    """One-token share calls counted, and their seconds beyond ggml's graph computation."""

    def __init__(self) -> None:
        self.count = 0
        self.overhead_s = 0.0

    def add(self, graph: _BlockGraph, began: float) -> None:
        """A call that began at `began` and ran this graph (a call that built its graph is not counted)."""
        if graph.fresh:
            graph.fresh = False
        elif graph.seq == 1:
            self.count += 1
            self.overhead_s += time.perf_counter() - began - graph.compute_s


class _BlockGraph:
    """One block's graph: hidden states in (hidden, seq), its partial out (width, seq)."""

    def __init__(self, shard: GgmlShard, seq: int, sequences: int = 1) -> None:
        parts = 0 if shard.head is None else len(shard.store.parts(shard.head))
        # each sequence of a batched step adds its attention's views, permutes, flash attention, reshape, concat
        self.gc = GraphContext(shard.backend, BLOCK_GRAPH_NODES + 8 * parts + 12 * sequences)
        self.x = self.gc.input(ggml_lib.F32, shard.config.hidden, seq)
        self.seq = seq
        self.inputs: StepInputs | None = None  # an attention block's positions, cache rows and mask
        self.batch: BatchInputs | None = None  # a batched step's, each sequence's own
        self.mask = np.zeros(0, np.float16)
        self.out = 0
        self.width = 0
        self.compute_s = 0.0  # the last run's graph computation
        self.fresh = True  # built for this call

    @classmethod
    def attention(cls, shard: GgmlShard, tensors: AttnTensors, seq: int, n_kv: int,
                  scratch: ScratchAllocator | None, base: int = 0) -> _BlockGraph:
        """Tokens of one sequence, whose cache rows start at `base` (its slot's)."""
        graph = cls(shard, seq)
        inputs = graph.inputs = StepInputs.of(graph.gc, seq, n_kv, shard.config.sliding_window)
        graph.mask = np.zeros((seq, n_kv), np.float16)
        spans = [Span(0, seq, base, n_kv, inputs.mask, inputs.window_mask)] if base else None
        graph._finish(attention_block(graph.gc, shard.store.tensor, shard.config, tensors, graph.x, inputs,
                                      SHARE_ROPE, spans), shard.config.hidden, scratch)
        return graph

    @classmethod
    def attention_rows(cls, shard: GgmlShard, tensors: AttnTensors, make_up: tuple[tuple[int, int, int], ...],
                       scratch: ScratchAllocator | None = None) -> _BlockGraph:
        """Tokens of several sequences, (slot, cache rows read, tokens) each: one token each of a batch's, or
        beside them a round's prompt chunks."""
        graph = cls(shard, sum(n for _, _, n in make_up), len(make_up))
        graph.batch = BatchInputs.of(graph.gc, make_up, shard.max_len, shard.config.sliding_window)
        graph._finish(attention_block(graph.gc, shard.store.tensor, shard.config, tensors, graph.x,
                                      graph.batch.inputs, SHARE_ROPE, graph.batch.spans), shard.config.hidden,
                      scratch)
        return graph

    @classmethod
    def mlp(cls, shard: GgmlShard, tensors: tuple[int, int, int], seq: int,
            scratch: ScratchAllocator | None) -> _BlockGraph:
        graph = cls(shard, seq)
        graph._finish(mlp_block(graph.gc.ctx, shard.store.tensor, *tensors, graph.x, shard.config.activation),
                      shard.config.hidden, scratch)
        return graph

    @classmethod
    def head(cls, shard: GgmlShard, seq: int, scratch: ScratchAllocator | None) -> _BlockGraph:
        graph = cls(shard, seq)
        assert shard.head is not None
        graph._finish(lm_head(graph.gc.ctx, shard.store, shard.head, graph.x), len(shard.vocab_rows), scratch)
        return graph

    def _finish(self, out: int, width: int, scratch: ScratchAllocator | None) -> None:
        self.out, self.width = out, width
        self.gc.expand(out)
        self.gc.allocate(scratch)

    def run(self, x: np.ndarray) -> np.ndarray:
        self.gc.set(self.x, x)
        began = time.perf_counter()
        self.gc.compute()
        self.compute_s = time.perf_counter() - began
        return self.gc.get(self.out, np.empty((self.seq, self.width), np.float32))
