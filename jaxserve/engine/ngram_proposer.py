"""Prompt-lookup drafts (vLLM's `ngram` method): a sequence that repeats itself proposes what followed last time.

For n from prompt_lookup_max down to prompt_lookup_min, the sequence's last n tokens are looked for earlier in the
sequence (prompt and outputs); at the latest earlier occurrence, the tokens that followed it, up to k, are the
drafts. Longer matches are tried first because they predict better; the latest occurrence because generated text
repeats what it produced most recently (a loop, an edited line of code). Costs a scan of the sequence on the host
per drafting sequence and step, vectorised: candidates are the positions holding the last token, checked whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxserve.engine.proposers import SequenceProposer
from jaxserve.speculative_config import SpeculativeConfig


class NgramProposer(SequenceProposer):
    """Proposes up to k drafts from a sequence's own history."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> tuple[int, ...]:
        """Drafts to follow `token_ids` (every id known), at most max_drafts; () when no suffix recurs."""
        if max_drafts < 1 or len(token_ids) <= self.min_n:
            return ()
        tokens = np.asarray(token_ids, np.int64)  # i64[L]
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = _latest_earlier_match(tokens, n)
            if start is not None:
                follow = start + n
                return tuple(int(t) for t in tokens[follow:follow + max_drafts])
        return ()


def _latest_earlier_match(tokens: np.ndarray, n: int) -> int | None:
    """Start of the latest occurrence of the last n tokens that ends before the last token; None if none."""
    suffix = tokens[-n:]
    # Candidate ends: positions before the last one holding the last token, latest first.
    ends = np.flatnonzero(tokens[n - 1:-1] == suffix[-1])[::-1] + n - 1  # i64[c]
    if ends.size == 0:
        return None
    windows = tokens[ends[:, None] - np.arange(n - 1, -1, -1)]  # i64[c, n]: the n tokens ending at each candidate
    hits = np.flatnonzero((windows == suffix).all(axis=1))
    return int(ends[hits[0]] - n + 1) if hits.size else None
