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
from dataclasses import dataclass
from enum import Enum
from typing import Any

from edgerun.model.generate import StopReason
from edgerun.model.sampling import MAX_SEED, USER_DEFAULTS, SamplingParams

MAX_STOP_STRINGS = 4  # as OpenAI


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


ROLES = ("system", "developer", "user", "assistant")


def chat_messages(body: dict[str, Any], roles: tuple[str, ...] = ROLES) -> list[dict[str, str]]:
    """The request's messages as the chat template takes them; `roles`: those the API accepts."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in roles:
            raise ApiError(400, f"messages[{i}]: 'role' must be one of {', '.join(roles)}", param="messages")
        role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for system
        out.append({"role": role, "content": _text_content(m.get("content"), f"messages[{i}]")})
    return out


# Fields of OpenAI's requests this server does not serve yet, and the value of each that asks for nothing (what
# clients send by default): any other value is a 400 that names the field, never an answer that ignores it.
UNSERVED: dict[str, Any] = {
    "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "functions": [], "function_call": "none",
    "logprobs": False, "top_logprobs": 0, "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
    "logit_bias": {}, "echo": False, "best_of": 1, "suffix": None,
}


def refuse_unserved(body: dict[str, Any], unserved: dict[str, Any] = UNSERVED) -> None:
    """A 400 for the first field of `unserved` (name -> the value that asks for nothing) the body asks for."""
    for name, neutral in unserved.items():
        value = body.get(name)
        if value is not None and value != neutral and not (name == "tools" and body.get("tool_choice") == "none"):
            raise ApiError(400, f"'{name}' is not served by this server yet (only {json.dumps(neutral)} or left out)",
                           param=name, code="unsupported_parameter")


def parse_request(endpoint: Endpoint, body: Any, render_chat: Any,
                  defaults: SamplingParams = USER_DEFAULTS) -> GenerationRequest:
    """The request in `body` (parsed JSON). `render_chat(messages) -> str` applies the model's chat template;
    sampling settings the request leaves out are `defaults`' (the server's)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    refuse_unserved(body)
    if endpoint == Endpoint.CHAT:
        prompt = render_chat(chat_messages(body))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
    n = _integer(body, "n", 1, 1_000_000)
    if n not in (None, 1):
        raise ApiError(400, "only n = 1 is served", param="n")
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
                             _stop(body), stream, bool(options.get("include_usage", False)))


def finish_reason(reason: StopReason) -> str:
    return "length" if reason == StopReason.MAX_TOKENS else "stop"


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


def response(endpoint: Endpoint, ids: ResponseIds, text: str, reason: StopReason, prompt_tokens: int,
             completion_tokens: int) -> dict[str, Any]:
    if endpoint == Endpoint.CHAT:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish_reason(reason)}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(reason)}
    return {"id": ids.id, "object": endpoint.value, "created": ids.created, "model": ids.model,
            "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def chunk(endpoint: Endpoint, ids: ResponseIds, text: str | None, reason: StopReason | None = None,
          first: bool = False) -> dict[str, Any]:
    """One streamed piece: text, or (text None) the closing chunk with the finish reason."""
    if endpoint == Endpoint.CHAT:
        delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else \
            ({} if text is None else {"content": text})
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                  "finish_reason": None if reason is None else finish_reason(reason)}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None,
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
