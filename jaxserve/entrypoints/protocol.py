"""The OpenAI (and vLLM) request bodies as declared schemas: one pydantic model per route.

Every field of OpenAI's and vLLM's completions, chat and responses requests is declared here, so none is ever silently
ignored: it is either honoured (the engine does what it asks) or refused (`_refused`: a 400 naming it unless it
holds a value that asks for nothing, such as `tools: []` or `best_of: 1`). A field no one declared is refused too
(pydantic's `extra="forbid"`), unless the server runs with --allow-unknown-fields. Validation is strict (JSON
types as they are: `"yes"` is not a boolean, `2.0` not an integer) and NaN or infinite numbers are refused.

The models check types and shapes; value ranges (temperature >= 0, ...) stay with SamplingParams, which the
offline API shares. The server's /openapi.json and the 400 messages both come from these models; `FIELD_STATUS`
is the README's table of every field.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator
from pydantic.fields import FieldInfo

from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import BOUNDS

REFUSED, NEUTRAL = "x-jaxserve-refused", "x-jaxserve-neutral"  # a refused field's schema keys
NOT_YET = "not implemented yet"
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for a function's name


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a declared field is refused, and the values that ask for nothing (so they pass)."""

    reason: str  # the 400's explanation
    neutral: tuple[Any, ...]  # values besides null that are accepted and change nothing

    def __call__(self, schema: dict[str, Any]) -> None:
        """The field's JSON Schema says exactly what passes: null or a neutral value."""
        description = schema.get("description")
        schema.clear()
        schema.update({"anyOf": [{"type": "null"}, *({"const": value} for value in self.neutral)], "default": None,
                       "description": description, REFUSED: self.reason, NEUTRAL: list(self.neutral)})


def _refused(reason: str, *neutral: Any, description: str = "") -> Any:
    """A declared field that the server does not implement: present with a value other than null or one of
    `neutral` (values that ask for nothing), it is a 400 giving `reason`."""
    return Field(default=None, description=f"refused unless {_spelled(neutral)}: {reason}. {description}".strip(),
                 json_schema_extra=Refusal(reason, neutral))


def refusal_of(field: FieldInfo) -> Refusal | None:
    """The Refusal of a refused field; None for one the server honours."""
    return field.json_schema_extra if isinstance(field.json_schema_extra, Refusal) else None


def _bounded(name: str, description: str) -> Any:
    """An optional numeric sampling field, its interval (checked by SamplingParams) declared in the schema."""
    return Field(None, description=description, json_schema_extra=BOUNDS[name].json_schema())


def _spelled(neutral: tuple[Any, ...]) -> str:
    return " or ".join(["null", *(json.dumps(value) for value in neutral)])


class _Body(BaseModel):
    """Strict JSON types, finite numbers, no undeclared fields."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool | None = Field(None, description="a last event with the request's usage")
    continuous_usage_stats: bool | None = Field(None, description="vLLM's: with include_usage, every event also "
                                                "carries its choice's usage so far")
    include_obfuscation: bool | None = _refused("obfuscation padding in events is " + NOT_YET, False)


class JsonSchemaFormat(_Body):
    """response_format's json_schema."""

    model_config = ConfigDict(serialize_by_alias=True)
    name: str = Field(description="the schema's name (not used for decoding)")
    description: str | None = Field(None, description="what the output is for (not used for decoding)")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON Schema the output matches "
                                           "(absent: any JSON object)")
    strict: bool | None = Field(None, description="accepted: the output always matches the schema exactly")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema")


class StructuredOutputsBody(_Body):
    """vLLM's structured_outputs: exactly one constraint."""

    json_: str | dict[str, Any] | None = Field(None, alias="json", description="a JSON Schema")
    json_object: bool | None = Field(None, description="any JSON object")
    regex: str | None = Field(None, description="a regular expression the whole output matches")
    choice: list[str] | None = Field(None, description="the output is one of these strings")
    grammar: str | None = Field(None, description="a Lark grammar, or GBNF/EBNF as llama.cpp writes it")
    disable_fallback: bool | None = Field(None, description="accepted: there is one grammar engine, no fallback")
    disable_any_whitespace: bool | None = Field(None, description="accepted: JSON is generated without optional "
                                                "whitespace anyway")
    disable_additional_properties: bool | None = _refused(NOT_YET, False)
    whitespace_pattern: str | None = _refused(NOT_YET)
    structural_tag: str | None = _refused(NOT_YET)

    model_config = ConfigDict(serialize_by_alias=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str = Field(description="the function called")
    arguments: str = Field(description="its arguments: a JSON object, as text")


class ToolCall(_Body):
    """A call an assistant message made, as the server answered it."""

    id: str = Field(description="the call's id, which the tool message answering it names")
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Body):
    """One message of a conversation; the model's chat template renders them."""

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="who speaks (tool: a tool's result, answering an assistant's call)")
    content: str | list[TextPart] | None = Field(None, description="text, or text parts joined by newlines (the "
                                                 "served model reads text only)")
    name: str | None = Field(None, description="the speaker's name, passed to the chat template")
    tool_calls: list[ToolCall] | None = Field(None, description="assistant messages: the calls it made, rendered "
                                              "by the chat template")
    tool_call_id: str | None = Field(None, description="tool messages (where it is required): the call answered")
    function_call: dict[str, Any] | None = _refused("the deprecated function_call is not implemented: use "
                                                    "tool_calls")
    refusal: str | None = _refused("assistant refusals are an OpenAI-side feature")
    reasoning_content: str | None = _refused("reasoning models are " + NOT_YET)
    # Fields of OpenAI's answers that clients echo back in the history: nothing of theirs is served here.
    annotations: list[dict[str, Any]] | None = _refused("annotations come from web search, which is not available", [])
    audio: dict[str, Any] | None = _refused("the served model reads and writes text only")


class FunctionDefinition(_Body):
    name: str = Field(pattern=FUNCTION_NAME, description="letters, digits, _ and -, at most 64")
    description: str | None = Field(None, description="what the function does, for the model to read")
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of its arguments (absent: any "
                                              "object)")
    strict: bool | None = Field(None, description="accepted: forced calls (tool_choice required or a named "
                                "function) always match the schema")


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(_Body):
    """Fields both completions and chat take: how tokens are drawn and when generation stops."""

    model: str | None = Field(None, description="the served model's name (--served-model-name); may be left out")
    frequency_penalty: float | None = _bounded("frequency_penalty", "subtracted per occurrence of a generated token "
                                            "(-2 to 2)")
    presence_penalty: float | None = _bounded("presence_penalty", "subtracted once per generated token (-2 to 2)")
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) → bias added to its logit "
                                                "(at most --max-logit-bias entries, 300 by default)")
    max_tokens: int | None = _bounded("max_tokens", "most tokens to generate (0 with echo: none, the prompt is "
                                      "scored)")
    n: int | None = _bounded("n", "continuations per prompt (at most --max-n, 128 by default)")
    seed: int | None = Field(None, description="same seed, same tokens (64 bits, all of them used)",
                             json_schema_extra={"minimum": -2**63, "maximum": 2**63 - 1})
    stop: str | list[str] | None = Field(None, description="a string or a list of strings that end generation "
                                                "(left out of the text)")
    stream: bool | None = Field(None, description="answer as server-sent events")
    stream_options: StreamOptions | None = Field(None, description="with stream only: include_usage (a last event "
                                                 "with the usage) and vLLM's continuous_usage_stats (every event "
                                                 "with its choice's usage so far)")
    temperature: float | None = _bounded("temperature", "0 decodes greedily")
    top_p: float | None = _bounded("top_p", "nucleus sampling, in (0, 1]")
    user: str | None = Field(None, description="accepted: an end-user id, as OpenAI takes it; changes nothing")
    # vLLM's sampling extensions.
    top_k: int | None = _bounded("top_k", "keep the k likeliest tokens (0 or -1: all)")
    min_p: float | None = _bounded("min_p", "drop tokens less likely than min_p × the likeliest")
    repetition_penalty: float | None = _bounded("repetition_penalty", "divides the logits of seen tokens (1: none)")
    ignore_eos: bool | None = Field(None, description="generate past the end-of-sequence token")
    min_tokens: int | None = _bounded("min_tokens", "EOS and stop_token_ids are ignored until this many tokens")
    stop_token_ids: list[int] | None = Field(None, description="token ids that end generation besides EOS (with the "
                                             "EOS ids, at most --max-stop-ids, 64 by default)")
    skip_special_tokens: bool | None = Field(None, description="leave special tokens out of the text (default)")
    include_stop_str_in_output: bool | None = Field(None, description="keep the matched stop string in the text")
    priority: int | None = Field(None, description="scheduling priority, lower served earlier (default 0); other "
                                 "values need --scheduling-policy priority, as in vLLM")
    # Declared, refused until built.
    # Structured output (one constraint per request, whichever field gives it).
    response_format: ResponseFormat | None = Field(None, description="OpenAI's: text, any JSON object, or JSON "
                                                   "matching a schema")
    structured_outputs: StructuredOutputsBody | None = Field(None, description="vLLM's: one of json, json_object, "
                                                             "regex, choice, grammar")
    guided_json: str | dict[str, Any] | None = Field(None, description="vLLM's older spelling: a JSON Schema")
    guided_regex: str | None = Field(None, description="vLLM's older spelling: a regular expression")
    guided_choice: list[str] | None = Field(None, description="vLLM's older spelling: one of these strings")
    guided_grammar: str | None = Field(None, description="vLLM's older spelling: a Lark or GBNF grammar")
    guided_decoding_backend: str | None = _refused("the grammar engine is llguidance", "auto", "guidance",
                                                   "llguidance")
    guided_whitespace_pattern: str | None = _refused(NOT_YET)
    allowed_token_ids: list[int] | None = _refused(NOT_YET)
    bad_words: list[str] | None = _refused(NOT_YET, [])
    prompt_logprobs: int | None = _refused(NOT_YET + " over HTTP (echo with logprobs scores a completions prompt)")
    truncate_prompt_tokens: int | None = _refused(NOT_YET)
    request_id: str | None = _refused("the server names its own requests")
    return_tokens_as_token_ids: bool | None = _refused(NOT_YET, False)
    return_token_ids: bool | None = _refused(NOT_YET, False)
    use_beam_search: bool | None = _refused("beam search is " + NOT_YET, False)
    length_penalty: float | None = _refused("beam search is " + NOT_YET, 1.0)
    logits_processors: list[Any] | None = _refused("custom logits processors are " + NOT_YET, [])
    spaces_between_special_tokens: bool | None = _refused(NOT_YET, True)
    cache_salt: str | None = _refused(NOT_YET)
    kv_transfer_params: dict[str, Any] | None = _refused("disaggregated serving is " + NOT_YET)
    vllm_xargs: dict[str, Any] | None = _refused(NOT_YET)
    mm_processor_kwargs: dict[str, Any] | None = _refused("the served model reads text only", {})
    prompt_embeds: Any = _refused("prompt embeddings are " + NOT_YET)


class CompletionRequestBody(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text, token ids, or a list of either (one request each; at most --max-prompts-per-request, "
        "2048 by default)")
    echo: bool | None = Field(None, description="each choice starts with its prompt, and with logprobs its prompt's "
                              "log-probabilities (with max_tokens 0: the prompt alone, scored); streamed, in its "
                              "first event")
    logprobs: int | None = _bounded("logprobs", "top log-probabilities per token (0 to --max-logprobs, 20 by "
                                    "default)")
    add_special_tokens: bool | None = Field(None, description="add BOS to text prompts (default true)")
    best_of: int | None = _refused("best-of sampling is " + NOT_YET, 1)
    suffix: str | None = _refused("insertion (fill in the middle) is " + NOT_YET, "")


class ChatCompletionRequestBody(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)] = Field(
        description="the conversation, rendered by the model's chat template")
    logprobs: bool | None = Field(None, description="return the sampled tokens' log-probabilities")
    top_logprobs: int | None = _bounded("logprobs", "with logprobs: this many alternatives per token (0 to "
                                        "--max-logprobs, 20 by default)")
    max_completion_tokens: int | None = _bounded("max_tokens", "most tokens to generate (wins over max_tokens)")
    add_generation_prompt: bool | None = Field(None, description="end the rendered prompt with the assistant's "
                                               "header (default true)")
    tools: list[ToolDefinition] | None = Field(None, description="functions the model may call, rendered by the "
                                               "chat template (a function's parameters: a JSON Schema of an object)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools: the model decides), required (at least one call) "
        "or a named function (one call of it); required and named calls are enforced by a grammar")
    parallel_tool_calls: bool | None = Field(None, description="more than one call per answer (default true)")
    functions: list[dict[str, Any]] | None = _refused("the deprecated functions are not implemented: use tools", [])
    function_call: str | dict[str, Any] | None = _refused("the deprecated function_call is not implemented: use "
                                                          "tool_choice", "none", "auto")
    audio: dict[str, Any] | None = _refused("the served model reads and writes text only")
    modalities: list[str] | None = _refused("the served model writes text only", ["text"])
    prediction: dict[str, Any] | None = _refused("predicted outputs are " + NOT_YET)
    reasoning_effort: str | None = Field(None, description="passed to the chat template as `reasoning_effort`, as "
                                         "vLLM does (the templates of reasoning models read it; others leave it "
                                         "unused)")
    verbosity: str | None = _refused(NOT_YET)
    service_tier: str | None = _refused("there is one service tier", "auto", "default")
    store: bool | None = _refused("completions are not stored", False)
    metadata: dict[str, str] | None = _refused("completions are not stored", {})
    web_search_options: dict[str, Any] | None = _refused("web search is not available")
    prompt_cache_key: str | None = Field(None, description="accepted: prefix caching is automatic, so the hint is "
                                         "not needed")
    safety_identifier: str | None = Field(None, description="accepted: an end-user id, as OpenAI takes it; "
                                          "changes nothing")
    echo: bool | None = _refused("echoing the last message is " + NOT_YET, False)
    continue_final_message: bool | None = _refused(NOT_YET, False)
    add_special_tokens: bool | None = _refused("the chat template writes the special tokens", False)
    chat_template: str | None = _refused("the server renders with the model's own template")
    chat_template_kwargs: dict[str, Any] | None = _refused(NOT_YET, {})
    documents: list[dict[str, Any]] | None = _refused(NOT_YET, [])


class TokenizeCompletionBody(_Body):
    """POST /tokenize with a prompt."""

    model: str | None = None
    prompt: str = Field(description="text to tokenize")
    add_special_tokens: bool | None = Field(None, description="add BOS (default true)")


class TokenizeChatBody(_Body):
    """POST /tokenize with a conversation."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool | None = Field(None, description="end with the assistant's header (default true)")
    tools: list[ToolDefinition] | None = Field(None, description="functions the chat template renders")


class DetokenizeBody(_Body):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int] = Field(description="token ids to spell out (special tokens included)")


class LoadLoraAdapterBody(_Body):
    """POST /v1/load_lora_adapter, as vLLM's."""

    lora_name: str = Field(min_length=1, description="the name requests give as their model")
    lora_path: str = Field(min_length=1, description="the PEFT adapter folder, on the server's disk")


class UnloadLoraAdapterBody(_Body):
    """POST /v1/unload_lora_adapter, as vLLM's."""

    lora_name: str = Field(min_length=1, description="the adapter's name")


# --- POST /v1/responses: OpenAI's Responses API, stateless -----------------------------------------------------------

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


class ResponsesTextPart(_Body):
    """A text part of an input item: input_text (what a user, the system or a developer says; a function's output)
    or output_text (an earlier answer, sent back as history)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = _refused("annotations come from hosted tools, which are not "
                                                        "available", [])
    logprobs: list[dict[str, Any]] | None = _accepted("an earlier answer's log-probabilities (not rendered)")
    prompt_cache_breakpoint: dict[str, Any] | None = _accepted("prefix caching is automatic")

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _served_kind(value, ("input_text", "output_text"), "content parts", "the served model reads text "
                            "only (input_text and output_text parts)")


class ResponsesMessageItem(_Body):
    """An input message: what a user, the system or a developer says, or an earlier answer (assistant)."""

    type: Literal["message"] | None = Field(None, description="message (may be left out)")
    role: Literal["user", "system", "developer", "assistant"] = Field(description="who speaks")
    content: str | list[ResponsesTextPart] = Field(description="text, or text parts joined by newlines")
    id: str | None = _accepted("an earlier answer's id")
    status: Literal["in_progress", "completed", "incomplete"] | None = _accepted("an earlier answer's status")
    phase: Literal["commentary", "final_answer"] | None = _accepted("an earlier answer's label (not rendered)")


class ResponsesFunctionCallItem(_Body):
    """A call an earlier answer made: the chat template renders it as the assistant's tool call."""

    type: Literal["function_call"]
    call_id: str = Field(description="the call's id, which the function_call_output answering it names")
    name: str = Field(description="the function called")
    arguments: str = Field(description="its arguments: a JSON object, as text")
    id: str | None = _accepted("an earlier answer's item id")
    status: Literal["in_progress", "completed", "incomplete"] | None = _accepted("an earlier answer's status")
    namespace: str | None = _refused("namespaced tools (tool search) are not available")
    caller: dict[str, Any] | None = _refused("programmatic tool calling is not available", {"type": "direct"})


class ResponsesFunctionCallOutputItem(_Body):
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


class ResponsesFunctionTool(_Body):
    """A function the model may call, in the Responses API's flat shape."""

    type: Literal["function"] = Field(description="function (hosted tools are refused)")
    name: str = Field(pattern=FUNCTION_NAME, description="letters, digits, _ and -, at most 64")
    description: str | None = Field(None, description="what the function does, for the model to read")
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of its arguments (absent: any object)")
    strict: bool | None = Field(None, description="accepted: forced calls (tool_choice required or a named "
                                "function) always match the schema")
    defer_loading: bool | None = _refused("tool search is not available", False)
    output_schema: dict[str, Any] | None = _refused("function output schemas are " + NOT_YET)
    allowed_callers: list[str] | None = _refused("programmatic tool calling is not available", ["direct"])

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        return _served_kind(value, ("function",), "tools", "only function tools are served (web_search, "
                            "file_search, code_interpreter, mcp and the other hosted tools are OpenAI's)")


class ResponsesNamedFunction(_Body):
    type: Literal["function"]
    name: str


def _served_choice(choice: Any) -> Any:
    return _served_kind(choice, ("function",), "tool choices", "the choices are none, auto, required and "
                        "{type: function, name} (allowed_tools and hosted tools' choices are not available)")


class ResponsesTextFormat(_Body):
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


class ResponsesText(_Body):
    format: ResponsesTextFormat | None = Field(None, description="text (the default), json_object or json_schema")
    verbosity: str | None = _refused(NOT_YET, "medium")


class ResponsesReasoning(_Body):
    effort: str | None = Field(None, description="passed to the chat template as `reasoning_effort`, as chat's "
                               "reasoning_effort is")
    summary: str | None = _refused("reasoning summaries are " + NOT_YET)
    generate_summary: str | None = _refused("reasoning summaries are " + NOT_YET)
    context: str | None = _refused("reasoning items are " + NOT_YET, "auto")
    mode: str | None = _refused("there is one reasoning mode", "standard")


class ResponsesStreamOptions(_Body):
    include_obfuscation: bool | None = _refused("obfuscation padding in events is " + NOT_YET, False)


class ResponsesRequestBody(_Body):
    """POST /v1/responses, stateless: nothing is stored, so every request brings its whole conversation."""

    model: str | None = Field(None, description="the served model's name (--served-model-name); may be left out")
    input: str | list[ResponsesInputItem] = Field(
        description="text (one user message), or items: messages (user, system, developer or assistant; text or "
        "text parts), function_call and function_call_output items, rendered by the model's chat template")
    instructions: str | None = Field(None, description="a system message put before the input")
    max_output_tokens: int | None = Field(None, description="most tokens to generate (default: the rest of the "
                                          "context)", json_schema_extra={"minimum": 1})
    temperature: float | None = _bounded("temperature", "0 decodes greedily")
    top_p: float | None = _bounded("top_p", "nucleus sampling, in (0, 1]")
    include: list[Literal["message.output_text.logprobs"]] | None = Field(
        None, description=f"{OUTPUT_LOGPROBS}: the output text's log-probabilities (the one value served: the "
        "others ask for hosted tools' or reasoning output)")
    top_logprobs: int | None = _bounded("logprobs", f"with include [\"{OUTPUT_LOGPROBS}\"]: this many alternatives "
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
    previous_response_id: str | None = _refused(STATELESS)
    conversation: str | dict[str, Any] | None = _refused(STATELESS)
    background: bool | None = _refused("a background response is fetched later from the store, and this server "
                                       "stores no responses", False)
    background_options: dict[str, Any] | None = _refused("background responses are not available")
    prompt: dict[str, Any] | None = _refused("stored prompt templates are OpenAI's")
    prompt_cache_options: dict[str, Any] | None = _refused("prefix caching is automatic and takes no options", {})
    prompt_cache_retention: str | None = _refused("cached prefixes stay in memory until evicted", "in_memory")
    truncation: str | None = _refused("an input too long for the context is refused, never truncated", "disabled")
    service_tier: str | None = _refused("there is one service tier", "auto", "default")
    context_management: list[dict[str, Any]] | None = _refused("context compaction is " + NOT_YET, [])
    moderation: dict[str, Any] | None = _refused("moderation is not available")
    image: dict[str, Any] | None = _refused("the served model reads text only")
    access_programs: dict[str, Any] | None = _refused("access programs are OpenAI's")
    # vLLM's extensions of its Responses requests.
    top_k: int | None = _bounded("top_k", "keep the k likeliest tokens (0 or -1: all)")
    repetition_penalty: float | None = _bounded("repetition_penalty", "divides the logits of seen tokens (1: none)")
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
    request_id: str | None = _refused("the server names its own requests")
    cache_salt: str | None = _refused(NOT_YET)
    kv_transfer_params: dict[str, Any] | None = _refused("disaggregated serving is " + NOT_YET)
    vllm_xargs: dict[str, Any] | None = _refused(NOT_YET)
    mm_processor_kwargs: dict[str, Any] | None = _refused("the served model reads text only", {})
    media_io_kwargs: dict[str, Any] | None = _refused("the served model reads text only", {})
    enable_response_messages: bool | None = _refused(NOT_YET, False)
    previous_input_messages: list[Any] | None = _refused(STATELESS, [])


# The fields that give an output constraint (structured output), on either endpoint
CONSTRAINT_FIELDS = frozenset({"response_format", "structured_outputs", "guided_json", "guided_regex",
                               "guided_choice", "guided_grammar"})


def parse_body(model: type[_Body], raw: bytes | str | dict, allow_unknown_fields: bool = False,
               max_items: int | None = None) -> _Body:
    """`raw` (JSON text, or an already parsed object) as `model`, with every refused field checked; anything wrong
    is an InvalidRequestError naming the field (`param`).

    `max_items` (the model's max_model_len): no list or object of a usable request holds more items (a prompt, a
    message, a tool each cost a token at least), so larger ones are refused before validating them, which would hold
    the interpreter for as long as they are large. Output constraints are exempt: their lists (a schema's enum,
    choices) are the grammar compiler's data, never prompt text, and its time limit bounds them.
    """
    value = raw if isinstance(raw, dict) else parse_json_object(raw)
    if allow_unknown_fields:
        value = {key: item for key, item in value.items() if key in model.model_fields}
    if max_items is not None:
        for name, item in value.items():
            if name not in CONSTRAINT_FIELDS:
                _check_items(name, item, max_items)
    try:
        body = model.model_validate(value)
    except ValidationError as error:
        raise _invalid(model, error) from None
    check_refused(body)
    return body


def check_refused(body: BaseModel) -> None:
    """The first refused field holding a value that asks for something, as a 400 naming it (nested models too)."""
    for name, field in type(body).model_fields.items():
        value = getattr(body, name)
        refusal = refusal_of(field)
        if refusal is not None and value is not None and value not in refusal.neutral:
            raise InvalidRequestError(f"{name} is not supported: {refusal.reason}", param=name)
        for nested in value if isinstance(value, list) else [value]:
            if isinstance(nested, BaseModel):
                try:
                    check_refused(nested)
                except InvalidRequestError as error:
                    raise InvalidRequestError(str(error), param=name) from None


def _check_items(name: str, value: Any, max_items: int) -> None:
    """Refuses field `name` if a list or object inside it is longer than `max_items`; lists of plain values are
    measured, not walked."""
    if isinstance(value, (list, dict)):
        if len(value) > max_items:
            raise InvalidRequestError(f"{name} holds {len(value)} items, more than a request to this model can use "
                                      f"({max_items}, its max_model_len)", param=name)
        for item in value.values() if isinstance(value, dict) else value:
            if isinstance(item, (list, dict)):
                _check_items(name, item, max_items)


def parse_json_object(raw: bytes | str) -> dict[str, Any]:
    """A request body as a JSON object; not UTF-8, not JSON (too deeply nested included) or not an object is an
    InvalidRequestError."""
    value = _json_value(raw)
    if not isinstance(value, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    return value


def _json_value(raw: bytes | str) -> Any:
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as error:
        raise InvalidRequestError(f"the request body is not UTF-8: byte {raw[error.start]:#04x} at position "
                                  f"{error.start}") from None
    try:
        return pydantic_core.from_json(text, allow_inf_nan=True)
    except ValueError as error:
        raise InvalidRequestError(f"the request body is not valid JSON: {error}") from None


def _invalid(model: type[_Body], error: ValidationError) -> InvalidRequestError:
    """pydantic's errors as one message and the top-level field at fault."""
    errors = error.errors(include_url=False)
    first = errors[0]
    param = str(first["loc"][0]) if first["loc"] else None
    if first["type"] == "extra_forbidden":
        # --allow-unknown-fields drops unknown top-level fields only; inside a known field, the path names the key.
        if len(first["loc"]) > 1:
            path = ".".join(str(part) for part in first["loc"])
            return InvalidRequestError(f"unknown field {path!r}: this server does not implement it", param=param)
        return InvalidRequestError(f"unknown field {param!r}: this server does not implement it (an operator can "
                                   "start it with --allow-unknown-fields to drop unknown fields instead)", param=param)
    if first["type"] == "missing" and len(first["loc"]) == 1:
        return InvalidRequestError(f"{param} is required", param=param)
    # Of a union's failed branches, the one that got furthest says the most; if none got inside, the field's
    # description says what it takes.
    branches = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
    deepest = max(branches, key=lambda e: len(e["loc"]))
    field = model.model_fields.get(param) if param is not None else None
    if len(branches) > 1 and len(deepest["loc"]) <= 2 and field is not None and field.description:
        return InvalidRequestError(f"{param} must be {field.description}", param=param)
    where = ".".join(str(part) for part in deepest["loc"] if isinstance(part, int) or part.isidentifier())
    return InvalidRequestError(f"{where}: {deepest['msg']}" if where else deepest["msg"], param=param)
