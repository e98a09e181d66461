"""The response bodies, declared: what /openapi.json promises and the tests hold the server's answers to.

The bodies themselves are built as plain dicts (entrypoints/openai_body.py; entrypoints/responses_output.py for
/v1/responses), which the tests validate against these models; the official `openai` client's types are the other
oracle.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel


class _Answer(BaseModel):
    """Exactly these fields: the document promises no others."""

    model_config = ConfigDict(extra="forbid")


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Answer):
    """The legacy shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Answer):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None = Field(description="the stop string or token id that ended the choice (vLLM)")


class CompletionResponse(_Answer):
    """POST /v1/completions, not streamed (streamed: CompletionChunk events, then [DONE])."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(_Answer):
    """One streamed /v1/completions event: what one choice gained, or (no choices) the usage, last."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, description="in the last event, with stream_options.include_usage; in every "
                                "event too (the choice's so far) with continuous_usage_stats")


class TopLogprob(_Answer):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's own bytes (a piece of a character stays a piece)")


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(_Answer):
    content: list[ChatLogprob] | None


class CalledFunction(_Answer):
    name: str
    arguments: str = Field(description="a JSON object, as the model wrote it")


class ToolCallMade(_Answer):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(_Answer):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is tool calls alone")
    tool_calls: list[ToolCallMade] | None = Field(None, description="with tools: the calls the answer made")


ChatFinishReason = Literal["stop", "length", "abort", "tool_calls"]


class ChatChoice(_Answer):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: ChatFinishReason | None
    stop_reason: int | str | None


class ChatCompletionResponse(_Answer):
    """POST /v1/chat/completions, not streamed (streamed: ChatCompletionChunk events, then [DONE])."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(_Answer):
    name: str | None = Field(None, description="in the call's first event")
    arguments: str | None = Field(None, description="the next piece of the arguments' JSON text")


class ToolCallDelta(_Answer):
    index: int = Field(description="which of the answer's calls grew")
    id: str | None = Field(None, description="in the call's first event")
    type: Literal["function"] | None = Field(None, description="in the call's first event")
    function: FunctionDelta


class ChatDelta(_Answer):
    role: Literal["assistant"] | None = Field(None, description="in each choice's first event")
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = Field(None, description="with tools: calls begun or grown")


class ChatChunkChoice(_Answer):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None
    finish_reason: ChatFinishReason | None
    stop_reason: int | str | None


class ChatCompletionChunk(_Answer):
    """One streamed /v1/chat/completions event: what one choice gained, or (no choices) the usage, last."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, description="in the last event, with stream_options.include_usage; in every "
                                "event too (the choice's so far) with continuous_usage_stats")


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(_Answer):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = Field(max_length=0, description="always empty: no hosted tool annotates")
    logprobs: list[ChatLogprob] = Field(description="with include message.output_text.logprobs, its tokens'")


class ResponseMessage(_Answer):
    """An answer's text."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus = Field(description="incomplete: max_output_tokens cut it")
    content: list[OutputText]


class ResponseFunctionCall(_Answer):
    """A call an answer made."""

    id: str
    type: Literal["function_call"]
    status: ItemStatus = Field(description="incomplete: max_output_tokens cut its arguments")
    call_id: str = Field(description="what the function_call_output answering it names")
    name: str
    arguments: str = Field(description="a JSON object, as the model wrote it")


ResponseOutputItem = Annotated[ResponseMessage | ResponseFunctionCall, Field(discriminator="type")]


class InputTokensDetails(_Answer):
    cached_tokens: int = Field(description="0: the engine does not report prefix-cache hits per request")
    cache_write_tokens: int = Field(description="0: nor the prefix-cache pages a request filled")


class OutputTokensDetails(_Answer):
    reasoning_tokens: int = Field(description="0: the served models do not reason apart from their answer")


class ResponseUsage(_Answer):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class FunctionToolEcho(_Answer):
    type: Literal["function"]
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class NamedFunctionChoice(_Answer):
    type: Literal["function"]
    name: str


class TextFormatEcho(_Answer):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfigEcho(_Answer):
    format: TextFormatEcho


class ResponseError(_Answer):
    code: str
    message: str


class IncompleteDetails(_Answer):
    reason: Literal["max_output_tokens"]


class ResponsesResponse(_Answer):
    """POST /v1/responses, not streamed (streamed: ResponseStreamEvent events; the last holds the Response)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[ResponseOutputItem]
    usage: ResponseUsage | None = Field(description="null until the answer is done")
    error: ResponseError | None = Field(description="why a streamed answer failed (status failed)")
    incomplete_details: IncompleteDetails | None = Field(description="with status incomplete")
    # The request's settings, repeated.
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: None
    reasoning: dict[str, Any] | None
    temperature: float | None
    text: TextConfigEcho
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice
    tools: list[FunctionToolEcho]
    top_logprobs: int | None
    top_p: float | None
    truncation: Literal["disabled"]
    background: Literal[False]


class ResponseLifecycleEvent(_Answer):
    """The answer began (created, in_progress) or ended (completed, incomplete, failed), with the Response so far."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    sequence_number: int
    response: ResponsesResponse


class OutputItemEvent(_Answer):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: ResponseOutputItem


class ContentPartEvent(_Answer):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDeltaEvent(_Answer):
    type: Literal["response.output_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[ChatLogprob] = Field(description="of the tokens since the previous delta, when included")


class OutputTextDoneEvent(_Answer):
    type: Literal["response.output_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[ChatLogprob]


class FunctionCallArgumentsDeltaEvent(_Answer):
    type: Literal["response.function_call_arguments.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(_Answer):
    type: Literal["response.function_call_arguments.done"]
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseErrorEvent(_Answer):
    """A failure after the stream began; response.failed follows."""

    type: Literal["error"]
    sequence_number: int
    code: str | None
    message: str
    param: str | None


class ResponseStreamEvent(RootModel[Annotated[
        ResponseLifecycleEvent | OutputItemEvent | ContentPartEvent | OutputTextDeltaEvent | OutputTextDoneEvent
        | FunctionCallArgumentsDeltaEvent | FunctionCallArgumentsDoneEvent | ResponseErrorEvent,
        Field(discriminator="type")]]):
    """One streamed /v1/responses event."""


class TokenizeResponse(_Answer):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Answer):
    prompt: str


class ModelCard(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str  # the model's folder (a LoRA adapter's) or its name
    parent: str | None  # a LoRA adapter's base model; None for the base model
    max_model_len: int


class ModelList(_Answer):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(_Answer):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(_Answer):
    """Every failure, whatever the route: OpenAI's error JSON."""

    error: ErrorDetail
