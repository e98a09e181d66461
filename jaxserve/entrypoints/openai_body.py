"""OpenAI request bodies (completions and chat) → prompts and SamplingParams; results → OpenAI response bodies.

Shared by the batch runner now and the HTTP server next. Field names follow OpenAI, plus the vLLM extensions
clients send (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from jaxserve.errors import InvalidRequestError
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams

# Body fields that map one to one onto SamplingParams.
_PASSED_THROUGH = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids")
OPENAI_DEFAULT_MAX_TOKENS = 16  # what OpenAI's completions endpoint generates when max_tokens is absent


def sampling_params_from_body(body: dict[str, Any], chat: bool, default_max_tokens: int) -> SamplingParams:
    """SamplingParams of a completions (chat=False) or chat completions body; InvalidRequestError names the field."""
    kwargs = {name: body[name] for name in _PASSED_THROUGH if body.get(name) is not None}
    max_tokens = body.get("max_completion_tokens") if chat else None
    max_tokens = max_tokens if max_tokens is not None else body.get("max_tokens")
    kwargs["max_tokens"] = default_max_tokens if max_tokens is None else max_tokens
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
    try:
        return SamplingParams(**kwargs)
    except TypeError as e:
        raise InvalidRequestError(f"a sampling field has the wrong type: {e}") from None


def _requested_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    if not chat:
        return body.get("logprobs")
    if not body.get("logprobs"):
        return None
    return body.get("top_logprobs") or 0


def completion_body(output: RequestOutput, model: str) -> dict[str, Any]:
    """The /v1/completions response for one prompt's result."""
    return {
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": c.index, "text": c.text, "logprobs": _completion_logprobs(c),
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in output.outputs],
        "usage": _usage(output),
    }


def chat_completion_body(output: RequestOutput, model: str) -> dict[str, Any]:
    """The /v1/chat/completions response for one conversation's result."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "logprobs": _chat_logprobs(c), "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    for c in output.outputs],
        "usage": _usage(output),
    }


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _completion_logprobs(completion: CompletionOutput) -> dict[str, Any] | None:
    """The legacy completions shape: parallel lists of tokens, their logprobs and the top alternatives."""
    if completion.logprobs is None:
        return None
    sampled = [candidates[token] for token, candidates in zip(completion.token_ids, completion.logprobs)]
    offsets, position = [], 0
    for entry in sampled:
        offsets.append(position)
        position += len(entry.decoded_token)
    return {
        "tokens": [entry.decoded_token for entry in sampled],
        "token_logprobs": [entry.logprob for entry in sampled],
        "top_logprobs": [{c.decoded_token: c.logprob for c in candidates.values()} for candidates in completion.logprobs],
        "text_offset": offsets,
    }


def _chat_logprobs(completion: CompletionOutput) -> dict[str, Any] | None:
    """The chat shape: one entry per token with its top alternatives (the sampled token listed first)."""
    if completion.logprobs is None:
        return None
    content = []
    for token, candidates in zip(completion.token_ids, completion.logprobs):
        chosen = candidates[token]
        alternatives = sorted(candidates.values(), key=lambda c: c.rank)
        content.append({"token": chosen.decoded_token, "logprob": chosen.logprob,
                        "bytes": list(chosen.decoded_token.encode()),
                        "top_logprobs": [{"token": c.decoded_token, "logprob": c.logprob,
                                          "bytes": list(c.decoded_token.encode())} for c in alternatives]})
    return {"content": content}


def _usage(output: RequestOutput) -> dict[str, int]:
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    prompt_tokens = len(output.prompt_token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

