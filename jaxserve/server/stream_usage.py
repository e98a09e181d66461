"""What a stream tells of its token usage: `stream_options.include_usage` (OpenAI's last event) and
`continuous_usage_stats` (vLLM's: every event carries its choice's usage so far, which load generators such as
guidellm read)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxserve.server.api_errors import ApiError
from jaxserve.server.request_fields import flag


@dataclasses.dataclass(frozen=True)
class StreamUsage:
    """The usage a streamed answer reports."""

    final: bool  # a last event with no choices and the request's usage (include_usage)
    continuous: bool  # every choice's event carries that choice's usage so far (continuous_usage_stats)


NO_USAGE = StreamUsage(final=False, continuous=False)


def stream_usage(body: dict[str, Any]) -> StreamUsage:
    """`stream_options` read; stream_options without stream is a 400, as in OpenAI and vLLM. Continuous usage comes
    only with include_usage, as in vLLM."""
    options = body.get("stream_options")
    if options is None:
        return NO_USAGE
    if not flag(body, "stream"):
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    final = flag(options, "include_usage")
    return StreamUsage(final=final, continuous=final and flag(options, "continuous_usage_stats"))


class ChoiceUsage:
    """Each choice's prompt tokens and the tokens generated for it so far, stamped on its events when the stream
    reports usage continuously (choice i of prompt p is index p × n + i, as in the answer)."""

    def __init__(self, usage: StreamUsage, prompt_tokens: Sequence[int], n: int):
        self._continuous = usage.continuous
        self._prompt_tokens = [count for count in prompt_tokens for _ in range(n)]  # by choice index
        self._generated = [0] * len(self._prompt_tokens)  # by choice index

    def count(self, index: int, new_tokens: int) -> None:
        """Choice `index` generated `new_tokens` more (counted whether or not an event goes out for them)."""
        self._generated[index] += new_tokens

    def stamped(self, chunk: dict[str, Any], index: int) -> dict[str, Any]:
        """`chunk` (an event of choice `index`), with that choice's usage so far when usage is continuous."""
        if self._continuous:
            prompt, generated = self._prompt_tokens[index], self._generated[index]
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": generated,
                              "total_tokens": prompt + generated}
        return chunk
