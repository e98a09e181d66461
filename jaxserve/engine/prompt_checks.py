"""A prompt's tokens checked once, with one message per fault, for every way in: `LLM.generate` / `chat`,
`jaxserve run-batch`, the HTTP routes and `LLMEngine.add_request` itself (the scheduler's own admission check shares
the length rule). `param` names the request field the prompt came from ("prompt", or "messages" for a chat), so the
server's error JSON points at it."""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.errors import InvalidRequestError

EMPTY_PROMPT = "prompt is empty"  # also what empty prompt text gets, before it would be tokenized to a lone BOS


def check_prompt_tokens(token_ids: Sequence[int], *, vocab_size: int, max_model_len: int,
                        param: str = "prompt", generates: bool = True) -> None:
    """Refuses a prompt the model cannot run: an id outside the vocabulary, no token at all, or no room left for a
    generated one (`generates` False: the request only scores its prompt, max_tokens 0, which may fill the context)."""
    check_token_ids(token_ids, vocab_size, param)
    check_prompt_length(len(token_ids), max_model_len, param, generates)


def check_prompt_length(num_tokens: int, max_model_len: int, param: str = "prompt", generates: bool = True) -> None:
    """Refuses an empty prompt and one longer than max_model_len, or as long when it is to generate."""
    if num_tokens == 0:
        raise InvalidRequestError(EMPTY_PROMPT, param=param)
    if num_tokens > max_model_len:
        raise InvalidRequestError(f"prompt has {num_tokens} tokens, but max_model_len is {max_model_len}",
                                  param=param)
    if num_tokens == max_model_len and generates:
        raise InvalidRequestError(f"prompt has {num_tokens} tokens, but max_model_len is {max_model_len} (at least "
                                  "one token must be generated; max_tokens 0 scores a prompt this long)", param=param)


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Refuses an id outside [0, vocab_size), naming the first one."""
    outside = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise InvalidRequestError(f"token id {outside} is outside the vocabulary [0, {vocab_size})", param=param)


def check_text_bytes(num_bytes: int, *, longest_token_bytes: int, max_model_len: int, param: str = "prompt") -> None:
    """Refuses text too long for max_model_len before it is tokenized (which could take seconds): no token covers more
    than `longest_token_bytes` bytes, so more than max_model_len times that many bytes are more than max_model_len
    tokens."""
    if num_bytes > max_model_len * longest_token_bytes:
        raise InvalidRequestError(f"{param} holds {num_bytes} bytes of text, more than max_model_len "
                                  f"({max_model_len} tokens) can hold: no token of this model spells more than "
                                  f"{longest_token_bytes} bytes", param=param)


def check_room_to_generate(num_prompt_tokens: int, max_tokens: int, max_model_len: int, param: str) -> None:
    """Refuses, as vLLM's server does, a request whose prompt plus `max_tokens` (named `param`) overflows the
    context, rather than generating fewer tokens than asked for."""
    if num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(f"this model's maximum context length is {max_model_len} tokens, but "
                                  f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the prompt, "
                                  f"{max_tokens} to generate): lower {param} or shorten the prompt", param=param)
