"""A Responses API answer assembled from the engine's steps: the events a stream sends, in the order the official
SDK requires (response.created, response.in_progress, each output item added, grown and done, then
response.completed, or response.incomplete when max_output_tokens cut it; `sequence_number` on every event), and the
Response they add up to, which a request that does not stream gets alone. Both come from the same steps, so a
streamed answer and a whole one agree item for item.

The model's text is one message item; with tools (tool_choice other than none) the calls it makes, read by
ToolCallParser as the text grows, are function_call items after it. An answer with neither is an empty message.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import uuid
from typing import Any

from jaxserve.openai.bodies import chat_logprobs
from jaxserve.openai.tool_calls import CallArguments, CallStarted, ContentText, ParsedEvent, ToolCallParser
from jaxserve.outputs import CompletionDelta, RequestOutput
from jaxserve.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class ResponseSettings:
    """What a Response repeats of its request (OpenAI's Response carries the settings it ran with)."""

    model: str  # the served model's name, or the LoRA adapter's
    instructions: str | None  # the system message put before the input, as sent
    max_output_tokens: int | None  # as sent; None: the rest of the context
    temperature: float | None  # as sent; None: the default, 1
    top_p: float | None  # as sent; None: the default, 1
    top_logprobs: int | None  # alternatives per token, as sent
    parallel_tool_calls: bool  # an answer may hold several calls
    tool_choice: str | dict[str, Any]  # as sent; "auto" when left out
    tools: tuple[dict[str, Any], ...]  # the function tools, in the Responses API's flat shape
    text: dict[str, Any]  # {"format": ...}; the format is {"type": "text"} when left out
    reasoning: dict[str, Any] | None  # as sent
    metadata: dict[str, str]  # as sent; {} when left out


@dataclasses.dataclass(frozen=True)
class LogprobsAsked:
    """The output text's log-probabilities, when the request includes them."""

    num_top: int  # alternatives listed per token
    tokenizer: Tokenizer  # spells each token's bytes


def response_usage(output: RequestOutput) -> dict[str, Any]:
    """The Responses API's usage of a finished request. The engine does not report which prompt tokens its prefix
    cache held or took in, so cached_tokens and cache_write_tokens are 0; no served model reasons apart from its
    answer, so reasoning_tokens is 0."""
    prompt, generated = len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated}


class ResponseAssembly:
    """One Response, built step by step: `opening()`, then `step(delta)` for each engine step, then `finish(usage)`
    (or `fail(...)`); each returns the events to stream, and `response()` is the Response so far.

    A message's log-probabilities are those of the tokens generated while its text was written: each text delta
    carries the tokens since the previous one (text held back, such as a possible stop string, comes with its
    tokens later); tokens that became calls carry none.
    """

    def __init__(self, settings: ResponseSettings, reader: ToolCallParser | None, logprobs: LogprobsAsked | None):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self._settings = settings
        self._reader = reader  # reads calls out of the text; None: the text is all message
        self._logprobs = logprobs  # None: the request did not include them
        self._sequence = 0  # the next event's sequence_number
        self.output: list[dict[str, Any]] = []  # the output items so far
        self._open: dict[str, Any] | None = None  # the item being written (the last of `output`), if any
        self._call_items: dict[int, int] = {}  # the reader's call index → its function_call item's output index
        self._pending: list[dict[str, Any]] = []  # log-probabilities of tokens no text delta has carried yet
        self._finish_reason: str | None = None  # the last step's
        self._status = "in_progress"  # then completed, incomplete or failed
        self._usage: dict[str, Any] | None = None  # known when the answer is done
        self._error: dict[str, str] | None = None  # a failed answer's code and message

    def opening(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def step(self, delta: CompletionDelta) -> list[dict[str, Any]]:
        """The events one engine step of the answer adds."""
        if self._logprobs is not None and delta.logprobs:
            self._pending += chat_logprobs(delta.token_ids, delta.logprobs, self._logprobs.num_top,
                                           self._logprobs.tokenizer)["content"]
        if delta.finish_reason is not None:
            self._finish_reason = delta.finish_reason
        events: list[dict[str, Any]] = []
        for piece in self._read(delta):
            if isinstance(piece, ContentText):
                events += self._text(piece.text)
            elif isinstance(piece, CallStarted):
                events += self._call_started(piece)
            elif isinstance(piece, CallArguments):
                events += self._call_grew(piece)
        return events

    def finish(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """The events that close the answer: its open item done (an empty message when it has none), then
        response.completed, or response.incomplete when max_output_tokens (or the context's end) cut it."""
        cut = self._finish_reason == "length"
        events = [] if self.output else self._open_message()
        if self._open is not None and self._open["type"] == "message":
            events += self._flush_logprobs()
        events += self._close(cut)
        self._status = "incomplete" if cut else "completed"
        self._usage = usage
        return events + [self._event(f"response.{self._status}", response=self.response())]

    def fail(self, message: str, code: str, param: str | None) -> list[dict[str, Any]]:
        """The events that end an answer that failed after its stream began: an error, then response.failed."""
        self._status, self._error = "failed", {"code": code, "message": message}
        return [self._event("error", code=code, message=message, param=param),
                self._event("response.failed", response=self.response())]

    def response(self) -> dict[str, Any]:
        """The Response as it stands."""
        settings = self._settings
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": self._status,
                "model": settings.model, "output": copy.deepcopy(self.output), "usage": self._usage,
                "error": self._error,
                "incomplete_details": {"reason": "max_output_tokens"} if self._status == "incomplete" else None,
                "instructions": settings.instructions, "max_output_tokens": settings.max_output_tokens,
                "metadata": settings.metadata, "parallel_tool_calls": settings.parallel_tool_calls,
                "previous_response_id": None, "reasoning": settings.reasoning, "temperature": settings.temperature,
                "text": settings.text, "tool_choice": settings.tool_choice, "tools": list(settings.tools),
                "top_logprobs": settings.top_logprobs, "top_p": settings.top_p, "truncation": "disabled",
                "background": False}

    def _read(self, delta: CompletionDelta) -> list[ParsedEvent]:
        if self._reader is None:
            return [ContentText(delta.text)] if delta.text else []
        return self._reader.feed(delta.text) + (self._reader.finish() if delta.finish_reason else [])

    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != "message":
            events = self._close() + self._open_message()
        return events + self._text_delta(text)

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        message, logprobs = self._open, self._pending
        self._pending = []
        part = message["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        return [self._event("response.output_text.delta", item_id=message["id"], output_index=len(self.output) - 1,
                            content_index=0, delta=text, logprobs=logprobs)]

    def _flush_logprobs(self) -> list[dict[str, Any]]:
        """The last tokens' log-probabilities (an end-of-sequence token writes no text) in a text delta of their own."""
        return self._text_delta("") if self._pending else []

    def _open_message(self) -> list[dict[str, Any]]:
        message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "in_progress",
                   "content": []}
        events = self._add(message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        message["content"].append(part)
        return events + [self._event("response.content_part.added", item_id=message["id"],
                                     output_index=len(self.output) - 1, content_index=0, part=copy.deepcopy(part))]

    def _call_started(self, started: CallStarted) -> list[dict[str, Any]]:
        self._pending = []  # the tokens since the last text wrote this call's head: no message's
        call = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                "call_id": started.id, "name": started.name, "arguments": ""}
        events = self._close() + self._add(call)
        self._call_items[started.index] = len(self.output) - 1
        return events

    def _call_grew(self, grew: CallArguments) -> list[dict[str, Any]]:
        self._pending = []
        index = self._call_items[grew.index]
        call = self.output[index]
        call["arguments"] += grew.text
        return [self._event("response.function_call_arguments.delta", item_id=call["id"], output_index=index,
                            delta=grew.text)]

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self._open = item
        return [self._event("response.output_item.added", output_index=len(self.output) - 1,
                            item=copy.deepcopy(item))]

    def _close(self, cut: bool = False) -> list[dict[str, Any]]:
        """The open item's done events (none when no item is open); `cut`: the answer ended at max_output_tokens
        while the item was being written."""
        item, index = self._open, len(self.output) - 1
        if item is None:
            return []
        self._open = None
        if item["type"] == "message":
            item["status"] = "incomplete" if cut else "completed"
            part = item["content"][0]
            events = [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=copy.deepcopy(part["logprobs"])),
                      self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=copy.deepcopy(part))]
        else:
            [call] = [call for call, position in self._call_items.items() if position == index]
            item["status"] = "completed" if self._reader.calls[call].complete else "incomplete"
            events = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"])]
        return events + [self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event
