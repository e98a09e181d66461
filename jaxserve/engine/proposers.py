"""What the scheduler asks of a draft proposer (speculative decoding), whatever proposes: n-gram lookup, a model."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

from jaxserve.engine.request import Request


@dataclasses.dataclass(frozen=True)
class DraftSlot:
    """One chunk of a step, as a proposer sees it."""

    request: Request  # the chunk's sequence: its known tokens, pages (allocated for max_drafts) and draft progress
    chunk_end: int  # position after the chunk's last token (before drafts)
    max_drafts: int  # drafts it may bring; 0: none (a draft model still follows the chunk's tokens)


class Proposer(abc.ABC):
    """Proposes drafts for a step's chunks; called once per step with every chunk of it."""

    @abc.abstractmethod
    def propose_batch(self, slots: Sequence[DraftSlot]) -> list[tuple[int, ...]]:
        """Drafts for each slot, at most its max_drafts (() for none)."""

    def expects_drafts(self, requests: Sequence[Request]) -> bool:
        """Whether it would propose drafts for some of these running requests once their tokens in flight are
        known, judged from the tokens known now. A step scheduled before the read-back gets no drafts, so True
        makes the engine wait for it; a proposer that always drafts (a draft model) says True."""
        return bool(requests)


class SequenceProposer(Proposer):
    """A proposer that looks at one sequence's known tokens at a time."""

    def propose_batch(self, slots: Sequence[DraftSlot]) -> list[tuple[int, ...]]:
        return [self.propose(slot.request.token_ids(0, slot.request.num_known_tokens), slot.max_drafts)
                if slot.max_drafts else () for slot in slots]

    @abc.abstractmethod
    def propose(self, token_ids: Sequence[int], max_drafts: int) -> tuple[int, ...]:
        """Drafts to follow `token_ids` (every id known), at most max_drafts."""
