"""A scored token as vLLM reports it: {token id: Logprob} with the top candidates and the token itself."""

from __future__ import annotations

import dataclasses

from jaxserve.outputs import Logprob
from jaxserve.tokenizer import Tokenizer


# Not frozen, though never changed: one is built per generated token, and a frozen dataclass costs about 1 us more to
# build (0.3 ms per step at 256 sequences).
@dataclasses.dataclass(slots=True)
class SampledToken:
    """One sampled (or scored prompt) token and the log-probabilities reported with it."""

    token_id: int  # the chosen token
    logprob: float  # its log-probability under the unmodified distribution
    rank: int  # 1 + how many tokens were more likely
    top: tuple[tuple[int, float], ...]  # (id, logprob) of the most likely tokens, as many as requested


def candidate_logprobs(token: SampledToken, tokenizer: Tokenizer) -> dict[int, Logprob]:
    """The top candidates in rank order, plus the token itself when it is not among them."""
    candidates = {tid: Logprob(lp, rank, _piece(tokenizer, tid)) for rank, (tid, lp) in enumerate(token.top, 1)}
    candidates.setdefault(token.token_id, Logprob(token.logprob, token.rank, _piece(tokenizer, token.token_id)))
    return candidates


def _piece(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)
