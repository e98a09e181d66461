"""POST /v1/completions: text or token-id prompts (one or many), echo, logprobs, streaming."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from quart import Blueprint, Response, jsonify

from jaxserve.engine.prompt_checks import check_prompt_tokens, check_room_to_generate
from jaxserve.openai.constraint_checks import ConstraintCheck, await_constraints, output_constraint_checks
from jaxserve.openai.bodies import (OPENAI_DEFAULT_MAX_TOKENS, completion_body, completion_chunk, completion_logprobs,
                                    joined_logprobs, prompt_logprobs_body, sampling_params_from_body, usage,
                                    usage_chunk)
from jaxserve.openai.prompts import TokenizedPrompt, completion_prompts, is_prompt_list
from jaxserve.openai.requests import CompletionRequestBody
from jaxserve.openai.schema import parse_body
from jaxserve.openai.request_limits import check_request_limits
from jaxserve.openai.answers import CompletionChunk, CompletionResponse
from jaxserve.outputs import CompletionDelta, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.admission import admit
from jaxserve.server.api_errors import streamed_response
from jaxserve.server.context import ServerContext, request_bytes, resolve_model, server_context
from jaxserve.server.openapi import RouteSchema, declares
from jaxserve.server.quotas import TokenTally
from jaxserve.server.request_fields import flag
from jaxserve.server.served_models import ServedModel
from jaxserve.server.stream_usage import ChoiceUsage, StreamUsage, stream_usage
from jaxserve.server.streams import final_outputs, merged_events

blueprint = Blueprint("completions", __name__)


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """A checked /v1/completions body."""

    prompts: list[TokenizedPrompt]  # one request in the engine each
    params: SamplingParams  # shared by all prompts; max_tokens 0 scores the prompts only
    echo: bool  # each choice starts with its prompt
    stream: bool  # answer as server-sent events
    usage: StreamUsage  # streaming: the usage events carry
    model: ServedModel  # the base model or the LoRA adapter it runs with
    constraints: tuple[ConstraintCheck, ...]  # its output constraint, to compile before it runs


@blueprint.post("/v1/completions")
@declares(RouteSchema(requests=(CompletionRequestBody,), response=CompletionResponse, stream_event=CompletionChunk))
async def create_completion() -> Response:
    context = server_context()
    request = await context.off_loop(parse_completion_request, await request_bytes(), context)
    await await_constraints(request.constraints, context.engine.grammars)
    tally = admit(context.admission, len(request.prompts) * request.params.n,
                  sum(len(prompt.token_ids) for prompt in request.prompts), request.params.max_tokens)
    model = request.model.name
    if request.stream:
        chunk_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        return await streamed_response(_completion_chunks(context, request, tally, chunk_id, created, model))
    outputs = await final_outputs(context, request.prompts, request.params, tally, request.model.lora)
    return jsonify(completion_body(outputs, model, echo_tokenizer=context.tokenizer if request.echo else None))


def parse_completion_request(raw: bytes, context: ServerContext) -> CompletionRequest:
    """The body checked against its schema, its prompts tokenized and checked, its sampling settings built (on a
    worker thread: tokenizing can take milliseconds)."""
    body = parse_body(CompletionRequestBody, raw, context.config.allow_unknown_fields, context.max_model_len)
    model = resolve_model(body.model, context)
    fields = body.model_dump(exclude_none=True)
    params = sampling_params_from_body(fields, chat=False, default_max_tokens=OPENAI_DEFAULT_MAX_TOKENS)
    prompts = _prompts(body.prompt, context, add_special_tokens=flag(fields, "add_special_tokens", default=True),
                       generates=params.max_tokens > 0)
    echo = flag(fields, "echo")
    if echo and params.logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
    check_request_limits(context.engine, prompts, params, spelled={})
    for prompt in prompts:
        check_room_to_generate(len(prompt.token_ids), params.max_tokens, context.max_model_len, "max_tokens")
    return CompletionRequest(prompts, params, echo, flag(fields, "stream"), stream_usage(fields), model,
                             tuple(output_constraint_checks(params, fields)))


def _prompts(prompt: Any, context: ServerContext, add_special_tokens: bool, generates: bool) -> list[TokenizedPrompt]:
    for text in (prompt if is_prompt_list(prompt) else [prompt]):
        if isinstance(text, str):
            context.check_text_fits([text], "prompt")
    tokenized = completion_prompts(prompt, context.tokenizer, add_special_tokens)
    for p in tokenized:
        check_prompt_tokens(p.token_ids, vocab_size=context.vocab_size, max_model_len=context.max_model_len,
                            generates=generates)
    return tokenized


async def _completion_chunks(context: ServerContext, request: CompletionRequest, tally: TokenTally, chunk_id: str,
                             created: int, model: str) -> AsyncIterator[dict[str, Any]]:
    n = request.params.n
    counts = ChoiceUsage(request.usage, [len(prompt.token_ids) for prompt in request.prompts], n)
    # With echo, each choice's first event starts with its prompt (and the prompt's logprobs), as in vLLM.
    unechoed = set(range(len(request.prompts) * n)) if request.echo else set()
    finished: list[RequestOutput] = []
    # Each choice's logprobs text_offset goes on from its previous event's, as answered whole.
    offsets: collections.Counter[int] = collections.Counter()
    async with contextlib.aclosing(merged_events(context, request.prompts, request.params, tally,
                                                 request.model.lora)) as events:
        async for i, event in events:
            if isinstance(event, RequestOutput):
                finished.append(event)
                continue
            index = i * n + event.index
            counts.count(index, len(event.token_ids))
            if index in unechoed or event.text or event.finish_reason or event.logprobs:
                echo = _echo(context, request.prompts[i], event) if index in unechoed else None
                unechoed.discard(index)
                chunk = _delta_chunk(chunk_id, created, model, index, event, offsets[index], echo)
                offsets[index] += _logprobs_text_length(chunk)
                yield counts.stamped(chunk, index)
    if request.usage.final:
        yield usage_chunk(chunk_id, created, model, "text_completion", usage(finished))


@dataclasses.dataclass(frozen=True)
class _Echo:
    """A choice's echoed prompt, which its first event starts with."""

    text: str  # the prompt's text
    logprobs: dict[str, Any] | None  # its legacy logprobs, when the request asked for logprobs


def _echo(context: ServerContext, prompt: TokenizedPrompt, first: CompletionDelta) -> _Echo:
    text = prompt.text if prompt.text is not None else context.tokenizer.decode(list(prompt.token_ids))
    logprobs = (prompt_logprobs_body(prompt.token_ids, first.prompt_logprobs, context.tokenizer)
                if first.logprobs is not None else None)
    return _Echo(text, logprobs)


def _delta_chunk(chunk_id: str, created: int, model: str, index: int, delta: CompletionDelta,
                 first_offset: int, echo: _Echo | None) -> dict[str, Any]:
    text, logprobs = delta.text, completion_logprobs(delta.token_ids, delta.logprobs, first_offset)
    if echo is not None:
        text = echo.text + text
        logprobs = joined_logprobs(echo.logprobs, logprobs) if echo.logprobs is not None else logprobs
    return completion_chunk(chunk_id, created, model, index, text, logprobs, delta.finish_reason, delta.stop_reason)


def _logprobs_text_length(chunk: dict[str, Any]) -> int:
    """Characters the chunk's logprobs tokens spell (what text_offset counts); 0 without logprobs."""
    logprobs = chunk["choices"][0]["logprobs"]
    return sum(map(len, logprobs["tokens"])) if logprobs is not None else 0
