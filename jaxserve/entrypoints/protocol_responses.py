"""The response bodies, declared: what /openapi.json promises and the tests hold the server's answers to.

The bodies themselves are built as plain dicts (entrypoints/openai_body.py), which the tests validate against these
models; the official `openai` client's types are the other oracle.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """The legacy shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None = Field(description="the stop string or token id that ended the choice (vLLM)")


class CompletionResponse(BaseModel):
    """POST /v1/completions, not streamed (streamed: `text_completion` events of the same shape, then [DONE])."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's own bytes (a piece of a character stays a piece)")


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None


class ChatCompletionResponse(BaseModel):
    """POST /v1/chat/completions, not streamed (streamed: `chat.completion.chunk` events, then [DONE])."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """Every failure, whatever the route: OpenAI's error JSON."""

    error: ErrorDetail
