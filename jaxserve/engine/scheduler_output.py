"""What the scheduler hands the runner each step, and the counters it exposes; plain frozen dataclasses."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ScheduledSequence:
    """One request's share of a step: a run of consecutive tokens to compute (a prefill chunk or one decode token)."""

    request_id: str
    token_ids: tuple[int, ...]  # tokens to compute; PENDING_TOKEN where the id comes from the previous step's sample
    start_position: int  # position of token_ids[0] in the sequence
    page_ids: tuple[int, ...]  # block table: exactly the pages covering positions [0, start_position + len(token_ids))
    samples: bool  # all known tokens are computed after this chunk, so the last token's logits are sampled
    wants_prompt_logits: bool  # return logits of every token of the chunk: it scores prompt tokens (prompt_logprobs)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """One ragged batch: every sequence computed in one step, decode tokens and prefill chunks mixed."""

    step: int  # increases by one per schedule() call; update_from_output() calls must come in this order
    sequences: tuple[ScheduledSequence, ...]  # running requests first (oldest first), then newly admitted ones
    num_batched_tokens: int  # sum of len(token_ids); at most max_num_batched_tokens
    preempted_ids: tuple[str, ...]  # requests preempted in this schedule() call; the runner drops their state
    finished_ids: tuple[str, ...] = ()  # requests finished or aborted since the previous non-empty output; same

    @property
    def is_empty(self) -> bool:
        return not self.sequences


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
