"""A scored token as vLLM reports it: {token id: Logprob} with the top candidates and the token itself."""

from __future__ import annotations

from jaxserve.outputs import Logprob
from jaxserve.runner.host_sampler import SampledToken
from jaxserve.tokenizer import Tokenizer


def candidate_logprobs(token: SampledToken, tokenizer: Tokenizer) -> dict[int, Logprob]:
    """The top candidates in rank order, plus the token itself when it is not among them."""
    candidates = {tid: Logprob(lp, rank, _piece(tokenizer, tid)) for rank, (tid, lp) in enumerate(token.top, 1)}
    candidates.setdefault(token.token_id, Logprob(token.logprob, token.rank, _piece(tokenizer, token.token_id)))
    return candidates


def _piece(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)
