"""Checks of OpenAI request fields shared by the endpoints: typed flags, stream options, limits."""

from __future__ import annotations

from typing import Any

from jaxserve.sampling_params import SamplingParams
from jaxserve.server.api_errors import ApiError
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
    """`stream_options.include_usage`: a last event with the usage; only meaningful when streaming."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    return flag(options, "include_usage")


def check_limits(params: SamplingParams, num_prompts: int, config: ServerConfig) -> None:
    """The server's own caps, which bound what one request may cost (the engine checks what the model can take)."""
    if params.n > config.max_n:
        raise ApiError(400, f"n must be at most {config.max_n}, got {params.n}", param="n")
    if num_prompts > config.max_prompts:
        raise ApiError(400, f"at most {config.max_prompts} prompts per request, got {num_prompts}", param="prompt")
