"""One device's share of every block in tensor-parallel mode.

`QuantShard` is the engine: each block a device holds units of is one small onnxruntime graph over the
units' quantized rows and columns (4-bit and 8-bit kernels, as the whole-model engine), with the KV
cache in preallocated buffers the attention kernel appends to in place: one native call per block.
`DynamicQuantShard`, for dynamic mapping, holds every unit in such graphs and runs those a ranking hands it,
chosen inside the graph. `Shard` below them is the float32 numpy reference the tests check them against.

A device holds some attention units (one KV head with the query heads that share it), some MLP
neuron groups (`group_size` intermediate rows of gate/up with the matching columns of down) and
some LM-head vocabulary blocks. For each block it returns a partial output; the partial outputs of
all devices sum to the reference block output, because the output projections are linear in the
per-head and per-neuron activations. The master adds the residuals and applies the norms, so a
shard holds no norm weights.

Only the rows and columns a device needs are dequantized to float32. Row slices (wq, wk, wv,
gate, up, LM head) come from `QuantTensor.take_rows`. Column slices (wo, w_down) are cut from the
quantized bytes of every row: quant blocks run along the columns, so the blocks that cover a column
range are dequantized and trimmed to it, and a whole matrix is never dequantized unless the device
holds all of it.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgerun.memory import huge_pages, release_mapped_files
from edgerun.model.config import ModelConfig
from edgerun.model.onnx_graph import (
    Activations,
    cache_root,
    dynamic_attention_graph,
    dynamic_mlp_graph,
    shard_attention_graph,
    shard_head_graph,
    shard_mlp_graph,
    shard_weights_path,
)
from edgerun.model.quant import dequantize_columns
from edgerun.model.reference import apply_rope, n_groups, rope_tables, silu
from edgerun.model.sampling import largest
from edgerun.model.session import session_options, share_cpu_arena
from edgerun.model.weights import LayerWeights, ModelWeights
from edgerun.net.wire import Block


@dataclass(frozen=True)
class ShardSpec:
    """What one device computes, in unit indices (not priority indices)."""

    attn_units: tuple[tuple[int, ...], ...]  # per layer: KV-head indices
    mlp_groups: tuple[tuple[int, ...], ...]  # per layer: MLP group indices
    vocab_blocks: tuple[int, ...]  # LM-head block indices
    group_size: int = 256
    vocab_block: int = 4096


def full_spec(config: ModelConfig, group_size: int = 256, vocab_block: int = 4096) -> ShardSpec:
    """Every unit on one device."""
    attn = tuple(range(config.n_kv_heads))
    mlp = tuple(range(n_groups(config.ffn, group_size)))
    return ShardSpec((attn,) * config.n_layers, (mlp,) * config.n_layers,
                     tuple(range(n_groups(config.vocab_size, vocab_block))), group_size, vocab_block)


def every_unit_spec(config: ModelConfig, spec: ShardSpec) -> ShardSpec:
    """Every attention unit and MLP group, with `spec`'s vocabulary blocks: a dynamic-mapping share, which
    computes the units a ranking hands it each step (the LM head is not ranked)."""
    return replace(full_spec(config, spec.group_size, spec.vocab_block), vocab_blocks=spec.vocab_blocks)


def split_spec(config: ModelConfig, n: int, group_size: int = 256, vocab_block: int = 4096) -> list[ShardSpec]:
    """Units dealt round-robin over n devices. In layer l unit u goes to device (u + l) mod n, so
    with fewer units than devices a different device sits a layer out each time."""
    if n < 1:
        raise ValueError(f"need at least one device, not {n}")
    n_attn, n_mlp = config.n_kv_heads, n_groups(config.ffn, group_size)
    n_vocab = n_groups(config.vocab_size, vocab_block)

    def deal(count: int, offset: int, device: int) -> tuple[int, ...]:
        return tuple(u for u in range(count) if (u + offset) % n == device)

    return [
        ShardSpec(
            attn_units=tuple(deal(n_attn, layer, d) for layer in range(config.n_layers)),
            mlp_groups=tuple(deal(n_mlp, layer, d) for layer in range(config.n_layers)),
            vocab_blocks=deal(n_vocab, 0, d),
            group_size=group_size,
            vocab_block=vocab_block,
        )
        for d in range(n)
    ]


def head_top(logits: np.ndarray, top: int) -> np.ndarray:
    """A device's LM-head partial for samplers that draw from `top` logits at most: for each token's row of
    `logits` (a request's one, a batch's each), its `top` largest logits (sampling.largest, of its own rows), then
    their places among its rows, all float32 (a place is below 2^24: exact). The master's
    deployment.place_head_top puts them back."""
    parts = []
    for row in logits.reshape(-1, logits.shape[-1]):
        chosen = largest(row, top)
        parts += [row[chosen], chosen]
    return np.concatenate(parts).astype(np.float32)


def head_top_size(rows: int, top: int) -> int:
    """Elements of a head_top partial of a device with `rows` vocabulary rows, for each token."""
    return 2 * min(top, rows)


def _row_index(ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    return np.concatenate([np.arange(a, b) for a, b in ranges]) if ranges else np.zeros(0, np.int64)


def _check_units(units: Sequence[int], count: int, where: str) -> None:
    if len(set(units)) != len(units) or any(not 0 <= u < count for u in units):
        raise ValueError(f"{where} must be distinct indices in 0..{count - 1}, not {list(units)}")


@dataclass(frozen=True)
class AttnWeights:
    """Gathered query/output weights of some attention units (see Shard.attention_weights)."""
    local: np.ndarray  # positions of the units among those the shard holds
    wq: np.ndarray
    wo: np.ndarray
    bq: np.ndarray | None


@dataclass(frozen=True)
class MlpWeights:
    """Gathered weights of some MLP neuron groups (see Shard.mlp_weights)."""
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


@dataclass
class _AttnShard:
    wq: np.ndarray  # (units * heads_per_kv * head_dim, hidden)
    wk: np.ndarray  # (units * head_dim, hidden)
    wv: np.ndarray
    wo: np.ndarray  # (hidden, units * heads_per_kv * head_dim)
    bq: np.ndarray | None
    bk: np.ndarray | None
    bv: np.ndarray | None
    k: np.ndarray  # cache, (units, max_len, head_dim)
    v: np.ndarray

    @property
    def n_units(self) -> int:
        return self.k.shape[0]

    def weight_bytes(self) -> int:
        arrays = (self.wq, self.wk, self.wv, self.wo, self.bq, self.bk, self.bv)
        return sum(a.nbytes for a in arrays if a is not None)


@dataclass
class _MlpShard:
    w_gate: np.ndarray  # (rows, hidden)
    w_up: np.ndarray
    w_down: np.ndarray  # (hidden, rows)

    def weight_bytes(self) -> int:
        return self.w_gate.nbytes + self.w_up.nbytes + self.w_down.nbytes


class _ShareBase:
    """What both kinds of share have: the spec checked against the model, the LM-head rows it holds, and the
    positions each layer's KV cache holds (a layer's attention may only continue from what it holds)."""

    def __init__(self, config: ModelConfig, spec: ShardSpec, max_len: int) -> None:
        c = config
        if len(spec.attn_units) != c.n_layers or len(spec.mlp_groups) != c.n_layers:
            raise ValueError(f"the spec must list units for each of the {c.n_layers} layers")
        if spec.group_size < 1 or spec.vocab_block < 1 or max_len < 1:
            raise ValueError("group_size, vocab_block and max_len must be positive")
        n_mlp = n_groups(c.ffn, spec.group_size)
        for layer in range(c.n_layers):
            _check_units(spec.attn_units[layer], c.n_kv_heads, f"layer {layer} attention units")
            _check_units(spec.mlp_groups[layer], n_mlp, f"layer {layer} MLP groups")
        _check_units(spec.vocab_blocks, n_groups(c.vocab_size, spec.vocab_block), "vocab blocks")
        self.config, self.spec, self.max_len = config, spec, max_len
        self.vocab_rows = _row_index([(b * spec.vocab_block, min((b + 1) * spec.vocab_block, c.vocab_size))
                                      for b in spec.vocab_blocks]).astype(np.int64)
        self.lengths = [0] * c.n_layers
        # Whether its layers' inputs may travel as wire's Q8 at no cost to its bits (GgmlShard.takes_q8_inputs):
        # onnxruntime's shares compute in float32 from what comes, so theirs travel as float32.
        self.takes_q8_inputs = False
        # per sequence a share holds (GgmlShard's slots), each layer's cached positions; the first is `lengths`
        self.slot_lengths = [self.lengths]

    def _advance(self, layer: int, start: int, seq: int, slot: int = 0) -> int:
        """A layer's cache (of the sequence in `slot`) takes positions start..start+seq-1 (forgetting any after
        them): check that it can, note its new length and return it."""
        end = start + seq
        lengths = self.slot_lengths[slot]
        if not 0 <= start <= lengths[layer]:
            raise ValueError(f"layer {layer} holds {lengths[layer]} positions; cannot continue at {start}")
        if end > self.max_len:
            raise ValueError(f"context of {self.max_len} tokens exceeded")
        lengths[layer] = end
        return end

    def _static_attention_input(self, layer: int, x_norm: np.ndarray, start: int,
                                units: Sequence[int] | None, slot: int = 0) -> tuple[np.ndarray, int]:
        """A static share's attention input as rows (seq, hidden), its layer's cache (of the sequence in `slot`)
        advanced to take them, and the cache's new length."""
        if units is not None:
            raise ValueError("a static share computes its own units; dynamic mapping runs on DynamicQuantShard")
        x = _rows(x_norm, self.config.hidden)
        return x, self._advance(layer, start, x.shape[0], slot)

    def _group_ranges(self, groups: Sequence[int]) -> list[tuple[int, int]]:
        """The intermediate rows [start, stop) of each MLP group."""
        size, ffn = self.spec.group_size, self.config.ffn
        return [(g * size, min((g + 1) * size, ffn)) for g in groups]

    def truncate(self, length: int) -> None:
        """Forget cached positions >= length in every layer."""
        if length < 0:
            raise ValueError(f"length must not be negative, not {length}")
        self.lengths[:] = [min(n, length) for n in self.lengths]  # in place: the native server reads this list


def _rows(x: np.ndarray, hidden: int) -> np.ndarray:
    """x as (tokens, hidden): itself where it is already two-dimensional (every caller's one-token input), with no
    numpy call (see _Block.run)."""
    return x if x.ndim == 2 else np.reshape(x, (-1, hidden))


class _Block:
    """One onnxruntime session with its inputs and outputs bound; decode steps (one token) run on preallocated
    buffers bound once, into which each step copies its input and position, so the hot path allocates nothing
    and binds nothing. Steps of several tokens (prefill) bind their own arrays, and the next one-token step binds
    the buffers again."""

    def __init__(self, graph: Path, weight_bytes: int, threads: int | None, output: str, width: int) -> None:
        options = session_options(threads)
        if threads and threads > 1:  # many sessions run one after another: an idle one must not spin on the cores
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        # A share is dozens of small sessions. Each one's arena, and the memory pattern it plans for every input
        # shape (prefills of each length), would keep their peak allocations for good: 100-250 MB in all on a 1B
        # share, a third of its weights. They share the process's one arena instead (share_cpu_arena).
        options.enable_cpu_mem_arena = False
        options.enable_mem_pattern = False
        share_cpu_arena(options)
        self.session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        self.weight_bytes = weight_bytes
        self.binding = self.session.io_binding()
        self.binding.bind_output(output)  # first, so it is output 0
        self.output = output
        inputs = {i.name: i for i in self.session.get_inputs()}
        # The one-token buffers: input, output, and where the graph takes them, the position and the units' flags.
        self.x1 = np.zeros((1, 1, int(inputs["hidden"].shape[-1])), np.float32)
        self.out1 = np.zeros((1, 1, width), np.float32)  # the one-token output, reused
        self.out_row = self.out1.reshape(1, width)  # the same memory as a (tokens, width) row, as run returns it
        self.seqlens1 = np.zeros(1, np.int32) if "seqlens_k" in inputs else None
        self.total1 = np.zeros((), np.int32) if "total_seq_len" in inputs else None
        self.flags1 = np.zeros(int(inputs["flags"].shape[0]), np.bool_) if "flags" in inputs else None
        self.one_token_bound = False

    def bind_cache(self, key: np.ndarray, value: np.ndarray) -> None:
        for past, present, buffer in (("past_key", "present_key", key), ("past_value", "present_value", value)):
            ort_value = ort.OrtValue.ortvalue_from_numpy(buffer)
            self.binding.bind_ortvalue_input(past, ort_value)
            self.binding.bind_ortvalue_output(present, ort_value)

    def _bind_one_token(self) -> None:
        b = self.binding
        for name, buffer in (("hidden", self.x1), ("seqlens_k", self.seqlens1), ("total_seq_len", self.total1),
                             ("flags", self.flags1)):
            if buffer is not None:
                b.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(buffer))
        b.bind_ortvalue_output(self.output, ort.OrtValue.ortvalue_from_numpy(self.out1))
        self.one_token_bound = True

    def run(self, x: np.ndarray, total: int | None = None, flags: np.ndarray | None = None) -> np.ndarray:
        """The block's output (seq, width) for x (seq, hidden) (with `flags`, of the units they select); for one
        token, a buffer reused by the next call. The one-token path makes as few numpy calls as it can: each
        costs 10-20 µs right after a kernel has streamed weights through the caches (wire.as_f32)."""
        b = self.binding
        if x.shape[0] == 1:
            if not self.one_token_bound:
                self._bind_one_token()
            self.x1[...] = x  # (1, hidden) into (1, 1, hidden), converted to float32 on the way
            if total is not None:
                self.seqlens1[0], self.total1[...] = total - 1, total
            if flags is not None:
                self.flags1[...] = flags
            self.session.run_with_iobinding(b)
            return self.out_row
        self.one_token_bound = False
        b.bind_cpu_input("hidden", np.ascontiguousarray(x, np.float32).reshape(1, x.shape[0], -1))
        if flags is not None:
            b.bind_cpu_input("flags", flags)
        if total is not None:
            b.bind_cpu_input("seqlens_k", np.array([total - 1], np.int32))
            b.bind_cpu_input("total_seq_len", np.array(total, np.int32))
        b.bind_output(self.output)
        self.session.run_with_iobinding(b)
        out = b.get_outputs()[0].numpy().reshape(x.shape[0], -1)
        # The binding would hold this step's input and output until the block's next one-token step: a
        # prompt's worth of activations in every block of the share. Letting go here took a 2-device 1B node's
        # peak down by 17 MB for a 70-token prompt (its prompt added 28 MB of resident memory instead of 45).
        self._bind_one_token()
        return out


def _shard_build_root() -> Path:
    root = cache_root() / "shards"
    root.mkdir(parents=True, exist_ok=True)
    return root


class QuantShard(_ShareBase):
    """One device's attention units, MLP groups and vocabulary blocks as quantized onnxruntime graphs, one
    per block, with the KV cache of its KV heads. The same interface as Shard, for static shares (`units`
    and `weights` are for dynamic mapping, which runs on Shard). Outputs of one-token steps are buffers the
    block reuses on its next call: use them before calling that block again."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, spec: ShardSpec, max_len: int,
                 threads: int | None = 1, activations: Activations = Activations.INT8,
                 mapped_files: Sequence[Path] = ()) -> None:
        """`mapped_files`: the files `weights` are memory-mapped from. Their pages, and those of each block's own
        weights file (onnxruntime has prepacked what it runs onto its heap), are let go of after every layer, so
        they never pile up in the device's memory."""
        super().__init__(config, spec, max_len)
        # Block graphs are written here, loaded and deleted at once (onnxruntime keeps what it mapped).
        build_dir = Path(tempfile.mkdtemp(prefix="shard-", dir=_shard_build_root()))
        try:
            self._build(weights, build_dir, threads, activations.accuracy_level, mapped_files)
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)
        huge_pages()  # the weights the kernels repacked, streamed every token (edgerun.memory.huge_pages)

    def _build(self, weights: ModelWeights, build_dir: Path, threads: int | None, accuracy_level: int,
               mapped_files: Sequence[Path]) -> None:
        c, spec, max_len = self.config, self.spec, self.max_len
        self.attn: list[_Block | None] = []
        self.kv: list[tuple[np.ndarray, np.ndarray] | None] = []
        self.mlp_blocks: list[_Block | None] = []
        for layer, w in enumerate(weights.layers):
            units, groups = spec.attn_units[layer], spec.mlp_groups[layer]
            attn_path, mlp_path = build_dir / f"attention{layer}.onnx", build_dir / f"mlp{layer}.onnx"
            if units:
                block = _Block(attn_path, shard_attention_graph(c, w, units, max_len, attn_path, accuracy_level),
                               threads, "partial", c.hidden)
                cache = tuple(np.zeros((1, len(units), max_len, c.head_dim), np.float32) for _ in range(2))
                block.bind_cache(*cache)
                self.attn.append(block)
                self.kv.append(cache)
            else:
                self.attn.append(None)
                self.kv.append(None)
            self.mlp_blocks.append(_Block(mlp_path, shard_mlp_graph(c, w, self._group_ranges(groups), mlp_path,
                                                                    accuracy_level), threads, "partial", c.hidden)
                                   if groups else None)
            release_mapped_files([shard_weights_path(attn_path), shard_weights_path(mlp_path), *mapped_files])
        self._build_head(weights, build_dir, threads, accuracy_level, mapped_files)

    def _build_head(self, weights: ModelWeights, build_dir: Path, threads: int | None, accuracy_level: int,
                    mapped_files: Sequence[Path]) -> None:
        path = build_dir / "head.onnx"
        # The head is the share's largest block: the model file's pages its rows were read from go after each
        # chunk, before onnxruntime prepacks it, or they would add its size again to the device's peak memory.
        self.head = (_Block(path, shard_head_graph(self.config, weights.output, self.vocab_rows, path, accuracy_level,
                                                   lambda: release_mapped_files(mapped_files)),
                            threads, "logits", len(self.vocab_rows)) if len(self.vocab_rows) else None)
        release_mapped_files([shard_weights_path(path), *mapped_files])

    @property
    def weight_bytes(self) -> int:
        """Bytes of the share's quantized weights as its kernels take them (codes, scales, offsets)."""
        blocks = [b for b in (*self.attn, *self.mlp_blocks, self.head) if b is not None]
        return sum(b.weight_bytes for b in blocks)

    @property
    def cache_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in (kv for kv in self.kv if kv is not None))

    def block_bytes(self, layer: int, block: Block, units: int | None = None) -> int:
        """Weight bytes one step of a block streams (0 where this device holds none of it); `units` is for
        dynamic shares, which compute some of a block's units."""
        held = self.attn[layer] if block == Block.ATTN else self.mlp_blocks[layer] if block == Block.MLP else self.head
        return 0 if held is None else held.weight_bytes

    def attention(self, layer: int, x_norm: np.ndarray, start: int, *, output: bool = True,
                  units: Sequence[int] | None = None) -> np.ndarray | None:
        """Partial attention output (seq, hidden) for positions start..start+seq-1, after caching their keys
        and values (later positions are forgotten). output=False: only the cache is filled."""
        x, end = self._static_attention_input(layer, x_norm, start, units)
        block = self.attn[layer]
        if block is None:
            return np.zeros((x.shape[0], self.config.hidden), np.float32) if output else None
        out = block.run(x, end)
        return out if output else None

    def mlp(self, layer: int, x_norm: np.ndarray, groups: Sequence[int] | None = None) -> np.ndarray:
        if groups is not None:
            raise ValueError("a static share computes its own groups; dynamic mapping runs on DynamicQuantShard")
        x = _rows(x_norm, self.config.hidden)
        block = self.mlp_blocks[layer]
        if block is None:
            return np.zeros((x.shape[0], self.config.hidden), np.float32)
        return block.run(x)

    def logits(self, x_norm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = _rows(x_norm, self.config.hidden)
        if self.head is None:
            return self.vocab_rows, np.zeros((x.shape[0], 0), np.float32)
        return self.vocab_rows, self.head.run(x)


class DynamicQuantShard(QuantShard):
    """Every unit of every layer, quantized, for dynamic mapping (every device holds the whole model and computes
    the units a ranking hands it each step): one graph per block with every unit's weights, where each unit runs
    only if the step's flags select it, so a step streams the weight bytes of its units alone and nothing is
    gathered or dequantized. Keys and values of every KV head are cached each step (any head may come next
    token). Memory: the model's quantized weights plus the whole KV cache."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, spec: ShardSpec, max_len: int,
                 threads: int | None = 1, activations: Activations = Activations.INT8,
                 mapped_files: Sequence[Path] = ()) -> None:
        """`spec` must hold every attention unit and MLP group (full_spec); its vocabulary blocks are this
        device's share of the LM head, which dynamic mapping does not rank."""
        if spec != every_unit_spec(config, spec):
            raise ValueError("a dynamic share holds every attention unit and MLP group")
        super().__init__(config, weights, spec, max_len, threads, activations, mapped_files)

    def _build(self, weights: ModelWeights, build_dir: Path, threads: int | None, accuracy_level: int,
               mapped_files: Sequence[Path]) -> None:
        c, max_len = self.config, self.max_len
        ranges = self._group_ranges(range(n_groups(c.ffn, self.spec.group_size)))
        self.attn, self.kv, self.mlp_blocks = [], [], []
        for layer, w in enumerate(weights.layers):
            attn_path, mlp_path = build_dir / f"attention{layer}.onnx", build_dir / f"mlp{layer}.onnx"
            block = _Block(attn_path, dynamic_attention_graph(c, w, max_len, attn_path, accuracy_level), threads,
                           "partial", c.hidden)
            cache = tuple(np.zeros((1, c.n_kv_heads, max_len, c.head_dim), np.float32) for _ in range(2))
            block.bind_cache(*cache)
            self.attn.append(block)
            self.kv.append(cache)
            self.mlp_blocks.append(_Block(mlp_path, dynamic_mlp_graph(c, w, ranges, mlp_path, accuracy_level),
                                          threads, "partial", c.hidden))
            release_mapped_files([shard_weights_path(attn_path), shard_weights_path(mlp_path), *mapped_files])
        self._build_head(weights, build_dir, threads, accuracy_level, mapped_files)

    @staticmethod
    def _flags(count: int, chosen: Sequence[int] | None) -> np.ndarray:
        flags = np.zeros(count, bool)
        if chosen is None:
            flags[:] = True
        else:
            _check_units(chosen, count, "units")
            flags[list(chosen)] = True
        return flags

    def attention(self, layer: int, x_norm: np.ndarray, start: int, *, output: bool = True,
                  units: Sequence[int] | None = None) -> np.ndarray | None:
        """Partial attention output of `units` (every KV head for None) at positions start..start+seq-1, after
        caching keys and values of every head there; output=False: only the cache."""
        x = _rows(x_norm, self.config.hidden)
        end = self._advance(layer, start, x.shape[0])
        flags = self._flags(self.config.n_kv_heads, units) if output else np.zeros(self.config.n_kv_heads, bool)
        out = self.attn[layer].run(x, end, flags)
        return out if output else None

    def mlp(self, layer: int, x_norm: np.ndarray, groups: Sequence[int] | None = None) -> np.ndarray:
        """Partial MLP output of `groups` (every group for None)."""
        flags = self._flags(n_groups(self.config.ffn, self.spec.group_size), groups)
        return self.mlp_blocks[layer].run(_rows(x_norm, self.config.hidden), None, flags)

    def block_bytes(self, layer: int, block: Block, units: int | None = None) -> int:
        """Weight bytes a step of `units` of the block's units streams (about: its share of the block's bytes)."""
        held = super().block_bytes(layer, block)
        if units is None or block == Block.HEAD:
            return held
        total = self.config.n_kv_heads if block == Block.ATTN else n_groups(self.config.ffn, self.spec.group_size)
        return held * units // total


class Shard(_ShareBase):
    """One device's attention units, MLP groups and vocabulary blocks, with the KV cache of its
    KV heads. Every method returns this device's partial result; the caller sums them."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, spec: ShardSpec, max_len: int) -> None:
        super().__init__(config, spec, max_len)
        c = config
        self.attn: list[_AttnShard | None] = []
        self.mlp_parts: list[_MlpShard | None] = []
        for layer, w in enumerate(weights.layers):
            units, groups = spec.attn_units[layer], spec.mlp_groups[layer]
            self.attn.append(self._attn_shard(w, units) if units else None)
            if groups:
                ranges = self._group_ranges(groups)
                rows = _row_index(ranges)
                self.mlp_parts.append(_MlpShard(w.w_gate.take_rows(rows).dequantize(),
                                                w.w_up.take_rows(rows).dequantize(),
                                                dequantize_columns(w.w_down, ranges)))
            else:
                self.mlp_parts.append(None)
        self.output = (weights.output.take_rows(self.vocab_rows).dequantize() if len(self.vocab_rows)
                       else np.zeros((0, c.hidden), np.float32))

    def _attn_shard(self, w: LayerWeights, units: Sequence[int]) -> _AttnShard:
        c = self.config
        q_width = c.heads_per_kv * c.head_dim  # query rows (and wo columns) of one unit
        q_ranges = [(u * q_width, (u + 1) * q_width) for u in units]
        kv_ranges = [(u * c.head_dim, (u + 1) * c.head_dim) for u in units]
        q_rows, kv_rows = _row_index(q_ranges), _row_index(kv_ranges)
        # Qwen2's Q/K/V biases go with the rows they are added to.
        return _AttnShard(
            wq=w.wq.take_rows(q_rows).dequantize(), wk=w.wk.take_rows(kv_rows).dequantize(),
            wv=w.wv.take_rows(kv_rows).dequantize(), wo=dequantize_columns(w.wo, q_ranges),
            bq=None if w.bq is None else w.bq[q_rows], bk=None if w.bk is None else w.bk[kv_rows],
            bv=None if w.bv is None else w.bv[kv_rows],
            k=np.zeros((len(units), self.max_len, c.head_dim), np.float32),
            v=np.zeros((len(units), self.max_len, c.head_dim), np.float32),
        )

    @property
    def weight_bytes(self) -> int:
        """Bytes of float32 weights held (matrices and biases; the KV cache not included)."""
        parts = [a.weight_bytes() for a in self.attn if a] + [m.weight_bytes() for m in self.mlp_parts if m]
        return sum(parts) + self.output.nbytes

    @property
    def cache_bytes(self) -> int:
        return sum(a.k.nbytes + a.v.nbytes for a in self.attn if a)

    def block_bytes(self, layer: int, block: Block, units: int | None = None) -> int:
        """Weight bytes of a block held here (a step of some `units` computes part of them: an upper bound). A node
        may run on this reference share (its tests do) and measures its speed with it."""
        if block == Block.ATTN:
            return 0 if self.attn[layer] is None else self.attn[layer].weight_bytes()
        if block == Block.MLP:
            return 0 if self.mlp_parts[layer] is None else self.mlp_parts[layer].weight_bytes()
        return self.output.nbytes

    def attention_weights(self, layer: int, units: Sequence[int] | None) -> AttnWeights:
        """The query and output weights of `units` (all held for None), gathered into arrays of their own."""
        a, c = self.attn[layer], self.config
        assert a is not None
        local = self._local(self.spec.attn_units[layer], units)
        if units is None:  # all of them: the held arrays themselves, not a copy per call
            return AttnWeights(local, a.wq, a.wo, a.bq)
        width = c.heads_per_kv * c.head_dim
        q_rows = (local[:, None] * width + np.arange(width)).reshape(-1)
        return AttnWeights(local, a.wq[q_rows], a.wo[:, q_rows], None if a.bq is None else a.bq[q_rows])

    def attention(self, layer: int, x_norm: np.ndarray, start: int, *, output: bool = True,
                  units: Sequence[int] | None = None) -> np.ndarray | None:
        """Partial attention output, (seq, hidden), for tokens at positions start..start+seq-1.

        Caches K and V of this device's KV heads at those positions first; positions after them
        are forgotten, so calling again from an earlier start re-runs from there. With output=False
        only the cache is filled (catching up on an input whose output would arrive too late).
        `units` (KV-head indices this shard holds) limits the output to those units, while the
        cache is still filled for all of them (dynamic mapping hands out other units next token).
        """
        c = self.config
        x_norm = np.asarray(x_norm, np.float32)
        seq = x_norm.shape[0]
        end = self._advance(layer, start, seq)
        a = self.attn[layer]
        if a is None:
            return np.zeros((seq, c.hidden), np.float32) if output else None
        n, g, d = a.n_units, c.heads_per_kv, c.head_dim
        k, v = x_norm @ a.wk.T, x_norm @ a.wv.T
        if a.bk is not None:
            k, v = k + a.bk, v + a.bv
        cos, sin = rope_tables(d, c.rope_base, np.arange(start, end))
        a.k[:, start:end] = apply_rope(k.reshape(seq, n, d), cos, sin).transpose(1, 0, 2)
        a.v[:, start:end] = v.reshape(seq, n, d).transpose(1, 0, 2)
        if not output:
            return None
        if units is not None and not len(units):
            return np.zeros((seq, c.hidden), np.float32)
        weights = self.attention_weights(layer, units)
        q = x_norm @ weights.wq.T
        if weights.bq is not None:
            q = q + weights.bq
        local, wo = weights.local, weights.wo
        n = len(local)
        q = apply_rope(q.reshape(seq, n * g, d), cos, sin)
        keys, values = a.k[local, :end], a.v[local, :end]
        # The same arithmetic as the reference, restricted to this device's KV heads.
        qg = q.reshape(seq, n, g, d).transpose(1, 2, 0, 3)  # (unit, head in unit, seq, dim)
        # A float32 scale: a numpy float64 scalar would turn everything after it into float64.
        scores = qg @ keys[:, None].transpose(0, 1, 3, 2) / np.float32(np.sqrt(d))
        causal = np.arange(end)[None, :] > (start + np.arange(seq))[:, None]
        scores = np.where(causal, -np.inf, scores)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        heads = (probs @ values[:, None]).reshape(n * g, seq, d)
        return heads.transpose(1, 0, 2).reshape(seq, n * g * d) @ wo.T

    @staticmethod
    def _local(held: Sequence[int], wanted: Sequence[int] | None) -> np.ndarray:
        """Positions within `held` of the `wanted` units (all of them for None)."""
        if wanted is None:
            return np.arange(len(held))
        where = {u: i for i, u in enumerate(held)}
        missing = [u for u in wanted if u not in where]
        if missing:
            raise ValueError(f"units {missing} are not held here ({list(held)})")
        return np.array([where[u] for u in wanted], np.int64)

    def mlp_weights(self, layer: int, groups: Sequence[int] | None) -> MlpWeights:
        """Gate, up and down weights of `groups` (all held for None), gathered."""
        m = self.mlp_parts[layer]
        assert m is not None
        if groups is None:
            return MlpWeights(m.w_gate, m.w_up, m.w_down)
        held, size, ffn = self.spec.mlp_groups[layer], self.spec.group_size, self.config.ffn
        starts = np.cumsum([0] + [min(size, ffn - g * size) for g in held])  # row offset of each held group
        rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in self._local(held, groups)])
        return MlpWeights(m.w_gate[rows], m.w_up[rows], m.w_down[:, rows])

    def mlp(self, layer: int, x_norm: np.ndarray, groups: Sequence[int] | None = None) -> np.ndarray:
        """Partial MLP output, (seq, hidden), of this device's neuron groups, or of the `groups` among them."""
        x_norm = np.asarray(x_norm, np.float32)
        if self.mlp_parts[layer] is None or (groups is not None and not len(groups)):
            return np.zeros((x_norm.shape[0], self.config.hidden), np.float32)
        w = self.mlp_weights(layer, groups)
        act = silu(x_norm @ w.gate.T) * (x_norm @ w.up.T)
        return act @ w.down.T

    def logits(self, x_norm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(vocabulary indices, logits (seq, len(indices))) of this device's LM-head blocks, for
        the hidden state after the output norm."""
        return self.vocab_rows, np.asarray(x_norm, np.float32) @ self.output.T

