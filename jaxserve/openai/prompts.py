"""Turning the prompt forms users pass (text, token ids, dicts, lists of these, conversations) into validated token
sequences."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxserve.engine.prompt_checks import EMPTY_PROMPT
from jaxserve.openai.tool_calls import template_messages
from jaxserve.errors import InvalidRequestError, TokenizerError
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer, flatten_text_content


@dataclasses.dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt ready for the model."""

    text: str | None  # the original text, when the prompt came as text
    token_ids: tuple[int, ...]  # what the model will see


def normalize_prompts(prompts: Any) -> list[str | dict]:
    """One prompt or a list of them, each a string, `{"prompt": str}` or `{"prompt_token_ids": [int, ...]}`."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts:
        return list(prompts)
    raise InvalidRequestError("prompts must be a string, a prompt dict, or a non-empty list of them", param="prompt")


def tokenize_prompt(prompt: str | dict, tokenizer: Tokenizer, add_special_tokens: bool = True) -> TokenizedPrompt:
    """Encodes text prompts; passes token-id prompts through."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return TokenizedPrompt(text=prompt.get("prompt"), token_ids=token_ids_of(prompt["prompt_token_ids"]))
    text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
    if not isinstance(text, str):
        raise _wrong_prompt_type(prompt)
    if not text:
        raise InvalidRequestError(EMPTY_PROMPT, param="prompt")
    return TokenizedPrompt(text=text, token_ids=tuple(encode_text(tokenizer, text, add_special_tokens)))


def completion_prompts(prompt: Any, tokenizer: Tokenizer, add_special_tokens: bool = True) -> list[TokenizedPrompt]:
    """An OpenAI completions `prompt` field in its four forms: text, token ids, or a list of either."""
    return [completion_prompt(p, tokenizer, add_special_tokens)
            for p in (prompt if is_prompt_list(prompt) else [prompt])]


def completion_prompt(prompt: Any, tokenizer: Tokenizer, add_special_tokens: bool = True) -> TokenizedPrompt:
    """One prompt of an OpenAI request body: text (BOS added unless `add_special_tokens` is false) or a list of
    token ids (the body has no dict form)."""
    if isinstance(prompt, list):
        return TokenizedPrompt(text=None, token_ids=token_ids_of(prompt))
    if not isinstance(prompt, str):
        raise _wrong_prompt_type(prompt)
    return tokenize_prompt(prompt, tokenizer, add_special_tokens)


def is_prompt_list(prompt: Any) -> bool:
    """Whether a completions `prompt` field holds several prompts. Its first item decides, as in vLLM, so a list that
    starts with a token id is one prompt (and its other items must be token ids too)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


def token_ids_of(value: Any, param: str = "prompt") -> tuple[int, ...]:
    """`value` as token ids; `param` names the request field it came from."""
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(_is_int(t) for t in value):
        raise InvalidRequestError("token ids must be a list of integers", param=param)
    return tuple(value)


def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
    """`tokenizer.encode`, refusing text that is not Unicode (JSON may carry lone surrogates the tokenizer rejects)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{param} is not valid Unicode text: {e.reason} at position {e.start}",
                                  param=param) from None
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def chat_prompt(tokenizer: Tokenizer, messages: Any, add_generation_prompt: bool = True,
                **template_variables: Any) -> TokenizedPrompt:
    """A conversation rendered by the model's chat template (text parts joined, tool calls' arguments as objects),
    then tokenized; `template_variables` (tools, ...) reach the template.

    The template writes BOS itself, so encoding adds no special tokens: adding them again would double BOS.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    try:
        text = tokenizer.apply_chat_template(template_messages(flatten_text_content(messages)),
                                             add_generation_prompt=add_generation_prompt, **template_variables)
    except TokenizerError as e:  # a message the template or its content parts cannot take
        raise InvalidRequestError(str(e), param="messages") from None
    return tokenize_prompt(text, tokenizer, add_special_tokens=False)


def params_per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    """One SamplingParams for every prompt: the same one repeated, or a list of matching length."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count or not all(isinstance(p, SamplingParams) for p in params):
        raise InvalidRequestError(
            f"got {len(params)} sampling params for {count} prompts; pass one, or one per prompt",
            param="sampling_params",
        )
    return params


def with_priorities(params: list[SamplingParams], priority: Sequence[int] | None) -> list[SamplingParams]:
    """Each prompt's params with its priority from vLLM's `priority=` list (one per prompt); None keeps theirs."""
    if priority is None:
        return params
    priority = list(priority)
    if len(priority) != len(params):
        raise InvalidRequestError(f"got {len(priority)} priorities for {len(params)} prompts; pass one per prompt",
                                  param="priority")
    return [p.with_priority(q) for p, q in zip(params, priority)]


def lora_per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                    num_prompts: int) -> list[LoRARequest | None]:
    """vLLM's `lora_request=`: one adapter (or None) for every prompt, or a list with one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts or not all(lora is None or isinstance(lora, LoRARequest) for lora in loras):
        raise InvalidRequestError(f"lora_request must be one LoRARequest or a list of {num_prompts} (one per prompt, "
                                  "None for the base model)", param="lora_request")
    return loras


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not token id 1


def _wrong_prompt_type(prompt: Any) -> InvalidRequestError:
    return InvalidRequestError(f"a prompt must be text or token ids, got {type(prompt).__name__}", param="prompt")
