"""The served model's tokenizer over HTTP, as vLLM offers it: /tokenize, /detokenize, /tokenizer_info.

Evaluation clients (lm-evaluation-harness with `tokenizer_backend=remote`) count and split prompts with these
instead of loading the tokenizer themselves.
"""

from __future__ import annotations

from quart import Blueprint, Response, jsonify

from jaxserve.engine.prompt_checks import check_token_ids
from jaxserve.openai.prompts import encode_text
from jaxserve.openai.requests import DetokenizeBody, TokenizeChatBody, TokenizeCompletionBody
from jaxserve.openai.schema import parse_body, parse_json_object
from jaxserve.openai.answers import DetokenizeResponse, TokenizeResponse
from jaxserve.server.context import ServerContext, request_bytes, resolve_model, server_context
from jaxserve.server.openapi import RouteSchema, declares
from jaxserve.server.request_fields import flag, rendered_conversation

blueprint = Blueprint("tokenizer", __name__)


@blueprint.post("/tokenize")
@declares(RouteSchema(requests=(TokenizeCompletionBody, TokenizeChatBody), response=TokenizeResponse))
async def tokenize() -> Response:
    """`{"prompt": str, "add_special_tokens": bool}` or `{"messages": [...], "add_generation_prompt": bool}`; either
    is counted whatever its length in tokens (`max_model_len` in the answer says what fits), as vLLM's."""
    context = server_context()
    tokens = await context.off_loop(_tokens_of, await request_bytes(), context)
    return jsonify({"tokens": tokens, "count": len(tokens), "max_model_len": context.max_model_len})


@blueprint.post("/detokenize")
@declares(RouteSchema(requests=(DetokenizeBody,), response=DetokenizeResponse))
async def detokenize() -> Response:
    """`{"tokens": [int, ...]}` → `{"prompt": str}`, special tokens spelled out so that /tokenize round-trips."""
    context = server_context()
    return jsonify({"prompt": await context.off_loop(_text_of, await request_bytes(), context)})


@blueprint.get("/tokenizer_info")
async def tokenizer_info() -> Response:
    context = server_context()
    tokenizer = context.tokenizer
    template = tokenizer.chat_template
    return jsonify({
        "tokenizer_class": type(tokenizer).__name__,
        "bos_token": tokenizer.bos_token, "bos_token_id": tokenizer.bos_token_id,
        "eos_token": tokenizer.eos_token, "eos_token_ids": list(tokenizer.eos_token_ids),
        "add_bos_token": tokenizer.add_bos_token,
        "chat_template": template.source if template is not None else None,
        "model_max_length": context.max_model_len, "vocab_size": tokenizer.vocab_size,
    })


def _tokens_of(raw: bytes, context: ServerContext) -> list[int]:
    value = parse_json_object(raw)
    if "messages" in value:
        body = parse_body(TokenizeChatBody, value, context.config.allow_unknown_fields, context.max_model_len)
        resolve_model(body.model, context)
        fields = body.model_dump(exclude_none=True)
        # As a prompt, counted whatever its length (as vLLM's /tokenize): only text no context could hold is refused.
        prompt = rendered_conversation(fields["messages"], context,
                                       flag(fields, "add_generation_prompt", default=True), tools=fields.get("tools"))
        return list(prompt.token_ids)
    body = parse_body(TokenizeCompletionBody, value, context.config.allow_unknown_fields, context.max_model_len)
    resolve_model(body.model, context)
    context.check_text_fits([body.prompt], "prompt")
    return encode_text(context.tokenizer, body.prompt, body.add_special_tokens is not False)


def _text_of(raw: bytes, context: ServerContext) -> str:
    body = parse_body(DetokenizeBody, raw, context.config.allow_unknown_fields, context.max_model_len)
    resolve_model(body.model, context)
    check_token_ids(body.tokens, context.tokenizer.vocab_size, param="tokens")
    return context.tokenizer.decode(body.tokens, skip_special_tokens=False)
