"""`jaxserve run-batch`: OpenAI batch-style JSONL in, one result line per request out (as `vllm run-batch`).

Each input line is `{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions", "body"}`.
Each line is checked as the server checks a request (its `model` included: the served model or a --lora-modules
adapter); a bad line gets its own error result (status 400, or 404 for an unknown model) and never stops the others;
valid requests run together through the engine's continuous batching.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any

from jaxserve.engine.prompt_checks import check_room_to_generate
from jaxserve.openai.constraint_checks import check_constraints, output_constraint_checks, tool_schema_checks
from jaxserve.entrypoints.llm import LLM
from jaxserve.openai.bodies import (body_spellings, chat_completion_body, chat_template_variables, completion_body,
                                    default_max_tokens, error_body, sampling_params_from_body)
from jaxserve.openai.prompts import TokenizedPrompt, chat_prompt, completion_prompt, is_prompt_list
from jaxserve.openai.requests import ChatCompletionRequestBody, CompletionRequestBody
from jaxserve.openai.schema import parse_body
from jaxserve.openai.request_limits import check_request_limits
from jaxserve.openai.tool_calls import ToolCalling, tool_calling_from_body
from jaxserve.errors import ConfigError, InvalidRequestError, JaxserveError, ModelNotFoundError
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"


@dataclasses.dataclass(frozen=True)
class BatchModels:
    """What a line's `model` may name, as the server resolves it: the served model (under its names) or one of the
    LoRA adapters given with --lora-modules."""

    names: tuple[str, ...]  # the served model's names; results carry the first
    adapters: dict[str, LoRARequest] = dataclasses.field(default_factory=dict)  # by name, registered with the engine

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a line runs with (None: the base model); another name is refused, as the server's 404."""
        if model is None or model in self.names:
            return None
        if model in self.adapters:
            return self.adapters[model]
        served = [*self.names, *self.adapters]
        raise ModelNotFoundError(f"the model {model!r} does not exist; this batch serves "
                                 f"{', '.join(map(repr, served))}", param="model")


@dataclasses.dataclass(frozen=True)
class BatchItem:
    """One input line, parsed."""

    custom_id: str  # the caller's key for matching results to requests
    chat: bool  # a chat completions request (else completions)
    prompt: TokenizedPrompt | None  # None when the line is invalid
    params: SamplingParams | None  # None when the line is invalid
    error: dict[str, Any] | None  # OpenAI error body for an invalid line
    tool_calling: ToolCalling | None = None  # a chat request's tools and how they may be called
    lora: LoRARequest | None = None  # the adapter the line names as its model; None: the base model
    model_name: str = ""  # what its result carries: the served model's first name or the adapter's
    status_code: int = 200  # of its result: 400 for a refused line, 404 for an unknown model


def run_batch(llm: LLM, input_path: Path, output_path: Path, models: BatchModels | str) -> tuple[int, int]:
    """Runs every request of input_path and writes output_path; returns (succeeded, failed). Every check the server
    makes runs per line, and a line the engine refuses fails alone: each input line gets its result line."""
    if llm.config.pooling:
        raise ConfigError("run-batch runs completions and chat lines, which a pooling engine (--runner pooling) "
                          "does not generate; /v1/embeddings lines are not implemented yet")
    models = BatchModels((models,)) if isinstance(models, str) else models
    items = [_parse_line(llm, number, line, models) for number, line in _lines(input_path)]
    valid = [item for item in items if item.error is None]
    results = llm.run_each([item.prompt for item in valid], [item.params for item in valid],
                           [item.lora for item in valid]) if valid else []
    by_id = {id(item): result for item, result in zip(valid, results)}
    failed = 0
    with Path(output_path).open("w") as out:
        for item in items:
            result = by_id.get(id(item))
            if isinstance(result, JaxserveError):  # refused when added: the same error body as a refused line
                item, result = _refused(item, result), None
            failed += item.error is not None
            out.write(json.dumps(_result_line(item, result, llm.tokenizer)) + "\n")
    return len(items) - failed, failed


def _lines(path: Path):
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise JaxserveError(f"cannot read batch input {path}: {e.strerror}") from None
    return [(number, line) for number, line in enumerate(text.splitlines(), 1) if line.strip()]


def _parse_line(llm: LLM, number: int, line: str, models: BatchModels) -> BatchItem:
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
        lora = models.resolve(body.get("model"))
        for unanswerable in ("stream", "echo"):
            if body.get(unanswerable):
                raise InvalidRequestError(f"{unanswerable} is not supported by run-batch, which writes each whole "
                                          "response as one line", param=unanswerable)
        tool_calling = tool_calling_from_body(body) if chat else None
        check_constraints(tool_schema_checks(tool_calling), llm.engine.grammars)
        prompt = (chat_prompt(llm.tokenizer, body["messages"], body.get("add_generation_prompt", True),
                              **chat_template_variables(body, tool_calling)) if chat
                  else _completion_prompt(llm, body))
        params = sampling_params_from_body(body, chat, default_max_tokens=default_max_tokens(
            chat, len(prompt.token_ids), llm.max_model_len), tool_calling=tool_calling)
        spelled = body_spellings(body, chat)
        check_request_limits(llm.engine, [prompt], params, spelled)
        asked = spelled.get("max_tokens", "max_tokens")
        if not chat or body.get(asked) is not None:  # as the server: chat without max_tokens fills the context
            check_room_to_generate(len(prompt.token_ids), params.max_tokens, llm.max_model_len, asked)
        check_constraints(output_constraint_checks(params, body, tool_calling), llm.engine.grammars)
        return BatchItem(custom_id, chat, prompt, params, None, tool_calling, lora,
                         lora.lora_name if lora is not None else models.names[0])
    except json.JSONDecodeError as e:
        return BatchItem(custom_id, False, None, None, error_body(f"line {number} is not valid JSON: {e.msg}"),
                         status_code=400)
    except JaxserveError as e:
        return _refused(BatchItem(custom_id, False, None, None, None), e)


def _refused(item: BatchItem, error: JaxserveError) -> BatchItem:
    """The item with the error that refused it, as the server answers it (404 for an unknown model, else 400)."""
    if isinstance(error, ModelNotFoundError):
        body, status = error_body(str(error), error.param, kind="not_found_error"), 404
    else:
        body, status = error_body(str(error), getattr(error, "param", None)), 400
    return dataclasses.replace(item, error=body, status_code=status)


def _completion_prompt(llm: LLM, body: dict[str, Any]) -> TokenizedPrompt:
    prompt = body.get("prompt")
    if is_prompt_list(prompt):
        raise InvalidRequestError("run-batch takes one prompt per line, got a list of prompts", param="prompt")
    return completion_prompt(prompt, llm.tokenizer, body.get("add_special_tokens", True))


def _result_line(item: BatchItem, result, tokenizer: Tokenizer) -> dict[str, Any]:
    request_id = f"batch-{uuid.uuid4().hex}"
    if item.error is not None:
        response = {"status_code": item.status_code, "request_id": request_id, "body": item.error}
    else:
        body = (chat_completion_body(result, item.model_name, item.params.logprobs or 0, tokenizer, item.tool_calling)
                if item.chat
                else completion_body([result], item.model_name))
        response = {"status_code": 200, "request_id": request_id, "body": body}
    return {"id": request_id, "custom_id": item.custom_id, "response": response, "error": None}
