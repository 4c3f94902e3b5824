"""LoRA tuning: the training forward pass against the reference, a pipeline's gradients against one process's,
checkpoints and resume, adapters in the engines, the data formats, and `edgerun tune` over real worker processes
(with a worker killed -9 mid-run)."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgerun.bench.pp import SECRET, start_worker  # noqa: E402
from edgerun.cli import main  # noqa: E402
from edgerun.errors import EdgerunError  # noqa: E402
from edgerun.model.generate import make_engine  # noqa: E402
from edgerun.model.loader import Model  # noqa: E402
from edgerun.model.reference import ReferenceModel  # noqa: E402
from edgerun.net.model_files import model_sha256  # noqa: E402
from edgerun.net.wire import derive_key  # noqa: E402
from edgerun.tune.cluster import TuneMaster, local_restart  # noqa: E402
from edgerun.tune.data import (  # noqa: E402
    PromptFormat,
    Record,
    default_records,
    format_prompt,
    make_batch,
    read_jsonl,
    split,
    tokenize,
)
from edgerun.tune.lora import Adapter, LoraConfig, Target, apply_adapter, load_adapter  # noqa: E402
from edgerun.tune.model import IGNORE, StageModel  # noqa: E402
from edgerun.tune.stage import OptimConfig, StageTrainer, adapter_from_state  # noqa: E402
from edgerun.tune.tuner import StepRecord, TuneConfig, Tuner, load_checkpoint  # noqa: E402

WORDS = ("cat", "house", "river", "green", "paper", "stone", "cloud", "apple", "light", "sound", "table", "chair",
         "bread", "water", "music", "plant")


def short_records() -> list[Record]:
    """Small Alpaca records (about 45 tokens each): fast steps."""
    return [Record(instruction="Write the word in capital letters.", input=w, output=w.upper()) for w in WORDS]


@pytest.fixture(scope="module")
def examples(shipped_model: Model):
    return tokenize(short_records(), shipped_model.tokenizer, PromptFormat.ALPACA, 128)


def random_adapter(model: Model, lora: LoraConfig, seed: int = 1) -> Adapter:
    """An adapter with B != 0 (a fresh one has B = 0, so A's gradient would be zero and prove nothing)."""
    rng = np.random.default_rng(seed)
    matrices = {}
    for layer in range(model.config.n_layers):
        for t in lora.targets:
            out, inp = t.shape(model.config)
            matrices[(layer, t)] = (rng.normal(0, 0.05, (lora.rank, inp)).astype(np.float32),
                                    rng.normal(0, 0.05, (out, lora.rank)).astype(np.float32))
    return Adapter(lora, model_sha256(model.path), matrices)


@pytest.mark.slow
def test_training_forward_equals_the_reference(shipped_model: Model) -> None:
    """Adapters at zero (B = 0): the PyTorch stage's logits are the numpy reference's, from quantized weights."""
    tokens = shipped_model.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    ref = ReferenceModel(shipped_model.config, shipped_model.weights)
    expected = ref.forward(tokens, ref.new_cache(64), all_logits=True)
    stage = StageModel(shipped_model.config, shipped_model.weights, 0, shipped_model.config.n_layers, LoraConfig())
    with torch.no_grad():
        got = stage.logits(stage(torch.tensor([tokens])))[0].numpy()
    assert np.abs(got - expected).max() < 1e-3 * np.abs(expected).max()
    assert (got.argmax(-1) == expected.argmax(-1)).all()
    # Quantized in memory: the stage holds about the file's bytes, not float32's four per weight.
    assert stage.frozen_bytes() < 0.3 * 4 * shipped_model.config.n_params()


@pytest.mark.slow
@pytest.mark.parametrize("cuts, recompute", [((15,), False), ((7, 20), True)])
def test_pipeline_gradients_equal_a_single_process(shipped_model: Model, examples, cuts: tuple[int, ...],
                                                   recompute: bool) -> None:
    """One step through 2 and 3 stages (activations forward, gradients back, dropout on; the 3 stages computing
    each layer again for the backward pass) gives every LoRA matrix the gradient a single process computes, and
    the same loss."""
    c = shipped_model.config
    lora = LoraConfig(rank=4, dropout=0.1, targets=(Target.Q, Target.V, Target.DOWN))
    adapter = random_adapter(shipped_model, lora)
    batch = make_batch(examples[:3])
    denominator = batch.n_labels

    def trainers(bounds: list[int], recompute: bool = False) -> list[StageTrainer]:
        out = []
        for first, end in itertools.pairwise(bounds):
            t = StageTrainer(c, shipped_model.weights, first, end, lora, OptimConfig(), recompute)
            t.model.load_adapter(adapter)
            out.append(t)
        return out

    (single,) = trainers([0, c.n_layers])
    loss_single, _, _ = single.forward_loss(batch.tokens, batch.labels, (0, 0), denominator)
    expected = single.gradients()
    stages = trainers([0, *cuts, c.n_layers], recompute)
    x = batch.tokens
    for s in stages[:-1]:
        x = s.forward(0, x, (0, 0))
    loss, count, grad = stages[-1].forward_loss(x, batch.labels, (0, 0), denominator)
    for s in reversed(stages[:-1]):
        grad = s.backward(0, grad)
    assert grad is None and count == denominator
    assert loss == pytest.approx(loss_single, rel=1e-6)
    got = {n: g for s in stages for n, g in s.gradients().items()}
    assert got.keys() == expected.keys()
    for name, g in expected.items():
        assert np.abs(g).max() > 0, name
        assert np.linalg.norm(got[name] - g) <= 1e-4 * np.linalg.norm(g), name


@pytest.mark.slow
def test_steps_lower_the_loss_and_a_resumed_run_repeats_the_losses(shipped_model: Model, examples,
                                                                   tmp_path: Path) -> None:
    """Six steps lower the loss; a run stopped after a checkpoint at step 4 and resumed reports the losses of the
    uninterrupted run, and its adapter is the same."""
    config = TuneConfig(steps=6, micro_size=2, micro_batches=2, lr=2e-3, checkpoint_every=2, eval_examples=4,
                        lora=LoraConfig(rank=4))
    sha = model_sha256(shipped_model.path)
    train, held = examples[:12], examples[12:]

    local = local_restart(shipped_model, config)

    whole = asyncio.run(Tuner(config, train, held, sha, tmp_path / "a").run(local))
    assert whole.losses[-1] < whole.losses[0] and whole.heldout_after < whole.heldout_before
    first = asyncio.run(Tuner(TuneConfig(**{**config.__dict__, "steps": 4}), train, held, sha,
                              tmp_path / "b").run(local))
    assert first.losses == pytest.approx(whole.losses[:4], rel=1e-5)
    checkpoint = load_checkpoint(tmp_path / "b", config, sha)
    assert checkpoint is not None and checkpoint.step == 4 and checkpoint.optimizer_steps == 4
    resumed = asyncio.run(Tuner(config, train, held, sha, tmp_path / "b").run(local, checkpoint))
    assert resumed.losses == pytest.approx(whole.losses, rel=1e-5)
    a = adapter_from_state(whole.final_state.tensors, config.lora, sha)
    b = adapter_from_state(resumed.final_state.tensors, config.lora, sha)
    for key, (ma, mb) in a.matrices.items():
        np.testing.assert_allclose(b.matrices[key][1], mb, rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(b.matrices[key][0], ma, rtol=1e-4, atol=1e-7)
    with pytest.raises(EdgerunError, match="another model"):
        load_checkpoint(tmp_path / "b", config, "0" * 64)


@pytest.mark.slow
def test_adapter_file_applies_in_onnx_and_reference_and_refuses_another_model(shipped_model: Model,
                                                                              tmp_path: Path) -> None:
    """Saved as PEFT names, loaded back exactly; the ONNX engine with the adapter computes what the reference with
    the adapter folded in computes, and not what the base model computes."""
    lora = LoraConfig(rank=4, targets=(Target.Q, Target.V, Target.UP))
    adapter = random_adapter(shipped_model, lora, seed=3)
    adapter.save(tmp_path / "adapter")
    names = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert names["peft_type"] == "LORA" and names["r"] == 4 and names["target_modules"] == ["q_proj", "v_proj",
                                                                                            "up_proj"]
    again = load_adapter(tmp_path / "adapter")
    assert again.base_sha256 == adapter.base_sha256
    for key, (a, b) in adapter.matrices.items():
        assert np.array_equal(again.matrices[key][0], a) and np.array_equal(again.matrices[key][1], b)
    tuned = apply_adapter(shipped_model, tmp_path / "adapter")
    tokens = shipped_model.tokenizer.encode("Write the word in capital letters: river")
    ref = ReferenceModel(tuned.config, tuned.weights)
    expected = ref.forward(tokens, ref.new_cache(64))
    base = ReferenceModel(shipped_model.config, shipped_model.weights).forward(tokens, ref.new_cache(64))
    engine = make_engine("onnx-f32", tuned, 64, threads=1)
    got = engine.step(tokens)
    got = got[-1] if got.ndim > 1 else got
    engine.release()
    assert np.abs(got - expected).max() < 1e-3 * np.abs(expected).max()
    assert np.abs(expected - base).max() > 0.1  # the adapter changes the numbers
    (tmp_path / "other").mkdir()
    Adapter(lora, "f" * 64, adapter.matrices).save(tmp_path / "other")
    with pytest.raises(EdgerunError, match="another model"):
        apply_adapter(shipped_model, tmp_path / "other")


def test_records_formats_and_default_data(shipped_model: Model, tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"instruction": "Add", "input": "2 and 3", "output": "5"}) + "\n\n" + json.dumps(
        {"instruction": "Answer the following multiple-choice question:", "question": "Which will not affect the "
         "degree of ionisation?", "options": "(A)Temperature (B)Current", "answer": "(B)Current",
         "explanation": "Current does not."}) + "\n")
    alpaca, mc = read_jsonl(path)
    assert format_prompt(alpaca, PromptFormat.ALPACA).endswith("### Input:\n2 and 3\n\n### Response:\n")
    assert format_prompt(mc, PromptFormat.ALPACA).endswith("### Options:\n(A)Temperature (B)Current\n### Answer:\n")
    assert mc.answer_text() == "(B)Current\n### Explanation:\nCurrent does not."
    assert "<|im_start|>user" in format_prompt(alpaca, PromptFormat.CHAT, shipped_model.tokenizer)
    (ex,) = tokenize([alpaca], shipped_model.tokenizer, PromptFormat.ALPACA, 256)
    batch = make_batch([ex])
    trained = batch.labels[batch.labels != IGNORE]
    assert shipped_model.tokenizer.decode(trained[:-1]) == "5" and trained[-1] == shipped_model.tokenizer.eos_id
    records = default_records()
    train, held = split(records, 0.1)
    assert len(train) + len(held) == len(records) > 300 and 0.05 < len(held) / len(records) < 0.15
    assert split(list(reversed(records)), 0.1)[1] == list(reversed(held))  # held out by content, not position
    assert all(r.answer.startswith("(") and r.explanation for r in records)


def test_an_earlier_run_is_not_overwritten_unasked(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "checkpoint.safetensors").write_bytes(b"")
    assert main(["tune", "--out", str(tmp_path), "--steps", "1"]) == 2
    assert "--resume to continue it, --overwrite to start over" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_takes_the_runs_own_data_and_settings(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`tune --resume --out DIR`, as the README writes it, continues with the run's data, format and LoRA settings
    (it failed with "other LoRA settings", or took the built-in data); an option that differs is refused."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"instruction": "Say {w}", "output": "{w.title()}"}}\n' for w in ("hi", "bye", "yes")))
    quick = ["--micro-size", "1", "--accumulate", "1", "--in-flight", "1", "--eval-examples", "0"]
    out = tmp_path / "run"
    assert main(["tune", "--data", str(data), "--format", "chat", "--rank", "4", "--max-len", "48", "--heldout",
                 "0.34", "--steps", "1", "--out", str(out), *quick]) == 0
    capsys.readouterr()
    assert main(["tune", "--resume", "--out", str(out), "--steps", "2", *quick]) == 0
    err = capsys.readouterr().err
    assert "resuming from step 1" in err and f"2 training and 1 held-out examples ({data.resolve()}), rank 4" in err
    assert main(["tune", "--resume", "--out", str(out), "--steps", "3", "--rank", "8"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"edgerun: error: --rank 8 is not the run's (4, in {out / 'run.json'}): leave it out to continue the run "
        "as it was, or start another --out")


def test_tune_short_of_workers_says_how_to_start_them(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["tune", "--out", str(tmp_path), "--steps", "1", "--workers", "2", "--wait-s", "1", "--host",
                 "127.0.0.1", "--port", "0", "--key", "k"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("edgerun: error: 0 of 2 workers connected within 1 s: start them with `edgerun node "
                              "--mode pp --master HOST:"), err


@pytest.mark.parametrize("content, args, message", [
    ('{"instruction": "x", "output": "y"}\n{not json}\n', [], "line 2 is not JSON"),
    ('{"instruction": "x"}\n', [], "needs instruction and output"),
    ("\n\n", [], "holds no records"),
    ('{"instruction": "x", "output": "y"}\n', ["--rank", "0"], "rank must be at least 1"),
    ('{"instruction": "x", "output": 5}\n', [], "must be a string"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture, content: str,
                                          args: list[str], message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    assert main(["tune", "--data", str(path), "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("edgerun: error:")


def test_generate_refuses_an_adapter_of_another_model(shipped_model: Model, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    lora = LoraConfig(rank=2)
    Adapter(lora, "e" * 64, random_adapter(shipped_model, lora).matrices).save(tmp_path / "a")
    assert main(["generate", "hello", "--adapter", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained on another model" in err[0]


@pytest.mark.slow
def test_tune_over_worker_processes_survives_a_kill_and_equals_one_process(shipped_model: Model, examples,
                                                                           tmp_path: Path) -> None:
    """Three `edgerun node --mode pp` processes train the stages; one is killed -9 at step 3. The master replans
    over the two left, resumes from the checkpoint of step 2, and ends with the losses and adapter a single
    process computes."""
    config = TuneConfig(steps=5, micro_size=2, micro_batches=2, in_flight=2, lr=2e-3, checkpoint_every=2,
                        eval_examples=2, lora=LoraConfig(rank=4))
    sha = model_sha256(shipped_model.path)
    train, held = examples[:12], examples[12:]

    local = local_restart(shipped_model, config)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers compute: another thread count rounds differently
    try:
        single = asyncio.run(Tuner(config, train, held, sha, None).run(local))
    finally:
        torch.set_num_threads(threads)
    logs: list[str] = []
    master = TuneMaster(shipped_model, derive_key(SECRET), config, 128, "127.0.0.1", 0, expect=3, wait_s=120,
                        log=logs.append)
    workers = [start_worker(master.port, f"w{i}", 2048) for i in range(3)]

    def on_step(record: StepRecord) -> None:
        if record.step == 3 and workers[1].poll() is None and len(master.plans) == 1:
            workers[1].send_signal(signal.SIGKILL)

    try:
        result = master.run(Tuner(config, train, held, sha, tmp_path, logs.append, on_step).run(master.restart))
    finally:
        master.close()
        for p in workers:
            p.kill()
            p.wait()
    assert len(master.plans[0].stages) == 3, logs
    assert result.recoveries == 1 and len(master.plans) == 2 and len(master.plans[1].stages) == 2, logs
    assert any("resuming from step 2" in line for line in logs), logs
    assert result.losses == pytest.approx(single.losses, rel=1e-4)
    # Five AdamW steps amplify last-bit differences (summation order across the cut) a little.
    assert result.heldout_after == pytest.approx(single.heldout_after, rel=1e-3)
    for name, value in single.final_state.tensors.items():
        np.testing.assert_allclose(result.final_state.tensors[name], value, rtol=1e-3, atol=1e-6)


@pytest.mark.slow
def test_a_pipeline_with_an_adapter_gives_the_single_engines_tokens(shipped_model: Model, tmp_path: Path) -> None:
    """`edgerun master --plan dp --adapter`: the stages' graphs carry the adapter's products, and two workers
    generate what the single engine with the adapter generates, not what the base model does."""
    from edgerun.bench.pp import local_pipeline
    from edgerun.model.onnx_engine import OnnxEngine
    from edgerun.model.sampling import Sampler, SamplingParams

    lora = LoraConfig(rank=4, targets=(Target.Q, Target.V))
    random_adapter(shipped_model, lora, seed=5).save(tmp_path / "adapter")
    tuned = apply_adapter(shipped_model, tmp_path / "adapter")
    prompt = shipped_model.tokenizer.encode("The capital of France is")

    def single(model: Model) -> list[int]:
        from edgerun.model.generate import generate

        return generate(OnnxEngine(model, max_len=64), prompt, 16, Sampler(SamplingParams())).tokens

    expected = single(tuned)
    assert expected != single(shipped_model)
    with local_pipeline(tuned, [80, 80], 64) as (master, _):
        master.start()
        assert len(master.plan.stages) == 2
        assert master.generate(prompt, 16) == expected
