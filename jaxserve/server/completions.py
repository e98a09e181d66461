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
from jaxserve.entrypoints.constraint_checks import ConstraintCheck, await_constraints, output_constraint_checks
from jaxserve.entrypoints.openai_body import (OPENAI_DEFAULT_MAX_TOKENS, completion_body, completion_chunk,
                                              completion_logprobs, sampling_params_from_body, usage, usage_chunk)
from jaxserve.entrypoints.prompts import TokenizedPrompt, completion_prompts, is_prompt_list
from jaxserve.entrypoints.protocol import CompletionRequestBody, parse_body
from jaxserve.entrypoints.protocol_responses import CompletionChunk, CompletionResponse
from jaxserve.outputs import CompletionDelta, CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.admission import admit
from jaxserve.server.api_errors import ApiError, streamed_response
from jaxserve.server.app import ServerContext, request_bytes, resolve_model, server_context
from jaxserve.server.openapi import RouteSchema, declares
from jaxserve.server.quotas import TokenTally
from jaxserve.server.request_fields import check_limits, flag, include_usage
from jaxserve.server.served_models import ServedModel
from jaxserve.server.streams import final_outputs, merged_events

blueprint = Blueprint("completions", __name__)


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """A checked /v1/completions body."""

    prompts: list[TokenizedPrompt]  # one request in the engine each
    params: SamplingParams  # shared by all prompts
    echo: bool  # each choice starts with its prompt
    prompt_only: bool  # max_tokens 0 with echo: one token is generated (the engine needs one) and dropped
    stream: bool  # answer as server-sent events
    include_usage: bool  # streaming: a last event with the usage
    model: ServedModel  # the base model or the LoRA adapter it runs with
    constraints: tuple[ConstraintCheck, ...]  # its output constraint, to compile before it runs


@blueprint.post("/v1/completions")
@declares(RouteSchema(requests=(CompletionRequestBody,), response=CompletionResponse, stream_event=CompletionChunk))
async def create_completion() -> Response:
    context = server_context()
    request = await context.off_loop(parse_completion_request, await request_bytes(), context)
    await await_constraints(request.constraints, context.engine.engine.grammars)
    tally = admit(context, len(request.prompts) * request.params.n,
                  sum(len(prompt.token_ids) for prompt in request.prompts), request.params.max_tokens)
    model = request.model.name
    if request.stream:
        chunk_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echoed = _echo_chunks(context, request, chunk_id, created, model) if request.echo else []
        return await streamed_response(_completion_chunks(context, request, tally, chunk_id, created, model), echoed)
    outputs = await final_outputs(context, request.prompts, request.params, tally, request.model.lora)
    if request.prompt_only:
        outputs = [_without_generated(output) for output in outputs]
    return jsonify(completion_body(outputs, model, echo_tokenizer=context.tokenizer if request.echo else None))


def parse_completion_request(raw: bytes, context: ServerContext) -> CompletionRequest:
    """The body checked against its schema, its prompts tokenized and checked, its sampling settings built (on a
    worker thread: tokenizing can take milliseconds)."""
    body = parse_body(CompletionRequestBody, raw, context.config.allow_unknown_fields, context.max_model_len)
    model = resolve_model(body.model, context)
    fields = body.model_dump(exclude_none=True)
    prompts = _prompts(body.prompt, context, add_special_tokens=flag(fields, "add_special_tokens", default=True))
    echo, stream = flag(fields, "echo"), flag(fields, "stream")
    prompt_only = echo and body.max_tokens == 0
    params = sampling_params_from_body({**fields, "max_tokens": 1} if prompt_only else fields, chat=False,
                                       default_max_tokens=OPENAI_DEFAULT_MAX_TOKENS)
    if echo and params.logprobs is not None:
        if stream:
            raise ApiError(400, "echo with logprobs is not supported when streaming", param="echo")
        params = dataclasses.replace(params, prompt_logprobs=params.logprobs)
    check_limits(params, len(prompts), context.config)
    if not prompt_only:
        for prompt in prompts:
            check_room_to_generate(len(prompt.token_ids), params.max_tokens, context.max_model_len, "max_tokens")
    return CompletionRequest(prompts, params, echo, prompt_only, stream, include_usage(fields), model,
                             tuple(output_constraint_checks(params, fields)))


def _prompts(prompt: Any, context: ServerContext, add_special_tokens: bool) -> list[TokenizedPrompt]:
    for text in (prompt if is_prompt_list(prompt) else [prompt]):
        if isinstance(text, str):
            context.check_text_fits([text], "prompt")
    tokenized = completion_prompts(prompt, context.tokenizer, add_special_tokens)
    for p in tokenized:
        check_prompt_tokens(p.token_ids, vocab_size=context.vocab_size, max_model_len=context.max_model_len)
    return tokenized


def _echo_chunks(context: ServerContext, request: CompletionRequest, chunk_id: str, created: int,
                 model: str) -> list[dict[str, Any]]:
    """Each choice's first event with echo: its prompt's text."""
    chunks = []
    for i, prompt in enumerate(request.prompts):
        text = prompt.text if prompt.text is not None else context.tokenizer.decode(list(prompt.token_ids))
        chunks += [completion_chunk(chunk_id, created, model, i * request.params.n + j, text, None, None, None)
                   for j in range(request.params.n)]
    return chunks


async def _completion_chunks(context: ServerContext, request: CompletionRequest, tally: TokenTally, chunk_id: str,
                             created: int, model: str) -> AsyncIterator[dict[str, Any]]:
    n = request.params.n
    finished: list[RequestOutput] = []
    # Each choice's logprobs text_offset goes on from its previous event's, as answered whole (echo with logprobs is
    # refused when streaming, so every choice starts at 0).
    offsets: collections.Counter[int] = collections.Counter()
    async with contextlib.aclosing(merged_events(context, request.prompts, request.params, tally,
                                                 request.model.lora)) as events:
        async for i, event in events:
            if isinstance(event, RequestOutput):
                finished.append(event)
            elif request.prompt_only:
                if event.finish_reason is not None:
                    yield completion_chunk(chunk_id, created, model, i * n + event.index, "", None, "length", None)
            elif event.text or event.finish_reason or event.logprobs:
                index = i * n + event.index
                chunk = _delta_chunk(chunk_id, created, model, index, event, offsets[index])
                offsets[index] += _logprobs_text_length(chunk)
                yield chunk
    if request.include_usage:
        if request.prompt_only:
            finished = [_without_generated(output) for output in finished]
        yield usage_chunk(chunk_id, created, model, "text_completion", usage(finished))


def _delta_chunk(chunk_id: str, created: int, model: str, index: int, delta: CompletionDelta,
                 first_offset: int) -> dict[str, Any]:
    return completion_chunk(chunk_id, created, model, index, delta.text,
                            completion_logprobs(delta.token_ids, delta.logprobs, first_offset), delta.finish_reason,
                            delta.stop_reason)


def _logprobs_text_length(chunk: dict[str, Any]) -> int:
    """Characters the chunk's logprobs tokens spell (what text_offset counts); 0 without logprobs."""
    logprobs = chunk["choices"][0]["logprobs"]
    return sum(map(len, logprobs["tokens"])) if logprobs is not None else 0


def _without_generated(output: RequestOutput) -> RequestOutput:
    """max_tokens 0 with echo: the prompt alone, as if generation had stopped at once for length."""
    empty = [CompletionOutput(index=c.index, text="", token_ids=(), cumulative_logprob=None,
                              logprobs=[] if c.logprobs is not None else None, finish_reason="length",
                              stop_reason=None) for c in output.outputs]
    return dataclasses.replace(output, outputs=empty)
