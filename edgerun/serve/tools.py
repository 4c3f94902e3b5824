"""Function calling (OpenAI's `tools` and `tool_choice`): through the chat template's own tool syntax where it has
one, else by one documented convention.

A template with a tool syntax (Qwen's and Hermes': the functions listed by the template, a call written as
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`) gets the functions, earlier calls and tool results
as it expects them, and the answer is held to its tags. Otherwise the functions are listed in a system message,
and a call is an answer made of one JSON object `{"name": <function>, "arguments": {...}}`.

Either way the answer's grammar (model/logits.py) holds the model to it: with tool_choice "required" or a named
function the answer must be such a call, its arguments valid against the function's parameters schema; with
"auto" it is either prose (not starting with "{", nor "<" under tags) or such a call; "none" lists nothing and
constrains nothing. A function's arguments are only those its parameters declare unless its schema sets
additionalProperties (model/logits.py: json_schema_grammar). One call per answer (parallel_tool_calls may be sent,
but a reply holds at most one call).

Under the convention, a conversation's earlier calls and results are rendered back as text: an assistant message
with tool_calls becomes the call's JSON, a "tool" message a user message carrying the result."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from enum import Enum
from typing import Any

from edgerun.model.logits import JSON_LAYOUT, Grammar, GrammarKind, json_schema_grammar
from edgerun.model.tokenizer import Tokenizer


class ToolError(ValueError):
    """A malformed tools, tool_choice or tool message: the request's fault (a 400)."""


class ToolChoice(Enum):
    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"
    NAMED = "named"  # {"type": "function", "function": {"name": ...}}


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: str  # a JSON Schema, as JSON text


@dataclass(frozen=True)
class CallTags:
    """The tags a chat template wraps a call in, and each as the answer's grammar names it: a tag that is one
    special token by its id (llguidance matches a special token only so), else as text."""

    opening: str
    closing: str
    opening_term: str
    closing_term: str

    @staticmethod
    def of(tokenizer: Tokenizer) -> CallTags | None:
        tags = tokenizer.tool_tags
        if tags is None:
            return None

        def term(tag: str) -> str:
            ids = tokenizer.encode(tag, add_bos=False)
            return f"<[{ids[0]}]>" if len(ids) == 1 and tokenizer.token_text(ids[0]) == tag else json.dumps(tag)

        return CallTags(tags[0], tags[1], term(tags[0]), term(tags[1]))


@dataclass(frozen=True)
class Tools:
    functions: tuple[Function, ...]
    choice: ToolChoice
    named: str | None = None  # the function tool_choice names
    tags: CallTags | None = None  # the template's call tags; None: the convention

    def grammar(self) -> Grammar | None:
        """The answer's grammar: a call (required, named), or either prose or a call (auto); a call is its JSON
        object, inside the template's tags where it has them."""
        if self.choice == ToolChoice.NONE:
            return None
        chosen = [f for f in self.functions if self.choice != ToolChoice.NAMED or f.name == self.named]
        calls = [_call_schema(f) for f in chosen]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        grammar = json_schema_grammar(schema)  # arguments only as declared (objects closed)
        if self.tags is None and self.choice != ToolChoice.AUTO:
            return grammar
        call = f"call: %json {json.dumps({**json.loads(grammar.text), 'x-guidance': JSON_LAYOUT})}\n"
        if self.tags is None:  # auto: prose (not starting with "{") or the call
            return Grammar(GrammarKind.LARK, "start: call | text\n" + call + "text: /[^{\\s][\\s\\S]*/\n")
        tagged = f'{self.tags.opening_term} "\\n" call "\\n" {self.tags.closing_term}'
        if self.choice == ToolChoice.AUTO:  # prose (not starting with "<" or "{": no untagged call) or the call
            return Grammar(GrammarKind.LARK, f"start: {tagged} | text\n" + call + "text: /[^<{\\s][\\s\\S]*/\n")
        return Grammar(GrammarKind.LARK, f"start: {tagged}\n" + call)

    def for_template(self) -> list[dict[str, Any]] | None:
        """The functions as a template with its own tool syntax lists them (None: the convention lists them in a
        system message, or tool_choice none lists nothing)."""
        if self.tags is None or self.choice == ToolChoice.NONE:
            return None
        return [{"type": "function", "function": {"name": f.name, "description": f.description,
                                                  "parameters": json.loads(f.parameters)}} for f in self.functions]


def _call_schema(f: Function) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": f.name}, "arguments": json.loads(f.parameters)},
            "required": ["name", "arguments"], "additionalProperties": False}


def parse_tools(body: dict[str, Any], tags: CallTags | None = None) -> Tools | None:
    """The request's tools and tool_choice; None where it lists no tools. `tags`: the chat template's call tags."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list):
        raise ToolError("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}")
    functions = []
    for i, tool in enumerate(tools):
        f = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        parameters = f.get("parameters", {"type": "object", "properties": {}})
        description = f.get("description", "")
        if not isinstance(parameters, dict) or not isinstance(description, str):
            raise ToolError(f"tools[{i}]: 'parameters' must be a JSON Schema object and 'description' a string")
        functions.append(Function(f["name"], description, json.dumps(parameters)))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise ToolError("'tools' names a function twice")
    if choice is None or choice in ("auto", "none", "required"):
        return Tools(tuple(functions), ToolChoice(choice or "auto"), tags=tags)
    function = choice.get("function") if isinstance(choice, dict) else None
    named = function.get("name") if isinstance(function, dict) else None
    if named not in names:
        raise ToolError(f"'tool_choice' must be auto, none, required or a function of 'tools' ({', '.join(names)})")
    return Tools(tuple(functions), ToolChoice.NAMED, named, tags)


def system_text(tools: Tools) -> str:
    """The system message's part that lists the functions and the convention of a call."""
    listed = "\n".join(json.dumps({"name": f.name, "description": f.description,
                                   "parameters": json.loads(f.parameters)}) for f in tools.functions)
    return ("You can call these functions:\n" + listed + "\nTo call one, answer with only a JSON object "
            "{\"name\": <function name>, \"arguments\": <its arguments>}. Otherwise answer in plain text.")


def with_tools(messages: list[dict[str, str]], tools: Tools) -> list[dict[str, str]]:
    """The messages with the functions listed in the system message (its own text kept first), where the template
    does not list them itself."""
    if tools.choice == ToolChoice.NONE or tools.tags is not None:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + system_text(tools)}, *messages[1:]]
    return [{"role": "system", "content": system_text(tools)}, *messages]


def earlier_call(call: Any, where: str) -> dict[str, Any]:
    """An assistant message's tool call, its arguments parsed: {"name": ..., "arguments": {...}}."""
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise ToolError(f"{where}: a tool call must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
    arguments = f.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError as e:
        raise ToolError(f"{where}: the call's arguments are not JSON: {e}") from e
    return {"name": f["name"], "arguments": parsed}


def call_text(call: Any, where: str) -> str:
    """An assistant message's tool call as the convention writes it."""
    return json.dumps(earlier_call(call, where))


def tool_result_text(message: dict[str, Any], content: str) -> str:
    name = message.get("name") or message.get("tool_name") or message.get("tool_call_id") or "the function"
    return f"Result of {name}: {content}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def answer_call(text: str, tools: Tools) -> ToolCall | None:
    """The call an answer makes, None where it is prose."""
    if tools.choice == ToolChoice.NONE:
        return None
    text = text.strip()
    tags = tools.tags
    if tags is not None and text.startswith(tags.opening) and text.endswith(tags.closing):
        text = text[len(tags.opening):-len(tags.closing)].strip()
    if not text.startswith("{"):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None  # cut short (max_tokens): the text is returned as it is
    names = {f.name for f in tools.functions}
    if not isinstance(value, dict) or value.get("name") not in names or not isinstance(value.get("arguments"), dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"], json.dumps(value["arguments"]))
