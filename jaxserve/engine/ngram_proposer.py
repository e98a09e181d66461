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

from jaxserve.engine.proposers import DraftSlot, SequenceProposer
from jaxserve.engine.request import Request
from jaxserve.speculative_config import SpeculativeConfig


class NgramProposer(SequenceProposer):
    """Proposes up to k drafts from a sequence's own history, kept as a numpy array that grows with the sequence
    (copying a long history every step would cost the host more than the lookup)."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._histories: dict[str, _History] = {}  # request id -> its known tokens, for sequences of recent steps

    def propose_batch(self, slots: Sequence[DraftSlot]) -> list[tuple[int, ...]]:
        drafts = [self._lookup(self._history(slot.request), slot.max_drafts) if slot.max_drafts else ()
                  for slot in slots]
        present = {slot.request.request_id for slot in slots}
        for request_id in self._histories.keys() - present:  # finished, preempted or waiting: rebuilt if it returns
            del self._histories[request_id]
        return drafts

    def expects_drafts(self, requests: Sequence[Request]) -> bool:
        """Some running request's known tokens end with an n-gram seen earlier in it: it is likely to again once its
        token in flight is known (a sequence that repeats itself goes on repeating)."""
        return any(self._lookup(self._history(request), 1) for request in requests)

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> tuple[int, ...]:
        """Drafts to follow `token_ids` (every id known), at most max_drafts; () when no suffix recurs."""
        return self._lookup(np.asarray(token_ids, np.int64), max_drafts)

    def _history(self, request: Request) -> np.ndarray:  # i64[known tokens]
        history = self._histories.get(request.request_id)
        if history is None or history.request is not request:
            history = self._histories[request.request_id] = _History(request)
        return history.extended()

    def _lookup(self, tokens: np.ndarray, max_drafts: int) -> tuple[int, ...]:
        if max_drafts < 1 or len(tokens) <= self.min_n:
            return ()
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = _latest_earlier_match(tokens, n)
            if start is not None:
                follow = start + n
                return tuple(int(t) for t in tokens[follow:follow + max_drafts])
        return ()


class _History:
    """A request's known tokens in a numpy buffer that doubles when full; known tokens never change, they only
    grow, so each step appends the new ones."""

    def __init__(self, request: Request):
        self.request = request  # the request it mirrors (an id may be reused by a later request)
        self._buffer = np.zeros(max(64, 2 * request.num_known_tokens), np.int64)  # i64[capacity]
        self._length = 0

    def extended(self) -> np.ndarray:  # i64[known tokens]: a view, valid until the next call
        known = self.request.num_known_tokens
        if known > self._length:
            if known > len(self._buffer):
                self._buffer = np.concatenate([self._buffer, np.zeros(known + len(self._buffer), np.int64)])
            self._buffer[self._length:known] = self.request.token_ids(self._length, known)
            self._length = known
        return self._buffer[:known]


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
