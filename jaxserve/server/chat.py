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
from jaxserve.openai.constraint_checks import (ConstraintCheck, await_constraints, output_constraint_checks,
                                               tool_schema_checks)
from jaxserve.openai.bodies import (body_spellings, chat_completion_body, chat_completion_chunk, chat_logprobs,
                                    chat_template_variables, default_max_tokens, sampling_params_from_body,
                                    tool_finish_reason, usage, usage_chunk)
from jaxserve.openai.prompts import TokenizedPrompt
from jaxserve.openai.requests import ChatCompletionRequestBody
from jaxserve.openai.schema import parse_body
from jaxserve.openai.request_limits import check_request_limits
from jaxserve.openai.answer_reader import AnswerReader
from jaxserve.openai.reasoning import REASONING_FORMATS, Reasoning, reasoning_for_prompt
from jaxserve.openai.tool_call_formats import TOOL_CALL_FORMATS
from jaxserve.openai.tool_calls import ToolCalling, delta_tool_calls, tool_calling_from_body
from jaxserve.openai.answers import ChatCompletionChunk, ChatCompletionResponse
from jaxserve.outputs import CompletionDelta, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.admission import admit
from jaxserve.server.api_errors import streamed_response
from jaxserve.server.context import ServerContext, request_bytes, resolve_model, server_context
from jaxserve.server.openapi import RouteSchema, declares
from jaxserve.server.quotas import TokenTally
from jaxserve.server.request_fields import conversation_prompt, flag
from jaxserve.server.served_models import ServedModel
from jaxserve.server.stream_usage import ChoiceUsage, StreamUsage, stream_usage
from jaxserve.server.streams import final_outputs, merged_events
from jaxserve.tokenizer import Tokenizer

blueprint = Blueprint("chat", __name__)


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A checked /v1/chat/completions body."""

    prompt: TokenizedPrompt  # the rendered conversation, ending with the assistant's header
    params: SamplingParams  # how its n choices are sampled
    stream: bool  # answer as server-sent events
    usage: StreamUsage  # streaming: the usage events carry
    tool_calling: ToolCalling | None  # the tools offered and how they may be called; None without tools
    reasoning: Reasoning | None  # how answers reason (--reasoning-parser); None: answers are content alone
    model: ServedModel  # the base model or the LoRA adapter it runs with
    constraints: tuple[ConstraintCheck, ...]  # output constraints and tool schemas to compile before it runs

    @property
    def reads_calls(self) -> bool:
        """Whether answers are read for tool calls (tools given, tool_choice not none)."""
        return self.tool_calling is not None and self.tool_calling.choice != "none"

    @property
    def forces_calls(self) -> bool:
        """Whether every answer is calls, never text (tools given, tool_choice required or a named function)."""
        return self.tool_calling is not None and self.tool_calling.forces_calls


@blueprint.post("/v1/chat/completions")
@declares(RouteSchema(requests=(ChatCompletionRequestBody,), response=ChatCompletionResponse,
                      stream_event=ChatCompletionChunk))
async def create_chat_completion() -> Response:
    context = server_context()
    request = await context.off_loop(parse_chat_request, await request_bytes(), context)
    await await_constraints(request.constraints, context.engine.grammars)
    tally = admit(context.admission, request.params.n, len(request.prompt.token_ids), request.params.max_tokens)
    model = request.model.name
    if request.stream:
        chunk_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        # OpenAI's first event of every choice names the speaker, with no text yet: content null where the answer is
        # certainly calls (as answered whole, so clients that accumulate the stream agree), "" where it may be text.
        role = {"role": "assistant", "content": None if request.forces_calls else ""}
        counts = ChoiceUsage(request.usage, [len(request.prompt.token_ids)], request.params.n)
        roles = [counts.stamped(chat_completion_chunk(chunk_id, created, model, index, role, None, None, None), index)
                 for index in range(request.params.n)]
        return await streamed_response(_chat_chunks(context, request, tally, chunk_id, created, model, counts), roles)
    [output] = await final_outputs(context, [request.prompt], request.params, tally, request.model.lora)
    return jsonify(chat_completion_body(output, model, request.params.logprobs or 0, context.tokenizer,
                                        request.tool_calling if request.reads_calls else None, request.reasoning))


def parse_chat_request(raw: bytes, context: ServerContext) -> ChatRequest:
    """The body checked against its schema, the conversation rendered, tokenized and checked, its sampling settings
    built and its constraints gathered (on a worker thread; they compile later, awaited on the event loop)."""
    body = parse_body(ChatCompletionRequestBody, raw, context.config.allow_unknown_fields,
                      context.max_model_len)
    model = resolve_model(body.model, context)
    fields = body.model_dump(exclude_none=True)
    tool_calling = tool_calling_from_body(fields, TOOL_CALL_FORMATS[context.config.tool_call_parser])
    tool_checks = tool_schema_checks(tool_calling)
    prompt = conversation_prompt(fields["messages"], context, flag(fields, "add_generation_prompt", default=True),
                                 **chat_template_variables(fields, tool_calling))
    reasoning = (reasoning_for_prompt(REASONING_FORMATS[context.config.reasoning_parser], prompt.text)
                 if context.config.reasoning_parser is not None else None)
    params = sampling_params_from_body(fields, chat=True, default_max_tokens=default_max_tokens(
        True, len(prompt.token_ids), context.max_model_len), tool_calling=tool_calling, reasoning=reasoning)
    check_request_limits(context.engine, [prompt], params, body_spellings(fields, chat=True))
    asked = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    if getattr(body, asked) is not None:
        check_room_to_generate(len(prompt.token_ids), params.max_tokens, context.max_model_len, asked)
    return ChatRequest(prompt, params, flag(fields, "stream"), stream_usage(fields), tool_calling, reasoning, model,
                       (*tool_checks, *output_constraint_checks(params, fields, tool_calling)))


async def _chat_chunks(context: ServerContext, request: ChatRequest, tally: TokenTally, chunk_id: str, created: int,
                       model: str, counts: ChoiceUsage) -> AsyncIterator[dict[str, Any]]:
    finished: list[RequestOutput] = []
    calling = request.tool_calling if request.reads_calls else None
    readers = ([AnswerReader(request.reasoning, calling) for _ in range(request.params.n)]
               if calling is not None or request.reasoning is not None else None)
    async with contextlib.aclosing(merged_events(context, [request.prompt], request.params, tally,
                                                 request.model.lora)) as events:
        async for _, event in events:
            if isinstance(event, RequestOutput):
                finished.append(event)
                continue
            counts.count(event.index, len(event.token_ids))
            said, finish_reason = _said(event, readers[event.index] if readers else None)
            if said or finish_reason or event.logprobs:
                yield counts.stamped(_delta_chunk(chunk_id, created, model, event, said, finish_reason,
                                                  request.params.logprobs or 0, context.tokenizer), event.index)
    if request.usage.final:
        yield usage_chunk(chunk_id, created, model, "chat.completion.chunk", usage(finished))


def _said(delta: CompletionDelta, reader: AnswerReader | None) -> tuple[dict[str, Any], str | None]:
    """What a step's text adds to the answer (content; with a reasoning parser, reasoning; with tools, calls begun or
    grown), and the finish reason when it is the last step ("tool_calls" for an answer that called tools)."""
    if reader is None:
        return {"content": delta.text} if delta.text else {}, delta.finish_reason
    fed = reader.feed(delta.text)
    last = reader.finish() if delta.finish_reason else None
    reasoning = fed.reasoning + (last.reasoning if last else "")
    content = fed.content + (last.content if last else "")
    calls = delta_tool_calls(fed.call_events + (last.call_events if last else []))
    said = {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": content} if content else {}),
            **({"tool_calls": calls} if calls else {})}
    return said, tool_finish_reason(delta.finish_reason, bool(reader.calls))


def _delta_chunk(chunk_id: str, created: int, model: str, delta: CompletionDelta, said: dict[str, Any],
                 finish_reason: str | None, num_top: int, tokenizer: Tokenizer) -> dict[str, Any]:
    # A last event with nothing new but the finish reason carries an empty delta, as OpenAI's does.
    return chat_completion_chunk(chunk_id, created, model, delta.index, said,
                                 chat_logprobs(delta.token_ids, delta.logprobs, num_top, tokenizer),
                                 finish_reason, delta.stop_reason)
