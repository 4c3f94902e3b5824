"""The ggml engine (llama.cpp's kernels on the file's blocks) against the numpy reference, itself, and llama.cpp."""

from __future__ import annotations

import numpy as np
import pytest

from edgerun.errors import EdgerunError
from edgerun.model.generate import ReferenceEngine, default_engine, generate, make_engine
from edgerun.model.ggml_engine import KV_STEP
from edgerun.model.loader import load_model
from edgerun.model.sampling import Sampler, SamplingParams

GREEDY = Sampler(SamplingParams())


def teacher_forced(reference, engine, prompt: list[int], steps: int) -> tuple[int, float]:
    """Both engines fed the reference's greedy tokens: how many of the engine's next-token choices agree with the
    reference's, and the largest logit difference relative to the reference's largest logit."""
    want, got = reference.step(prompt), engine.step(prompt)
    agree, worst = 0, 0.0
    for _ in range(steps):
        token = int(want.argmax())
        agree += int(got.argmax()) == token
        worst = max(worst, float(np.abs(want - got).max() / np.abs(want).max()))
        want, got = reference.step([token]), engine.step([token])
    return agree, worst


@pytest.mark.parametrize(("arch", "qtype"), [("llama", "Q4_0"), ("qwen2", "Q4_K"), ("llama", "Q8_0"),
                                             ("llama", "Q4_1")])
def test_ggml_tracks_the_reference(tiny_spec, synth_gguf, arch: str, qtype: str) -> None:
    """Activations quantized per block as llama.cpp does keep every logit within 2% of the reference's largest
    (measured: 0.7-1.3%) and pick the reference's token at 38-40 of 40 steps (the others are near-ties)."""
    model = load_model(synth_gguf(tiny_spec(arch, qtype, tied=False)))
    agree, worst = teacher_forced(ReferenceEngine(model, 128), make_engine("ggml", model, 128, threads=1),
                                  list(range(10, 40)), 40)
    assert agree >= 36 and worst < 0.02, (agree, worst)


def test_ggml_reads_its_cache_across_graph_lengths(tiny_spec, synth_gguf) -> None:
    """A decode graph reads the KV cache in whole KV_STEP rows: a request that crosses from one length to the next
    (and a prompt fed in pieces) still tracks the reference."""
    model = load_model(synth_gguf(tiny_spec("llama", "Q4_0", tied=False)))
    ref, engine = ReferenceEngine(model, 2 * KV_STEP + 8), make_engine("ggml", model, 2 * KV_STEP + 8, threads=1)
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 250, KV_STEP - 8)]
    ref.step(prompt[:100])
    engine.step(prompt[:100])
    agree, worst = teacher_forced(ref, engine, prompt[100:], 24)
    assert engine.position > KV_STEP
    assert agree >= 21 and worst < 0.02, (agree, worst)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K"])
def test_an_lm_head_loaded_in_parts_computes_as_one_tensor(tiny_spec, synth_gguf, monkeypatch, qtype: str) -> None:
    """The head is loaded in parts (row_parts, a bounded peak while repacking) and computed as one tensor over
    their memory: the same logits, bit for bit, as the parts' products put side by side."""
    from edgerun.model import ggml_engine, ggml_lib

    model = load_model(synth_gguf(tiny_spec("llama", qtype, tied=False)))
    row_bytes = model.weights.output.nbytes // model.weights.output.rows
    monkeypatch.setattr(ggml_engine, "HEAD_PART_BYTES", 192 * row_bytes)  # parts of 192, 192 and 128 rows
    joined = ggml_engine.GgmlEngine(model, 64, threads=1)
    assert len(joined.weights.parts(joined.output)) > 2 and joined.weights.joined(joined.output) is not None
    monkeypatch.setattr(ggml_lib.WeightStore, "_join", lambda self, parts, ctx: 0)
    apart = ggml_engine.GgmlEngine(model, 64, threads=1)
    assert apart.weights.joined(apart.output) is None
    prompt = [5, 17, 99, 3]
    assert np.array_equal(joined.step(prompt), apart.step(prompt))
    assert np.array_equal(joined.step([7]), apart.step([7]))


def test_ggml_gives_the_same_tokens_every_time_and_on_any_thread_count(shipped_model) -> None:
    prompt = shipped_model.tokenizer.encode("The capital of France is")
    runs = []
    for threads in (1, 2, 1):
        engine = make_engine("ggml", shipped_model, 128, threads=threads)
        runs.append(generate(engine, prompt, 32, GREEDY).tokens)
        runs.append(generate(engine, prompt, 32, GREEDY).tokens)
    assert all(r == runs[0] for r in runs), runs


def test_ggml_answers_paris(shipped_model) -> None:
    """The France chat, rendered as llama.cpp's conversation mode renders it (no system message), says Paris, as
    llama.cpp does on this file. (With the template's default system message llama.cpp and the ggml engine both
    answer "L'Étoile, ...": tests/fixtures/llamacpp_*.json holds such prompts too.)"""
    tok = shipped_model.tokenizer
    prompt = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    engine = make_engine(default_engine(shipped_model), shipped_model, 128)
    assert engine.name == "ggml"
    text = tok.decode(generate(engine, prompt, 16, GREEDY, tok.stop_ids).tokens)
    assert "Paris" in text, text


def test_models_ggml_does_not_build_take_onnx(tiny_spec, synth_gguf) -> None:
    from edgerun.model.synth import SHAPES, SynthSpec

    moe = load_model(synth_gguf(SynthSpec(SHAPES["moe-tiny"], "Q8_0")))
    assert default_engine(moe) == "onnx"
    with pytest.raises(EdgerunError, match="mixture-of-experts"):
        make_engine("ggml", moe, 64)
    dense = load_model(synth_gguf(tiny_spec()))
    assert default_engine(dense) == "ggml" and default_engine(dense, activations_f32=True) == "onnx-f32"


def test_cuda_tracks_the_reference_or_says_why_not(tiny_spec, synth_gguf) -> None:
    """On a machine with an NVIDIA GPU (the device machine), the engine on ggml's CUDA backend tracks the
    reference as the CPU's does; elsewhere --device cuda is one line that says why, before any compilation."""
    from edgerun import llamacpp

    model = load_model(synth_gguf(tiny_spec("llama", "Q4_0", tied=False)))
    if not llamacpp.has_nvidia_gpu():
        with pytest.raises(EdgerunError, match="no NVIDIA GPU"):
            llamacpp.ggml_libraries(cuda=True)
        pytest.skip("no NVIDIA GPU here")
    import subprocess
    import sys

    # ggml's CUDA build loads in a process of its own (one build of ggml per process)
    code = ("from edgerun.model.loader import load_model; from edgerun.model.generate import ReferenceEngine, "
            "make_engine; import sys; sys.path.insert(0, 'tests'); from test_ggml_engine import teacher_forced; "
            f"m = load_model({str(model.path)!r}); "
            "print(*teacher_forced(ReferenceEngine(m, 128), make_engine('ggml', m, 128, device='cuda'), "
            "list(range(10, 40)), 40))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    agree, worst = int(out[0]), float(out[1])
    assert agree >= 36 and worst < 0.02, (agree, worst)
