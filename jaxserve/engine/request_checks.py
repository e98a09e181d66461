"""Whether the engine can run a request, decided before anything of it is kept: the prompt's tokens, max_tokens
against the context, the step programs' fixed widths (logit_bias, stop ids, logprobs, top_k) and the scheduler's
admission. One function for every way in (LLMEngine.add_request, and LLMEngine.check_request for the server and
run-batch, which check each request before running any)."""

from __future__ import annotations

from collections.abc import Sequence

from jaxserve.config import EngineConfig
from jaxserve.engine.prompt_checks import check_prompt_tokens
from jaxserve.engine.scheduler import Scheduler
from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import SamplingParams


def checked_max_new_tokens(prompt_token_ids: Sequence[int], params: SamplingParams, config: EngineConfig,
                           vocab_size: int, num_eos_ids: int, scheduler: Scheduler) -> int:
    """The most tokens the request will generate; InvalidRequestError if it cannot run at all."""
    check_prompt_tokens(prompt_token_ids, vocab_size=vocab_size, max_model_len=config.max_model_len,
                        generates=params.max_tokens > 0)
    max_new = _max_new_tokens(len(prompt_token_ids), params, config)
    _check_step_widths(params, config, vocab_size, num_eos_ids)
    scheduler.check_admissible(len(prompt_token_ids), max(max_new, 1), params.priority,
                               scores_only=params.max_tokens == 0)
    return max_new


def _max_new_tokens(prompt_len: int, params: SamplingParams, config: EngineConfig) -> int:
    room = config.max_model_len - prompt_len
    if params.max_tokens > room and config.max_tokens_policy == "reject":
        raise InvalidRequestError(f"prompt ({prompt_len} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                                  f"max_model_len ({config.max_model_len})", param="max_tokens")
    return min(params.max_tokens, room)


def _check_step_widths(params: SamplingParams, config: EngineConfig, vocab_size: int, num_eos_ids: int) -> None:
    """What the compiled sampler's fixed-width inputs can hold, and ids the vocabulary has."""
    if len(params.logit_bias) > config.max_logit_bias:
        raise InvalidRequestError(f"logit_bias has {len(params.logit_bias)} entries; at most "
                                  f"{config.max_logit_bias} are allowed", param="logit_bias")
    if len(params.stop_token_ids) + num_eos_ids > config.max_stop_ids:
        raise InvalidRequestError(f"at most {config.max_stop_ids - num_eos_ids} stop_token_ids are allowed",
                                  param="stop_token_ids")
    if any(not 0 <= t < vocab_size for t, _ in params.logit_bias):
        raise InvalidRequestError(f"logit_bias names a token outside the vocabulary [0, {vocab_size})",
                                  param="logit_bias")
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise InvalidRequestError(f"stop_token_ids names a token outside the vocabulary [0, {vocab_size})",
                                  param="stop_token_ids")
    for name in ("logprobs", "prompt_logprobs"):
        if (getattr(params, name) or 0) > config.max_logprobs:
            raise InvalidRequestError(f"{name} must be at most {config.max_logprobs} (max_logprobs), got "
                                      f"{getattr(params, name)}", param=name)
    if params.top_k > vocab_size:
        raise InvalidRequestError(f"top_k must be at most the vocabulary size ({vocab_size}), got {params.top_k}",
                                  param="top_k")
