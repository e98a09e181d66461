"""A /v1/responses body as the chat completions body it asks for: its instructions and input items as messages, its
tools, tool_choice, text.format and sampling fields spelled as chat spells them. The server runs that body through
chat's own checks, prompt rendering, tool calling and structured output, so both routes behave alike; errors found
on the way are named by the Responses field that gave them (`responses_param`, `respelled`).

Items become messages: a message item is a message of its role (text parts joined), consecutive function_call
items are one assistant message's tool_calls (parallel calls), a function_call_output is a tool message.
"""

from __future__ import annotations

import json
import re
from typing import Any

from jaxserve.openai.responses_api_requests import (OUTPUT_LOGPROBS, ResponsesFunctionCallItem, ResponsesMessageItem,
                                                    ResponsesRequestBody, ResponsesTextPart)
from jaxserve.openai.responses_output import ResponseSettings
from jaxserve.errors import InvalidRequestError

# Fields both bodies spell alike and that mean the same (vLLM's extensions among them).
_SAME_FIELDS = ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "top_k", "repetition_penalty",
                "seed", "stop", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "priority",
                "logit_bias", "structured_outputs")
# Chat fields a Responses body spells otherwise, and how (for errors about them). Chat's logprobs is never the one
# an error names: the converted body always asks for logprobs with top_logprobs, which keeps its name.
_RESPONSES_SPELLING = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                       "response_format": "text.format", "reasoning_effort": "reasoning.effort"}
_CHAT_WORDS = re.compile(r"(?<![\w-])(" + "|".join(_RESPONSES_SPELLING) + r")\b")
_MESSAGES = re.compile(r"(?<![\w-])messages(\[\d+\](\.[a-z_]+|\[\d+\])*)?")
_FUNCTION_FIELD = re.compile(r"\btools\[(\d+)\]\.function\.")


def chat_body(body: ResponsesRequestBody) -> dict[str, Any]:
    """The chat completions body that asks what `body` asks."""
    fields = body.model_dump(exclude_none=True)
    if "stream_options" in fields and not body.stream:
        raise InvalidRequestError("stream_options is only allowed with stream: true", param="stream_options")
    chat = {name: fields[name] for name in _SAME_FIELDS if name in fields}
    chat["messages"] = conversation(body.instructions, body.input)
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if body.tools is not None:
        chat["tools"] = [_chat_tool(tool) for tool in fields["tools"]]
    choice = fields.get("tool_choice")
    if choice is not None:  # a named function: {type, name} in Responses, {type, function: {name}} in chat
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice["name"]}}
    text_format = fields.get("text", {}).get("format")
    if text_format is not None:
        chat["response_format"] = _response_format(text_format)
    effort = fields.get("reasoning", {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    return chat | _logprobs(fields)


def conversation(instructions: str | None, items: str | list[Any]) -> list[dict[str, Any]]:
    """The chat messages of `instructions` (a leading system message) and the input (text: one user message)."""
    messages = [] if instructions is None else [{"role": "system", "content": instructions}]
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    calls_made: set[str] = set()
    for index, item in enumerate(items):
        if isinstance(item, ResponsesMessageItem):
            messages.append({"role": item.role, "content": _chat_content(item.content)})
        elif isinstance(item, ResponsesFunctionCallItem):
            calls_made.add(item.call_id)
            _add_call(messages, item, index)
        else:
            if item.call_id not in calls_made:
                raise InvalidRequestError(f"input[{index}]: no function_call item before this function_call_output "
                                          f"has its call_id {item.call_id!r}", param="input")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _chat_content(item.output)})
    return messages


def _add_call(messages: list[dict[str, Any]], item: ResponsesFunctionCallItem, index: int) -> None:
    """A function_call item as a tool call of the assistant message before it, when that one made calls too
    (parallel calls are one message), else of a new assistant message."""
    _check_arguments(item.arguments, index)
    call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
    if messages and messages[-1].get("tool_calls"):
        messages[-1]["tool_calls"].append(call)
    else:
        messages.append({"role": "assistant", "tool_calls": [call]})


def response_settings(body: ResponsesRequestBody, model: str) -> ResponseSettings:
    """What the Response to `body` repeats of it; `model`: the name the request was served under."""
    fields = body.model_dump(exclude_none=True)
    return ResponseSettings(
        model=model, instructions=body.instructions, max_output_tokens=body.max_output_tokens,
        temperature=body.temperature, top_p=body.top_p, top_logprobs=body.top_logprobs,
        parallel_tool_calls=body.parallel_tool_calls is not False, tool_choice=fields.get("tool_choice", "auto"),
        tools=tuple({"type": "function", "name": tool["name"], "description": tool.get("description"),
                     "parameters": tool.get("parameters"), "strict": tool.get("strict")}
                    for tool in fields.get("tools", ())),
        text={"format": fields.get("text", {}).get("format", {"type": "text"})},
        reasoning=fields.get("reasoning"), metadata=body.metadata or {})


def responses_param(param: str | None) -> str | None:
    """The Responses field that gave the chat body's field `param` (its top-level field, as the body's own schema
    errors name it; a tool's parameters by their path)."""
    if param is None:
        return None
    if _MESSAGES.fullmatch(param):
        return "input"
    if param in _RESPONSES_SPELLING:
        return _RESPONSES_SPELLING[param].split(".")[0]
    return _FUNCTION_FIELD.sub(r"tools[\1].", param)


def respelled(message: str) -> str:
    """An error message about the chat body, in the Responses fields' names."""
    message = _FUNCTION_FIELD.sub(r"tools[\1].", message)
    message = _MESSAGES.sub("input", message)
    return _CHAT_WORDS.sub(lambda match: _RESPONSES_SPELLING[match.group(1)], message)


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A flat Responses function tool as chat nests it (its refused fields hold nothing by now)."""
    return {"type": "function", "function": {key: value for key, value in tool.items()
                                             if key in ("name", "description", "parameters", "strict")}}


def _chat_content(content: str | list[ResponsesTextPart]) -> str | list[dict[str, str]]:
    return content if isinstance(content, str) else [{"type": "text", "text": part.text} for part in content]


def _check_arguments(arguments: str, index: int) -> None:
    """A call's arguments are a JSON object, as text (the chat template renders them as an object)."""
    try:
        parsed = json.loads(arguments)
    except ValueError as error:
        raise InvalidRequestError(f"input[{index}].arguments is not valid JSON: {error}", param="input") from None
    if not isinstance(parsed, dict):
        raise InvalidRequestError(f"input[{index}].arguments must be a JSON object", param="input")


def _response_format(text_format: dict[str, Any]) -> dict[str, Any]:
    """text.format as chat's response_format (which nests a json_schema's fields under json_schema)."""
    if text_format["type"] != "json_schema":
        return {"type": text_format["type"]}
    return {"type": "json_schema", "json_schema": {key: value for key, value in text_format.items() if key != "type"}}


def _logprobs(fields: dict[str, Any]) -> dict[str, Any]:
    """include's output logprobs and top_logprobs, as chat's logprobs and top_logprobs."""
    top = fields.get("top_logprobs")
    if OUTPUT_LOGPROBS in fields.get("include", ()):
        return {"logprobs": True, **({"top_logprobs": top} if top is not None else {})}
    if top:
        raise InvalidRequestError(f"top_logprobs needs include: [\"{OUTPUT_LOGPROBS}\"]", param="top_logprobs")
    return {}
