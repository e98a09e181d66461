"""Checks of OpenAI request fields shared by the endpoints: typed flags, stream options, limits, conversations."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from jaxserve.engine.prompt_checks import check_prompt_tokens
from jaxserve.entrypoints.prompts import TokenizedPrompt, chat_prompt
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.api_errors import ApiError
from jaxserve.server.app import ServerContext
from jaxserve.server.config import ServerConfig


def flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """A boolean field; absent or null is `default`, anything but a boolean is a 400."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean, got {value!r}", param=name)
    return value


def include_usage(body: dict[str, Any]) -> bool:
    """`stream_options.include_usage`: a last event with the usage; stream_options without stream is a 400, as in
    OpenAI and vLLM."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not flag(body, "stream"):
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    return flag(options, "include_usage")


def check_limits(params: SamplingParams, num_prompts: int, config: ServerConfig) -> None:
    """The server's own caps, which bound what one request may cost (the engine checks what the model can take)."""
    if params.n > config.max_n:
        raise ApiError(400, f"n must be at most {config.max_n}, got {params.n}", param="n")
    if num_prompts > config.max_prompts:
        raise ApiError(400, f"at most {config.max_prompts} prompts per request, got {num_prompts}", param="prompt")


def conversation_prompt(messages: list[dict[str, Any]], context: ServerContext, add_generation_prompt: bool,
                        tools: Sequence[dict[str, Any]] | None = None) -> TokenizedPrompt:
    """A checked conversation (with the tools the template renders) rendered by the chat template and tokenized;
    text too long to fit is refused first."""
    context.check_text_fits([*(part for message in messages for part in _texts(message)),
                             *(json.dumps(tool) for tool in tools or ())], "messages")
    prompt = chat_prompt(context.tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools)
    check_prompt_tokens(prompt.token_ids, vocab_size=context.vocab_size, max_model_len=context.max_model_len,
                        param="messages")
    return prompt


def _texts(message: dict[str, Any]) -> list[str]:
    content = message.get("content")
    parts = [content] if isinstance(content, str) else [part["text"] for part in content or ()]
    calls = [call["function"]["arguments"] for call in message.get("tool_calls", ())]
    return parts + calls + ([message["name"]] if "name" in message else [])
