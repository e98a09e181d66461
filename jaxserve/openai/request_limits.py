"""What one OpenAI request may ask for, checked before any of it runs: the same rule for the HTTP server and
`jaxserve run-batch`, so a body either runs the same way through both or is refused by both with the same error."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from jaxserve.config import EngineConfig
from jaxserve.openai.bodies import named_as_sent
from jaxserve.openai.prompts import TokenizedPrompt
from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import SamplingParams


class ChecksRequests(Protocol):
    """An engine as the checks see it: LLMEngine offline and in run-batch, AsyncEngine on the server."""

    config: EngineConfig  # its settings, the per-request caps among them

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int: ...


def check_request_limits(engine: ChecksRequests, prompts: Sequence[TokenizedPrompt], params: SamplingParams,
                         spelled: dict[str, str]) -> None:
    """Refuses a request asking for more continuations or prompts than the engine's per-request caps (max_n,
    max_prompts_per_request), or one the engine would refuse for any prompt (LLMEngine.check_request: the model's
    and the step programs' limits). `spelled`: SamplingParams fields the body names otherwise (body_spellings), so
    that the error names the field the client sent."""
    config = engine.config
    if params.n > config.max_n:
        raise InvalidRequestError(f"n must be at most {config.max_n} (max_n), got {params.n}", param="n")
    if len(prompts) > config.max_prompts_per_request:
        raise InvalidRequestError(f"at most {config.max_prompts_per_request} prompts per request "
                                  f"(max_prompts_per_request), got {len(prompts)}", param="prompt")
    with named_as_sent(spelled):
        for prompt in prompts:
            engine.check_request(prompt.token_ids, params)
