"""`jaxserve run-batch`: OpenAI batch-style JSONL in, one result line per request out (as `vllm run-batch`).

Each input line is `{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body"}`.
A bad line gets its own error result (status 400) and never stops the others; valid requests run together through
the engine's continuous batching.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any

from jaxserve.engine.prompt_checks import check_prompt_tokens
from jaxserve.engine.scheduler import check_priority
from jaxserve.entrypoints.constraint_checks import check_constraints, output_constraint_checks, tool_schema_checks
from jaxserve.entrypoints.llm import LLM
from jaxserve.entrypoints.openai_body import (chat_completion_body, completion_body, default_max_tokens, error_body,
                                              sampling_params_from_body)
from jaxserve.entrypoints.prompts import TokenizedPrompt, chat_prompt, completion_prompt, is_prompt_list
from jaxserve.entrypoints.protocol import ChatCompletionRequestBody, CompletionRequestBody, parse_body
from jaxserve.entrypoints.tool_calls import ToolCalling, tool_calling_from_body
from jaxserve.errors import InvalidRequestError, JaxserveError
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"


@dataclasses.dataclass(frozen=True)
class BatchItem:
    """One input line, parsed."""

    custom_id: str  # the caller's key for matching results to requests
    chat: bool  # a chat completions request (else completions)
    prompt: TokenizedPrompt | None  # None when the line is invalid
    params: SamplingParams | None  # None when the line is invalid
    error: dict[str, Any] | None  # OpenAI error body for an invalid line
    tool_calling: ToolCalling | None = None  # a chat request's tools and how they may be called


def run_batch(llm: LLM, input_path: Path, output_path: Path, model_name: str) -> tuple[int, int]:
    """Runs every request of input_path and writes output_path; returns (succeeded, failed)."""
    items = [_parse_line(llm, number, line) for number, line in _lines(input_path)]
    valid = [item for item in items if item.error is None]
    results = llm.generate([{"prompt_token_ids": list(i.prompt.token_ids)} for i in valid],
                           [i.params for i in valid], use_tqdm=True) if valid else []
    by_id = {id(item): result for item, result in zip(valid, results)}
    with Path(output_path).open("w") as out:
        for item in items:
            out.write(json.dumps(_result_line(item, by_id.get(id(item)), model_name, llm.tokenizer)) + "\n")
    return len(valid), len(items) - len(valid)


def _lines(path: Path):
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise JaxserveError(f"cannot read batch input {path}: {e.strerror}") from None
    return [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]


def _parse_line(llm: LLM, number: int, line: str) -> BatchItem:
    custom_id = f"line-{number}"
    try:
        request = json.loads(line)
        if not isinstance(request, dict):
            raise InvalidRequestError("each line must be a JSON object")
        custom_id = str(request.get("custom_id", custom_id))
        url, body = request.get("url"), request.get("body")
        if url not in (COMPLETIONS_URL, CHAT_URL):
            raise InvalidRequestError(f"url must be {COMPLETIONS_URL} or {CHAT_URL}, got {url!r}", param="url")
        if not isinstance(body, dict):
            raise InvalidRequestError("body must be a JSON object", param="body")
        chat = url == CHAT_URL
        schema = ChatCompletionRequestBody if chat else CompletionRequestBody
        body = parse_body(schema, body, max_items=llm.max_model_len).model_dump(exclude_none=True)
        for unanswerable in ("stream", "echo"):
            if body.get(unanswerable):
                raise InvalidRequestError(f"{unanswerable} is not supported by run-batch, which writes each whole "
                                          "response as one line", param=unanswerable)
        tool_calling = tool_calling_from_body(body) if chat else None
        check_constraints(tool_schema_checks(tool_calling), llm.engine.grammars)
        prompt = (chat_prompt(llm.tokenizer, body["messages"], body.get("add_generation_prompt", True),
                              tools=tool_calling.tools if tool_calling is not None else None) if chat
                  else _completion_prompt(llm, body))
        check_prompt_tokens(prompt.token_ids, vocab_size=llm.model.config.vocab_size, max_model_len=llm.max_model_len)
        params = sampling_params_from_body(body, chat, default_max_tokens=default_max_tokens(
            chat, len(prompt.token_ids), llm.max_model_len), tool_calling=tool_calling)
        check_constraints(output_constraint_checks(params, body, tool_calling), llm.engine.grammars)
        # Here, not in the engine, so that a priority the policy refuses fails this line only.
        check_priority(params.priority, llm.config.scheduling_policy)
        return BatchItem(custom_id, chat, prompt, params, None, tool_calling)
    except json.JSONDecodeError as e:
        return BatchItem(custom_id, False, None, None, error_body(f"line {number} is not valid JSON: {e.msg}"))
    except JaxserveError as e:
        return BatchItem(custom_id, False, None, None, error_body(str(e), getattr(e, "param", None)))


def _completion_prompt(llm: LLM, body: dict[str, Any]) -> TokenizedPrompt:
    prompt = body.get("prompt")
    if is_prompt_list(prompt):
        raise InvalidRequestError("run-batch takes one prompt per line, got a list of prompts", param="prompt")
    return completion_prompt(prompt, llm.tokenizer, body.get("add_special_tokens", True))


def _result_line(item: BatchItem, result, model_name: str, tokenizer: Tokenizer) -> dict[str, Any]:
    request_id = f"batch-{uuid.uuid4().hex}"
    if item.error is not None:
        response = {"status_code": 400, "request_id": request_id, "body": item.error}
    else:
        body = (chat_completion_body(result, model_name, item.params.logprobs or 0, tokenizer, item.tool_calling)
                if item.chat
                else completion_body([result], model_name))
        response = {"status_code": 200, "request_id": request_id, "body": body}
    return {"id": request_id, "custom_id": item.custom_id, "response": response, "error": None}
