"""POST /v1/chat/completions: a conversation through the model's chat template, n choices, logprobs, streaming."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from quart import Blueprint, Response, jsonify

from jaxserve.engine.prompt_checks import check_room_to_generate
from jaxserve.entrypoints.openai_body import (chat_completion_body, chat_completion_chunk, chat_logprobs,
                                              default_max_tokens, sampling_params_from_body, usage, usage_chunk)
from jaxserve.entrypoints.prompts import TokenizedPrompt
from jaxserve.entrypoints.protocol import ChatCompletionRequestBody, parse_body
from jaxserve.entrypoints.protocol_responses import ChatCompletionChunk, ChatCompletionResponse
from jaxserve.outputs import CompletionDelta, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.admission import admit
from jaxserve.server.api_errors import streamed_response
from jaxserve.server.app import ServerContext, check_model, request_bytes, server_context
from jaxserve.server.openapi import RouteSchema, declares
from jaxserve.server.request_fields import check_constraint, check_limits, conversation_prompt, flag, include_usage
from jaxserve.server.streams import final_outputs, merged_events
from jaxserve.tokenizer import Tokenizer

blueprint = Blueprint("chat", __name__)


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A checked /v1/chat/completions body."""

    prompt: TokenizedPrompt  # the rendered conversation, ending with the assistant's header
    params: SamplingParams  # how its n choices are sampled
    stream: bool  # answer as server-sent events
    include_usage: bool  # streaming: a last event with the usage


@blueprint.post("/v1/chat/completions")
@declares(RouteSchema(requests=(ChatCompletionRequestBody,), response=ChatCompletionResponse,
                      stream_event=ChatCompletionChunk))
async def create_chat_completion() -> Response:
    context = server_context()
    request = await context.off_loop(parse_chat_request, await request_bytes(), context)
    admit(context, request.params.n)
    model = context.config.served_model_name
    if request.stream:
        chunk_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        # OpenAI's first event of every choice names the speaker, with no text yet.
        roles = [chat_completion_chunk(chunk_id, created, model, index, {"role": "assistant", "content": ""}, None,
                                       None, None) for index in range(request.params.n)]
        return await streamed_response(_chat_chunks(context, request, chunk_id, created, model), roles)
    [output] = await final_outputs(context, [request.prompt], request.params)
    return jsonify(chat_completion_body(output, model, request.params.logprobs or 0, context.tokenizer))


def parse_chat_request(raw: bytes, context: ServerContext) -> ChatRequest:
    """The body checked against its schema, the conversation rendered, tokenized and checked, its sampling settings
    built (on a worker thread)."""
    body = parse_body(ChatCompletionRequestBody, raw, context.config.allow_unknown_fields,
                      context.max_model_len)
    check_model(body.model, context)
    fields = body.model_dump(exclude_none=True)
    prompt = conversation_prompt(fields["messages"], context, flag(fields, "add_generation_prompt", default=True))
    params = sampling_params_from_body(fields, chat=True, default_max_tokens=default_max_tokens(
        True, len(prompt.token_ids), context.max_model_len))
    check_limits(params, 1, context.config)
    check_constraint(params, fields, context)
    asked = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if getattr(body, asked) is not None:
        check_room_to_generate(len(prompt.token_ids), params.max_tokens, context.max_model_len, asked)
    return ChatRequest(prompt, params, flag(fields, "stream"), include_usage(fields))


async def _chat_chunks(context: ServerContext, request: ChatRequest, chunk_id: str, created: int,
                       model: str) -> AsyncIterator[dict[str, Any]]:
    finished: list[RequestOutput] = []
    async with contextlib.aclosing(merged_events(context, [request.prompt], request.params)) as events:
        async for _, event in events:
            if isinstance(event, RequestOutput):
                finished.append(event)
            elif event.text or event.finish_reason or event.logprobs:
                yield _delta_chunk(chunk_id, created, model, event, request.params.logprobs or 0, context.tokenizer)
    if request.include_usage:
        yield usage_chunk(chunk_id, created, model, "chat.completion.chunk", usage(finished))


def _delta_chunk(chunk_id: str, created: int, model: str, delta: CompletionDelta, num_top: int,
                 tokenizer: Tokenizer) -> dict[str, Any]:
    # A last event with nothing new but the finish reason carries an empty delta, as OpenAI's does.
    content = {"content": delta.text} if delta.text else {}
    return chat_completion_chunk(chunk_id, created, model, delta.index, content,
                                 chat_logprobs(delta.token_ids, delta.logprobs, num_top, tokenizer),
                                 delta.finish_reason, delta.stop_reason)
