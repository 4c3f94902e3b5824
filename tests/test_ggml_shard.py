"""Tensor-parallel shares on ggml (llama.cpp's kernels): partials of 1 and 3 devices summed by a master loop track
the numpy reference, K-quant heads and groups that cut through 256-wide blocks included."""

from __future__ import annotations

import numpy as np
import pytest
from test_shard import MAX_LEN, PROMPT, VOCAB_BLOCK, model, run_master

from edgerun.model.reference import ReferenceModel
from edgerun.net.wire import Block
from edgerun.tp.ggml_shard import GgmlShard, column_ranges
from edgerun.tp.shard import split_spec


def reference(name: str, steps: int) -> tuple[list[int], list[np.ndarray]]:
    config, weights = model(name)
    ref = ReferenceModel(config, weights)
    kv = ref.new_cache(MAX_LEN)
    tokens, logits, feed = [], [], PROMPT
    for _ in range(steps):
        out = ref.forward(feed, kv)
        logits.append(out)
        tokens.append(int(np.argmax(out)))
        feed = [tokens[-1]]
    return tokens, logits


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama-q4k"])
@pytest.mark.parametrize("n", [1, 3])
def test_ggml_shares_track_the_reference(name: str, n: int) -> None:
    """Activations quantized per block as llama.cpp does: every logit within 3% of the reference's largest, the
    reference's greedy token at 7 or 8 of 8 steps."""
    config, weights = model(name)
    want_tokens, want_logits = reference(name, 8)
    shards = [GgmlShard(config, weights, spec, MAX_LEN) for spec in split_spec(config, n, 192, VOCAB_BLOCK)]
    tokens, logits = run_master(config, weights, shards, PROMPT, 8)
    worst = max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(logits, want_logits, strict=True))
    agree = sum(a == b for a, b in zip(tokens, want_tokens, strict=True))
    assert agree >= 7 and worst < 0.03, (agree, worst)
    assert sum(s.weight_bytes for s in shards) > 0
    assert all(s.block_bytes(0, Block.MLP) > 0 for s in shards if s.spec.mlp_groups[0])


def test_a_column_range_keeps_the_files_blocks_where_it_can() -> None:
    _, weights = model("llama-q4k")
    wo = weights.layers[0].wo  # Q4_K: 256-wide blocks
    aligned = column_ranges(wo, [(0, 256)])
    assert aligned.qtype == "Q4_K" and aligned.shape == (wo.rows, 256)
    np.testing.assert_array_equal(aligned.dequantize(), wo.dequantize()[:, :256])
    cut = column_ranges(wo, [(0, 64), (128, 192)])  # heads inside a block: requantized to Q8_0
    assert cut.qtype == "Q8_0" and cut.shape == (wo.rows, 128)
    full = wo.dequantize()
    np.testing.assert_allclose(cut.dequantize(), np.concatenate([full[:, :64], full[:, 128:192]], axis=1),
                               atol=0.01 * float(np.abs(full).max()))


@pytest.mark.parametrize(("name", "qtype", "takes"), [("llama", "Q4_0", True), ("qwen2", "Q8_0", True),
                                                      ("qwen2", "Q4_1", False), ("llama-q4k", "Q4_K", False)])
def test_a_q8_input_gives_a_share_the_bits_its_float32_gives(name: str, qtype: str, takes: bool) -> None:
    """A share whose weights take Q8_0 activations (Q4_0, Q8_0) says it takes its layers' inputs as Q8
    (takes_q8_inputs, the master's input codec then), and computes from the decoded Q8 input the bits it computes
    from the float32: a prompt's and a token's attention, and MLP. Q4_1's (Q8_1 activations, whose sum is taken
    with the scale before its f16 rounding) and a K-quant's (Q8_K) do not: there the Q8 input computes other bits."""
    from test_shard import MODELS

    from edgerun.model.synth import SynthSpec, synth_weights
    from edgerun.net.wire import Codec, decode_vector, encode_vector

    config = MODELS[name][0]
    weights = synth_weights(SynthSpec(config, qtype, seed=1))
    spec = split_spec(config, 2, 192, VOCAB_BLOCK)[1]
    shares = [GgmlShard(config, weights, spec, MAX_LEN) for _ in range(2)]
    assert [s.takes_q8_inputs for s in shares] == [takes, takes]
    rng = np.random.default_rng(3)

    def travelled(x: np.ndarray) -> np.ndarray:
        return decode_vector(encode_vector(x, Codec.Q8), Codec.Q8, x.size).reshape(x.shape)

    differed = 0
    for start, seq in ((0, 5), (5, 1), (6, 1)):
        for layer in range(config.n_layers):
            x = (rng.standard_normal((seq, config.hidden)) * rng.uniform(0.1, 3, (seq, 1))).astype(np.float32)
            assert not np.array_equal(travelled(x), x)  # the input itself does change on the way
            outs = [shares[0].attention(layer, x, start), shares[1].attention(layer, travelled(x), start),
                    shares[0].mlp(layer, x), shares[1].mlp(layer, travelled(x))]
            same = [np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in (outs[:2], outs[2:])]
            if takes:
                assert same == [True, True], (start, layer)
            differed += not all(same)
    assert takes or differed


def test_the_masters_q8_encoder_writes_wires_bytes() -> None:
    """wire_q8 (ggml's quantizer, which the master's reliable inputs take where ggml_quantizes_as_wire) writes the
    bytes encode_vector writes: a prompt's rows, zero blocks, one huge value, a block under f16's range, and a
    length that is no multiple of a block (encode_vector's own then)."""
    from edgerun.net.wire import Codec, decode_vector, encode_vector
    from edgerun.tp.ggml_shard import ggml_quantizes_as_wire, wire_q8

    if not ggml_quantizes_as_wire():
        pytest.skip("this CPU's ggml quantizes otherwise: the master keeps encode_vector")
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((64, 2048)) * rng.uniform(0.01, 30, (64, 1))).astype(np.float32)
    x[0, :64] = 0.0
    x[1, 0] = 3e4
    x[2, :32] *= 1e-8
    assert wire_q8(x) == encode_vector(x, Codec.Q8)
    assert wire_q8(x[3]) == encode_vector(x[3], Codec.Q8)
    odd = x.reshape(-1)[:1000]
    assert wire_q8(odd) == encode_vector(odd, Codec.Q8)
    back = decode_vector(memoryview(wire_q8(x)), Codec.Q8, x.size)  # a frame's view, as a node decodes it
    assert back.shape == (x.size,) and np.abs(back.reshape(x.shape) - x).max() <= np.abs(x).max() / 127
