"""`edgerun tune`: fine-tune LoRA adapters, in this process or across a pipeline of workers."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from edgerun.commands.common import cluster_key, key_arg, model_arg, thread_count
from edgerun.errors import EdgerunError

DEFAULT_OUT = Path("tune-out")
HELDOUT_TOKENS = 48  # of the held-out example's answer shown at the end


def cmd_tune(args: argparse.Namespace) -> None:
    from edgerun.tune.worker import require_torch

    require_torch()
    import torch

    from edgerun.model.loader import load_model
    from edgerun.net.model_files import model_sha256
    from edgerun.tune.cluster import TuneMaster, local_restart
    from edgerun.tune.data import PromptFormat, default_records, read_jsonl, split, tokenize
    from edgerun.tune.lora import LoraConfig, parse_targets
    from edgerun.tune.tuner import CHECKPOINT_FILE, StepRecord, TuneConfig, Tuner, eta_text, load_checkpoint

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    if args.workers < 0:
        raise EdgerunError(f"--workers must be at least 0, not {args.workers}")
    settings = _run_settings(args)
    if args.max_len < 2:
        raise EdgerunError(f"--max-len must be at least 2, not {args.max_len}")
    lora = LoraConfig(rank=args.rank, alpha=args.alpha, dropout=args.dropout, targets=parse_targets(args.targets),
                      seed=args.seed)
    config = TuneConfig(steps=args.steps, micro_size=args.micro_size, micro_batches=args.accumulate,
                        in_flight=args.in_flight, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
                        checkpoint_every=args.checkpoint_every, eval_examples=args.eval_examples, lora=lora,
                        recompute=args.recompute)
    model = load_model(args.model)
    if model.config.is_moe:
        raise EdgerunError("tuning a mixture-of-experts model is not supported")
    records = read_jsonl(args.data) if args.data else default_records()
    train_records, held_records = split(records, args.heldout)
    fmt = PromptFormat(args.format)
    train = tokenize(train_records, model.tokenizer, fmt, args.max_len)
    held = tokenize(held_records, model.tokenizer, fmt, args.max_len)
    if not train:
        raise EdgerunError(f"no training example keeps an answer token within --max-len {args.max_len}")
    sha = model_sha256(model.path)
    if not args.resume and not args.overwrite and (args.out / CHECKPOINT_FILE).exists():
        raise EdgerunError(f"{args.out} holds an earlier run's checkpoint: --resume to continue it, --overwrite to "
                           "start over, or another --out")
    resume = load_checkpoint(args.out, config, sha) if args.resume else None
    if resume is None:  # a fresh run: what --resume takes up again
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / RUN_FILE).write_text(json.dumps(settings, indent=2) + "\n")
    if args.resume and resume is None:
        log(f"no checkpoint in {args.out}: starting from step 0")
    if resume is not None:
        log(f"resuming from step {resume.step} of {args.out / 'checkpoint.safetensors'}")
    log(f"tuning {model.name}: {len(train)} training and {len(held)} held-out examples "
        f"({args.data or 'the built-in standard-library questions'}), rank {lora.rank} on "
        f"{','.join(t.value for t in lora.targets)}, {config.steps} steps of {config.micro_batches} x "
        f"{config.micro_size} sequences, lr {config.lr:g}")
    started = time.perf_counter()
    done_before = resume.step if resume else 0

    def on_step(r: StepRecord) -> None:
        elapsed = time.perf_counter() - started
        rate = (r.step - done_before) / elapsed if elapsed > 0 else 0.0
        eta = (config.steps - r.step) / rate if rate > 0 else float("inf")
        log(f"step {r.step}/{config.steps}  loss {r.loss:.4f}  {r.tokens_per_s:.0f} tok/s  ETA {eta_text(eta)}")
        if args.json:
            print(json.dumps({"step": r.step, "loss": round(r.loss, 6), "tokens_per_s": round(r.tokens_per_s, 1),
                              "seconds": round(r.seconds, 3)}), flush=True)

    tuner = Tuner(config, train, held, sha, args.out, log, on_step)
    if args.workers == 0:
        import asyncio

        torch.set_num_threads(args.threads)
        result = asyncio.run(tuner.run(local_restart(model, config), resume))
    else:
        master = TuneMaster(model, cluster_key(args), config, args.max_len, args.host, args.port, args.workers,
                            args.wait_s, log=log)
        log(f"waiting for {args.workers} workers: edgerun node --mode pp --master HOST:{master.port}")
        try:
            result = master.run(tuner.run(master.restart, resume))
        finally:
            master.close()
    from edgerun.tune.stage import adapter_from_state

    adapter = adapter_from_state(result.final_state.tensors, lora, sha)
    adapter.save(args.out / "adapter")
    summary = {**result.summary(args.loss_window), "adapter": str(args.out / "adapter")}
    if held_records:
        summary["heldout_example"] = show_heldout(model, held_records[0], fmt, args.out, log)
    log(f"loss {summary['initial_loss']:.4f} -> {summary['final_loss']:.4f} (means of the first and last "
        f"{summary['loss_window']} steps); adapter saved in {args.out / 'adapter'}")
    if args.json:
        print(json.dumps(summary), flush=True)


def show_heldout(model, record, fmt, out: Path, log) -> dict[str, str]:
    """A held-out record's prompt answered greedily by the base model and by the tuned one (the single engine, as
    `edgerun generate --adapter` runs it); the prompt is written to OUT/heldout_prompt.txt to reproduce it."""
    from edgerun.model.generate import generate, make_engine
    from edgerun.model.sampling import Sampler, SamplingParams
    from edgerun.tune.data import format_prompt
    from edgerun.tune.lora import apply_adapter

    text = format_prompt(record, fmt, model.tokenizer)
    (out / "heldout_prompt.txt").write_text(text)
    prompt = model.tokenizer.encode(text)
    answers = {}
    for label, m in (("base", model), ("tuned", apply_adapter(model, out / "adapter"))):
        result = generate(make_engine("onnx", m, len(prompt) + HELDOUT_TOKENS + 1, threads=1), prompt,
                          HELDOUT_TOKENS, Sampler(SamplingParams()), m.tokenizer.stop_ids)
        answers[label] = m.tokenizer.decode(result.tokens)
    log(f"held-out prompt ({out / 'heldout_prompt.txt'}):\n{text}")
    log(f"base model's answer:\n{answers['base']}\n")
    log(f"tuned model's answer:\n{answers['tuned']}\n")
    log(f"expected:\n{record.answer_text()}\n")
    log(f"reproduce: cat {out / 'heldout_prompt.txt'} | edgerun generate --adapter {out / 'adapter'} -")
    return {"prompt": text, "base": answers["base"], "tuned": answers["tuned"], "expected": record.answer_text()}


# What defines a run's examples and adapter: kept in --out/run.json when it starts, taken from there by --resume.
RUN_SETTINGS: dict[str, object] = {"data": None, "format": "alpaca", "heldout": 0.1, "max_len": 256, "rank": 8,
                                   "alpha": 16.0, "dropout": 0.05, "targets": "q,v", "seed": 0}
RUN_FILE = "run.json"


def _run_settings(args: argparse.Namespace) -> dict[str, object]:
    """Fill in the run's settings: with --resume the run's own (an option given that differs is refused), else
    the defaults for those not given. Returns them, for a fresh run's --out/run.json."""
    given = {name: getattr(args, name) for name in RUN_SETTINGS if getattr(args, name) is not None}
    if given.get("data") is not None:
        given["data"] = str(Path(given["data"]).resolve())
    path = args.out / RUN_FILE
    saved: dict[str, object] = {}
    if args.resume and path.is_file():
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise EdgerunError(f"cannot read {path}: {e}") from e
        for name, value in given.items():
            if name in saved and saved[name] != value:
                option = "--" + name.replace("_", "-")
                raise EdgerunError(f"{option} {value} is not the run's ({saved[name]}, in {path}): leave it out to "
                                   "continue the run as it was, or start another --out")
    settings = {**RUN_SETTINGS, **saved, **given}
    for name, value in settings.items():
        setattr(args, name, Path(value) if name == "data" and value is not None else value)
    return settings


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="fine-tune LoRA adapters, alone or across a pipeline of workers",
                       description="Train LoRA adapters on a JSONL dataset (Alpaca's instruction/input/output, or "
                                   "instruction/question/options/answer/explanation) over the frozen, quantized "
                                   "model: in this process (--workers 0) or across `edgerun node --mode pp` workers, "
                                   "each holding a range of layers; activations flow forward and gradients back. "
                                   "Checkpoints every --checkpoint-every steps; a lost worker means a new plan over "
                                   "the ones left and a resume from the last checkpoint. Needs PyTorch (pip install "
                                   "torch==2.13.0).")
    model_arg(p)
    p.add_argument("--data", type=Path, default=None, help="JSONL dataset (default: built-in multiple-choice "
                   "questions about Python's standard library, made offline from its docstrings)")
    p.add_argument("--format", choices=("alpaca", "chat"), default=None,
                   help="prompt format: alpaca's '### Instruction:' sections, or the model's chat template "
                        "(default: alpaca)")
    p.add_argument("--heldout", type=float, default=None, help="share of records held out (default: 0.1)")
    p.add_argument("--eval-examples", type=int, default=48,
                   help="held-out examples scored before and after tuning; 0: none (default: 48)")
    p.add_argument("--max-len", type=int, default=None, help="tokens per example at most (default: 256)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    p.add_argument("--micro-size", type=int, default=2, help="sequences per micro-batch (default: 2)")
    p.add_argument("--accumulate", type=int, default=2,
                   help="micro-batches per optimizer step, gradients accumulated; with --in-flight, what keeps "
                        "several stages busy at once (default: 2)")
    p.add_argument("--in-flight", type=int, default=2,
                   help="micro-batches in the pipeline at once, GPipe-style (default: 2)")
    p.add_argument("--recompute", action="store_true",
                   help="keep only each layer's input for the backward pass and compute the layer again there: "
                        "about a third more compute for a fraction of the activations' memory, which is most of a "
                        "training stage's (default: off)")
    p.add_argument("--lr", type=float, default=5e-5,
                   help="AdamW learning rate (default: 5e-5, the DE-LLMIT report's)")
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW weight decay (default: 0.1, the DE-LLMIT report's)")
    p.add_argument("--rank", type=int, default=None, help="LoRA rank (default: 8)")
    p.add_argument("--alpha", type=float, default=None, help="LoRA alpha; the update is scaled by alpha/rank "
                   "(default: 16)")
    p.add_argument("--dropout", type=float, default=None, help="dropout on LoRA's input (default: 0.05)")
    p.add_argument("--targets", default=None, help="projections to adapt, from q,k,v,o,gate,up,down, or all "
                   "(default: q,v)")
    p.add_argument("--seed", type=int, default=None, help="data order, dropout and initial values (default: 0)")
    p.add_argument("--workers", type=int, default=0, help="pipeline workers to wait for; 0 trains in this process "
                   "(default: 0)")
    p.add_argument("--host", default="0.0.0.0", help="with --workers: address to listen on (default: 0.0.0.0)")
    p.add_argument("--port", type=int, default=7000, help="with --workers: port workers connect to (default: 7000)")
    p.add_argument("--wait-s", type=float, default=600.0,
                   help="with --workers: seconds to wait for them, and for one after a loss (default: 600)")
    p.add_argument("--threads", type=thread_count, default=1,
                   help="PyTorch threads with --workers 0 (workers use their own --threads) (default: 1)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints; 0: only at the end "
                   "(default: 10)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"directory for checkpoint.safetensors and adapter/ (default: {DEFAULT_OUT})")
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint in --out, with the run's own data, format, lengths and LoRA "
                        "settings (kept in --out/run.json; an option given that differs is refused) (default: off)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over where --out holds an earlier run's checkpoint (default: refuse)")
    p.add_argument("--loss-window", type=int, default=10, help="steps averaged into initial_loss and final_loss "
                   "(default: 10)")
    p.add_argument("--json", action="store_true", help="print each step as a JSON line and a JSON summary at the end")
    key_arg(p)
    p.set_defaults(func=cmd_tune)
