"""POST /v1/responses: OpenAI's Responses API request, declared field by field (schema.py says how), stateless."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator

from jaxserve.openai.requests import StructuredOutputsBody
from jaxserve.openai.schema import FUNCTION_NAME, NOT_YET, Body, bounded, refused


STATELESS = "this server stores no responses (it is stateless, as vLLM is without its store): send the whole " \
            "conversation in input"
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one `include` value served


def _served_kind(value: Any, kinds: tuple[str, ...], what: str, why: str) -> Any:
    """`value`, unless it is an object whose `type` (`kinds[0]` when absent) is not one of `kinds`: then a validation
    error naming that type and saying why it is not served."""
    if isinstance(value, dict) and (value.get("type") or kinds[0]) not in kinds:
        raise pydantic_core.PydanticCustomError("not_served", "{what} of type {kind} are not served: {why}",
                                                {"what": what, "kind": json.dumps(value["type"]), "why": why})
    return value


def _accepted(what: str) -> Any:
    """An optional field that changes nothing (an earlier answer's detail sent back with it, a hint not needed)."""
    return Field(None, description=f"accepted: {what}")


class ResponsesTextPart(Body):
    """A text part of an input item: input_text (what a user, the system or a developer says; a function's output)
    or output_text (an earlier answer, sent back as history)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = refused("annotations come from hosted tools, which are not "
                                                        "available", [])
    logprobs: list[dict[str, Any]] | None = _accepted("an earlier answer's log-probabilities (not rendered)")
    prompt_cache_breakpoint: dict[str, Any] | None = _accepted("prefix caching is automatic")

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _served_kind(value, ("input_text", "output_text"), "content parts", "the served model reads text "
                            "only (input_text and output_text parts)")


class ResponsesMessageItem(Body):
    """An input message: what a user, the system or a developer says, or an earlier answer (assistant)."""

    type: Literal["message"] | None = Field(None, description="message (may be left out)")
    role: Literal["user", "system", "developer", "assistant"] = Field(description="who speaks")
    content: str | list[ResponsesTextPart] = Field(description="text, or text parts joined by newlines")
    id: str | None = _accepted("an earlier answer's id")
    status: Literal["in_progress", "completed", "incomplete"] | None = _accepted("an earlier answer's status")
    phase: Literal["commentary", "final_answer"] | None = _accepted("an earlier answer's label (not rendered)")


class ResponsesFunctionCallItem(Body):
    """A call an earlier answer made: the chat template renders it as the assistant's tool call."""

    type: Literal["function_call"]
    call_id: str = Field(description="the call's id, which the function_call_output answering it names")
    name: str = Field(description="the function called")
    arguments: str = Field(description="its arguments: a JSON object, as text")
    id: str | None = _accepted("an earlier answer's item id")
    status: Literal["in_progress", "completed", "incomplete"] | None = _accepted("an earlier answer's status")
    namespace: str | None = refused("namespaced tools (tool search) are not available")
    caller: dict[str, Any] | None = refused("programmatic tool calling is not available", {"type": "direct"})


class ResponsesFunctionCallOutputItem(Body):
    """A function's result, answering an earlier call: the chat template renders it as a tool message."""

    type: Literal["function_call_output"]
    call_id: str = Field(description="the call answered")
    output: str | list[ResponsesTextPart] = Field(description="text, or text parts joined by newlines")
    id: str | None = _accepted("an earlier item's id")
    status: Literal["in_progress", "completed", "incomplete"] | None = _accepted("an earlier item's status")


def _item_kind(item: Any) -> str:
    """An input item's kind: its type (a message's may be left out)."""
    return (item.get("type") if isinstance(item, dict) else getattr(item, "type", None)) or "message"


def _served_item(item: Any) -> Any:
    return _served_kind(item, ("message", "function_call", "function_call_output"), "input items",
                        "this server is stateless and has no hosted tools or reasoning items: it takes message, "
                        "function_call and function_call_output items")


ResponsesInputItem = Annotated[
    Annotated[ResponsesMessageItem, Tag("message")] | Annotated[ResponsesFunctionCallItem, Tag("function_call")]
    | Annotated[ResponsesFunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind), BeforeValidator(_served_item)]


class ResponsesFunctionTool(Body):
    """A function the model may call, in the Responses API's flat shape."""

    type: Literal["function"] = Field(description="function (hosted tools are refused)")
    name: str = Field(pattern=FUNCTION_NAME, description="letters, digits, _ and -, at most 64")
    description: str | None = Field(None, description="what the function does, for the model to read")
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of its arguments (absent: any object)")
    strict: bool | None = Field(None, description="accepted: forced calls (tool_choice required or a named "
                                "function) always match the schema")
    defer_loading: bool | None = refused("tool search is not available", False)
    output_schema: dict[str, Any] | None = refused("function output schemas are " + NOT_YET)
    allowed_callers: list[str] | None = refused("programmatic tool calling is not available", ["direct"])

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        return _served_kind(value, ("function",), "tools", "only function tools are served (web_search, "
                            "file_search, code_interpreter, mcp and the other hosted tools are OpenAI's)")


class ResponsesNamedFunction(Body):
    type: Literal["function"]
    name: str


def _served_choice(choice: Any) -> Any:
    return _served_kind(choice, ("function",), "tool choices", "the choices are none, auto, required and "
                        "{type: function, name} (allowed_tools and hosted tools' choices are not available)")


class ResponsesTextFormat(Body):
    """text.format: plain text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(serialize_by_alias=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, description="json_schema (required there): the schema's name")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="json_schema (required there): the "
                                           "JSON Schema the output matches")
    description: str | None = Field(None, description="json_schema: what the output is for (not used for decoding)")
    strict: bool | None = Field(None, description="accepted: the output always matches the schema exactly")

    @model_validator(mode="after")
    def _schema_given(self) -> ResponsesTextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs name and schema")
        return self


class ResponsesText(Body):
    format: ResponsesTextFormat | None = Field(None, description="text (the default), json_object or json_schema")
    verbosity: str | None = refused(NOT_YET, "medium")


class ResponsesReasoning(Body):
    effort: str | None = Field(None, description="passed to the chat template as `reasoning_effort`, as chat's "
                               "reasoning_effort is")
    summary: str | None = refused("reasoning summaries are " + NOT_YET)
    generate_summary: str | None = refused("reasoning summaries are " + NOT_YET)
    context: str | None = refused("reasoning items are " + NOT_YET, "auto")
    mode: str | None = refused("there is one reasoning mode", "standard")


class ResponsesStreamOptions(Body):
    include_obfuscation: bool | None = refused("obfuscation padding in events is " + NOT_YET, False)


class ResponsesRequestBody(Body):
    """POST /v1/responses, stateless: nothing is stored, so every request brings its whole conversation."""

    model: str | None = Field(None, description="the served model's name (--served-model-name); may be left out")
    input: str | list[ResponsesInputItem] = Field(
        description="text (one user message), or items: messages (user, system, developer or assistant; text or "
        "text parts), function_call and function_call_output items, rendered by the model's chat template")
    instructions: str | None = Field(None, description="a system message put before the input")
    max_output_tokens: int | None = Field(None, description="most tokens to generate (default: the rest of the "
                                          "context)", json_schema_extra={"minimum": 1})
    temperature: float | None = bounded("temperature", "0 decodes greedily")
    top_p: float | None = bounded("top_p", "nucleus sampling, in (0, 1]")
    include: list[Literal["message.output_text.logprobs"]] | None = Field(
        None, description=f"{OUTPUT_LOGPROBS}: the output text's log-probabilities (the one value served: the "
        "others ask for hosted tools' or reasoning output)")
    top_logprobs: int | None = bounded("logprobs", f"with include [\"{OUTPUT_LOGPROBS}\"]: this many alternatives "
                                        "per token")
    tools: list[ResponsesFunctionTool] | None = Field(
        None, description="functions the model may call, {type: function, name, description, parameters, strict}, "
        "rendered by the chat template; hosted tools (web_search, file_search, mcp, ...) are refused")
    tool_choice: Annotated[Literal["none", "auto", "required"] | ResponsesNamedFunction,
                           BeforeValidator(_served_choice)] | None = Field(
        None, description="none, auto (the default with tools: the model decides), required (at least one call) or "
        "{type: function, name} (one call of it); required and named calls are enforced by a grammar; "
        "allowed_tools and hosted tools' choices are refused")
    parallel_tool_calls: bool | None = Field(None, description="more than one call per answer (default true)")
    text: ResponsesText | None = Field(None, description="format: text, json_object (any JSON object) or "
                                       "json_schema {name, schema, strict} (JSON matching the schema)")
    reasoning: ResponsesReasoning | None = Field(None, description="effort, passed to the chat template as "
                                                 "reasoning_effort; summaries are refused")
    stream: bool | None = Field(None, description="answer as server-sent events, response.created to "
                                "response.completed (response.incomplete when cut by max_output_tokens)")
    stream_options: ResponsesStreamOptions | None = Field(None, description="with stream only")
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = Field(None, description="up to 16 key-value pairs, echoed in "
                                                             "the response (nothing is stored)")
    store: bool | None = _accepted("nothing is stored whatever it says (true is OpenAI's default, so clients send "
                                   "it without meaning it), as vLLM does without its store")
    max_tool_calls: int | None = _accepted("it bounds calls of hosted tools, and there are none")
    user: str | None = _accepted("an end-user id, as OpenAI takes it; changes nothing")
    safety_identifier: str | None = _accepted("an end-user id, as OpenAI takes it; changes nothing")
    prompt_cache_key: str | None = _accepted("prefix caching is automatic, so the hint is not needed")
    previous_response_id: str | None = refused(STATELESS)
    conversation: str | dict[str, Any] | None = refused(STATELESS)
    background: bool | None = refused("a background response is fetched later from the store, and this server "
                                       "stores no responses", False)
    background_options: dict[str, Any] | None = refused("background responses are not available")
    prompt: dict[str, Any] | None = refused("stored prompt templates are OpenAI's")
    prompt_cache_options: dict[str, Any] | None = refused("prefix caching is automatic and takes no options", {})
    prompt_cache_retention: str | None = refused("cached prefixes stay in memory until evicted", "in_memory")
    truncation: str | None = refused("an input too long for the context is refused, never truncated", "disabled")
    service_tier: str | None = refused("there is one service tier", "auto", "default")
    context_management: list[dict[str, Any]] | None = refused("context compaction is " + NOT_YET, [])
    moderation: dict[str, Any] | None = refused("moderation is not available")
    image: dict[str, Any] | None = refused("the served model reads text only")
    access_programs: dict[str, Any] | None = refused("access programs are OpenAI's")
    # vLLM's extensions of its Responses requests.
    top_k: int | None = bounded("top_k", "keep the k likeliest tokens (0 or -1: all)")
    repetition_penalty: float | None = bounded("repetition_penalty", "divides the logits of seen tokens (1: none)")
    seed: int | None = Field(None, description="same seed, same tokens (64 bits, all of them used)",
                             json_schema_extra={"minimum": -2**63, "maximum": 2**63 - 1})
    stop: str | list[str] | None = Field(None, description="a string or a list of strings that end generation (left "
                                         "out of the text)")
    ignore_eos: bool | None = Field(None, description="generate past the end-of-sequence token")
    skip_special_tokens: bool | None = Field(None, description="leave special tokens out of the text (default)")
    include_stop_str_in_output: bool | None = Field(None, description="keep the matched stop string in the text")
    priority: int | None = Field(None, description="scheduling priority, lower served earlier (default 0); other "
                                 "values need --scheduling-policy priority, as in vLLM")
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) → bias added to its logit "
                                                "(at most --max-logit-bias entries, 300 by default)")
    structured_outputs: StructuredOutputsBody | None = Field(None, description="vLLM's: one of json, json_object, "
                                                             "regex, choice, grammar (instead of text.format)")
    request_id: str | None = refused("the server names its own requests")
    cache_salt: str | None = refused(NOT_YET)
    kv_transfer_params: dict[str, Any] | None = refused("disaggregated serving is " + NOT_YET)
    vllm_xargs: dict[str, Any] | None = refused(NOT_YET)
    mm_processor_kwargs: dict[str, Any] | None = refused("the served model reads text only", {})
    media_io_kwargs: dict[str, Any] | None = refused("the served model reads text only", {})
    enable_response_messages: bool | None = refused(NOT_YET, False)
    previous_input_messages: list[Any] | None = refused(STATELESS, [])
