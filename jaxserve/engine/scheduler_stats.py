"""`SchedulerStats`: the scheduler's queue and pool counters, for metrics and logs."""

from __future__ import annotations

import dataclasses


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

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0
