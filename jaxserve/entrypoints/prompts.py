"""Turning the prompt forms users pass (text, token ids, dicts, lists of these) into validated token sequences."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import Tokenizer


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
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, Sequence) or isinstance(ids, str) or not all(_is_int(t) for t in ids):
            raise InvalidRequestError("prompt_token_ids must be a list of integers", param="prompt")
        return TokenizedPrompt(text=prompt.get("prompt"), token_ids=tuple(ids))
    text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
    if not isinstance(text, str):
        raise InvalidRequestError(f"a prompt must be text or token ids, got {type(prompt).__name__}", param="prompt")
    if not text:
        raise InvalidRequestError("prompt is empty", param="prompt")
    return TokenizedPrompt(text=text, token_ids=tuple(tokenizer.encode(text, add_special_tokens=add_special_tokens)))


def check_prompt(prompt: TokenizedPrompt, vocab_size: int, max_model_len: int) -> None:
    """Rejects prompts the model cannot run: empty, ids outside the vocabulary, or no room left to generate."""
    ids = prompt.token_ids
    if not ids:
        raise InvalidRequestError("prompt is empty", param="prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="prompt")
    if len(ids) >= max_model_len:
        raise InvalidRequestError(
            f"prompt has {len(ids)} tokens, but max_model_len is {max_model_len} (at least one token must be "
            "generated)",
            param="prompt",
        )


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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
