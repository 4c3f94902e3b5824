"""What a request asks of the logits beyond sampling: a grammar the text must follow (structured output and tool
calls, through llguidance), penalties on tokens already said, biases on chosen tokens, and the log-probabilities
of what was chosen.

They run where the draw runs (model/sampling.py's Sampler, given a LogitShaper): on the whole vocabulary's logits,
so an engine whose logits are spread over devices gathers all of them for such a request (Sampler.candidates is
None), and a pipeline's last stage hands its logits back instead of drawing (pp/master.py).

llguidance was chosen over xgrammar and outlines-core (all on PyPI): a 3 MB wheel with no dependencies (xgrammar
0.2 pulls in torch and transformers; outlines-core compiles a regular expression of the whole schema into an
index over the vocabulary, seconds for a nested schema), JSON Schema with nested objects, arrays, enums, anyOf
and $ref, a token mask computed in about a millisecond on a 49k vocabulary without an index built up front,
and it is the grammar engine llama.cpp itself offers."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from edgerun.errors import EdgerunError

if TYPE_CHECKING:
    from edgerun.model.tokenizer import Tokenizer


class GrammarKind(Enum):
    JSON_SCHEMA = "json_schema"  # the text is a JSON Schema; {} or {"type": "object"} for any JSON object
    LARK = "lark"  # llguidance's Lark dialect (it may embed %json{...} schemas)


@dataclass(frozen=True)
class Grammar:
    kind: GrammarKind
    text: str


# JSON on one line with a space after "," and ":" (as json.dumps writes it): free whitespace lets a small model
# spend its tokens on newlines until max_tokens cuts the object short. A Lark grammar's %json schemas take it as
# their "x-guidance" key.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = Grammar(GrammarKind.JSON_SCHEMA, json.dumps({"type": "object"}))


def json_schema_grammar(schema: dict[str, Any]) -> Grammar:
    """A JSON Schema's grammar, its objects closed: an object schema that lists properties and does not set
    additionalProperties allows only those (as OpenAI's strict mode requires them to say). Left open, a small
    model goes on adding keys of its own until max_tokens cuts the object short."""
    return Grammar(GrammarKind.JSON_SCHEMA, json.dumps(_closed(schema)))


def _closed(node: Any, close: bool = True) -> Any:
    """`node` with its object schemas closed; `close` False for the direct parts of an allOf, each of which lists
    only some of the object's properties (closing them would leave no object that satisfies all)."""
    if isinstance(node, list):
        return [_closed(v, close) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: v if k in ("const", "enum", "default", "examples") else _closed(v, k != "allOf")
           for k, v in node.items()}
    if close and isinstance(node.get("properties"), dict) and "additionalProperties" not in node \
            and "allOf" not in node:
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class LogitRules:
    """A request's rules on the logits; the defaults ask for nothing."""

    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit)
    presence_penalty: float = 0.0  # subtracted once from a token that appeared in the answer (OpenAI's)
    frequency_penalty: float = 0.0  # subtracted per time a token appeared in the answer (OpenAI's)
    repetition_penalty: float = 1.0  # a token of the prompt or answer: positive logit / p, negative * p (CTRL's)
    top_logprobs: int | None = None  # None: no log-probabilities; n: the chosen token's and the n most likely
    grammar: Grammar | None = None

    @property
    def shapes(self) -> bool:
        """Whether the draw sees other logits than the model's."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or \
            self.repetition_penalty != 1.0 or self.grammar is not None

    @property
    def active(self) -> bool:
        return self.shapes or self.top_logprobs is not None


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability under the model (its logits before any rule) and the most likely ones."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class GrammarError(EdgerunError):
    """A grammar or schema that llguidance does not accept."""


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer: Tokenizer, n_vocab: int) -> Any:
    """llguidance's view of a tokenizer (its token bytes and end tokens): built once per model, ~0.3 s."""
    import llguidance

    eos = sorted(tokenizer.stop_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=n_vocab, eos_token=eos or None)


def check_grammar(grammar: Grammar) -> None:
    """GrammarError naming what llguidance refuses in `grammar`."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(_ll_grammar(grammar))
    if is_error:
        raise GrammarError(f"the {grammar.kind.value} is not accepted: {'; '.join(messages)}")


def _ll_grammar(grammar: Grammar) -> str:
    import llguidance

    if grammar.kind == GrammarKind.JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(grammar.text, defaults=JSON_LAYOUT)
    return llguidance.LLMatcher.grammar_from_lark(grammar.text)


class LogitShaper:
    """One generation's rules applied step by step: `shape` the logits before a draw, then `accept` the drawn token
    (its log-probability kept in `logprobs`, the grammar advanced). Built per request; holds the answer so far."""

    def __init__(self, rules: LogitRules, tokenizer: Tokenizer, prompt: list[int], n_vocab: int) -> None:
        self.rules, self.n_vocab = rules, n_vocab
        self.answer: list[int] = []
        self.counts = np.zeros(n_vocab, np.int32)  # each token's count in the answer
        self.seen = np.zeros(n_vocab, bool)  # tokens of the prompt or answer (the repetition penalty's)
        self.seen[np.asarray([t for t in prompt if 0 <= t < n_vocab], np.int64)] = True
        self.logprobs: list[TokenLogprob] = []
        self.matcher: Any = None
        if rules.grammar is not None:
            import llguidance

            check_grammar(rules.grammar)
            self.matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer, n_vocab), _ll_grammar(rules.grammar))
            self._mask = np.zeros((n_vocab + 31) // 32, np.int32)
        self._bias_ids = np.asarray([t for t, _ in rules.logit_bias], np.int64)
        self._bias = np.asarray([b for _, b in rules.logit_bias], np.float64)

    @property
    def grammar_done(self) -> bool:
        """The grammar is complete and allows nothing more than ending."""
        return self.matcher is not None and self.matcher.is_stopped()

    def shape(self, logits: np.ndarray) -> np.ndarray:
        """The logits a draw sees (float64, a copy)."""
        r = self.rules
        z = np.asarray(logits, np.float64).reshape(-1).copy()
        if r.repetition_penalty != 1.0:
            s = self.seen
            z[s] = np.where(z[s] > 0, z[s] / r.repetition_penalty, z[s] * r.repetition_penalty)
        if r.frequency_penalty != 0.0:
            z -= r.frequency_penalty * self.counts
        if r.presence_penalty != 0.0:
            z -= r.presence_penalty * (self.counts > 0)
        if self._bias_ids.size:
            z[self._bias_ids] += self._bias
        if self.matcher is not None:
            self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
            allowed = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[:z.size].astype(bool)
            if not allowed.any():
                raise EdgerunError(f"the grammar allows no token here: {self.matcher.get_error()}")
            z[~allowed] = -np.inf
            if not np.isfinite(z[allowed]).any():  # biases pushed every allowed token to -inf: keep the grammar
                z[allowed] = 0.0
        return z

    def accept(self, token: int, logits: np.ndarray) -> None:
        """`token` was drawn from `logits` (the model's, before shape)."""
        if self.rules.top_logprobs is not None:
            self.logprobs.append(token_logprob(logits, token, self.rules.top_logprobs))
        if self.matcher is not None and not self.matcher.is_stopped() and not self.matcher.consume_token(token):
            raise EdgerunError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        if 0 <= token < self.n_vocab:
            self.answer.append(token)
            self.counts[token] += 1
            self.seen[token] = True


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under softmax(logits) and the `top` most likely (larger first, ties by index)."""
    from edgerun.model.sampling import largest

    z = np.asarray(logits, np.float64).reshape(-1)
    m = z.max()
    lse = m + np.log(np.exp(z - m).sum())
    best = largest(z, top) if top > 0 else np.zeros(0, np.int64)
    return TokenLogprob(int(token), float(z[token] - lse), tuple((int(t), float(z[t] - lse)) for t in best))
