"""The completions, chat, tokenizer and adapter request bodies, declared field by field (schema.py says how)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from jaxserve.openai.schema import FUNCTION_NAME, NOT_YET, Body, bounded, refused


class StreamOptions(Body):
    include_usage: bool | None = Field(None, description="a last event with the request's usage")
    continuous_usage_stats: bool | None = Field(None, description="vLLM's: with include_usage, every event also "
                                                "carries its choice's usage so far")
    include_obfuscation: bool | None = refused("obfuscation padding in events is " + NOT_YET, False)


class JsonSchemaFormat(Body):
    """response_format's json_schema."""

    model_config = ConfigDict(serialize_by_alias=True)
    name: str = Field(description="the schema's name (not used for decoding)")
    description: str | None = Field(None, description="what the output is for (not used for decoding)")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON Schema the output matches "
                                           "(absent: any JSON object)")
    strict: bool | None = Field(None, description="accepted: the output always matches the schema exactly")


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema")


class StructuredOutputsBody(Body):
    """vLLM's structured_outputs: exactly one constraint."""

    json_: str | dict[str, Any] | None = Field(None, alias="json", description="a JSON Schema")
    json_object: bool | None = Field(None, description="any JSON object")
    regex: str | None = Field(None, description="a regular expression the whole output matches")
    choice: list[str] | None = Field(None, description="the output is one of these strings")
    grammar: str | None = Field(None, description="a Lark grammar, or GBNF/EBNF as llama.cpp writes it")
    disable_fallback: bool | None = Field(None, description="accepted: there is one grammar engine, no fallback")
    disable_any_whitespace: bool | None = Field(None, description="accepted: JSON is generated without optional "
                                                "whitespace anyway")
    disable_additional_properties: bool | None = refused(NOT_YET, False)
    whitespace_pattern: str | None = refused(NOT_YET)
    structural_tag: str | None = refused(NOT_YET)

    model_config = ConfigDict(serialize_by_alias=True)


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: str = Field(description="the function called")
    arguments: str = Field(description="its arguments: a JSON object, as text")


class ToolCall(Body):
    """A call an assistant message made, as the server answered it."""

    id: str = Field(description="the call's id, which the tool message answering it names")
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(Body):
    """One message of a conversation; the model's chat template renders them."""

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="who speaks (tool: a tool's result, answering an assistant's call)")
    content: str | list[TextPart] | None = Field(None, description="text, or text parts joined by newlines (the "
                                                 "served model reads text only)")
    name: str | None = Field(None, description="the speaker's name, passed to the chat template")
    tool_calls: list[ToolCall] | None = Field(None, description="assistant messages: the calls it made, rendered "
                                              "by the chat template")
    tool_call_id: str | None = Field(None, description="tool messages (where it is required): the call answered")
    function_call: dict[str, Any] | None = refused("the deprecated function_call is not implemented: use "
                                                    "tool_calls")
    refusal: str | None = refused("assistant refusals are an OpenAI-side feature")
    reasoning_content: str | None = Field(None, description="assistant messages: the reasoning an earlier answer "
                                          "gave (reasoning_content), passed to the chat template (Qwen3's keeps "
                                          "it only after the last user message)")
    # Fields of OpenAI's answers that clients echo back in the history: nothing of theirs is served here.
    annotations: list[dict[str, Any]] | None = refused("annotations come from web search, which is not available", [])
    audio: dict[str, Any] | None = refused("the served model reads and writes text only")


class FunctionDefinition(Body):
    name: str = Field(pattern=FUNCTION_NAME, description="letters, digits, _ and -, at most 64")
    description: str | None = Field(None, description="what the function does, for the model to read")
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of its arguments (absent: any "
                                              "object)")
    strict: bool | None = Field(None, description="accepted: forced calls (tool_choice required or a named "
                                "function) always match the schema")


class ToolDefinition(Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class _Sampling(Body):
    """Fields both completions and chat take: how tokens are drawn and when generation stops."""

    model: str | None = Field(None, description="the served model's name (--served-model-name); may be left out")
    frequency_penalty: float | None = bounded("frequency_penalty", "subtracted per occurrence of a generated token "
                                            "(-2 to 2)")
    presence_penalty: float | None = bounded("presence_penalty", "subtracted once per generated token (-2 to 2)")
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) → bias added to its logit "
                                                "(at most --max-logit-bias entries, 300 by default)")
    max_tokens: int | None = bounded("max_tokens", "most tokens to generate (0 with echo: none, the prompt is "
                                      "scored)")
    n: int | None = bounded("n", "continuations per prompt (at most --max-n, 128 by default)")
    seed: int | None = Field(None, description="same seed, same tokens (64 bits, all of them used)",
                             json_schema_extra={"minimum": -2**63, "maximum": 2**63 - 1})
    stop: str | list[str] | None = Field(None, description="a string or a list of strings that end generation "
                                                "(left out of the text)")
    stream: bool | None = Field(None, description="answer as server-sent events")
    stream_options: StreamOptions | None = Field(None, description="with stream only: include_usage (a last event "
                                                 "with the usage) and vLLM's continuous_usage_stats (every event "
                                                 "with its choice's usage so far)")
    temperature: float | None = bounded("temperature", "0 decodes greedily")
    top_p: float | None = bounded("top_p", "nucleus sampling, in (0, 1]")
    user: str | None = Field(None, description="accepted: an end-user id, as OpenAI takes it; changes nothing")
    # vLLM's sampling extensions.
    top_k: int | None = bounded("top_k", "keep the k likeliest tokens (0 or -1: all)")
    min_p: float | None = bounded("min_p", "drop tokens less likely than min_p × the likeliest")
    repetition_penalty: float | None = bounded("repetition_penalty", "divides the logits of seen tokens (1: none)")
    ignore_eos: bool | None = Field(None, description="generate past the end-of-sequence token")
    min_tokens: int | None = bounded("min_tokens", "EOS and stop_token_ids are ignored until this many tokens")
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
    guided_decoding_backend: str | None = refused("the grammar engine is llguidance", "auto", "guidance",
                                                   "llguidance")
    guided_whitespace_pattern: str | None = refused(NOT_YET)
    allowed_token_ids: list[int] | None = refused(NOT_YET)
    bad_words: list[str] | None = refused(NOT_YET, [])
    prompt_logprobs: int | None = refused(NOT_YET + " over HTTP (echo with logprobs scores a completions prompt)")
    truncate_prompt_tokens: int | None = refused(NOT_YET)
    request_id: str | None = refused("the server names its own requests")
    return_tokens_as_token_ids: bool | None = refused(NOT_YET, False)
    return_token_ids: bool | None = refused(NOT_YET, False)
    use_beam_search: bool | None = refused("beam search is " + NOT_YET, False)
    length_penalty: float | None = refused("beam search is " + NOT_YET, 1.0)
    logits_processors: list[Any] | None = refused("custom logits processors are " + NOT_YET, [])
    spaces_between_special_tokens: bool | None = refused(NOT_YET, True)
    cache_salt: str | None = refused(NOT_YET)
    kv_transfer_params: dict[str, Any] | None = refused("disaggregated serving is " + NOT_YET)
    vllm_xargs: dict[str, Any] | None = refused(NOT_YET)
    mm_processor_kwargs: dict[str, Any] | None = refused("the served model reads text only", {})
    prompt_embeds: Any = refused("prompt embeddings are " + NOT_YET)


class CompletionRequestBody(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text, token ids, or a list of either (one request each; at most --max-prompts-per-request, "
        "2048 by default)")
    echo: bool | None = Field(None, description="each choice starts with its prompt, and with logprobs its prompt's "
                              "log-probabilities (with max_tokens 0: the prompt alone, scored); streamed, in its "
                              "first event")
    logprobs: int | None = bounded("logprobs", "top log-probabilities per token (0 to --max-logprobs, 20 by "
                                    "default)")
    add_special_tokens: bool | None = Field(None, description="add BOS to text prompts (default true)")
    best_of: int | None = refused("best-of sampling is " + NOT_YET, 1)
    suffix: str | None = refused("insertion (fill in the middle) is " + NOT_YET, "")


class ChatCompletionRequestBody(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)] = Field(
        description="the conversation, rendered by the model's chat template")
    logprobs: bool | None = Field(None, description="return the sampled tokens' log-probabilities")
    top_logprobs: int | None = bounded("logprobs", "with logprobs: this many alternatives per token (0 to "
                                        "--max-logprobs, 20 by default)")
    max_completion_tokens: int | None = bounded("max_tokens", "most tokens to generate (wins over max_tokens)")
    add_generation_prompt: bool | None = Field(None, description="end the rendered prompt with the assistant's "
                                               "header (default true)")
    tools: list[ToolDefinition] | None = Field(None, description="functions the model may call, rendered by the "
                                               "chat template (a function's parameters: a JSON Schema of an object)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (the default with tools: the model decides), required (at least one call) "
        "or a named function (one call of it); required and named calls are enforced by a grammar")
    parallel_tool_calls: bool | None = Field(None, description="more than one call per answer (default true)")
    functions: list[dict[str, Any]] | None = refused("the deprecated functions are not implemented: use tools", [])
    function_call: str | dict[str, Any] | None = refused("the deprecated function_call is not implemented: use "
                                                          "tool_choice", "none", "auto")
    audio: dict[str, Any] | None = refused("the served model reads and writes text only")
    modalities: list[str] | None = refused("the served model writes text only", ["text"])
    prediction: dict[str, Any] | None = refused("predicted outputs are " + NOT_YET)
    reasoning_effort: str | None = Field(None, description="passed to the chat template as `reasoning_effort`, as "
                                         "vLLM does (the templates of reasoning models read it; others leave it "
                                         "unused)")
    verbosity: str | None = refused(NOT_YET)
    service_tier: str | None = refused("there is one service tier", "auto", "default")
    store: bool | None = refused("completions are not stored", False)
    metadata: dict[str, str] | None = refused("completions are not stored", {})
    web_search_options: dict[str, Any] | None = refused("web search is not available")
    prompt_cache_key: str | None = Field(None, description="accepted: prefix caching is automatic, so the hint is "
                                         "not needed")
    safety_identifier: str | None = Field(None, description="accepted: an end-user id, as OpenAI takes it; "
                                          "changes nothing")
    echo: bool | None = refused("echoing the last message is " + NOT_YET, False)
    continue_final_message: bool | None = refused(NOT_YET, False)
    add_special_tokens: bool | None = refused("the chat template writes the special tokens", False)
    chat_template: str | None = refused("the server renders with the model's own template")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="more variables for the chat template, "
                                                        "as vLLM passes them (e.g. {\"enable_thinking\": false} "
                                                        "for Qwen3); they win over reasoning_effort")
    documents: list[dict[str, Any]] | None = refused(NOT_YET, [])


class TokenizeCompletionBody(Body):
    """POST /tokenize with a prompt."""

    model: str | None = None
    prompt: str = Field(description="text to tokenize")
    add_special_tokens: bool | None = Field(None, description="add BOS (default true)")


class TokenizeChatBody(Body):
    """POST /tokenize with a conversation."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool | None = Field(None, description="end with the assistant's header (default true)")
    tools: list[ToolDefinition] | None = Field(None, description="functions the chat template renders")


class DetokenizeBody(Body):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[int] = Field(description="token ids to spell out (special tokens included)")


class LoadLoraAdapterBody(Body):
    """POST /v1/load_lora_adapter, as vLLM's."""

    lora_name: str = Field(min_length=1, description="the name requests give as their model")
    lora_path: str = Field(min_length=1, description="the PEFT adapter folder, on the server's disk")


class UnloadLoraAdapterBody(Body):
    """POST /v1/unload_lora_adapter, as vLLM's."""

    lora_name: str = Field(min_length=1, description="the adapter's name")
