"""Ollama's API beside OpenAI's, so Ollama's clients and the front-ends built on it work unchanged: `/api/chat` and
`/api/generate` (streamed as NDJSON unless "stream": false, Ollama's default being a stream), `/api/tags`,
`/api/show`, `/api/version`. A request becomes the same GenerationRequest as an OpenAI one; its "options" are the
sampler's (temperature, top_k, top_p, min_p, seed, num_predict, stop), what it leaves out the server's defaults.
Errors are Ollama's: {"error": "message"}."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from edgerun.model.generate import StopReason
from edgerun.model.loader import Model
from edgerun.model.logits import ANY_JSON_OBJECT, Grammar, LogitRules, TokenLogprob
from edgerun.model.sampling import MAX_SEED, SamplingParams
from edgerun.serve.openai_api import (
    MAX_TOP_LOGPROBS,
    ApiError,
    Endpoint,
    GenerationRequest,
    _integer,
    _number,
    _stop,
    chat_prompt,
    refuse_unserved,
    schema_grammar,
)
from edgerun.serve.tools import CallTags, ToolCall

VERSION = "0.6.0"  # the Ollama API this follows, as /api/version reports it
PATHS = ("/api/chat", "/api/generate", "/api/tags", "/api/show", "/api/version")
ROLES = ("system", "user", "assistant", "tool")
# Ollama fields this server does not serve, and the value of each that asks for nothing.
UNSERVED: dict[str, Any] = {"images": [], "think": False, "context": [], "template": "", "suffix": ""}


def parse(chat: bool, body: Any, render_chat: Any, defaults: SamplingParams,
          tool_tags: CallTags | None = None) -> GenerationRequest:
    """An /api/chat (`chat`) or /api/generate request. /api/generate renders its prompt (and "system") through the
    chat template as Ollama does, unless "raw". /api/chat's "tools" are OpenAI's, chosen by the model (Ollama has
    no tool_choice: auto), in the template's tags `tool_tags` where it has them (serve/tools.py)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    refuse_unserved(body, UNSERVED)
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'options' must be an object", param="options")
    tools = None
    grammar = _format(body.get("format"))
    if chat:  # Ollama has no tool_choice: the model chooses
        prompt, tools, grammar = chat_prompt({"messages": body.get("messages"), "tools": body.get("tools")},
                                             render_chat, tool_tags, grammar, ROLES)
    elif body.get("tools"):
        raise ApiError(400, "'tools' are for /api/chat", param="tools")
    else:
        text, system = body.get("prompt"), body.get("system")
        if not isinstance(text, str) or not text:
            raise ApiError(400, "'prompt' must be a non-empty string", param="prompt")
        if system is not None and not isinstance(system, str):
            raise ApiError(400, "'system' must be a string", param="system")
        turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        prompt = text if body.get("raw") is True else render_chat(turns)
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    predict = _integer(options, "num_predict", -2, 1 << 30)
    top_k = _integer(options, "top_k", 0, 1 << 30)
    seed = _integer(options, "seed", -(1 << 63), (1 << 63) - 1)
    try:
        sampling = SamplingParams(
            _number(options, "temperature", defaults.temperature, 0.0, 2.0),
            defaults.top_k if top_k is None else top_k,
            _number(options, "top_p", defaults.top_p, 1e-9, 1.0),
            defaults.seed if seed is None else seed % MAX_SEED,
            _number(options, "min_p", defaults.min_p, 0.0, 0.999))
    except ValueError as e:
        raise ApiError(400, str(e)) from e
    # num_predict -1 (or -2, "fill the context"): as many as the context leaves
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, "'logprobs' must be true or false", param="logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    return GenerationRequest(Endpoint.CHAT if chat else Endpoint.COMPLETION, prompt,
                             None if predict is None or predict < 0 else max(predict, 1), sampling, _stop(options),
                             stream, False, LogitRules(grammar=grammar, top_logprobs=(top or 0) if wanted else None),
                             tools)


def logprobs(entries: Sequence[TokenLogprob], show: Callable[[int], tuple[str, bytes]]) -> list[dict[str, Any]]:
    """Ollama's logprobs of some tokens: each token's text and log-probability, with the most likely ones."""
    return [{"token": show(e.token)[0], "logprob": e.logprob,
             "top_logprobs": [{"token": show(t)[0], "logprob": lp} for t, lp in e.top]} for e in entries]


def _format(value: Any) -> Grammar | None:
    """Ollama's "format": "json" (a JSON object) or a JSON Schema."""
    if value in (None, ""):
        return None
    if value == "json":
        return ANY_JSON_OBJECT
    if not isinstance(value, dict):
        raise ApiError(400, "'format' must be \"json\" or a JSON Schema object", param="format")
    return schema_grammar(value, "format")


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def piece(model: str, chat: bool, text: str, call: ToolCall | None = None,
          token_logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One streamed line of text (or of the answer's tool call), with its tokens' logprobs where asked."""
    out: dict[str, Any] = {"model": model, "created_at": _now(), "done": False}
    if token_logprobs is not None:
        out["logprobs"] = token_logprobs
    if chat:
        out["message"] = {"role": "assistant", "content": text}
        if call is not None:  # Ollama's arguments are an object, not OpenAI's JSON text
            out["message"] = {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": call.name, "arguments": json.loads(call.arguments)}}]}
    else:
        out["response"] = text
    return out


def final(model: str, chat: bool, text: str, reason: StopReason, prompt_tokens: int, completion_tokens: int,
          started: float, prefill_s: float, decode_s: float, call: ToolCall | None = None,
          token_logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The last line of a stream (`text` empty), or the whole answer: Ollama's counts and durations (ns)."""
    out = piece(model, chat, text, call, token_logprobs)
    ns = 1e9
    out |= {"done": True, "done_reason": "length" if reason == StopReason.MAX_TOKENS else "stop",
            "total_duration": int((time.perf_counter() - started) * ns), "load_duration": 0,
            "prompt_eval_count": prompt_tokens, "prompt_eval_duration": int(prefill_s * ns),
            "eval_count": completion_tokens, "eval_duration": int(decode_s * ns)}
    return out


def details(model: Model) -> dict[str, Any]:
    c = model.config
    matrices = [t for layer in model.weights.layers for _, t in layer.matrices()]
    level = max({t.qtype for t in matrices}, key=lambda q: sum(t.qtype == q for t in matrices)) if matrices else ""
    return {"parent_model": "", "format": "gguf" if model.path.suffix == ".gguf" else "safetensors",
            "family": c.architecture, "families": [c.architecture],
            "parameter_size": f"{c.n_params() / 1e6:.0f}M" if c.n_params() < 1e9 else f"{c.n_params() / 1e9:.1f}B",
            "quantization_level": level}


def tags(model: Model, name: str) -> dict[str, Any]:
    """/api/tags: the one model this server serves."""
    size = model.path.stat().st_size if model.path.is_file() else \
        sum(f.stat().st_size for f in model.path.rglob("*") if f.is_file())
    return {"models": [{"name": name, "model": name, "size": size, "digest": "",
                        "modified_at": datetime.fromtimestamp(model.path.stat().st_mtime, UTC).isoformat(),
                        "details": details(model)}]}


def show(model: Model, name: str, body: Any) -> dict[str, Any]:
    """/api/show for the model this server serves (by its name), else a 404."""
    asked = body.get("model", body.get("name")) if isinstance(body, dict) else None
    if asked != name:
        raise ApiError(404, f"model {asked!r} not found: this server serves {name!r}", param="model")
    c = model.config
    return {"modelfile": "", "parameters": "", "template": model.tokenizer.chat_template or "", "license": "",
            "details": details(model), "capabilities": ["completion"],
            "model_info": {"general.architecture": c.architecture, "general.parameter_count": c.n_params(),
                           f"{c.architecture}.context_length": c.context_length,
                           f"{c.architecture}.embedding_length": c.hidden,
                           f"{c.architecture}.block_count": c.n_layers}}
