"""OpenAI request bodies (completions and chat) → prompts and SamplingParams; results → OpenAI response bodies.

Shared by the batch runner now and the HTTP server next. Field names follow OpenAI, plus the vLLM extensions
clients send (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids, priority).
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from jaxserve.errors import InvalidRequestError
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.openai.answer_reader import read_answer
from jaxserve.openai.reasoning import ANSWER_RULE, Reasoning, after_reasoning, constraint_rules
from jaxserve.openai.tool_calls import ToolCalling, tool_calls_body
from jaxserve.structured_outputs import StructuredOutputsParams
from jaxserve.tokenizer import Tokenizer

# Body fields that map one to one onto SamplingParams (priority too: it rides with them into the engine).
_PASSED_THROUGH = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens",
                   "include_stop_str_in_output", "priority")
OPENAI_DEFAULT_MAX_TOKENS = 16  # what OpenAI's completions endpoint generates when max_tokens is absent


def sampling_params_from_body(body: dict[str, Any], chat: bool, default_max_tokens: int,
                              tool_calling: ToolCalling | None = None,
                              reasoning: Reasoning | None = None) -> SamplingParams:
    """SamplingParams of a completions (chat=False) or chat completions body (with its `tool_calling`, which may
    force calls, and its `reasoning`, after which any output constraint applies); InvalidRequestError names the
    field."""
    kwargs = {name: body[name] for name in _PASSED_THROUGH if body.get(name) is not None}
    if tool_calling is not None and tool_calling.format.keeps_special_tokens and "skip_special_tokens" not in kwargs:
        kwargs["skip_special_tokens"] = False  # the calls' trigger is a special token, which the reader must see
    spelled = body_spellings(body, chat)
    max_tokens = body.get(spelled.get("max_tokens", "max_tokens"))
    kwargs["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    if max_tokens == 0 and (chat or not body.get("echo")):  # as vLLM: 0 asks for the echoed prompt's scores alone
        raise InvalidRequestError(f"{spelled.get('max_tokens', 'max_tokens')} must be at least 1 (0 only with echo, "
                                  "to score the prompt)", param=spelled.get("max_tokens", "max_tokens"))
    stop = body.get("stop")
    if stop is not None:
        if not (isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
            raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
        kwargs["stop"] = stop
    if body.get("logit_bias") is not None:
        if not isinstance(body["logit_bias"], dict):
            raise InvalidRequestError("logit_bias must map token ids to biases", param="logit_bias")
        kwargs["logit_bias"] = body["logit_bias"]
    logprobs = _requested_logprobs(body, chat)
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    constraint, field = structured_outputs_from_body(body, tool_calling, reasoning)
    if constraint is not None:
        kwargs["structured_outputs"] = constraint
        spelled["structured_outputs"] = field
    try:
        with named_as_sent(spelled):
            return SamplingParams(**kwargs)
    except TypeError as e:
        raise InvalidRequestError(f"a sampling field has the wrong type: {e}") from None


def body_spellings(body: dict[str, Any], chat: bool) -> dict[str, str]:
    """SamplingParams fields that the body spells otherwise (chat's top_logprobs, max_completion_tokens), so that
    errors name the field the client sent."""
    spelled = {"logprobs": "top_logprobs"} if chat else {}
    if chat and body.get("max_completion_tokens") is not None:  # OpenAI's newer name wins over the older one
        spelled["max_tokens"] = "max_completion_tokens"
    return spelled


@contextlib.contextmanager
def named_as_sent(spelled: dict[str, str]) -> Iterator[None]:
    """An InvalidRequestError about a SamplingParams field re-raised naming the body's field (`body_spellings`)."""
    try:
        yield
    except InvalidRequestError as e:
        field = spelled.get(e.param)
        if field is None:
            raise
        raise InvalidRequestError(str(e).replace(e.param, field, 1), param=field) from None


def structured_outputs_from_body(body: dict[str, Any], tool_calling: ToolCalling | None = None,
                                 reasoning: Reasoning | None = None,
                                 ) -> tuple[StructuredOutputsParams | None, str | None]:
    """The body's output constraint and the field that gave it (tool_choice when it forces calls); more than one
    constraining field is a 400. With `reasoning`, the constraint applies after the reasoning."""
    given = {}
    for field, keywords_of in CONSTRAINT_KEYWORDS.items():
        if body.get(field) is not None:
            keywords = keywords_of(body[field])
            if keywords is not None:
                given[field] = keywords
    forced_calls = tool_calling.constraint() if tool_calling is not None else None
    if forced_calls is not None:
        given["tool_choice"] = {"grammar": forced_calls.grammar}
    if len(given) > 1:
        second = list(given)[1]
        raise InvalidRequestError(f"{second} cannot be combined with {list(given)[0]}: a request takes one output "
                                  "constraint", param=second)
    if not given:
        return None, None
    (field, keywords), = given.items()
    try:
        constraint = StructuredOutputsParams(**keywords)
    except InvalidRequestError as error:
        raise InvalidRequestError(str(error), param=field) from None
    if reasoning is None:
        return constraint, field
    answer = (tool_calling.forced_calls_rules(ANSWER_RULE) if field == "tool_choice"
              else constraint_rules(constraint, field))
    return after_reasoning(reasoning, answer), field


def _response_format_constraint(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's response_format as StructuredOutputsParams keywords (None for plain text)."""
    kind = response_format.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        return None
    spec = response_format.get("json_schema")
    if spec is None:
        raise InvalidRequestError("response_format of type json_schema needs json_schema", param="response_format")
    schema = spec.get("schema")
    return {"json": schema} if schema is not None else {"json_object": True}


# The fields that may carry a request's output constraint, and how each becomes StructuredOutputsParams' keywords.
CONSTRAINT_KEYWORDS = {
    "response_format": _response_format_constraint,
    "structured_outputs": lambda value: {name: value[name] for name in ("json", "json_object", "regex", "choice",
                                                                        "grammar") if value.get(name) is not None},
    "guided_json": lambda value: {"json": value},
    "guided_regex": lambda value: {"regex": value},
    "guided_choice": lambda value: {"choice": value},
    "guided_grammar": lambda value: {"grammar": value},
}


def chat_template_variables(body: dict[str, Any], tool_calling: ToolCalling | None) -> dict[str, Any]:
    """What a chat body hands its chat template besides the messages: the tools offered, reasoning_effort, and
    chat_template_kwargs (enable_thinking, ...), which win over both, as vLLM passes them."""
    variables: dict[str, Any] = {"tools": tool_calling.tools if tool_calling is not None else None}
    if body.get("reasoning_effort") is not None:
        variables["reasoning_effort"] = body["reasoning_effort"]
    extra = body.get("chat_template_kwargs") or {}
    taken = sorted(set(extra) & set(_BODY_TEMPLATE_FIELDS))
    if taken:
        raise InvalidRequestError(f"chat_template_kwargs cannot set {taken[0]}: the body's own field "
                                  f"{_BODY_TEMPLATE_FIELDS[taken[0]]} sets it", param="chat_template_kwargs")
    return {**variables, **extra}


# Template variables the body sets with fields of its own, and those fields.
_BODY_TEMPLATE_FIELDS = {"messages": "messages", "add_generation_prompt": "add_generation_prompt", "tools": "tools"}


def default_max_tokens(chat: bool, prompt_len: int, max_model_len: int) -> int:
    """For bodies without max_tokens: chat fills the rest of the context (as vLLM does), completions get OpenAI's 16."""
    return max_model_len - prompt_len if chat else OPENAI_DEFAULT_MAX_TOKENS


def _requested_logprobs(body: dict[str, Any], chat: bool) -> Any:
    """Completions ask with `logprobs: k`; chat with `logprobs: true` and `top_logprobs: k`."""
    if not chat:
        return body.get("logprobs")
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise InvalidRequestError(f"logprobs must be a boolean, got {wanted!r}", param="logprobs")
    if top is not None and not wanted:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    return (0 if top is None else top) if wanted else None


def completion_body(outputs: Sequence[RequestOutput], model: str, echo_tokenizer: Tokenizer | None = None,
                    ) -> dict[str, Any]:
    """The /v1/completions response: continuation j of prompt i is choice i * n + j.

    With `echo_tokenizer`, each choice starts with its prompt (text, and log-probabilities when asked for); the
    tokenizer spells the prompt's tokens.
    """
    return {
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [_completion_choice(output, c, i * len(output.outputs) + c.index, echo_tokenizer)
                    for i, output in enumerate(outputs) for c in output.outputs],
        "usage": usage(outputs),
    }


def completion_chunk(chunk_id: str, created: int, model: str, index: int, text: str,
                     logprobs: dict[str, Any] | None, finish_reason: str | None,
                     stop_reason: int | str | None) -> dict[str, Any]:
    """One streamed /v1/completions event: what one choice gained."""
    return {"id": chunk_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                         "stop_reason": stop_reason}]}


def chat_completion_chunk(chunk_id: str, created: int, model: str, index: int, delta: dict[str, Any],
                          logprobs: dict[str, Any] | None, finish_reason: str | None,
                          stop_reason: int | str | None) -> dict[str, Any]:
    """One streamed /v1/chat/completions event: what one choice gained (`delta`: role and/or content)."""
    return {"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                         "stop_reason": stop_reason}]}


def usage_chunk(chunk_id: str, created: int, model: str, kind: str, usage_body: dict[str, int]) -> dict[str, Any]:
    """The last streamed event with `stream_options.include_usage`: no choices, the request's usage."""
    return {"id": chunk_id, "object": kind, "created": created, "model": model, "choices": [], "usage": usage_body}


def _completion_choice(output: RequestOutput, completion: CompletionOutput, index: int,
                       echo_tokenizer: Tokenizer | None) -> dict[str, Any]:
    text, logprobs = completion.text, completion_logprobs(completion.token_ids, completion.logprobs)
    if echo_tokenizer is not None:
        prompt_text = output.prompt if output.prompt is not None else echo_tokenizer.decode(
            list(output.prompt_token_ids))
        text = prompt_text + text
        if logprobs is not None:
            logprobs = joined_logprobs(_prompt_logprobs(output, echo_tokenizer), logprobs)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason}


def chat_completion_body(output: RequestOutput, model: str, num_top: int, tokenizer: Tokenizer,
                         tool_calling: ToolCalling | None = None, reasoning: Reasoning | None = None,
                         ) -> dict[str, Any]:
    """The /v1/chat/completions response for one conversation's result; `num_top`: the top_logprobs asked for;
    with `tool_calling` (tool_choice other than none), answers that call tools come back as tool_calls; with
    `reasoning`, the reasoning as reasoning_content."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": c.index, **_chat_message(c, tool_calling, reasoning),
                     "logprobs": chat_logprobs(c.token_ids, c.logprobs, num_top, tokenizer),
                     "stop_reason": c.stop_reason}
                    for c in output.outputs],
        "usage": usage([output]),
    }


def _chat_message(completion: CompletionOutput, tool_calling: ToolCalling | None,
                  reasoning: Reasoning | None) -> dict[str, Any]:
    """A choice's message and finish reason."""
    reads_calls = tool_calling is not None and tool_calling.choice != "none"
    if not reads_calls and reasoning is None:
        return {"message": {"role": "assistant", "content": completion.text},
                "finish_reason": completion.finish_reason}
    said, calls = read_answer(completion.text, reasoning, tool_calling if reads_calls else None)
    # As vLLM: with a reasoning parser, no content is null; with calls alone, content is null.
    empty = None if calls or reasoning is not None else ""
    message: dict[str, Any] = {"role": "assistant", "content": said.content or empty}
    if reasoning is not None:
        message["reasoning_content"] = said.reasoning or None
    if calls:
        message["tool_calls"] = tool_calls_body(calls)
    return {"message": message, "finish_reason": tool_finish_reason(completion.finish_reason, bool(calls))}


def tool_finish_reason(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended by itself after calling tools."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def completion_logprobs(token_ids: Sequence[int], logprobs: list[dict[int, Logprob]] | None,
                        first_offset: int = 0) -> dict[str, Any] | None:
    """The legacy completions shape: parallel lists of tokens, their logprobs, the top alternatives, text offsets."""
    if logprobs is None:
        return None
    sampled = [candidates[token] for token, candidates in zip(token_ids, logprobs)]
    return {
        "tokens": [entry.decoded_token for entry in sampled],
        "token_logprobs": [entry.logprob for entry in sampled],
        "top_logprobs": [_top_by_text(candidates) for candidates in logprobs],
        "text_offset": _offsets([entry.decoded_token for entry in sampled], first_offset),
    }


def _prompt_logprobs(output: RequestOutput, tokenizer: Tokenizer) -> dict[str, Any]:
    return prompt_logprobs_body(output.prompt_token_ids, output.prompt_logprobs, tokenizer)


def prompt_logprobs_body(token_ids: Sequence[int], scored: list[dict[int, Logprob] | None] | None,
                         tokenizer: Tokenizer) -> dict[str, Any]:
    """The echoed prompt's entries in the legacy completions shape: nothing predicts its first token, so that one has
    no log-probability."""
    scored = scored or [None] * len(token_ids)
    tokens = [candidates[token].decoded_token if candidates else tokenizer.decode([token], skip_special_tokens=False)
              for token, candidates in zip(token_ids, scored)]
    return {
        "tokens": tokens,
        "token_logprobs": [candidates[token].logprob if candidates else None
                           for token, candidates in zip(token_ids, scored)],
        "top_logprobs": [_top_by_text(candidates) if candidates else None for candidates in scored],
        "text_offset": _offsets(tokens, 0),
    }


def _top_by_text(candidates: dict[int, Logprob]) -> dict[str, float]:
    """The legacy shape keys alternatives by text. Different tokens can spell the same text (byte pieces all decode
    to U+FFFD): the likelier one's log-probability stays, so a client's greedy check (is the token's log-probability
    the largest listed?) stays right."""
    top: dict[str, float] = {}
    for candidate in candidates.values():
        top[candidate.decoded_token] = max(candidate.logprob, top.get(candidate.decoded_token, -math.inf))
    return top


def joined_logprobs(prompt: dict[str, Any], completion: dict[str, Any]) -> dict[str, Any]:
    """An echoed prompt's legacy logprobs followed by its continuation's, text offsets from the prompt's start."""
    joined = {key: prompt[key] + completion[key] for key in ("tokens", "token_logprobs", "top_logprobs")}
    joined["text_offset"] = _offsets(joined["tokens"], 0)
    return joined


def _offsets(pieces: list[str], first: int) -> list[int]:
    offsets, position = [], first
    for piece in pieces:
        offsets.append(position)
        position += len(piece)
    return offsets


def chat_logprobs(token_ids: Sequence[int], logprobs: list[dict[int, Logprob]] | None, num_top: int,
                  tokenizer: Tokenizer) -> dict[str, Any] | None:
    """The chat shape: one entry per token with exactly `num_top` alternatives, most likely first (the sampled token
    is listed among them only when it is one of them), and each token's own bytes."""
    if logprobs is None:
        return None
    content = []
    for token, candidates in zip(token_ids, logprobs):
        top = sorted((item for item in candidates.items() if item[1].rank <= num_top), key=lambda item: item[1].rank)
        content.append({**_chat_entry(token, candidates[token], tokenizer),
                        "top_logprobs": [_chat_entry(tid, candidate, tokenizer) for tid, candidate in top]})
    return {"content": content}


def _chat_entry(token_id: int, candidate: Logprob, tokenizer: Tokenizer) -> dict[str, Any]:
    return {"token": candidate.decoded_token, "logprob": candidate.logprob,
            "bytes": list(tokenizer.token_bytes(token_id))}


def usage(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    """Token counts of a response, summed over its prompts and their continuations."""
    completion_tokens = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

