"""POST /v1/embeddings on a pooling server (`--runner pooling`), and the 400 each runner answers to the other's routes.

Every input becomes one engine request (AsyncEngine.encode), all submitted at once, so the engine batches them with
whatever else runs; the answer lists their embeddings in input order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Sequence

from quart import Blueprint, Response, jsonify, request

from jaxserve.engine.prompt_checks import check_prompt_tokens
from jaxserve.openai.bodies import named_as_sent
from jaxserve.openai.embeddings_answers import EmbeddingResponse, embedding_body
from jaxserve.openai.embeddings_requests import (FLOAT, INPUT, EmbeddingRequestBody, embedding_inputs,
                                                 pooling_params_from_body)
from jaxserve.openai.prompts import TokenizedPrompt
from jaxserve.openai.schema import parse_body, parse_json_object
from jaxserve.outputs import PoolingRequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.server.admission import admit
from jaxserve.server.api_errors import ApiError
from jaxserve.server.context import ServerContext, request_bytes, resolve_model, server_context
from jaxserve.server.openapi import RouteSchema, declares
from jaxserve.server.request_fields import flag

blueprint = Blueprint("embeddings", __name__)

ROUTE = "/v1/embeddings"
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")  # what a pooling server refuses


@dataclasses.dataclass(frozen=True)
class EmbeddingRequest:
    """A checked /v1/embeddings body."""

    prompts: list[TokenizedPrompt]  # one engine request each, truncated as the engine will run them
    params: PoolingParams  # shared by all inputs
    encoding_format: str  # float or base64
    model: str  # the served model's name, as answers carry it


@blueprint.post("/v1/embeddings")
@declares(RouteSchema(requests=(EmbeddingRequestBody,), response=EmbeddingResponse))
async def create_embedding() -> Response:
    """Embeddings of text or token-id inputs (a server started with --runner pooling)."""
    context = server_context()
    if not context.engine.config.pooling:
        raise ApiError(400, f"{ROUTE} needs an embedding model, but this server generates text: start it with "
                            "--runner pooling (vLLM's flag) to serve embeddings")
    embedding = await context.off_loop(parse_embedding_request, await request_bytes(), context)
    admit(context.admission, len(embedding.prompts), sum(len(p.token_ids) for p in embedding.prompts), 0)
    outputs = await pooled_outputs(context, embedding.prompts, embedding.params)
    return jsonify(embedding_body(outputs, embedding.model, embedding.encoding_format))


def refuse_generation_on_pooling_server() -> None:
    """Before every request: a pooling server answers the generation routes with a 400 naming the flag."""
    if request.method == "POST" and request.path in GENERATION_ROUTES and server_context().engine.config.pooling:
        raise ApiError(400, f"{request.path} generates text, but this server embeds (--runner pooling): it serves "
                            f"{ROUTE}; start a server without --runner pooling (or with --runner generate) to "
                            "generate")


def parse_embedding_request(raw: bytes, context: ServerContext) -> EmbeddingRequest:
    """The body checked against its schema and its inputs tokenized, truncated and checked as the engine will run
    them (on a worker thread: tokenizing can take milliseconds)."""
    fields = parse_json_object(raw)
    # A list longer than max_model_len is refused unparsed, unless the inputs are to be truncated (the body's size
    # bounds it then).
    longest = None if fields.get("truncate_prompt_tokens") is not None else context.max_model_len
    body = parse_body(EmbeddingRequestBody, fields, context.config.allow_unknown_fields, longest)
    model = resolve_model(body.model, context).name
    params = pooling_params_from_body(body)
    if params.truncate_prompt_tokens is None:  # else any length is fine: the engine keeps a part
        for text in [body.input] if isinstance(body.input, str) else body.input:
            if isinstance(text, str):
                context.check_text_fits([text], INPUT)
    prompts = embedding_inputs(body.input, context.tokenizer, flag(body.model_dump(), "add_special_tokens", True))
    limit = context.engine.config.max_prompts_per_request
    if len(prompts) > limit:
        raise ApiError(400, f"at most {limit} inputs per request (max_prompts_per_request), got {len(prompts)}",
                       param=INPUT)
    if len(prompts) > context.admission.capacity:
        raise ApiError(400, f"the request has {len(prompts)} inputs; this server admits at most "
                            f"{context.admission.capacity} at once", param=INPUT)
    checked = []
    for prompt in prompts:
        ids = params.truncated(prompt.token_ids, context.max_model_len)
        check_prompt_tokens(ids, vocab_size=context.vocab_size, max_model_len=context.max_model_len, param=INPUT,
                            generates=False)
        with named_as_sent({"prompt": INPUT}):
            context.engine.check_request(ids, params)
        checked.append(TokenizedPrompt(prompt.text, ids))
    return EmbeddingRequest(checked, params, body.encoding_format or FLOAT, model)


async def pooled_outputs(context: ServerContext, prompts: Sequence[TokenizedPrompt],
                         params: PoolingParams) -> list[PoolingRequestOutput]:
    """Each input's embedding, in input order; the first failure ends them all, and a caller that leaves aborts
    every request still running."""
    base, started = uuid.uuid4().hex, time.perf_counter()
    tasks = [asyncio.ensure_future(context.engine.encode(f"embd-{base}-{index}", prompt.token_ids, params,
                                                         prompt=prompt.text))
             for index, prompt in enumerate(prompts)]
    try:
        outputs = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    metrics = context.metrics
    metrics.prompt_tokens.inc(sum(len(output.prompt_token_ids) for output in outputs))
    metrics.request_success.labels("stop").inc(len(outputs))
    for _ in outputs:
        metrics.e2e_request_latency.observe(time.perf_counter() - started)
    return list(outputs)
