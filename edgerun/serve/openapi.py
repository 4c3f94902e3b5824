"""The API's description as OpenAPI 3.1 (served at /openapi.json), written by hand from what openai_api.py,
ollama_api.py and app.py accept: Starlette derives none. A fuzzer (tests/test_serve.py, schemathesis) sends
requests generated from it and holds that none gets a 5xx."""

from __future__ import annotations

from typing import Any

from edgerun.serve.openai_api import MAX_CHOICES, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS

NUMBER = {"type": "number"}
STRING = {"type": "string"}
INTEGER = {"type": "integer"}
BOOLEAN = {"type": "boolean"}
ERROR = {"$ref": "#/components/schemas/Error"}

STOP = {"anyOf": [{"type": "string", "minLength": 1},
                  {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
                  {"type": "null"}]}
SAMPLING: dict[str, Any] = {
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "min_p": {"type": "number", "minimum": 0, "maximum": 0.999},
    "seed": INTEGER,
    "max_tokens": {"type": "integer", "minimum": 1},
    "stop": STOP,
    "stream": BOOLEAN,
    "stream_options": {"type": "object", "properties": {"include_usage": BOOLEAN}},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": "number", "minimum": 0.01, "maximum": 10},
    "logit_bias": {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "response_format": {"oneOf": [
        {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"]},
        {"type": "object", "properties": {"type": {"const": "json_schema"}, "json_schema": {
            "type": "object", "properties": {"name": STRING, "schema": {"type": "object"}, "strict": BOOLEAN}}},
         "required": ["type", "json_schema"]}]},
    "model": STRING,
}
MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": {"anyOf": [STRING, {"type": "null"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": STRING}}}]},
    "tool_calls": {"type": "array", "items": {"type": "object", "properties": {
        "id": STRING, "type": {"const": "function"}, "function": {
            "type": "object", "required": ["name"], "properties": {"name": STRING, "arguments": STRING}}}}},
    "tool_call_id": STRING, "name": STRING}}
TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"}, "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1}, "description": STRING, "parameters": {"type": "object"}}}}}
CHAT = {"type": "object", "required": ["messages"], "properties": {
    **SAMPLING, "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1},
    "logprobs": BOOLEAN, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
    "tools": {"type": "array", "items": TOOL},
    "tool_choice": {"anyOf": [{"enum": ["auto", "none", "required"]}, {"type": "object", "properties": {
        "type": {"const": "function"}, "function": {"type": "object", "properties": {"name": STRING}}}}]}}}
COMPLETION = {"type": "object", "required": ["prompt"], "properties": {
    **SAMPLING, "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                                     {"type": "array", "items": STRING, "minItems": 1, "maxItems": 1}]},
    "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}}}
OLLAMA_OPTIONS = {"type": "object", "properties": {
    "temperature": SAMPLING["temperature"], "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": SAMPLING["top_k"], "min_p": SAMPLING["min_p"], "seed": INTEGER, "num_predict": INTEGER,
    "stop": STOP}}
OLLAMA_FORMAT = {"anyOf": [{"enum": ["", "json"]}, {"type": "object"}]}
OLLAMA_LOGPROBS = {"logprobs": BOOLEAN, "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}}


def _post(summary: str, body: dict[str, Any], ok: str = "application/json") -> dict[str, Any]:
    return {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {"200": {"description": "the answer", "content": {ok: {}}},
                          "4XX": {"description": "the request's fault, as OpenAI's error JSON",
                                  "content": {"application/json": {"schema": ERROR}}}}}


def _get(summary: str, kind: str = "application/json") -> dict[str, Any]:
    return {"summary": summary, "responses": {"200": {"description": summary, "content": {kind: {}}}}}


def openapi(model_name: str) -> dict[str, Any]:
    """The description of the API this server offers for `model_name`."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "edgerun serve", "version": "1", "description": f"OpenAI's and Ollama's APIs for "
                 f"{model_name}, on one machine's engine or a cluster of devices"},
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": {"type": "object", "required": ["error"], "properties": {"error": {
                "type": "object", "required": ["message"], "properties": {
                    "message": STRING, "type": STRING, "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]}}}}}}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/chat/completions": {"post": _post("a chat's next message (an SSE stream with stream: true)", CHAT)},
            "/v1/completions": {"post": _post("a prompt's continuation", COMPLETION)},
            "/v1/models": {"get": _get("the model served")},
            "/v1/models/{name}": {"get": {**_get("one model"), "parameters": [
                {"name": "name", "in": "path", "required": True, "schema": STRING}]}},
            "/v1/embeddings": {"post": _post("mean-pooled, final-normed last-layer hidden states", {
                "type": "object", "required": ["input"], "properties": {
                    "input": {"anyOf": [STRING, {"type": "array", "items": STRING, "minItems": 1}]},
                    "encoding_format": {"enum": ["float", "base64"]}, "model": STRING}})},
            "/tokenize": {"post": _post("text to token ids", {"type": "object", "required": ["content"],
                                                              "properties": {"content": STRING}})},
            "/detokenize": {"post": _post("token ids to text", {"type": "object", "required": ["tokens"],
                                                                "properties": {"tokens": {"type": "array",
                                                                                          "items": INTEGER}}})},
            "/api/chat": {"post": _post("Ollama's chat (NDJSON unless stream: false)", {
                "type": "object", "required": ["messages"], "properties": {
                    "model": STRING, "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
                    "stream": BOOLEAN, "options": OLLAMA_OPTIONS, "format": OLLAMA_FORMAT,
                    "tools": {"type": "array", "items": TOOL}, **OLLAMA_LOGPROBS}},
                "application/x-ndjson")},
            "/api/generate": {"post": _post("Ollama's generate", {
                "type": "object", "required": ["prompt"], "properties": {
                    "model": STRING, "prompt": {"type": "string", "minLength": 1}, "system": STRING,
                    "raw": BOOLEAN, "stream": BOOLEAN, "options": OLLAMA_OPTIONS, "format": OLLAMA_FORMAT,
                    **OLLAMA_LOGPROBS}},
                "application/x-ndjson")},
            "/api/tags": {"get": _get("Ollama's model list")},
            "/api/show": {"post": _post("Ollama's model details", {"type": "object", "properties": {
                "model": STRING, "name": STRING}})},
            "/api/version": {"get": {**_get("Ollama's API version"), "security": []}},
            "/health": {"get": {**_get("whether the server answers"), "security": []}},
            "/metrics": {"get": _get("Prometheus' text", "text/plain")},
            "/api/state": {"get": _get("what the dashboard shows")},
        },
    }
