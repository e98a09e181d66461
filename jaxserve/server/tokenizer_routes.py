"""The served model's tokenizer over HTTP, as vLLM offers it: /tokenize, /detokenize, /tokenizer_info.

Evaluation clients (lm-evaluation-harness with `tokenizer_backend=remote`) count and split prompts with these
instead of loading the tokenizer themselves.
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response, jsonify

from jaxserve.engine.prompt_checks import check_token_ids
from jaxserve.entrypoints.prompts import chat_prompt, encode_text, token_ids_of
from jaxserve.server.api_errors import ApiError
from jaxserve.server.app import ServerContext, check_model, json_body, server_context
from jaxserve.server.request_fields import flag

blueprint = Blueprint("tokenizer", __name__)


@blueprint.post("/tokenize")
async def tokenize() -> Response:
    """`{"prompt": str, "add_special_tokens": bool}` or `{"messages": [...], "add_generation_prompt": bool}`."""
    context = server_context()
    body = await json_body()
    check_model(body, context)
    tokens = _tokens_of(body, context)
    return jsonify({"tokens": tokens, "count": len(tokens), "max_model_len": context.max_model_len})


@blueprint.post("/detokenize")
async def detokenize() -> Response:
    """`{"tokens": [int, ...]}` → `{"prompt": str}`, special tokens spelled out so that /tokenize round-trips."""
    context = server_context()
    body = await json_body()
    check_model(body, context)
    tokens = _checked_token_ids(body.get("tokens"), context.tokenizer.vocab_size)
    return jsonify({"prompt": context.tokenizer.decode(tokens, skip_special_tokens=False)})


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


def _tokens_of(body: dict[str, Any], context: ServerContext) -> list[int]:
    if body.get("messages") is not None:
        prompt = chat_prompt(context.tokenizer, body["messages"],
                             add_generation_prompt=flag(body, "add_generation_prompt", default=True))
        return list(prompt.token_ids)
    text = body.get("prompt")
    if not isinstance(text, str):
        raise ApiError(400, "send prompt (a string) or messages (a list of {role, content} objects)", param="prompt")
    return encode_text(context.tokenizer, text, flag(body, "add_special_tokens", default=True))


def _checked_token_ids(tokens: Any, vocab_size: int) -> list[int]:
    ids = token_ids_of(tokens, param="tokens")
    check_token_ids(ids, vocab_size, param="tokens")
    return list(ids)
