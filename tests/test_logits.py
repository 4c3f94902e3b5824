"""A request's rules on the logits (model/logits.py) with the shipped model's ggml engine: JSON Schemas of many
shapes always give text that parses and validates, penalties and biases move the draw as defined, and
log-probabilities are the model's."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from edgerun.errors import EdgerunError
from edgerun.model.generate import StopReason, generate
from edgerun.model.logits import (
    ANY_JSON_OBJECT,
    Grammar,
    GrammarError,
    GrammarKind,
    LogitRules,
    LogitShaper,
    check_grammar,
    json_schema_grammar,
    token_logprob,
)
from edgerun.model.sampling import USER_DEFAULTS, Sampler, SamplingParams

# Twenty schemas of varied shapes: flat and nested objects, enums, arrays (bounded and of objects), numbers with
# bounds, booleans, nulls, optional keys, anyOf, $ref, string patterns and lengths.
SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
     "required": ["city", "country"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                               "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}},
     "required": ["score"]},
    {"type": "object", "properties": {"person": {"type": "object", "properties": {
        "first": {"type": "string"}, "last": {"type": "string"}}, "required": ["first", "last"]}},
     "required": ["person"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "label": {"type": "string"}},
        "required": ["id", "label"]}}}, "required": ["items"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"note": {"type": ["string", "null"]}}, "required": ["note"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["code"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 8}},
     "required": ["word"]},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                         "required": ["x", "y"]}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
     "required": ["from", "to"]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]},
                                      "unit": {"const": "cm"}}, "required": ["level", "unit"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "boolean"}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"name": {"type": "string"}, "nickname": {"type": "string"}},
     "required": ["name"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer"}, "maxItems": 2}}}, "required": ["matrix"]},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer", "minimum": 1900,
                                                                             "maximum": 2100},
                                      "genres": {"type": "array", "items": {"enum": ["drama", "comedy"]}}},
     "required": ["title", "year", "genres"], "additionalProperties": False},
]


GREEDY = SamplingParams()


def shaped(model, engine, prompt_text: str, rules: LogitRules, max_tokens: int = 96,
           params: SamplingParams = GREEDY) -> tuple[str, LogitShaper, StopReason]:
    tok = model.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt_text}]))
    shaper = LogitShaper(rules, tok, prompt, model.config.vocab_size)
    result = generate(engine, prompt, max_tokens, Sampler(params, shaper), tok.stop_ids)
    return tok.decode(result.tokens), shaper, result.stop_reason


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_schema_gives_text_that_validates(shipped_model, shipped_ggml, index: int) -> None:
    schema = SCHEMAS[index]
    rules = LogitRules(grammar=json_schema_grammar(schema))
    # As a client asks: the schema in the request and in its prompt, sampled with the server's defaults.
    question = f"Answer with a short JSON value that follows this schema: {json.dumps(schema)}"
    text, shaper, reason = shaped(shipped_model, shipped_ggml, question, rules, max_tokens=100,
                                  params=USER_DEFAULTS)
    assert reason == StopReason.STOP_TOKEN and shaper.grammar_done, text
    jsonschema.validate(json.loads(text), schema)


def test_a_json_object_and_the_same_request_twice(shipped_model, shipped_ggml) -> None:
    rules = LogitRules(grammar=ANY_JSON_OBJECT)
    first, _, _ = shaped(shipped_model, shipped_ggml, "Describe Paris as JSON.", rules, params=USER_DEFAULTS)
    assert isinstance(json.loads(first), dict)
    assert shaped(shipped_model, shipped_ggml, "Describe Paris as JSON.", rules, params=USER_DEFAULTS)[0] == first


def test_bad_grammars_are_named() -> None:
    with pytest.raises(GrammarError, match="nonsense"):
        check_grammar(Grammar(GrammarKind.JSON_SCHEMA, json.dumps({"type": "nonsense"})))
    with pytest.raises(GrammarError):
        check_grammar(Grammar(GrammarKind.LARK, "start: undefined_rule"))


def test_logit_bias_penalties_and_logprobs(shipped_model, shipped_ggml) -> None:
    tok = shipped_model.tokenizer
    vocab = shipped_model.config.vocab_size
    plain, _, _ = shaped(shipped_model, shipped_ggml, "Count from one to ten.", LogitRules(), max_tokens=24)
    # A bias of +100 on one token makes it every greedy choice.
    forced = tok.encode(" banana")[0]
    _, shaper, _ = shaped(shipped_model, shipped_ggml, "Count from one to ten.",
                          LogitRules(logit_bias=((forced, 100.0),)), max_tokens=5)
    assert shaper.answer == [forced] * 5
    # A frequency penalty makes a token that has appeared less likely by exactly that much per appearance.
    shaper = LogitShaper(LogitRules(frequency_penalty=0.5, presence_penalty=0.25), tok, [], vocab)
    logits = np.zeros(vocab, np.float32)
    shaper.accept(7, logits)
    shaper.accept(7, logits)
    z = shaper.shape(logits)
    assert z[7] == pytest.approx(-0.5 * 2 - 0.25) and z[8] == 0.0
    # The repetition penalty divides a positive logit of a seen token (prompt or answer), multiplies a negative one.
    shaper = LogitShaper(LogitRules(repetition_penalty=2.0), tok, [3, 4], vocab)
    logits[3], logits[4], logits[5] = 4.0, -4.0, 4.0
    z = shaper.shape(logits)
    assert (z[3], z[4], z[5]) == (2.0, -8.0, 4.0)
    # Penalties change a greedy answer that repeats itself.
    penalized, _, _ = shaped(shipped_model, shipped_ggml, "Count from one to ten.",
                             LogitRules(frequency_penalty=2.0), max_tokens=24)
    assert penalized != plain
    # Log-probabilities: the model's (the logits before any rule), the top ones sorted, and a distribution.
    _, shaper, _ = shaped(shipped_model, shipped_ggml, "Say hello.", LogitRules(top_logprobs=3), max_tokens=4)
    assert len(shaper.logprobs) == 4
    for entry in shaper.logprobs:
        assert entry.top[0][0] == entry.token  # greedy: the chosen one is the most likely
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
        assert entry.logprob <= 0
    z = np.array([1.0, 2.0, 3.0])
    e = token_logprob(z, 0, 2)
    assert np.isclose(np.exp(e.logprob), np.exp(1) / np.exp(z).sum()) and [t for t, _ in e.top] == [2, 1]


def test_a_grammar_needs_the_whole_vocabulary() -> None:
    """An engine spread over devices gathers every logit for a shaped draw, not the few a plain one needs."""
    from edgerun.model.fetch import fetch_smollm2
    from edgerun.model.loader import load_model

    model = load_model(fetch_smollm2())
    shaper = LogitShaper(LogitRules(grammar=ANY_JSON_OBJECT), model.tokenizer, [1], model.config.vocab_size)
    assert Sampler(SamplingParams(), shaper).candidates is None and Sampler(SamplingParams()).candidates == 1
    assert Sampler(SamplingParams(temperature=0.5, top_k=40)).candidates == 40
    with pytest.raises(EdgerunError, match="refused"):
        shaper.accept(model.tokenizer.encode("hello")[0], np.zeros(model.config.vocab_size))


def test_largest_over_a_mask_ranks_as_over_the_whole() -> None:
    """A grammar's mask leaves most logits minus infinity; `largest` ranks the finite ones alone there (numpy's
    partition is slow over so many equal values): the same indices, in the same order, as the plain ranking."""
    from edgerun.model.sampling import largest

    def reference(z: np.ndarray, k: int) -> np.ndarray:
        if k == 1:
            return np.array([int(np.argmax(z))])
        threshold = np.partition(z, z.size - k)[z.size - k]
        above = np.flatnonzero(z > threshold)
        chosen = np.concatenate([above, np.flatnonzero(z == threshold)[:k - above.size]])
        return chosen[np.lexsort((chosen, -z[chosen]))]

    rng = np.random.default_rng(0)
    for _ in range(200):
        z = rng.standard_normal(3000)
        z[rng.random(z.size) < rng.random()] = -np.inf
        z[rng.integers(0, z.size, 5)] = z[10]  # ties
        k = int(rng.integers(1, 60))
        assert np.array_equal(largest(z, k), reference(z, k))
