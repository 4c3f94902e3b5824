"""Pipeline stages on ggml: a chain of stages computes what the whole-model engine computes, and their KV rows
are StageSession's (onnxruntime's) form, so the two kinds hand keys and values to each other."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from edgerun.model.generate import make_engine
from edgerun.model.ggml_stage import GgmlStage
from edgerun.model.loader import load_model
from edgerun.model.onnx_graph import Activations, StageSpec, cached_stage
from edgerun.model.session import StageSession


def chain_step(stages: list[GgmlStage], x: np.ndarray) -> np.ndarray:
    for stage in stages:
        x = stage.run(x)
    return x


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_chain_of_stages_is_the_whole_engine(tiny_spec, synth_gguf, arch: str) -> None:
    """Stages of 1, 2 and the rest of the layers, fed a prompt and then one token at a time, give the whole
    engine's logits exactly: the same graphs cut at layer boundaries, hidden states passed as float32."""
    spec = tiny_spec(arch, "Q4_0", tied=False)
    model = load_model(synth_gguf(replace(spec, config=replace(spec.config, n_layers=4))))
    n = model.config.n_layers
    whole = make_engine("ggml", model, 64, threads=1)
    stages = [GgmlStage(model, a, b, 64, threads=1) for a, b in ((0, 1), (1, 3), (3, n))]
    assert [s.input_name for s in stages] == ["input_ids", "hidden", "hidden"]
    prompt = list(range(10, 30))
    want = whole.step(prompt)
    got = chain_step(stages, np.array([prompt], np.int64))
    assert got.shape == (1, 1, model.config.vocab_size)
    np.testing.assert_array_equal(got[0, -1], want)
    for _ in range(8):
        token = int(want.argmax())
        want, got = whole.step([token]), chain_step(stages, np.array([[token]], np.int64))
        np.testing.assert_array_equal(got[0, -1], want)
    assert all(s.position == len(prompt) + 8 for s in stages)


def test_stages_run_a_batch_of_sequences_each_as_alone(tiny_spec, synth_gguf) -> None:
    """Two stages holding three sequences (slots), their prompts run slot by slot, then batched steps of all three
    (and of two, in another order): each sequence's logits are bit for bit those of a chain that runs it alone, and
    those of the whole engine's batched decode."""
    spec = tiny_spec("llama", "Q4_0", tied=False)
    model = load_model(synth_gguf(replace(spec, config=replace(spec.config, n_layers=4))))
    stages = [GgmlStage(model, 0, 2, 64, threads=1, slots=3), GgmlStage(model, 2, 4, 64, threads=1, slots=3)]
    whole = make_engine("ggml", model, 64, threads=1, slots=3)
    prompts = [list(range(10, 27)), list(range(40, 45)), list(range(7, 40, 3))]
    alone = []
    for slot, prompt in enumerate(prompts):
        x: np.ndarray = np.array([prompt], np.int64)
        for stage in stages:
            x = stage.run_slot(slot, x, 0)
        np.testing.assert_array_equal(x[0, -1], whole.prefill(slot, prompt, 0))
        chain = [GgmlStage(model, 0, 2, 64, threads=1), GgmlStage(model, 2, 4, 64, threads=1)]
        alone.append((chain, chain_step(chain, np.array([prompt], np.int64))[0, -1]))
    positions = [len(p) for p in prompts]
    for step in range(4):
        slots = [0, 1, 2] if step % 2 == 0 else [2, 0]
        tokens = [int(alone[s][1].argmax()) for s in slots]
        batch = [(s, positions[s]) for s in slots]
        x = np.array(tokens, np.int64)
        for stage in stages:
            x = stage.run_batch(batch, x)
        assert x.shape == (len(slots), model.config.vocab_size)
        batched = whole.decode([(s, positions[s], t) for s, t in zip(slots, tokens, strict=True)])
        np.testing.assert_array_equal(x, batched)
        for row, s, token in zip(x, slots, tokens, strict=True):
            chain, _ = alone[s]
            logits = chain_step(chain, np.array([[token]], np.int64))[0, -1]
            np.testing.assert_array_equal(row, logits)
            alone[s] = (chain, logits)
            positions[s] += 1


def test_kv_rows_are_onnxruntimes_form_and_move_between_stages(tiny_spec, synth_gguf) -> None:
    """A ggml stage's keys and values of a prompt are an onnxruntime stage's to F16 rounding (Hugging Face row
    order, (1, kv heads, positions, head dim)); loaded into a fresh ggml stage (as a recovery or a swap moves
    them) the next token's output is the one the first stage gives; a saved prefix comes back."""
    model = load_model(synth_gguf(tiny_spec("llama", "Q4_0", tied=False)))
    c = model.config
    directory = cached_stage(model.path, c, model.weights, StageSpec.for_layers(c, 0, 2, Activations.INT8))
    onnx = StageSession(directory, c, 0, 2, 64, threads=1)
    stage = GgmlStage(model, 0, 2, 64, threads=1)
    prompt = np.array([list(range(5, 17))], np.int64)
    np.testing.assert_allclose(stage.run(prompt), onnx.run(prompt), atol=0.05, rtol=0.05)
    for layer in (0, 1):
        for ours, theirs in zip(stage.kv_rows(layer), onnx.kv_rows(layer), strict=True):
            assert ours.shape == theirs.shape == (1, c.n_kv_heads, 12, c.head_dim)
            scale = np.abs(theirs).max()
            assert np.abs(ours - theirs).max() < 0.03 * scale
    moved = GgmlStage(model, 0, 2, 64, threads=1)
    for layer in (0, 1):
        moved.load_kv_rows(layer, *stage.kv_rows(layer))
    assert moved.position == 12
    stage.save_prefix()
    token = np.array([[42]], np.int64)
    expected = stage.run(token)
    np.testing.assert_array_equal(moved.run(token), expected)
    stage.run(np.array([[7, 8, 9]], np.int64))
    assert stage.restore_prefix() == 12 and stage.position == 12
    np.testing.assert_array_equal(stage.run(token), expected)
    with pytest.raises(ValueError, match="not in this stage"):
        stage.kv_rows(3)
