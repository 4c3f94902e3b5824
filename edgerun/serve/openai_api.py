"""OpenAI's chat and completions API as edgerun serves it: requests parsed into frozen dataclasses (every bad
field is an ApiError with OpenAI's error JSON and status), and the response and stream-chunk objects.

Only what the engine can honour is accepted: one choice (n = 1), text content, and the sampling parameters
temperature, top_p, top_k (an extension), seed, max_tokens (or max_completion_tokens) and stop strings.
Unknown fields are ignored, as OpenAI's own server ignores fields a model does not use."""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from edgerun.model.generate import StopReason
from edgerun.model.logits import (
    ANY_JSON_OBJECT,
    Grammar,
    GrammarError,
    LogitRules,
    TokenLogprob,
    check_grammar,
    json_schema_grammar,
)
from edgerun.model.sampling import MAX_SEED, USER_DEFAULTS, SamplingParams
from edgerun.serve.tools import (
    CallTags,
    ToolCall,
    ToolError,
    Tools,
    call_text,
    earlier_call,
    parse_tools,
    tool_result_text,
    with_tools,
)

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_CHOICES = 16  # n: sequences of one request (each a job of the queue, which --max-queue bounds too)


class ApiError(Exception):
    """An error the client caused or must wait out, as OpenAI reports it."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.retry_after_s = retry_after_s  # a Retry-After header: when a client that must wait may try again

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Endpoint(Enum):
    CHAT = "chat.completion"
    COMPLETION = "text_completion"


@dataclass(frozen=True)
class GenerationRequest:
    """One request, either endpoint: the prompt as text (a chat is rendered with the model's template first)."""

    endpoint: Endpoint
    prompt: str
    max_tokens: int | None  # None: as many as the context leaves (capped by the server's default)
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    rules: LogitRules = field(default_factory=LogitRules)  # grammar, penalties, biases, log-probabilities
    tools: Tools | None = None  # the functions the model may call, and how (tool_choice)
    n: int = 1  # choices: sequences of one prompt, choice i sampled with seed + i


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ApiError(400, f"'{name}' must be a number from {low} to {high}, not {value!r}", param=name)
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ApiError(400, f"'{name}' must be an integer from {low} to {high}, not {value!r}", param=name)
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or \
            not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them",
                       param="stop")
    return tuple(stop)


def _text_content(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (images and audio are not served)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}: only text content parts are supported", param="messages")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where}: content must be a string or a list of text parts", param="messages")


ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(body: dict[str, Any], roles: tuple[str, ...] = ROLES, native_tools: bool = False) -> list[dict]:
    """The request's messages as the chat template takes them; `roles`: those the API accepts. Earlier tool calls
    and their results go to a template with a tool syntax as it expects them (`native_tools`), else are written
    in the tools convention (serve/tools.py), as text every template renders."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in roles:
            raise ApiError(400, f"messages[{i}]: 'role' must be one of {', '.join(roles)}", param="messages")
        where = f"messages[{i}]"
        role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for system
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls:
            if not isinstance(calls, list):
                raise ApiError(400, f"{where}: 'tool_calls' must be a list", param="messages")
            try:
                if native_tools:
                    text = m.get("content")
                    out.append({"role": role, "content": "" if text is None else _text_content(text, where),
                                "tool_calls": [{"type": "function", "function": earlier_call(c, where)}
                                               for c in calls]})
                    continue
                content = "\n".join(call_text(c, where) for c in calls)
            except ToolError as e:
                raise ApiError(400, str(e), param="messages") from e
        else:
            content = _text_content(m.get("content"), where)
        if role == "tool" and not native_tools:  # most templates know no tool role: the result is the user's turn
            role, content = "user", tool_result_text(m, content)
        out.append({"role": role, "content": content})
    return out


# Fields of OpenAI's requests this server does not serve, and the value of each that asks for nothing (what
# clients send by default): any other value is a 400 that names the field, never an answer that ignores it.
UNSERVED: dict[str, Any] = {
    "functions": [], "function_call": "none", "echo": False, "best_of": 1, "suffix": None,
}
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat (its completions: 5)
MAX_LOGIT_BIAS = 100.0


def response_grammar(value: Any, param: str = "response_format") -> Grammar | None:
    """OpenAI's response_format as a grammar: text (None), json_object (any JSON object) or json_schema."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError(400, f"'{param}' must be an object whose type is text, json_object or json_schema",
                       param=param)
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return ANY_JSON_OBJECT
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise ApiError(400, f"'{param}.json_schema' must be an object with a 'schema' object", param=param)
    return schema_grammar(spec.get("schema", {}), param)


def schema_grammar(schema: dict[str, Any], param: str) -> Grammar:
    grammar = json_schema_grammar(schema)
    try:
        check_grammar(grammar)
    except GrammarError as e:
        raise ApiError(400, f"'{param}': {e}", param=param) from e
    return grammar


def logit_rules(body: dict[str, Any], endpoint: Endpoint, vocab_size: int, grammar: Grammar | None) -> LogitRules:
    """Penalties, logit_bias and logprobs as the request asks for them."""
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise ApiError(400, "'logit_bias' must be an object of token ids to numbers", param="logit_bias")
    pairs = []
    for key, value in bias.items():
        if not str(key).isdigit() or not int(key) < vocab_size:
            raise ApiError(400, f"'logit_bias': {key!r} is not a token id of this model (0 to {vocab_size - 1})",
                           param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float) or \
                not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ApiError(400, f"'logit_bias' values must be numbers from -100 to 100, not {value!r}",
                           param="logit_bias")
        pairs.append((int(key), float(value)))
    if endpoint == Endpoint.CHAT:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise ApiError(400, "'logprobs' must be true or false", param="logprobs")
        top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top is not None and not wanted:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        top_logprobs = (top or 0) if wanted else None
    else:
        top_logprobs = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)  # completions: how many alternatives
    repetition = _number(body, "repetition_penalty", 1.0, 0.01, 10.0)  # an extension, as vLLM's
    return LogitRules(tuple(pairs), _number(body, "presence_penalty", 0.0, -2.0, 2.0),
                      _number(body, "frequency_penalty", 0.0, -2.0, 2.0), repetition, top_logprobs, grammar)


def refuse_unserved(body: dict[str, Any], unserved: dict[str, Any] = UNSERVED) -> None:
    """A 400 for the first field of `unserved` (name -> the value that asks for nothing) the body asks for."""
    for name, neutral in unserved.items():
        value = body.get(name)
        if value is not None and value != neutral:
            raise ApiError(400, f"'{name}' is not served by this server yet (only {json.dumps(neutral)} or left out)",
                           param=name, code="unsupported_parameter")


def chat_prompt(body: dict[str, Any], render_chat: Any, tool_tags: CallTags | None, grammar: Grammar | None,
                roles: tuple[str, ...] = ROLES) -> tuple[str, Tools | None, Grammar | None]:
    """A chat request's prompt (its messages, and its tools where it lists them, through the chat template), its
    tools, and the grammar of its answer: the tools' where they may be called, else `grammar` (its response
    format). A 400 where both would shape the answer, or the tools' grammar is refused."""
    try:
        tools = parse_tools(body, tool_tags)
    except ToolError as e:
        raise ApiError(400, str(e), param="tools") from e
    messages = chat_messages(body, roles, native_tools=tool_tags is not None)
    if tools is None:
        return render_chat(messages), None, grammar
    prompt = render_chat(with_tools(messages, tools), tools=tools.for_template())
    calls = tools.grammar()
    if calls is None:  # tool_choice none: the response format, if any, shapes the answer
        return prompt, tools, grammar
    if grammar is not None:
        raise ApiError(400, "a response format and tools cannot both shape one answer", param="tools")
    try:
        check_grammar(calls)
    except GrammarError as e:
        raise ApiError(400, f"'tools': a function's parameters are not a usable JSON Schema: {e}",
                       param="tools") from e
    return prompt, tools, calls


def parse_request(endpoint: Endpoint, body: Any, render_chat: Any, defaults: SamplingParams = USER_DEFAULTS,
                  vocab_size: int = 1 << 31, tool_tags: CallTags | None = None) -> GenerationRequest:
    """The request in `body` (parsed JSON). `render_chat(messages, tools=None) -> str` applies the model's chat
    template, whose call tags are `tool_tags` where it has a tool syntax; sampling settings the request leaves out
    are `defaults`' (the server's)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    refuse_unserved(body)
    grammar = response_grammar(body.get("response_format"))
    tools = None
    if endpoint == Endpoint.CHAT:
        prompt, tools, grammar = chat_prompt(body, render_chat, tool_tags, grammar)
    elif body.get("tools") or body.get("tool_choice") not in (None, "none"):
        raise ApiError(400, "'tools' are for /v1/chat/completions", param="tools")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
    n = _integer(body, "n", 1, MAX_CHOICES)
    max_tokens = _integer(body, "max_completion_tokens", 1, 1 << 30)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, 1 << 30)
    temperature = _number(body, "temperature", defaults.temperature, 0.0, 2.0)
    top_p = _number(body, "top_p", defaults.top_p, 0.0, 1.0)
    if top_p == 0.0:  # OpenAI accepts 0: only the most likely token
        top_p, temperature = 1.0, 0.0
    top_k = _integer(body, "top_k", 0, 1 << 30)  # llama.cpp's server's extensions: top_k, min_p
    top_k = defaults.top_k if top_k is None else top_k
    min_p = _number(body, "min_p", defaults.min_p, 0.0, 0.999)
    seed = _integer(body, "seed", -(1 << 63), (1 << 63) - 1)
    seed = defaults.seed if seed is None else seed % MAX_SEED  # OpenAI takes any 64-bit seed; ours lie in [0, 2^53)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    return GenerationRequest(endpoint, prompt, max_tokens, SamplingParams(temperature, top_k, top_p, seed, min_p),
                             _stop(body), stream, bool(options.get("include_usage", False)),
                             logit_rules(body, endpoint, vocab_size, grammar), tools, 1 if n is None else n)


def finish_reason(reason: StopReason, call: ToolCall | None = None) -> str:
    if call is not None:
        return "tool_calls"
    return "length" if reason == StopReason.MAX_TOKENS else "stop"


def logprobs_object(endpoint: Endpoint, entries: Sequence[TokenLogprob], show: Callable[[int], tuple[str, bytes]],
                    offset: int = 0) -> dict[str, Any]:
    """OpenAI's logprobs of some tokens (`show`: a token's text and bytes): chat's {"content": [...]},
    completions' parallel lists (text offsets counted from `offset`, the answer's characters before these
    tokens)."""
    def text_of(token: int) -> str:
        return show(token)[0]

    if endpoint == Endpoint.CHAT:
        def one(token: int, logprob: float) -> dict[str, Any]:
            text, raw = show(token)
            return {"token": text, "logprob": logprob, "bytes": list(raw)}
        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}
    texts = [text_of(e.token) for e in entries]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text_of(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}


@dataclass(frozen=True)
class ResponseIds:
    """What every object of one response shares."""

    id: str
    created: int
    model: str

    @staticmethod
    def new(endpoint: Endpoint, model: str) -> ResponseIds:
        prefix = "chatcmpl" if endpoint == Endpoint.CHAT else "cmpl"
        return ResponseIds(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_choice(endpoint: Endpoint, index: int, text: str, reason: StopReason,
                    logprobs: dict[str, Any] | None = None, call: ToolCall | None = None) -> dict[str, Any]:
    if endpoint == Endpoint.CHAT:
        message: dict[str, Any] = {"role": "assistant", "content": text} if call is None else \
            {"role": "assistant", "content": None, "tool_calls": [call.as_openai()]}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason(reason, call)}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


def response(endpoint: Endpoint, ids: ResponseIds, choices: list[dict[str, Any]], prompt_tokens: int,
             completion_tokens: int) -> dict[str, Any]:
    """A whole answer: its choices (response_choice), the prompt's tokens counted once and every choice's."""
    return {"id": ids.id, "object": endpoint.value, "created": ids.created, "model": ids.model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def chunk(endpoint: Endpoint, ids: ResponseIds, text: str | None, reason: StopReason | None = None,
          first: bool = False, logprobs: dict[str, Any] | None = None, call: ToolCall | None = None,
          called: bool = False, index: int = 0) -> dict[str, Any]:
    """One streamed piece of choice `index`: text (with its tokens' logprobs), a tool call (`call`: its whole
    delta), or (text None) the closing chunk with the finish reason ("tool_calls" where `called`)."""
    if endpoint == Endpoint.CHAT:
        delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else \
            ({} if text is None else {"content": text})
        if call is not None:
            delta = {"tool_calls": [call.as_openai(index=0)]}
        ending = None if reason is None else ("tool_calls" if called else finish_reason(reason))
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": ending}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": None if reason is None else finish_reason(reason)}
        kind = "text_completion"
    return {"id": ids.id, "object": kind, "created": ids.created, "model": ids.model, "choices": [choice]}


def usage_chunk(endpoint: Endpoint, ids: ResponseIds, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    kind = "chat.completion.chunk" if endpoint == Endpoint.CHAT else "text_completion"
    return {"id": ids.id, "object": kind, "created": ids.created, "model": ids.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


class StopText:
    """Cuts a stream of text at the first stop string, holding back a tail that may still become one, so
    nothing past a stop string is ever sent."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The text that is safe to send now; sets `stopped` at a stop string."""
        if self.stopped:
            return ""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[:min(hits)], "", True
            return out
        cut = len(self.pending) - self.hold
        if cut <= 0:
            return ""
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
