"""Tuning data: JSONL records, their prompt formats, the offline default dataset, and token batches.

Records are either Alpaca's (instruction, input, output) or the DE-LLMIT report's multiple-choice form (instruction,
question, options, answer, explanation; the DE-LLMIT report §5.5.3). A record becomes a prompt and an answer; only the
answer's tokens (and the end-of-sequence token after them) are trained, the prompt's are masked.

The default dataset needs no download: multiple-choice questions about which standard-library module defines
a function or class, with the first sentence of its docstring as the explanation, built from the Python that
runs edgerun (as the predictors' calibration text is).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.tokenizer import Tokenizer
from edgerun.tune.model import IGNORE

ALPACA_HEADER = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                 "the request.\n\n")
MC_INSTRUCTION = "Answer the following multiple-choice question:"


class PromptFormat(Enum):
    ALPACA = "alpaca"  # the "### Instruction:" sections (the DE-LLMIT report's form for its multiple-choice records)
    CHAT = "chat"  # the model's chat template: the prompt as the user's turn, the answer as the assistant's


@dataclass(frozen=True)
class Record:
    """One training example, as the dataset states it."""

    instruction: str
    input: str = ""  # Alpaca's optional input
    output: str = ""
    question: str = ""  # the multiple-choice form's fields
    options: str = ""
    answer: str = ""
    explanation: str = ""

    @property
    def multiple_choice(self) -> bool:
        return bool(self.question)

    def user_text(self) -> str:
        """The request without any template: what a chat user would write."""
        if self.multiple_choice:
            return f"{self.instruction}\n{self.question}\nOptions: {self.options}"
        return f"{self.instruction}\n\n{self.input}" if self.input else self.instruction

    def answer_text(self) -> str:
        if self.multiple_choice:
            return f"{self.answer}\n### Explanation:\n{self.explanation}" if self.explanation else self.answer
        return self.output


def format_prompt(record: Record, fmt: PromptFormat, tokenizer: Tokenizer | None = None) -> str:
    """The text before the answer: what `edgerun generate --adapter` is given to get the trained behaviour."""
    if fmt == PromptFormat.CHAT:
        if tokenizer is None or tokenizer.chat_template is None:
            raise EdgerunError("--format chat needs a model with a chat template")
        return tokenizer.apply_chat_template([{"role": "user", "content": record.user_text()}])
    if record.multiple_choice:
        return (f"### Instruction:\n{record.instruction}\n### Question:\n{record.question}\n"
                f"### Options:\n{record.options}\n### Answer:\n")
    inp = f"### Input:\n{record.input}\n\n" if record.input else ""
    return f"{ALPACA_HEADER}### Instruction:\n{record.instruction}\n\n{inp}### Response:\n"


def _text(obj: dict, key: str, line: int, required: bool) -> str:
    value = obj.get(key, "")
    if not isinstance(value, str):
        raise EdgerunError(f"line {line}: field {key!r} must be a string, not {type(value).__name__}")
    if required and not value.strip():
        raise EdgerunError(f"line {line}: field {key!r} is missing or empty")
    return value


def parse_record(obj: object, line: int) -> Record:
    if not isinstance(obj, dict):
        raise EdgerunError(f"line {line}: a record must be a JSON object, not {type(obj).__name__}")
    if "question" in obj:
        return Record(instruction=_text(obj, "instruction", line, False) or MC_INSTRUCTION,
                      question=_text(obj, "question", line, True), options=_text(obj, "options", line, False),
                      answer=_text(obj, "answer", line, True), explanation=_text(obj, "explanation", line, False))
    if "instruction" not in obj or "output" not in obj:
        raise EdgerunError(f"line {line}: a record needs instruction and output (Alpaca) or question and answer "
                           f"(multiple choice); it has {', '.join(sorted(obj)) or 'no fields'}")
    return Record(instruction=_text(obj, "instruction", line, True), input=_text(obj, "input", line, False),
                  output=_text(obj, "output", line, True))


def read_jsonl(path: str | Path) -> list[Record]:
    """Every record of a JSONL file; a malformed line is one EdgerunError naming it."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise EdgerunError(f"dataset not found: {p}")
    records = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise EdgerunError(f"{p} is not UTF-8 text: {e}") from e
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise EdgerunError(f"{p}: line {n} is not JSON ({e.msg} at column {e.colno})") from None
        records.append(parse_record(obj, n))
    if not records:
        raise EdgerunError(f"{p} holds no records")
    return records


# --- the default dataset ------------------------------------------------------------------------------------
DEFAULT_MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv", "datetime",
    "decimal", "difflib", "email.utils", "fnmatch", "fractions", "functools", "glob", "gzip", "hashlib", "heapq",
    "hmac", "html", "http.client", "inspect", "ipaddress", "itertools", "json", "logging", "math", "mimetypes",
    "operator", "os", "os.path", "pathlib", "pickle", "platform", "pprint", "queue", "random", "re", "secrets",
    "shlex", "shutil", "socket", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "time", "typing", "unicodedata", "urllib.parse", "uuid", "zipfile", "zlib",
)
LETTERS = "ABCD"


def _first_sentence(doc: str) -> str | None:
    text = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    sentence = match.group(1) if match else None
    # Signatures, tables and one-word notes make poor explanations.
    if sentence is None or not 25 <= len(sentence) <= 160 or "(" in sentence[:12] or sentence[0].islower():
        return None
    return sentence


def default_records() -> list[Record]:
    """Multiple-choice questions about the standard library, in a fixed order (the same on every machine with
    this Python)."""
    found: list[tuple[str, str, str]] = []
    for module_name in DEFAULT_MODULES:
        module = importlib.import_module(module_name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            for name, value in sorted(vars(module).items()):
                if name.startswith("_") or not (inspect.isfunction(value) or inspect.isclass(value) or
                                                inspect.isbuiltin(value)):
                    continue
                doc = value.__doc__
                sentence = _first_sentence(doc) if isinstance(doc, str) else None
                if sentence is not None:
                    found.append((module_name, name, sentence))
    seen: set[str] = set()
    unique = [(m, n, s) for m, n, s in found if not (n in seen or seen.add(n))]  # a name re-exported: once
    rng = np.random.default_rng(0)
    modules = sorted({m for m, _, _ in unique})
    records = []
    for module_name, name, sentence in unique:
        others = [m for m in modules if m != module_name]
        choices = [module_name, *(others[i] for i in rng.choice(len(others), 3, replace=False))]
        order = rng.permutation(4)
        options = [choices[i] for i in order]
        right = LETTERS[int(np.argmax(order == 0))]
        records.append(Record(
            instruction=MC_INSTRUCTION, question=f"Which Python standard-library module defines {name}?",
            options=" ".join(f"({letter}){m}" for letter, m in zip(LETTERS, options, strict=True)),
            answer=f"({right}){module_name}", explanation=f"{module_name}.{name}: {sentence}"))
    return records


def split(records: Sequence[Record], heldout: float) -> tuple[list[Record], list[Record]]:
    """(train, held-out): a record is held out by a hash of its text, so the split does not move when records
    are added or reordered."""
    if not 0 <= heldout < 1:
        raise EdgerunError(f"--heldout must be in [0, 1), not {heldout}")
    train, held = [], []
    for r in records:
        h = int.from_bytes(hashlib.sha256(repr(r).encode()).digest()[:4], "little") / 2**32
        (held if h < heldout else train).append(r)
    if not train:
        raise EdgerunError("no training records left after the held-out split")
    return train, held


# --- tokens ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Example:
    tokens: tuple[int, ...]
    answer_start: int  # tokens[answer_start:] are trained (each predicted from the one before)


def tokenize(records: Sequence[Record], tokenizer: Tokenizer, fmt: PromptFormat, max_len: int) -> list[Example]:
    """Prompt + answer + end-of-sequence token, cut to `max_len`; a record with no answer token left is dropped."""
    out = []
    for r in records:
        prompt = tokenizer.encode(format_prompt(r, fmt, tokenizer))
        answer = tokenizer.encode(r.answer_text(), add_bos=False)
        if tokenizer.eos_id is not None:
            answer.append(tokenizer.eos_id)
        tokens = (prompt + answer)[:max_len]
        if len(tokens) > len(prompt):
            out.append(Example(tuple(tokens), len(prompt)))
    return out


@dataclass(frozen=True)
class Batch:
    tokens: np.ndarray  # int64 (batch, seq), right-padded with 0
    labels: np.ndarray  # int64 (batch, seq): the next token where it is trained, else IGNORE

    @property
    def n_labels(self) -> int:
        return int((self.labels != IGNORE).sum())

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)


def make_batch(examples: Sequence[Example]) -> Batch:
    seq = max(len(e.tokens) for e in examples)
    tokens = np.zeros((len(examples), seq), np.int64)
    labels = np.full((len(examples), seq), IGNORE, np.int64)
    for i, e in enumerate(examples):
        n = len(e.tokens)
        tokens[i, :n] = e.tokens
        # Position t predicts token t + 1: trained where t + 1 is in the answer.
        labels[i, e.answer_start - 1:n - 1] = e.tokens[e.answer_start:]
    return Batch(tokens, labels)


def step_batches(examples: Sequence[Example], step: int, micro_batches: int, micro_size: int,
                 seed: int) -> list[Batch]:
    """The micro-batches of optimizer step `step` (from 0): consecutive slices of a seeded shuffle of the
    examples, reshuffled each epoch. A function of the step alone, so a run resumed from a checkpoint reads the
    same data as one never interrupted."""
    per_step = micro_batches * micro_size
    n = len(examples)
    out = []
    for m in range(micro_batches):
        picked = []
        for j in range(micro_size):
            index = step * per_step + m * micro_size + j
            epoch, at = divmod(index, n)
            order = np.random.default_rng([seed, epoch]).permutation(n)
            picked.append(examples[int(order[at])])
        out.append(make_batch(picked))
    return out


def batches(examples: Sequence[Example], size: int) -> Iterator[Batch]:
    """Every example once, in order, `size` at a time (evaluation)."""
    for i in range(0, len(examples), size):
        yield make_batch(examples[i:i + size])
