"""POST /v1/responses: OpenAI's Responses API, stateless (nothing is stored; every request brings its whole
conversation). A body becomes the chat completions request it asks for (openai/responses_request.py), which
runs as chat's does; the answer's steps become Responses items and events (openai/responses_output.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from quart import Blueprint, Response, jsonify

from jaxserve.openai.constraint_checks import await_constraints
from jaxserve.openai.responses_api_requests import ResponsesRequestBody
from jaxserve.openai.schema import parse_body
from jaxserve.openai.responses_api_answers import ResponsesResponse, ResponseStreamEvent
from jaxserve.openai.responses_output import LogprobsAsked, ResponseAssembly, ResponseSettings, response_usage
from jaxserve.openai.responses_request import chat_body, respelled, response_settings, responses_param
from jaxserve.openai.tool_calls import ToolCallParser
from jaxserve.errors import InvalidRequestError
from jaxserve.outputs import RequestOutput
from jaxserve.server.admission import admit
from jaxserve.server.api_errors import ApiError, as_api_error, streamed_response
from jaxserve.server.context import ServerContext, request_bytes, server_context
from jaxserve.server.chat import ChatRequest, parse_chat_request
from jaxserve.server.openapi import RouteSchema, declares
from jaxserve.server.quotas import TokenTally
from jaxserve.server.streams import merged_events

blueprint = Blueprint("responses", __name__)


@dataclasses.dataclass(frozen=True)
class ResponsesRequest:
    """A checked /v1/responses body."""

    chat: ChatRequest  # the chat completions request it asks for: prompt, sampling, tools, model, constraints
    settings: ResponseSettings  # what its Response repeats of it


@blueprint.post("/v1/responses")
@declares(RouteSchema(requests=(ResponsesRequestBody,), response=ResponsesResponse,
                      stream_event=ResponseStreamEvent))
async def create_response() -> Response:
    """A Response to the input: text, function calls, streamed as OpenAI's events or whole."""
    context = server_context()
    request = await context.off_loop(parse_responses_request, await request_bytes(), context)
    chat = request.chat
    with spelled_as_responses():
        await await_constraints(chat.constraints, context.engine.grammars)
        tally = admit(context.admission, chat.params.n, len(chat.prompt.token_ids), chat.params.max_tokens)
        logprobs = None if chat.params.logprobs is None else LogprobsAsked(chat.params.logprobs, context.tokenizer)
        assembly = ResponseAssembly(request.settings, ToolCallParser(chat.tool_calling) if chat.reads_calls else None,
                                    logprobs)
        if chat.stream:
            opening = assembly.opening()  # response.created and response.in_progress: the first sequence numbers
            return await streamed_response(_streamed(_answer(context, chat, tally, assembly), assembly), opening)
        async with contextlib.aclosing(_answer(context, chat, tally, assembly)) as events:
            async for _ in events:
                pass
    return jsonify(assembly.response())


def parse_responses_request(raw: bytes, context: ServerContext) -> ResponsesRequest:
    """The body checked against its schema and converted to the chat completions body it asks for, which chat's own
    parsing checks, renders and tokenizes (on a worker thread)."""
    body = parse_body(ResponsesRequestBody, raw, context.config.allow_unknown_fields, context.max_model_len)
    converted = json.dumps(chat_body(body)).encode()
    with spelled_as_responses():
        chat = parse_chat_request(converted, context)
    return ResponsesRequest(chat, response_settings(body, chat.model.name))


@contextlib.contextmanager
def spelled_as_responses() -> Iterator[None]:
    """A refusal of the converted chat request, re-raised naming the Responses fields that gave what it names."""
    try:
        yield
    except ApiError as error:
        error.param, error.message = responses_param(error.param), respelled(error.message)
        raise
    except InvalidRequestError as error:
        raise type(error)(respelled(str(error)), param=responses_param(error.param)) from None


async def _answer(context: ServerContext, chat: ChatRequest, tally: TokenTally,
                  assembly: ResponseAssembly) -> AsyncIterator[dict[str, Any]]:
    """The events of the answer's steps, then of its end; a failure raises."""
    finished: RequestOutput | None = None
    async with contextlib.aclosing(merged_events(context, [chat.prompt], chat.params, tally,
                                                 chat.model.lora)) as events:
        async for _, event in events:
            if isinstance(event, RequestOutput):
                finished = event
                continue
            for payload in assembly.step(event):
                yield payload
    for payload in assembly.finish(response_usage(finished)):
        yield payload


async def _streamed(answer: AsyncIterator[dict[str, Any]],
                    assembly: ResponseAssembly) -> AsyncIterator[dict[str, Any]]:
    """`answer`'s events. A failure before the first one is the request's error answer (streamed_response waits for
    it); after it, the status is sent, and the stream ends as OpenAI's do: an error event, then response.failed."""
    started = False
    async with contextlib.aclosing(answer):
        try:
            async for payload in answer:
                started = True
                yield payload
        except Exception as failure:
            if not started:
                raise
            error = as_api_error(failure)
            code = "server_error" if error.status >= 500 else "invalid_prompt"
            for payload in assembly.fail(respelled(error.message), code, responses_param(error.param)):
                yield payload
