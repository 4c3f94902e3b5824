"""Tensor-parallel shards against the numpy reference: the partial outputs of every device sum to
the reference block outputs, KV cache included, and a master loop over shards decodes the same
greedy tokens as the reference."""

from __future__ import annotations

import functools
import platform
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from edgerun.model.config import ModelConfig
from edgerun.model.onnx_graph import Activations
from edgerun.model.quant import AffineBlocks, quantize, slice_affine
from edgerun.model.reference import DenseLayer, KVCache, ReferenceModel, n_groups, rms_norm, rms_norm_fast
from edgerun.model.synth import SynthSpec, custom_shape, synth_weights
from edgerun.model.weights import ModelWeights
from edgerun.tp.shard import (
    DynamicQuantShard,
    QuantShard,
    Shard,
    ShardSpec,
    dequantize_columns,
    full_spec,
    split_spec,
)

MAX_LEN = 32
PROMPT = [72, 101, 108, 108, 111, 44, 32]  # "Hello, "
DECODE_STEPS = 4
VOCAB_BLOCK = 100  # 512 = 5 * 100 + 12: the last block is short

# Block outputs are sums of a few hundred float32 products whose order differs between one big
# matmul and a sum of per-device partials; errors of a few float32 ulps of the output's scale.
RTOL, ATOL = 1e-5, 1e-6

MODELS = {
    # 4 KV heads of 2 query heads each; ffn 704 leaves a short last group for group sizes 128 and 192.
    "llama": (custom_shape("tiny", tied_embeddings=False, n_heads=8, n_kv_heads=4, head_dim=32, ffn=704), "Q4_0"),
    # Q, K and V biases; 2 KV heads, so with 3 or 4 devices some hold no attention unit in a layer.
    "qwen2": (custom_shape("tiny", architecture="qwen2", qkv_bias=True, tied_embeddings=False), "Q4_0"),
    # K-quant blocks are 256 wide: a 128-column head or a 192-column group cuts through a block.
    "llama-q4k": (custom_shape("tiny", tied_embeddings=False), "Q4_K"),
}


# The numpy reference shard and the quantized onnxruntime shard answer the same calls. The quantized shard runs
# with float32 activations here, to compare with the reference to rounding; int8 activations have tests of their own.
SHARDS = {"numpy": Shard, "quant": functools.partial(QuantShard, threads=1, activations=Activations.F32)}
shard_kinds = pytest.mark.parametrize("kind", list(SHARDS))


def make(kind: str, config: ModelConfig, weights: ModelWeights, spec: ShardSpec) -> Shard | QuantShard:
    return SHARDS[kind](config, weights, spec, MAX_LEN)


@cache
def model(name: str) -> tuple[ModelConfig, ModelWeights]:
    config, qtype = MODELS[name]
    return config, synth_weights(SynthSpec(config, qtype, seed=1))


@dataclass(frozen=True)
class Call:
    kind: str  # "attn" or "mlp"
    layer: int
    x_norm: np.ndarray
    start: int
    out: np.ndarray


class RecordingReference(ReferenceModel):
    """The reference, noting every block's normalized input, start position and output."""

    def __init__(self, config: ModelConfig, weights: ModelWeights, group_size: int = 256) -> None:
        super().__init__(config, weights, group_size)
        self.calls: list[Call] = []

    def attention(self, index: int, layer: DenseLayer, x: np.ndarray, cache: KVCache,
                  cos: np.ndarray, sin: np.ndarray, hooks: object) -> np.ndarray:
        out = super().attention(index, layer, x, cache, cos, sin, None)
        # The reference advances cache.length after the last layer, so here it is the start.
        self.calls.append(Call("attn", index, x, cache.length, out))
        return out

    def mlp(self, index: int, layer: DenseLayer, x: np.ndarray, hooks: object) -> np.ndarray:
        out = super().mlp(index, layer, x, None)
        self.calls.append(Call("mlp", index, x, -1, out))
        return out


@cache
def reference_run(name: str) -> tuple[list[Call], list[int], list[np.ndarray]]:
    """Block calls, greedy tokens and last-token logits of a prefill then DECODE_STEPS decode steps."""
    config, weights = model(name)
    ref = RecordingReference(config, weights)
    kv = ref.new_cache(MAX_LEN)
    tokens, all_logits = [], []
    feed = PROMPT
    for _ in range(DECODE_STEPS + 1):
        logits = ref.forward(feed, kv)
        all_logits.append(logits)
        tokens.append(int(np.argmax(logits)))
        feed = [tokens[-1]]
    return ref.calls, tokens, all_logits


def summed(parts: Sequence[np.ndarray]) -> np.ndarray:
    return np.sum(np.stack(parts), axis=0)


def replay(shards: Sequence[Shard | QuantShard], call: Call) -> np.ndarray:
    if call.kind == "attn":
        return summed([s.attention(call.layer, call.x_norm, call.start) for s in shards])
    return summed([s.mlp(call.layer, call.x_norm) for s in shards])


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL)


@shard_kinds
@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("group_size", [128, 192])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_partials_sum_to_reference_blocks(kind: str, name: str, group_size: int, n: int) -> None:
    config, weights = model(name)
    calls, _, _ = reference_run(name)
    shards = [make(kind, config, weights, spec) for spec in split_spec(config, n, group_size, VOCAB_BLOCK)]
    assert len(calls) == 2 * config.n_layers * (DECODE_STEPS + 1)
    for call in calls:
        assert_close(replay(shards, call), call.out)


@shard_kinds
@pytest.mark.parametrize("group_size", [16, 192])
def test_kquant_blocks_cut_by_units(kind: str, group_size: int) -> None:
    config, weights = model("llama-q4k")
    calls, _, _ = reference_run("llama-q4k")
    shards = [make(kind, config, weights, spec) for spec in split_spec(config, 2, group_size, VOCAB_BLOCK)]
    for call in calls:
        assert_close(replay(shards, call), call.out)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_int8_partials_match_the_whole_int8_block(name: str) -> None:
    """With int8 activations (the default), every device quantizes the same 32-element blocks of the same input,
    so partials split by units still sum to the one-device block up to the order of summation; and both stay
    within int8's approximation of the float reference."""
    config, weights = model(name)
    calls, _, _ = reference_run(name)
    whole = [QuantShard(config, weights, spec, MAX_LEN) for spec in split_spec(config, 1, 128, VOCAB_BLOCK)]
    split = [QuantShard(config, weights, spec, MAX_LEN) for spec in split_spec(config, 3, 128, VOCAB_BLOCK)]
    for call in calls:
        one, three = replay(whole, call), replay(split, call)
        np.testing.assert_allclose(three, one, rtol=1e-4, atol=1e-4 * float(np.abs(one).max()))
        assert np.linalg.norm(one - call.out) <= 0.05 * np.linalg.norm(call.out)


def run_master(config: ModelConfig, weights: ModelWeights, shards: Sequence[Shard | QuantShard], prompt: list[int],
               steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy decoding with the master's part done here (embedding, residuals, norms, argmax) and
    every block's output summed from the shards' partials."""
    eps = config.norm_eps
    tokens, all_logits = [], []
    feed, pos = prompt, 0
    for _ in range(steps):
        x = weights.token_embd.dequantize_rows(np.asarray(feed, np.int64))
        for i, layer in enumerate(weights.layers):
            h = rms_norm(x, layer.attn_norm, eps)
            x = x + summed([s.attention(i, h, pos) for s in shards])
            h = rms_norm(x, layer.ffn_norm, eps)
            x = x + summed([s.mlp(i, h) for s in shards])
        pos += len(feed)
        h = rms_norm(x[-1:], weights.output_norm, eps)
        logits = np.full(config.vocab_size, np.nan, np.float32)
        for s in shards:
            rows, part = s.logits(h)
            logits[rows] = part[0]
        all_logits.append(logits)
        tokens.append(int(np.argmax(logits)))
        feed = [tokens[-1]]
    return tokens, all_logits


@shard_kinds
@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("n", [1, 3])
def test_master_loop_matches_reference_greedy(kind: str, name: str, n: int) -> None:
    config, weights = model(name)
    ref = ReferenceModel(config, weights)
    kv = ref.new_cache(MAX_LEN)
    want_tokens, want_logits = [], []
    feed = PROMPT
    for _ in range(8):
        logits = ref.forward(feed, kv)
        want_logits.append(logits)
        want_tokens.append(int(np.argmax(logits)))
        feed = [want_tokens[-1]]
    assert len(set(want_tokens)) > 1, "a constant greedy sequence would not test much"

    shards = [make(kind, config, weights, spec) for spec in split_spec(config, n, 192, VOCAB_BLOCK)]
    tokens, logits = run_master(config, weights, shards, PROMPT, 8)
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits, strict=True):
        # Logits are of order 1 (measured differences: a few 1e-7), ten times the block outputs' scale.
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-5)


def test_every_block_allocates_from_the_processs_one_arena() -> None:
    """A share's blocks take their buffers from one arena of the process (share_cpu_arena): neither one arena each,
    which would keep every block's peak, nor none, which maps large buffers afresh at every step; two shares of one
    process share it too (onnxruntime registers the arena once)."""
    config, weights = model("llama")
    for spec in split_spec(config, 2, 128, VOCAB_BLOCK):
        shard = QuantShard(config, weights, spec, MAX_LEN, threads=1)
        blocks = [b for b in (*shard.attn, *shard.mlp_blocks, shard.head) if b is not None]
        assert blocks
        for block in blocks:
            options = block.session.get_session_options()
            assert options.get_session_config_entry("session.use_env_allocators") == "1"
            assert not options.enable_cpu_mem_arena


def test_a_prompt_leaves_no_activations_bound_in_its_blocks() -> None:
    """A block's binding lets go of a prompt's input and output once the prompt's step is done: it would keep
    them until the block's next one-token step, a prompt's worth of activations in every block of a share."""
    config, weights = model("llama")
    shard = QuantShard(config, weights, split_spec(config, 2, 128, VOCAB_BLOCK)[0], MAX_LEN, threads=1)
    x = np.random.default_rng(0).standard_normal((len(PROMPT), config.hidden)).astype(np.float32)
    attn, mlp = shard.attention(0, x, 0), shard.mlp(0, x)
    assert attn.shape == mlp.shape == (len(PROMPT), config.hidden)
    for block in (shard.attn[0], shard.mlp_blocks[0]):
        assert block.one_token_bound
        bound = block.binding.get_outputs()[0]  # the block's output (an attention block's KV cache follows)
        assert bound.shape() == [1, 1, config.hidden]
    # The outputs handed back are the caller's own: the next step's buffers are not them.
    again = shard.mlp(0, x[:1])
    assert not np.shares_memory(again, mlp)
    np.testing.assert_allclose(again, mlp[:1], rtol=RTOL, atol=1e-5)


@shard_kinds
@pytest.mark.parametrize("n", [1, 2, 4])
def test_logit_rows_reassemble_the_lm_head(kind: str, n: int) -> None:
    config, weights = model("llama")
    ref = ReferenceModel(config, weights)
    x = rms_norm(np.random.default_rng(0).standard_normal((3, config.hidden), dtype=np.float32),
                 weights.output_norm, config.norm_eps)
    rows, parts = [], []
    for spec in split_spec(config, n, 128, VOCAB_BLOCK):
        r, p = make(kind, config, weights, spec).logits(x)
        assert r.dtype == np.int64 and p.shape == (3, len(r)) and p.dtype == np.float32
        rows.append(r)
        parts.append(p)
    index = np.concatenate(rows)
    assert np.array_equal(np.sort(index), np.arange(config.vocab_size))
    logits = np.empty((3, config.vocab_size), np.float32)
    logits[:, index] = np.concatenate(parts, axis=1)
    np.testing.assert_allclose(logits, x @ ref.output.T, rtol=RTOL, atol=1e-5)


@shard_kinds
def test_truncate_then_rerun_is_identical(kind: str) -> None:
    config, weights = model("qwen2")
    calls, _, _ = reference_run("qwen2")
    shards = [make(kind, config, weights, spec) for spec in split_spec(config, 2, 128, VOCAB_BLOCK)]
    first = [replay(shards, call) for call in calls]
    # Calls per forward pass: attention and MLP of each layer. Keep the prefill and one decode step.
    per_pass = 2 * config.n_layers
    kept = len(PROMPT) + 1
    for s in shards:
        s.truncate(kept)
    # Overwrite the positions after the cut with other inputs, then cut again: none of it may stay.
    rng = np.random.default_rng(1)
    for call in calls[2 * per_pass:]:
        other = rng.standard_normal(call.x_norm.shape, dtype=np.float32)
        replay(shards, Call(call.kind, call.layer, other, call.start, call.out))
    for s in shards:
        s.truncate(kept)
    again = [replay(shards, call) for call in calls[2 * per_pass:]]
    for got, want in zip(again, first[2 * per_pass:], strict=True):
        assert np.array_equal(got, want)
    # And from the start: a re-prefill after truncate(0) reproduces everything.
    for s in shards:
        s.truncate(0)
    for call, want in zip(calls, first, strict=True):
        assert np.array_equal(replay(shards, call), want)


@shard_kinds
def test_device_without_units_returns_zeros(kind: str) -> None:
    config, weights = model("qwen2")
    spec = ShardSpec(attn_units=((1,), ()), mlp_groups=((), (0, 2)), vocab_blocks=(), group_size=192,
                     vocab_block=VOCAB_BLOCK)
    shard = make(kind, config, weights, spec)
    x = np.random.default_rng(2).standard_normal((5, config.hidden), dtype=np.float32)
    for out in (shard.attention(1, x, 0), shard.mlp(0, x)):
        assert out.shape == (5, config.hidden) and out.dtype == np.float32 and not out.any()
    assert shard.attention(0, x, 0).any() and shard.mlp(1, x).any()
    # An empty layer still follows the positions, so decoding continues past the prefill.
    assert not shard.attention(1, x[:1], 5).any()
    rows, logits = shard.logits(x)
    assert rows.shape == (0,) and logits.shape == (5, 0)
    # Round-robin with more devices than KV heads: some device sits out every layer.
    for spec in split_spec(config, 4, 192, VOCAB_BLOCK):
        s = make(kind, config, weights, spec)
        for layer in range(config.n_layers):
            if not spec.attn_units[layer]:
                assert not s.attention(layer, x, 0).any()


def test_specs_cover_every_unit_once() -> None:
    config, _ = model("llama")
    assert split_spec(config, 1, 192, VOCAB_BLOCK) == [full_spec(config, 192, VOCAB_BLOCK)]
    specs = split_spec(config, 3, 192, VOCAB_BLOCK)
    for layer in range(config.n_layers):
        attn = sorted(u for s in specs for u in s.attn_units[layer])
        mlp = sorted(g for s in specs for g in s.mlp_groups[layer])
        assert attn == list(range(config.n_kv_heads))
        assert mlp == list(range(n_groups(config.ffn, 192)))
    assert sorted(b for s in specs for b in s.vocab_blocks) == list(range(6))


def test_weight_bytes() -> None:
    config, weights = model("qwen2")
    ref = ReferenceModel(config, weights)
    full = Shard(config, weights, full_spec(config, 128, VOCAB_BLOCK), MAX_LEN)
    biases = config.n_layers * (config.q_dim + 2 * config.kv_dim) * 4
    assert full.weight_bytes == ref.weight_bytes + biases
    parts = [Shard(config, weights, s, MAX_LEN) for s in split_spec(config, 3, 128, VOCAB_BLOCK)]
    assert sum(p.weight_bytes for p in parts) == full.weight_bytes
    # One attention unit in one layer: its query heads' rows of wq and columns of wo, one KV head's
    # rows of wk and wv, and the biases of those rows.
    one = Shard(config, weights, ShardSpec(((0,), ()), ((), ()), ()), MAX_LEN)
    q, kv = config.heads_per_kv * config.head_dim, config.head_dim
    assert one.weight_bytes == 4 * (2 * q * config.hidden + 2 * kv * config.hidden + q + 2 * kv)
    assert one.cache_bytes == 2 * MAX_LEN * kv * 4


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_dequantize_columns_matches_full_dequantize(qtype: str) -> None:
    t = quantize(np.random.default_rng(3).standard_normal((6, 768), dtype=np.float32), qtype)
    full = t.dequantize()
    ranges = [(0, 128), (192, 320), (700, 768), (256, 512), (5, 6)]
    got = dequantize_columns(t, ranges)
    assert got.dtype == np.float32 and got.flags.c_contiguous
    assert np.array_equal(got, np.concatenate([full[:, a:b] for a, b in ranges], axis=1))
    assert dequantize_columns(t, []).shape == (6, 0)
    with pytest.raises(ValueError):
        dequantize_columns(t, [(700, 800)])


def test_rejects_bad_specs_and_positions() -> None:
    config, weights = model("qwen2")
    with pytest.raises(ValueError, match="each of the 2 layers"):
        Shard(config, weights, ShardSpec(((0,),), ((0,),), ()), MAX_LEN)
    with pytest.raises(ValueError, match="attention units"):
        Shard(config, weights, ShardSpec(((0, 0), ()), ((), ()), ()), MAX_LEN)
    with pytest.raises(ValueError, match="MLP groups"):
        Shard(config, weights, ShardSpec(((), ()), ((2,), ()), (), group_size=256), MAX_LEN)
    with pytest.raises(ValueError, match="vocab blocks"):
        Shard(config, weights, ShardSpec(((), ()), ((), ()), (6,), vocab_block=VOCAB_BLOCK), MAX_LEN)
    shard = Shard(config, weights, full_spec(config), 8)
    x = np.zeros((4, config.hidden), np.float32)
    with pytest.raises(ValueError, match="cannot continue at 2"):
        shard.attention(0, x, 2)
    shard.attention(0, x, 0)
    with pytest.raises(ValueError, match="context of 8"):
        shard.attention(0, np.zeros((5, config.hidden), np.float32), 4)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_selected_units_of_full_shards_sum_to_reference_blocks(name: str) -> None:
    """Dynamic mapping: every device holds every unit and computes the ones it is handed per call;
    handing each unit to exactly one device still sums to the reference, token after token, with
    each device's KV cache kept for all KV heads."""
    config, weights = model(name)
    calls, _, _ = reference_run(name)
    group_size = 192  # ffn 704 or 512: a short last group
    spec = full_spec(config, group_size, VOCAB_BLOCK)
    shards = [Shard(config, weights, spec, MAX_LEN) for _ in range(3)]
    rng = np.random.default_rng(0)
    n_mlp = n_groups(config.ffn, group_size)
    for call in calls:
        count = config.n_kv_heads if call.kind == "attn" else n_mlp
        owner = rng.integers(0, 3, count)  # a fresh random hand-out every call
        picks = [[int(u) for u in rng.permutation(np.flatnonzero(owner == d))] for d in range(3)]
        if call.kind == "attn":
            out = summed([s.attention(call.layer, call.x_norm, call.start, units=p) for s, p in zip(shards, picks,
                                                                                                   strict=True)])
        else:
            out = summed([s.mlp(call.layer, call.x_norm, groups=p) for s, p in zip(shards, picks, strict=True)])
        assert_close(out, call.out)


def test_selecting_units_a_shard_does_not_hold_fails() -> None:
    config, weights = model("llama")
    shard = Shard(config, weights, split_spec(config, 2, 192, VOCAB_BLOCK)[0], MAX_LEN)
    held = shard.spec.mlp_groups[0]
    other = next(g for g in range(n_groups(config.ffn, 192)) if g not in held)
    x = np.ones((1, config.hidden), np.float32)
    with pytest.raises(ValueError, match="not held"):
        shard.mlp(0, x, groups=[other])
    assert not shard.mlp(0, x, groups=[]).any()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "F16"])
def test_slices_stay_quantized_and_exact(qtype: str) -> None:
    """Rows and column ranges of a quantized matrix keep their codes (no float32 copy): the slice's values
    are exactly the file's. A range cut at 16 columns inside a 32-block re-expresses it as 16-blocks; only
    a cut finer than the kernels' smallest block, or a float type, gives float32."""
    rng = np.random.default_rng(3)
    t = quantize(rng.standard_normal((48, 512), dtype=np.float32), qtype)
    full = t.dequantize()

    def values(form: AffineBlocks | np.ndarray) -> np.ndarray:
        if not isinstance(form, AffineBlocks):
            return form
        scales = np.repeat(form.scales, form.block, axis=1)
        offsets = 0 if form.offsets is None else np.repeat(form.offsets, form.block, axis=1)
        return scales * (form.codes.astype(np.float32) - 2 ** (form.bits - 1)) + offsets

    rows = np.array([5, 1, 40, 41])
    ranges = [(64, 128), (320, 352), (16, 48)]
    for form, want in ((slice_affine(t, rows), full[rows]),
                       (slice_affine(t, col_ranges=ranges), np.concatenate([full[:, a:b] for a, b in ranges], 1))):
        assert isinstance(form, AffineBlocks) == (qtype != "F16")
        np.testing.assert_allclose(values(form), want, rtol=0, atol=1e-6 * np.abs(full).max())
    odd = slice_affine(t, col_ranges=[(8, 40)])
    assert not isinstance(odd, AffineBlocks) and np.array_equal(odd, full[:, 8:40])


def test_release_mapped_file_lets_go_of_its_pages(tmp_path) -> None:
    """A share copies what it needs out of the memory-mapped model; the file's pages it read leave the
    process's resident memory, and the mapping still reads the same bytes afterwards."""
    from edgerun.memory import release_mapped_files

    def file_rss_kb() -> int:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("RssFile"))

    path = tmp_path / "weights.bin"
    data = np.random.default_rng(4).integers(0, 255, 64 << 20, dtype=np.uint8)
    data.tofile(path)
    mapped = np.memmap(path, np.uint8, mode="r")
    assert int(mapped.sum(dtype=np.int64)) == int(data.sum(dtype=np.int64))  # every page touched
    touched = file_rss_kb()
    release_mapped_files([path])
    assert file_rss_kb() < touched - 48 * 1024, (touched, file_rss_kb())
    assert np.array_equal(mapped[::4096], data[::4096])


def test_huge_pages_back_the_resident_heap_and_leave_untouched_buffers_alone() -> None:
    """A share's repacked weights are anonymous memory in 4 KB pages where the system gives huge pages only on
    request; huge_pages() moves a resident buffer into huge pages with its bytes unchanged, and leaves a buffer
    mostly untouched (a KV cache) unresident. In a child process: the heap's regions are the whole process's."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("no transparent huge pages on this system")
    script = """
import ctypes, sys
from edgerun.memory import huge_pages
def region(address):
    fields = {}
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            start, end = (int(v, 16) for v in head[0].split("-"))
            inside = start <= address < end
        elif inside and head[0] in ("Rss:", "AnonHugePages:"):
            fields[head[0]] = int(head[1]) // 1024
    return fields
size = 32 << 20
weights = bytearray(size)  # calloc: fresh pages, made resident by the fill
weights[:] = bytes(range(256)) * (size // 256)
untouched = bytearray(size)
at = lambda b: ctypes.addressof((ctypes.c_char * size).from_buffer(b))
before = region(at(weights))
collapsed = huge_pages()
print(before["AnonHugePages:"], region(at(weights))["AnonHugePages:"], region(at(untouched))["Rss:"], collapsed >> 20,
      weights == bytes(range(256)) * (size // 256))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    huge_before, huge_after, untouched_rss, collapsed_mb, same = out.stdout.split()
    if int(collapsed_mb) == 0:
        pytest.skip(f"this kernel moves no pages at once (MADV_COLLAPSE: Linux 6.1+): {platform.release()}")
    assert int(huge_after) >= 28 > int(huge_before), out.stdout  # all but the buffer's unaligned ends
    assert int(untouched_rss) < 4, out.stdout
    assert same == "True"


def test_a_node_gives_back_what_it_frees_and_reports_the_peak_of_its_current_share() -> None:
    """glibc's default lets freed multi-MB buffers (a prefill's) stay resident on the heap once a larger block
    was freed; a node process fixes its thresholds so they go back, and restarts its peak when it takes a new
    share. In a child process: the thresholds are the whole process's."""
    script = """
import numpy as np, re, sys
from edgerun.memory import reset_peak_rss, return_freed_memory
def status(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) // 1024
if sys.argv[1] == "fixed":
    return_freed_memory()
big = np.ones(24 << 20, np.uint8); del big  # freed from mmap: glibc's threshold rises to 24 MB by default
base = status("VmRSS")
held = [np.ones(4 << 20, np.uint8) for _ in range(10)]  # 40 MB of 4 MB buffers: below the trim threshold
pin = np.ones(1 << 10, np.uint8)  # a small block above them keeps the heap from shrinking from its top
del held
after = status("VmRSS")
before_reset = status("VmHWM")
reset_peak_rss()
print(after - base, before_reset - status("VmHWM"))
"""
    def run(mode: str) -> tuple[int, ...]:
        done = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, check=True)
        return tuple(map(int, done.stdout.split()))

    grown = {mode: run(mode) for mode in ("default", "fixed")}
    assert grown["default"][0] > 24, grown  # the heap kept most of the 40 MB
    assert grown["fixed"][0] < 12, grown  # all but noise went back
    assert grown["fixed"][1] > 24, grown  # the peak restarted from what the process holds now


def test_a_nodes_block_sized_buffers_come_from_its_heap_without_page_faults() -> None:
    """A batch's blocks move vectors of hundreds of kilobytes (a 64-token chunk's of a 1B: 512 KB), allocated and
    written anew every block: the input decoded, the partial, its frame. Under a node's thresholds they come from
    the heap, whose pages stay mapped; from a fresh mmap each (a 128 KB threshold) every one faulted in its 128
    pages again. In a child process: the thresholds are the whole process's."""
    script = """
import resource, sys
import numpy as np
from edgerun.memory import return_freed_memory
return_freed_memory()
def block():
    x = np.empty(128 * 1024, np.float32)
    x.fill(1.0)
    out = x * 2.0
    frame = bytearray().join((b"head", memoryview(out).cast("B")))
    return len(frame)
for _ in range(5):  # the heap grows to its size once
    block()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    block()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert int(done.stdout) < 200, done.stdout  # 50 blocks of three 512 KB buffers from mmap: 19,200


def test_the_masters_fast_norm_equals_the_reference_norm_to_an_ulp() -> None:
    rng = np.random.default_rng(3)
    weight = rng.standard_normal(576).astype(np.float32)
    for rows in (1, 5):
        x = (rng.standard_normal((rows, 576)) * 40).astype(np.float32)
        fast, reference = rms_norm_fast(x, weight, 1e-5), rms_norm(x, weight, 1e-5)
        assert fast.dtype == np.float32 and fast.shape == reference.shape
        np.testing.assert_allclose(fast, reference, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("name", list(MODELS))
def test_dynamic_quantized_share_computes_the_units_it_is_handed(name: str) -> None:
    """Dynamic mapping's quantized share (every unit held, the step's units chosen inside the graph) gives the
    float32 reference share's partial for any set of units, caches every KV head whatever it computes, and an
    empty set adds nothing."""
    config, weights = model(name)
    calls, _, _ = reference_run(name)
    group_size = 128
    spec = full_spec(config, group_size, VOCAB_BLOCK)
    dynamic = DynamicQuantShard(config, weights, spec, MAX_LEN, activations=Activations.F32)
    reference = Shard(config, weights, spec, MAX_LEN)
    rng = np.random.default_rng(5)
    n_attn, n_mlp = config.n_kv_heads, -(-config.ffn // group_size)
    for i, call in enumerate(calls):
        count = n_attn if call.kind == "attn" else n_mlp
        units = sorted(rng.choice(count, size=int(rng.integers(0, count + 1)), replace=False).tolist())
        if call.kind == "attn":
            output = i % 5 != 4  # now and then only the cache, as a node catching up does
            got = dynamic.attention(call.layer, call.x_norm, call.start, output=output, units=units)
            want = reference.attention(call.layer, call.x_norm, call.start, output=output, units=units)
            if not output:
                assert got is None and want is None
                continue
        else:
            got, want = dynamic.mlp(call.layer, call.x_norm, groups=units), reference.mlp(call.layer, call.x_norm,
                                                                                         groups=units)
        assert_close(got, want)
        if not units:
            assert not np.any(got)
    assert dynamic.cache_bytes == reference.cache_bytes
    with pytest.raises(ValueError, match="every attention unit"):
        DynamicQuantShard(config, weights, split_spec(config, 2, group_size, VOCAB_BLOCK)[0], MAX_LEN)
