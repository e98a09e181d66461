"""Tool calling as Llama 3.1, 3.2 and 3.3 do it: the chat template renders the tools, and the model answers a call
with a JSON object `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or not; several joined by "; ").

`ToolCalling` is what a chat request asks: which tools, and whether the model may (auto), must (required) or must
call one named function. Forced calls become a grammar on the output, so even a model that never learned the format
answers with valid calls. `ToolCallParser` reads the model's text back into OpenAI's `tool_calls`, piece by piece as
it streams or all at once; both give the same calls.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from jaxserve.errors import InvalidRequestError
from jaxserve.structured_outputs import StructuredOutputsParams

CALL_SEPARATOR = "; "  # between parallel calls, as Llama's JSON tool-call parsers read them
# The start of one call, up to and including the `{` that opens its arguments.
_CALL_HEAD = re.compile(r'\s*(?:<\|python_tag\|>)?\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"\s*,\s*'
                        r'"(?:parameters|arguments)"\s*:\s*\{')
# Text longer than this that has not become a call head never will (names are at most 64 characters).
_HEAD_LIMIT = 160


@dataclasses.dataclass(frozen=True)
class ToolCalling:
    """What a chat request asks of tool calls."""

    tools: tuple[dict[str, Any], ...]  # the client's tool definitions, as the chat template renders them
    choice: str  # "none", "auto", "required", or "function": every answer calls `function`
    function: str | None  # with choice "function": the function's name
    parallel: bool  # an answer may hold several calls

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(tool["function"]["name"] for tool in self.tools)

    @property
    def forces_calls(self) -> bool:
        """Every answer is calls, never text (tool_choice required, or a named function)."""
        return self.choice in ("required", "function")

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that forces calls (required, or a named function); None when the model decides."""
        if not self.forces_calls:
            return None
        forced = [tool["function"] for tool in self.tools if self.choice == "required" or
                  tool["function"]["name"] == self.function]
        rules = [f"call_{index}: %json {json.dumps(_call_schema(function))}" for index, function in enumerate(forced)]
        calls = 'call ("' + CALL_SEPARATOR + '" call)*' if self.parallel and self.choice == "required" else "call"
        alternatives = " | ".join(f"call_{index}" for index in range(len(forced)))
        return StructuredOutputsParams(grammar="\n".join([f"start: {calls}", f"call: {alternatives}", *rules]))

    def parameter_schemas(self) -> list[tuple[int, dict[str, Any]]]:
        """(tool index, arguments schema) of every tool that declares one."""
        return [(index, tool["function"]["parameters"]) for index, tool in enumerate(self.tools)
                if tool["function"].get("parameters") is not None]


def tool_calling_from_body(fields: dict[str, Any]) -> ToolCalling | None:
    """The chat body's tools, tool_choice and parallel_tool_calls (already schema-checked); None without tools."""
    tools = tuple(fields.get("tools") or ())
    choice = fields.get("tool_choice")
    function = choice["function"]["name"] if isinstance(choice, dict) else None
    if not tools:
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools to choose from", param="tool_choice")
        return None
    for index, tool in enumerate(tools):
        _check_parameters_object(tool["function"].get("parameters"), f"tools[{index}].function.parameters")
    names = [tool["function"]["name"] for tool in tools]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise InvalidRequestError(f"tools name {repeated[0]!r} more than once", param="tools")
    if function is not None and function not in names:
        raise InvalidRequestError(f"tool_choice names {function!r}, which is not one of the tools", param="tool_choice")
    return ToolCalling(tools=tools, choice="function" if function is not None else (choice or "auto"),
                       function=function, parallel=fields.get("parallel_tool_calls") is not False)


def _check_parameters_object(schema: Any, param: str) -> None:
    """A function's arguments are a JSON object (calls carry them as one): a parameters schema of another type is
    refused, as OpenAI refuses it, rather than forced calls coming back as text."""
    if not isinstance(schema, dict) or "type" not in schema:
        return
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    if "object" not in kinds:
        raise InvalidRequestError(f"{param} must be a JSON Schema of type \"object\" (a function's arguments are an "
                                  f"object), got type {json.dumps(schema['type'])}", param=param)


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    """One call of `function` in Llama's form, written without optional whitespace. The parameters schema sits one
    level down, under properties/parameters, so its references to its own root ("#", "#/$defs/...", what pydantic
    writes for enums and nested models) are re-rooted there."""
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "parameters": _rerooted(parameters, "#/properties/parameters")},
            "required": ["name", "parameters"], "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False}}


def _rerooted(schema: Any, root: str) -> Any:
    """`schema` with every local `$ref` (a JSON pointer from its root, "#...") pointing from `root` instead."""
    if isinstance(schema, list):
        return [_rerooted(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return {key: root + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#")
            else _rerooted(value, root) for key, value in schema.items()}


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates read them: a call's arguments as an object, not JSON text (as transformers
    and vLLM pass them); a tool message must name the call it answers, and every message but an assistant's calls
    needs content."""
    rendered = []
    for index, message in enumerate(messages):
        if message.get("role") == "tool" and not message.get("tool_call_id"):
            raise InvalidRequestError(f"messages[{index}]: a tool message needs tool_call_id", param="messages")
        if message.get("tool_call_id") is not None and message.get("role") != "tool":
            raise InvalidRequestError(f"messages[{index}]: only tool messages take tool_call_id", param="messages")
        if message.get("tool_calls"):
            if message.get("role") != "assistant":
                raise InvalidRequestError(f"messages[{index}]: only assistant messages take tool_calls",
                                          param="messages")
            message = {**message, "tool_calls": [_template_call(call, f"messages[{index}].tool_calls[{number}]")
                                                 for number, call in enumerate(message["tool_calls"])]}
        elif message.get("content") is None:
            # As OpenAI answers: only an assistant message that makes calls may go without content.
            raise InvalidRequestError(f"messages[{index}]: a {message.get('role')} message needs content",
                                      param=f"messages[{index}].content")
        rendered.append(message)
    return rendered


def _template_call(call: Any, where: str) -> dict[str, Any]:
    """A call with its arguments as an object (given as JSON text, as OpenAI sends them, or already parsed)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or "arguments" not in function:
        raise InvalidRequestError(f"{where} must be {{id, type, function: {{name, arguments}}}}", param="messages")
    arguments = function["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as error:
            raise InvalidRequestError(f"{where}.function.arguments is not valid JSON: {error}",
                                      param="messages") from None
    return {**call, "function": {**function, "arguments": arguments}}


@dataclasses.dataclass(frozen=True)
class ContentText:
    """Text of the answer that is not a call."""

    text: str


@dataclasses.dataclass(frozen=True)
class CallStarted:
    """A call begins: its id and function are known, its arguments follow."""

    index: int  # which of the answer's calls
    id: str  # the call's id, "call_" and 24 hex digits
    name: str  # the function called


@dataclasses.dataclass(frozen=True)
class CallArguments:
    """More of a call's arguments (JSON text); a call's pieces joined are its arguments."""

    index: int  # which of the answer's calls
    text: str


ParsedEvent = ContentText | CallStarted | CallArguments


@dataclasses.dataclass
class ParsedCall:
    id: str  # "call_" and 24 hex digits
    name: str  # the function called
    arguments: str  # its arguments, JSON text as the model wrote it
    complete: bool  # the arguments' object was closed (else the output ended inside it)


class ToolCallParser:
    """Reads one answer's text, as it grows, into content and calls.

    With tool_choice auto the model decides: text that starts as a call of a declared function is read as calls,
    anything else is content, held back only until that is clear. Text after the last call is dropped.
    """

    def __init__(self, calling: ToolCalling):
        self._names = set(calling.names) if calling.choice != "function" else {calling.function}
        self._parallel = calling.parallel
        self._pending = ""  # text not yet classified (a call head in the making)
        self._state = "head"  # head, content, arguments, after_arguments, between, ignored
        self._depth = 0  # open braces and brackets inside the arguments
        self._in_string = False  # inside a JSON string of the arguments
        self._escaped = False  # after a backslash inside that string
        self.content: list[str] = []  # content pieces, in order
        self.calls: list[ParsedCall] = []  # the calls, in order

    def feed(self, text: str) -> list[ParsedEvent]:
        """What `text`, the answer's next piece, adds."""
        events: list[ParsedEvent] = []
        while text:
            text = self._READERS[self._state](self, text, events)
        return events

    def finish(self) -> list[ParsedEvent]:
        """The answer ended: text still held back as a possible call head is content after all."""
        events: list[ParsedEvent] = []
        if self._state == "head" and self._pending and not self.calls:
            events.append(self._content(self._pending))
        self._pending = ""
        return events

    def _head(self, text: str, events: list[ParsedEvent]) -> str:
        self._pending += text
        match = _CALL_HEAD.match(self._pending)
        if match is not None and match.group(1) in self._names:
            rest = self._pending[match.end():]
            self._pending = ""
            call = ParsedCall(id=f"call_{uuid.uuid4().hex[:24]}", name=match.group(1), arguments="", complete=False)
            self.calls.append(call)
            events.append(CallStarted(len(self.calls) - 1, call.id, call.name))
            self._state, self._depth = "arguments", 1
            events.append(self._arguments_piece("{"))
            return rest
        if match is not None or not self._may_become_head():
            pending, self._pending = self._pending, ""
            if self.calls:
                self._state = "ignored"
                return ""
            self._state = "content"
            events.append(self._content(pending))
        return ""

    def _may_become_head(self) -> bool:
        stripped = self._pending.lstrip()
        return len(self._pending) <= _HEAD_LIMIT and (not stripped or stripped[0] in "{<")

    def _content(self, text: str) -> ContentText:
        self.content.append(text)
        return ContentText(text)

    def _arguments(self, text: str, events: list[ParsedEvent]) -> str:
        for position, character in enumerate(text):
            if self._in_string:
                self._escaped, self._in_string = (False, True) if self._escaped else (character == "\\",
                                                                                       character != '"')
            elif character == '"':
                self._in_string = True
            elif character in "{[":
                self._depth += 1
            elif character in "}]":
                self._depth -= 1
                if self._depth == 0:
                    events.append(self._arguments_piece(text[:position + 1]))
                    self.calls[-1].complete = True
                    self._state = "after_arguments"
                    return text[position + 1:]
        events.append(self._arguments_piece(text))
        return ""

    def _arguments_piece(self, text: str) -> CallArguments:
        self.calls[-1].arguments += text
        return CallArguments(len(self.calls) - 1, text)

    def _after_arguments(self, text: str, events: list[ParsedEvent]) -> str:
        """Whitespace, then the `}` that closes the call."""
        rest = text.lstrip()
        if rest:
            self._state = "between" if rest[0] == "}" else "ignored"
            return rest[1:] if rest[0] == "}" else ""
        return ""

    def _between(self, text: str, events: list[ParsedEvent]) -> str:
        """Whitespace, then ";" and the next call (when parallel calls are allowed)."""
        rest = text.lstrip()
        if rest:
            self._state = "head" if rest[0] == ";" and self._parallel else "ignored"
            return rest[1:] if self._state == "head" else ""
        return ""

    def _in_content(self, text: str, events: list[ParsedEvent]) -> str:
        events.append(self._content(text))
        return ""

    def _ignored(self, text: str, events: list[ParsedEvent]) -> str:
        return ""

    # Each state's reader takes the text and returns what it left for the next state.
    _READERS = {"head": _head, "content": _in_content, "arguments": _arguments, "after_arguments": _after_arguments,
                "between": _between, "ignored": _ignored}


def parse_answer(text: str, calling: ToolCalling) -> ToolCallParser:
    """A whole answer read at once."""
    parser = ToolCallParser(calling)
    parser.feed(text)
    parser.finish()
    return parser


def tool_calls_body(calls: Iterable[ParsedCall]) -> list[dict[str, Any]]:
    """OpenAI's `message.tool_calls`."""
    return [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in calls]


def delta_tool_calls(events: Iterable[ParsedEvent]) -> list[dict[str, Any]]:
    """OpenAI's streamed `delta.tool_calls`: per call, its id, type and name first, then pieces of its arguments."""
    entries: dict[int, dict[str, Any]] = {}
    for event in events:
        if isinstance(event, CallStarted):
            entries[event.index] = {"index": event.index, "id": event.id, "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}
        elif isinstance(event, CallArguments):
            entry = entries.setdefault(event.index, {"index": event.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += event.text
    return list(entries.values())
