"""Checks of OpenAI request fields shared by the endpoints: typed flags and conversations."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from jaxserve.engine.prompt_checks import check_prompt_tokens
from jaxserve.openai.prompts import TokenizedPrompt, chat_prompt
from jaxserve.server.api_errors import ApiError
from jaxserve.server.context import ServerContext


def flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """A boolean field; absent or null is `default`, anything but a boolean is a 400."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean, got {value!r}", param=name)
    return value


def conversation_prompt(messages: list[dict[str, Any]], context: ServerContext, add_generation_prompt: bool,
                        tools: Sequence[dict[str, Any]] | None = None, **variables: Any) -> TokenizedPrompt:
    """A conversation (with the tools and other `variables` the template renders) rendered by the chat template,
    tokenized, and checked as a prompt the model can run (it leaves room in max_model_len to generate)."""
    prompt = rendered_conversation(messages, context, add_generation_prompt, tools, **variables)
    check_prompt_tokens(prompt.token_ids, vocab_size=context.vocab_size, max_model_len=context.max_model_len,
                        param="messages")
    return prompt


def rendered_conversation(messages: list[dict[str, Any]], context: ServerContext, add_generation_prompt: bool,
                          tools: Sequence[dict[str, Any]] | None = None, **variables: Any) -> TokenizedPrompt:
    """A conversation rendered by the chat template and tokenized, whatever its length; text too long for
    max_model_len tokens is refused first, untokenized (check_text_bytes)."""
    context.check_text_fits([*(part for message in messages for part in _texts(message)),
                             *(json.dumps(tool) for tool in tools or ())], "messages")
    return chat_prompt(context.tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                       **variables)


def _texts(message: dict[str, Any]) -> list[str]:
    content = message.get("content")
    parts = [content] if isinstance(content, str) else [part["text"] for part in content or ()]
    calls = [call["function"]["arguments"] for call in message.get("tool_calls", ())]
    return parts + calls + ([message["name"]] if "name" in message else [])
