"""The response bodies, declared: what /openapi.json promises and the tests hold the server's answers to.

The bodies themselves are built as plain dicts (entrypoints/openai_body.py; openai/responses_output.py for
/v1/responses), which the tests validate against these models; the official `openai` client's types are the other
oracle.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Answer(BaseModel):
    """Exactly these fields: the document promises no others."""

    model_config = ConfigDict(extra="forbid")


class Usage(Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(Answer):
    """The legacy shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Answer):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None = Field(description="the stop string or token id that ended the choice (vLLM)")


class CompletionResponse(Answer):
    """POST /v1/completions, not streamed (streamed: CompletionChunk events, then [DONE])."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(Answer):
    """One streamed /v1/completions event: what one choice gained, or (no choices) the usage, last."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, description="in the last event, with stream_options.include_usage; in every "
                                "event too (the choice's so far) with continuous_usage_stats")


class TopLogprob(Answer):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's own bytes (a piece of a character stays a piece)")


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(Answer):
    content: list[ChatLogprob] | None


class CalledFunction(Answer):
    name: str
    arguments: str = Field(description="a JSON object, as the model wrote it")


class ToolCallMade(Answer):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(Answer):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is tool calls alone (or, with a reasoning "
                                "parser, reasoning alone)")
    reasoning_content: str | None = Field(None, description="with --reasoning-parser: the answer's reasoning "
                                          "(<think>...</think>), null without any")
    tool_calls: list[ToolCallMade] | None = Field(None, description="with tools: the calls the answer made")


ChatFinishReason = Literal["stop", "length", "abort", "tool_calls"]


class ChatChoice(Answer):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: ChatFinishReason | None
    stop_reason: int | str | None


class ChatCompletionResponse(Answer):
    """POST /v1/chat/completions, not streamed (streamed: ChatCompletionChunk events, then [DONE])."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(Answer):
    name: str | None = Field(None, description="in the call's first event")
    arguments: str | None = Field(None, description="the next piece of the arguments' JSON text")


class ToolCallDelta(Answer):
    index: int = Field(description="which of the answer's calls grew")
    id: str | None = Field(None, description="in the call's first event")
    type: Literal["function"] | None = Field(None, description="in the call's first event")
    function: FunctionDelta


class ChatDelta(Answer):
    role: Literal["assistant"] | None = Field(None, description="in each choice's first event")
    reasoning_content: str | None = Field(None, description="with --reasoning-parser: more of the reasoning")
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = Field(None, description="with tools: calls begun or grown")


class ChatChunkChoice(Answer):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None
    finish_reason: ChatFinishReason | None
    stop_reason: int | str | None


class ChatCompletionChunk(Answer):
    """One streamed /v1/chat/completions event: what one choice gained, or (no choices) the usage, last."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="in the last event, with stream_options.include_usage; in every "
                                "event too (the choice's so far) with continuous_usage_stats")


class TokenizeResponse(Answer):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(Answer):
    prompt: str


class ModelCard(Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str  # the model's folder (a LoRA adapter's) or its name
    parent: str | None  # a LoRA adapter's base model; None for the base model
    max_model_len: int


class ModelList(Answer):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(Answer):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(Answer):
    """Every failure, whatever the route: OpenAI's error JSON."""

    error: ErrorDetail
