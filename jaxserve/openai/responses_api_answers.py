"""POST /v1/responses' answers, declared: the Response, its output items and usage, and the streamed events (what
/openapi.json promises; responses_output.py builds them as plain dicts, which the tests validate against these)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, RootModel

from jaxserve.openai.answers import Answer, ChatLogprob


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(Answer):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] = Field(max_length=0, description="always empty: no hosted tool annotates")
    logprobs: list[ChatLogprob] = Field(description="with include message.output_text.logprobs, its tokens'")


class ResponseMessage(Answer):
    """An answer's text."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus = Field(description="incomplete: max_output_tokens cut it")
    content: list[OutputText]


class ResponseFunctionCall(Answer):
    """A call an answer made."""

    id: str
    type: Literal["function_call"]
    status: ItemStatus = Field(description="incomplete: max_output_tokens cut its arguments")
    call_id: str = Field(description="what the function_call_output answering it names")
    name: str
    arguments: str = Field(description="a JSON object, as the model wrote it")


ResponseOutputItem = Annotated[ResponseMessage | ResponseFunctionCall, Field(discriminator="type")]


class InputTokensDetails(Answer):
    cached_tokens: int = Field(description="0: the engine does not report prefix-cache hits per request")
    cache_write_tokens: int = Field(description="0: nor the prefix-cache pages a request filled")


class OutputTokensDetails(Answer):
    reasoning_tokens: int = Field(description="0: the served models do not reason apart from their answer")


class ResponseUsage(Answer):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class FunctionToolEcho(Answer):
    type: Literal["function"]
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class NamedFunctionChoice(Answer):
    type: Literal["function"]
    name: str


class TextFormatEcho(Answer):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfigEcho(Answer):
    format: TextFormatEcho


class ResponseError(Answer):
    code: str
    message: str


class IncompleteDetails(Answer):
    reason: Literal["max_output_tokens"]


class ResponsesResponse(Answer):
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


class ResponseLifecycleEvent(Answer):
    """The answer began (created, in_progress) or ended (completed, incomplete, failed), with the Response so far."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    sequence_number: int
    response: ResponsesResponse


class OutputItemEvent(Answer):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: ResponseOutputItem


class ContentPartEvent(Answer):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDeltaEvent(Answer):
    type: Literal["response.output_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[ChatLogprob] = Field(description="of the tokens since the previous delta, when included")


class OutputTextDoneEvent(Answer):
    type: Literal["response.output_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[ChatLogprob]


class FunctionCallArgumentsDeltaEvent(Answer):
    type: Literal["response.function_call_arguments.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(Answer):
    type: Literal["response.function_call_arguments.done"]
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponseErrorEvent(Answer):
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
