"""`SchedulerStats`: the scheduler's queue and pool counters, for metrics and logs."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class SpecDecodeStats:
    """Speculative decoding's counters since start (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # sequence steps that brought drafts
    num_draft_tokens: int = 0  # drafts proposed
    num_accepted_tokens: int = 0  # drafts the target accepted
    # Entry j: steps whose draft j + 1 was accepted (acceptance falls with the position: a run stops at a rejection)
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One sequence's step: `num_drafts` proposed, the first `num_accepted` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def snapshot(self) -> SpecDecodeStats:
        return dataclasses.replace(self, accepted_per_position=list(self.accepted_per_position))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of queue and pool counters, for metrics and logs."""

    num_running: int  # requests holding pages
    num_waiting: int  # queued requests, preempted ones included
    num_pages_used: int  # pages with refcount > 0
    num_pages_free: int  # pages with refcount 0 and no cached content
    num_pages_cached: int  # pages with refcount 0 whose content a later request may reuse
    num_preemptions: int  # preemptions since start
    prefix_queried_tokens: int  # tokens looked up in the prefix cache by admitted requests
    prefix_hit_tokens: int  # of those, tokens found cached
    num_steps: int  # non-empty batches scheduled since start
    spec_decode: SpecDecodeStats = dataclasses.field(default_factory=SpecDecodeStats)  # all 0 without speculation

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0
