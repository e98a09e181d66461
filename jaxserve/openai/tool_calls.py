"""Tool calling: the chat template renders the tools, and the model answers calls in its family's format
(tool_call_formats.py: Llama 3's JSON, Hermes/Qwen's `<tool_call>` blocks, Mistral's `[TOOL_CALLS]` array; the
server's --tool-call-parser picks one, llama3_json by default).

`ToolCalling` is what a chat request asks: which tools, and whether the model may (auto), must (required) or must
call one named function. Forced calls become a grammar on the output, written in the format, so even a model that
never learned the format answers with valid calls. `ToolCallParser` reads the model's text back into OpenAI's
`tool_calls`, piece by piece as it streams or all at once; both give the same calls.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from jaxserve.errors import InvalidRequestError
from jaxserve.openai.tool_call_formats import LLAMA3_JSON, ToolCallFormat, match_pieces, trigger_split
from jaxserve.structured_outputs import StructuredOutputsParams



@dataclasses.dataclass(frozen=True)
class ToolCalling:
    """What a chat request asks of tool calls."""

    tools: tuple[dict[str, Any], ...]  # the client's tool definitions, as the chat template renders them
    choice: str  # "none", "auto", "required", or "function": every answer calls `function`
    function: str | None  # with choice "function": the function's name
    parallel: bool  # an answer may hold several calls
    format: ToolCallFormat = LLAMA3_JSON  # how the model writes calls (--tool-call-parser)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(tool["function"]["name"] for tool in self.tools)

    @property
    def forces_calls(self) -> bool:
        """Every answer is calls, never text (tool_choice required, or a named function)."""
        return self.choice in ("required", "function")

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that forces calls (required, or a named function); None when the model decides."""
        rules = self.forced_calls_rules("start")
        return None if rules is None else StructuredOutputsParams(grammar="\n".join(rules))

    def forced_calls_rules(self, entry: str) -> list[str] | None:
        """Lark rules whose rule `entry` is the forced calls, in the format; None when the model decides."""
        if not self.forces_calls:
            return None
        forced = [tool["function"] for tool in self.tools if self.choice == "required" or
                  tool["function"]["name"] == self.function]
        rules = [f"call_{index}: %json {json.dumps(_call_schema(function, self.format.arguments_key))}"
                 for index, function in enumerate(forced)]
        alternatives = [f"call_{index}" for index in range(len(forced))]
        parallel = self.parallel and self.choice == "required"
        return [*self.format.forced_calls_rules(entry, alternatives, parallel), *rules]

    def parameter_schemas(self) -> list[tuple[int, dict[str, Any]]]:
        """(tool index, arguments schema) of every tool that declares one."""
        return [(index, tool["function"]["parameters"]) for index, tool in enumerate(self.tools)
                if tool["function"].get("parameters") is not None]


def tool_calling_from_body(fields: dict[str, Any], call_format: ToolCallFormat = LLAMA3_JSON) -> ToolCalling | None:
    """The chat body's tools, tool_choice and parallel_tool_calls (already schema-checked), calls written in
    `call_format`; None without tools."""
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
                       function=function, parallel=fields.get("parallel_tool_calls") is not False,
                       format=call_format)


def _check_parameters_object(schema: Any, param: str) -> None:
    """A function's arguments are a JSON object (calls carry them as one): a parameters schema of another type is
    refused, as OpenAI refuses it, rather than forced calls coming back as text."""
    if not isinstance(schema, dict) or "type" not in schema:
        return
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    if "object" not in kinds:
        raise InvalidRequestError(f"{param} must be a JSON Schema of type \"object\" (a function's arguments are an "
                                  f"object), got type {json.dumps(schema['type'])}", param=param)


def _call_schema(function: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    """One call of `function`, `{"name": ..., <arguments_key>: {...}}`, written without optional whitespace. The
    parameters schema sits one level down, under properties/<arguments_key>, so its references to its own root ("#",
    "#/$defs/...", what pydantic writes for enums and nested models) are re-rooted there."""
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             arguments_key: _rerooted(parameters, f"#/properties/{arguments_key}")},
            "required": ["name", arguments_key], "additionalProperties": False,
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
    and vLLM pass them), and an assistant's calls without content with content "" (as vLLM passes them: templates
    such as Qwen's read it); a tool message must name the call it answers, and every message but an assistant's
    calls needs content."""
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
            message = {"content": "", **message,
                       "tool_calls": [_template_call(call, f"messages[{index}].tool_calls[{number}]")
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
    """Reads one answer's text, as it grows, into content and calls, in the tool calling's format.

    With tool_choice auto the model decides: text that starts as a call of a declared function is read as calls
    (in formats where text may come first, from the format's trigger on), anything else is content, held back only
    until that is clear; whitespace between text and the calls is dropped. Text after the last call is dropped.
    """

    def __init__(self, calling: ToolCalling):
        self._names = set(calling.names) if calling.choice != "function" else {calling.function}
        self._parallel = calling.parallel
        self._format = calling.format
        self._pending = ""  # text not yet classified (a head in the making, whitespace that may precede calls)
        # text (before any call, looking for the trigger), head, arguments, close, only_text, ignored
        self._state = "text" if calling.format.trigger is not None else "head"
        self._depth = 0  # open braces and brackets inside the arguments
        self._in_string = False  # inside a JSON string of the arguments
        self._escaped = False  # after a backslash inside that string
        self.content: list[str] = []  # content pieces, in order
        self.calls: list[ParsedCall] = []  # the calls, in order

    def feed(self, text: str) -> list[ParsedEvent]:
        """What `text`, the answer's next piece, adds."""
        events: list[ParsedEvent] = []
        self._pending += text
        while self._pending and self._READERS[self._state](self, events):
            pass
        return events

    def finish(self) -> list[ParsedEvent]:
        """The answer ended: text held back (a possible head, whitespace before possible calls) is content after
        all, unless calls were made."""
        events: list[ParsedEvent] = []
        if self._pending and not self.calls and self._state in ("text", "head"):
            events.append(self._content(self._pending))
        self._pending = ""
        return events

    # Each state's reader works on self._pending and says whether it should be called again (it changed state and
    # left text for the next reader).

    def _text(self, events: list[ParsedEvent]) -> bool:
        """Content until the trigger; trailing whitespace waits, since whitespace before calls is dropped."""
        before, rest = trigger_split(self._pending, self._format.trigger)
        shown = before.rstrip()
        if shown:
            events.append(self._content(shown))
        if rest is None:  # the whitespace, and a tail that may begin the trigger, wait
            self._pending = self._pending[len(shown):]
            return False
        self._pending, self._state = rest, "head"
        return True

    def _head(self, events: list[ParsedEvent]) -> bool:
        head = match_pieces(self._pending, self._format.next_head if self.calls else self._format.first_head)
        if head.status == "maybe":
            return False
        if head.status == "match" and head.name in self._names:
            call = ParsedCall(id=f"call_{uuid.uuid4().hex[:24]}", name=head.name, arguments="", complete=False)
            self.calls.append(call)
            events.append(CallStarted(len(self.calls) - 1, call.id, call.name))
            self._pending, self._state, self._depth = self._pending[head.end:], "arguments", 1
            events.append(self._arguments_piece("{"))
            return True
        if self.calls:
            self._state = "ignored"
        else:
            self._state = "only_text"
            events.append(self._content(self._pending))
        self._pending = ""
        return False

    def _arguments(self, events: list[ParsedEvent]) -> bool:
        text = self._pending
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
                    self._pending, self._state = text[position + 1:], "close"
                    return True
        events.append(self._arguments_piece(text))
        self._pending = ""
        return False

    def _close(self, events: list[ParsedEvent]) -> bool:
        """The pieces that close the call, then (with parallel calls) the next call's head."""
        closed = match_pieces(self._pending, self._format.call_close)
        if closed.status == "maybe":
            return False
        self._state = "head" if closed.status == "match" and self._parallel else "ignored"
        self._pending = self._pending[closed.end:] if self._state == "head" else ""
        return self._state == "head"

    def _only_text(self, events: list[ParsedEvent]) -> bool:
        events.append(self._content(self._pending))
        self._pending = ""
        return False

    def _ignored(self, events: list[ParsedEvent]) -> bool:
        self._pending = ""
        return False

    def _content(self, text: str) -> ContentText:
        self.content.append(text)
        return ContentText(text)

    def _arguments_piece(self, text: str) -> CallArguments:
        self.calls[-1].arguments += text
        return CallArguments(len(self.calls) - 1, text)

    _READERS = {"text": _text, "head": _head, "arguments": _arguments, "close": _close, "only_text": _only_text,
                "ignored": _ignored}


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
