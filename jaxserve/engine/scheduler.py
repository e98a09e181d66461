"""`Scheduler`: decides, each step, which tokens of which requests the runner computes.

There are no prefill and decode phases (vLLM v1's rule): a request knows `num_tokens` (prompt plus outputs so far)
and `num_computed_tokens`, and each step hands out tokens so that computed catches up with known. One ragged batch
mixes decode tokens and prefill chunks under a token budget and a sequence cap.

Queue policy. Each request gets a rank on arrival and both queues are kept in rank order, lower first:

- `fcfs` (the default): the rank is the arrival order.
- `priority`: the rank is (priority × A + the engine step it arrived at, arrival order), A = priority_aging_steps.
  That is aging: ranking by an effective priority of priority − age / A (age: steps since arrival) gives this order
  at every step, since all requests age alike, so a rank is fixed on arrival and the queues are never re-sorted.
  A request of priority p goes ahead of one of priority p − k that arrives k × A steps after it or later: a stream
  of more urgent requests delays it, never starves it. Steps, not seconds: the scheduler keeps no clock, and a
  step is the unit of work it hands out. Requests of one priority are served first come, first served.

A step (vLLM's chunked-prefill policy, made explicit). The token budget (`max_num_batched_tokens`) goes, in order:

1. to the running decodes (requests with one token to compute), in rank order: a prompt never delays them;
2. to the running prefills (more than one token left: a prompt, or a preempted request's recompute), in rank order;
3. to waiting requests, admitted in rank order, each with its first chunk.

A prefill that does not fit the budget left is chunked (`enable_chunked_prefill`). With `max_num_partial_prefills`
1 (the default) the first one that does not fit takes the rest of the budget, so one long prompt may fill whole
steps while the short ones behind it wait. Above 1, vLLM's limits let short prompts start beside long ones:

- each prefill chunk is at most max_num_batched_tokens / n tokens, n the prompts that may prefill in this step (the
  running prefills, then waiting requests up to the free sequence slots and the long limit), at most
  `max_num_partial_prefills`;
- at most `max_num_partial_prefills` chunks of one step leave their prompt unfinished;
- at most `max_long_partial_prefills` of its prefills are long (more tokens left to compute than
  `long_prefill_token_threshold`, by default 4% of max_model_len): a long prompt past that limit is passed over
  for this step, and shorter ones behind it start. A long prompt is passed over only for better-ranked long prompts
  (the first ones in rank order take the long slots), so it still waits for finitely many.

Pages are found in rank order, whatever the batch order: when they run out, the worst-ranked running request is
preempted by recompute (fcfs: the newest; priority: the least urgent, the newest among equals, as vLLM v1 picks,
aged as above), its chunk dropped from the batch: its pages go back, its computed count drops to zero and it returns
to the waiting queue at its rank with its outputs kept. Admission guarantees that any request fits the pool alone,
so the best-ranked running request can always proceed: no deadlock. No request is admitted in a step that preempted
one for a shortage: the pages just freed would let a victim caught mid-prefill straight back in with a small first
chunk, restarting it for nothing.

Whatever the policy:

- Waiting requests are admitted in rank order with head-of-line blocking: when the head does not fit (tokens, pages
  or sequence cap), nothing behind it is admitted. A request only ever waits for better-ranked ones, of which
  finitely many can exist: starvation is bounded. Two exceptions pass a request over for a step: the long-prefill
  limit above, and a request whose LoRA adapter finds every adapter slot held by other adapters' running requests
  (as in vLLM v1), for at most `max_lora_wait_steps` steps; after that it blocks the queue again, so those requests
  drain, a slot frees, and it is served.
- Admission and preemption share the rank, so a request aged into admission is not the first victim of the next
  shortage (admitted, preempted, admitted again, each time recomputing).

Priority preemption. Under `priority`, when the best-ranked waiting request waits for a sequence slot
(`max_num_seqs`) or for the pages of its first chunk, the least urgent running requests that it outranks and that
have a strictly larger `priority` value are preempted for it, the worst-ranked first, as few as make it fit (none if
they cannot), and it alone is admitted in that step. vLLM v1 lets such an arrival wait for the running batch to
drain (its issue #40004): 16 low-priority requests holding 16 slots made an urgent one finish last of 17. Aging keeps
this from starving anyone: a running request is preempted only for requests ranked ahead of it, i.e. of a priority
k levels more urgent arriving less than k x priority_aging_steps steps after it, finitely many; after that window
no arrival outranks it. A victim ranks behind every running request it shares a priority with, so victims never
preempt each other back.

Async overlap: the engine may call `schedule()` for step N+1 before `update_from_output()` of step N, so progress is
booked at schedule time. A chunk that reaches the end of its request's tokens samples and appends a pending token,
which the next step may already feed as PENDING_TOKEN (the runner substitutes the id it sampled on device). At most
one step may be in flight when `schedule()` is called, so "pending" always means "sampled in the previous step".

Prefix caching: full pages of known tokens are registered once the batch that computes them is built, so they are
reusable from the next step on: device order runs the writing step first, and no kernel reads a page written in the
same batch. So requests admitted in the same step (e.g. the n continuations of one prompt) each compute the shared
prompt; only requests admitted later reuse its pages.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import operator
from collections.abc import Mapping

from jaxserve.engine.adapter_slots import AdapterSlots
from jaxserve.engine.page_pool import PagePool, PrefixMatch, prefix_root
from jaxserve.engine.prompt_checks import check_prompt_length
from jaxserve.config import FCFS_POLICY, PRIORITY_POLICY, EngineConfig
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.ngram_proposer import NgramProposer
from jaxserve.engine.proposers import DraftSlot, Proposer
from jaxserve.engine.scheduler_stats import SchedulerStats, SpecDecodeStats
from jaxserve.errors import InvalidRequestError
from jaxserve.schedule import ScheduledSequence, SchedulerOutput
from jaxserve.speculative_config import NGRAM_METHOD

_NO_PREFIX = PrefixMatch()
_RANK = operator.attrgetter("rank")  # the sort key of both queues


@dataclasses.dataclass
class _StepPlan:
    """The batch being built by one schedule() call."""

    token_budget: int  # tokens the step may still take
    sequences: list[ScheduledSequence] = dataclasses.field(default_factory=list)  # the batch so far, in order
    preempted: bool = False  # a running request lost its pages to a shortage in this call: nobody is admitted
    admit_one: bool = False  # running requests were preempted for the best-ranked waiting one: only it is admitted
    # Chunked prefill's limits (module docstring, "A step"), filled in once the running decodes are planned:
    prefill_cap: int = 0  # most tokens one prefill chunk may take in this step
    num_partial: int = 0  # prefill chunks planned that leave their request's prefill unfinished
    num_long: int = 0  # long prefills (more tokens left than the threshold) with a chunk planned
    lora_loads: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (slot, adapter id) to write
    # Requests whose chunk reaches past their registered pages (a decode token: every page_size-th step): their
    # full pages are offered to the prefix cache once the batch is built.
    to_register: list[Request] = dataclasses.field(default_factory=list)


class Scheduler:
    """Owns the waiting and running queues and turns them into one batch per step; pages come from `pool`."""

    def __init__(self, config: EngineConfig, proposer: Proposer | None = None):
        """`proposer`: where speculative drafts come from (the engine's draft model); None: from the config's
        method (ngram), or none without speculative_config."""
        self.config = config
        self.max_model_len = config.require("max_model_len")
        self.max_num_seqs = config.require("max_num_seqs")
        self.max_num_batched_tokens = config.require("max_num_batched_tokens")
        self.num_pages = config.require("num_kv_pages")
        self.page_size = config.block_size
        self.max_num_partial_prefills = config.max_num_partial_prefills
        self.max_long_partial_prefills = config.max_long_partial_prefills
        self.long_prefill_tokens = config.long_prefill_tokens  # 0: no prompt is long
        self.pool = PagePool(self.num_pages, self.page_size, config.enable_prefix_caching)
        self._requests: dict[str, Request] = {}
        # LoRA adapter slots held by running requests; None: the engine serves no adapters
        self.adapter_slots = AdapterSlots(config.max_loras) if config.enable_lora else None
        self._waiting: list[Request] = []  # kept sorted by rank
        self._running: list[Request] = []  # kept sorted by rank
        self._next_step = 0
        self._steps_in_flight: set[int] = set()
        self._num_preemptions = 0
        self._num_steps = 0
        spec = config.speculative_config
        # Speculative decoding: drafts proposed for sampling chunks, and what became of them.
        self.proposer = proposer if proposer is not None else (
            NgramProposer(spec) if spec is not None and spec.method == NGRAM_METHOD else None)
        self._num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.spec_stats = SpecDecodeStats(accepted_per_position=[0] * self._num_speculative_tokens)

    def add_request(self, request: Request) -> None:
        """Queues a request; raises InvalidRequestError, changing nothing, if it could never run."""
        self.check_admissible(request.num_prompt_tokens, request.max_new_tokens, request.params.priority,
                              scores_only=request.params.max_tokens == 0)
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.rank = self._rank_on_arrival(request)
        self._requests[request.request_id] = request
        bisect.insort(self._waiting, request, key=_RANK)

    def get_request(self, request_id: str) -> Request | None:
        """The live request with this id; None once finished or aborted."""
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def schedule(self) -> SchedulerOutput:
        """Builds the next step's batch and books its progress; an empty output needs no update."""
        if len(self._steps_in_flight) > 1:
            raise RuntimeError(f"steps {sorted(self._steps_in_flight)} await update_from_output(); "
                               "at most one step may be in flight when scheduling the next")
        plan = _StepPlan(self.max_num_batched_tokens)
        # A static batch stays open until its first token exists, so it fills up even when the prompts of one
        # batch take several steps' token budgets to prefill.
        batch_in_progress = self.config.static_batching and any(r.output_token_ids for r in self._running)
        if self.config.scheduling_policy == PRIORITY_POLICY and not batch_in_progress:
            self._preempt_for_waiting(plan)
        self._schedule_running(plan)
        if not plan.preempted and not batch_in_progress:
            self._admit_waiting(plan)
        if self.proposer is not None:
            self._add_drafts(plan)
        for request in plan.to_register:
            self._register_full_pages(request)
        return self._emit(plan)

    def drafts_expected(self) -> bool:
        """Whether the proposer (speculative decoding) expects drafts for a running request from its known tokens:
        then the next step should wait for the tokens in flight (drafts continue them) rather than overlap."""
        return self.proposer is not None and self.proposer.expects_drafts(self._running)

    def forget_steps_in_flight(self) -> None:
        """After a failed step (its requests aborted): the outputs of the steps scheduled so far never come back."""
        self._steps_in_flight.clear()

    def update_from_output(self, output: SchedulerOutput, sampled: Mapping[str, int],
                           num_accepted: Mapping[str, int] | None = None) -> None:
        """Fills in the tokens sampled in `output`'s step: `sampled` maps each sampling sequence to its token id,
        `num_accepted` each sequence that brought drafts to how many of them the step accepted.

        Outputs must come back in step order. Results of requests finished meanwhile are dropped.
        """
        self._steps_in_flight.discard(output.step)
        for scheduled in output.sequences:
            request = self._requests.get(scheduled.request_id)
            drafted = scheduled.num_draft_tokens
            if drafted:
                self.spec_stats.record(drafted, num_accepted[scheduled.request_id])
            if not scheduled.samples or request is None or request.num_pending_tokens == 0:
                continue
            if drafted:
                accepted = scheduled.draft_token_ids[:num_accepted[scheduled.request_id]]
                request.resolve_pending_token(sampled[scheduled.request_id], accepted)
                self._roll_back_rejected(request, drafted - len(accepted))
            else:
                request.resolve_pending_token(sampled[scheduled.request_id])
            # A preempted request keeps this token (it was sampled from intact pages) but holds no pages to register.
            if request.num_computed_tokens // self.page_size > len(request.page_keys):
                self._register_full_pages(request)

    def finish_request(self, request_id: str, reason: str) -> None:
        """Ends a request wherever it is and returns its pages at once; unknown or finished ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
            self._release_adapter(request)
        else:
            self._waiting.remove(request)
        self._release_pages(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def abort_request(self, request_id: str) -> None:
        self.finish_request(request_id, "abort")

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_pages_used=self.pool.num_used,
            num_pages_free=self.pool.num_free,
            num_pages_cached=self.pool.num_cached,
            num_preemptions=self._num_preemptions,
            prefix_queried_tokens=self.pool.prefix_queried_tokens,
            prefix_hit_tokens=self.pool.prefix_hit_tokens,
            num_steps=self._num_steps,
            spec_decode=self.spec_stats.snapshot(),
        )

    def _rank_on_arrival(self, request: Request) -> tuple[int, int]:
        """The request's place in both queues (module docstring, "Queue policy"); `_num_steps` is the age clock."""
        if self.config.scheduling_policy == FCFS_POLICY:
            return (0, request.arrival_index)
        return (request.params.priority * self.config.priority_aging_steps + self._num_steps, request.arrival_index)

    def check_admissible(self, prompt_len: int, max_new_tokens: int, priority: int, scores_only: bool = False) -> None:
        """Raises InvalidRequestError if a request of this prompt length, generating at most `max_new_tokens`, could
        never run (or its priority is refused). `scores_only`: max_tokens 0, the prompt alone is computed (its one
        sample is dropped), so it may fill the whole context."""
        check_priority(priority, self.config.scheduling_policy)
        limit, usable_pages = self.max_model_len, self.num_pages - 1
        kept = 0 if scores_only else max_new_tokens
        check_prompt_length(prompt_len, limit, generates=kept > 0)
        if prompt_len + kept > limit:
            raise InvalidRequestError(f"the prompt ({prompt_len} tokens) plus max_tokens ({kept}) "
                                      f"exceeds the maximum context length of {limit} tokens", param="max_tokens")
        if self._pages_for(prompt_len) > usable_pages:
            raise InvalidRequestError(f"the prompt needs {self._pages_for(prompt_len)} KV pages but the pool has "
                                      f"{usable_pages}", param="prompt")
        # The last sampled token is never fed back, so it needs no KV slot.
        needed = self._pages_for(prompt_len + max_new_tokens - 1)
        if needed > usable_pages:
            raise InvalidRequestError(f"the prompt plus max_tokens needs {needed} KV pages but the pool has "
                                      f"{usable_pages}; lower max_tokens", param="max_tokens")

    def _schedule_running(self, plan: _StepPlan) -> None:
        planned, needing_pages = self._plan_running(plan)
        if needing_pages:
            self._find_pages(needing_pages, plan)
        if plan.preempted:  # the victims' chunks are dropped
            planned = [(request, num_new) for request, num_new in planned if request.status is RequestStatus.RUNNING]
        for request, num_new in planned:
            self._schedule_chunk(request, num_new, plan)

    def _plan_running(self, plan: _StepPlan) -> tuple[list[tuple[Request, int]], list[tuple[Request, int]]]:
        """Tokens for each running request, in batch order: the decodes, then the prefills' chunks under the partial-
        prefill limits (module docstring, "A step"), as (request, tokens); and those of them whose chunk reaches past
        the pages their request holds. Nothing is booked yet."""
        # The per-request work of a step at hundreds of sequences: properties are read inline (each call saved per
        # request is ~0.03 ms per step at 256 sequences, benchmarks/host_overhead.py).
        planned: list[tuple[Request, int]] = []
        needing_pages: list[tuple[Request, int]] = []
        prefills: list[tuple[Request, int]] = []
        budget, page_size = plan.token_budget, self.page_size
        for request in self._running:
            if len(request.output_token_ids) >= request.max_new_tokens:
                continue  # its last output is sampled; it waits only for finish_request
            computed = request.num_computed_tokens
            remaining = request.num_tokens - computed
            if remaining == 1:
                if budget:
                    planned.append((request, 1))
                    budget -= 1
                    # Most decodes fit the pages they hold (a decode token needs a new page every 16th step).
                    if computed >= len(request.page_ids) * page_size:
                        needing_pages.append((request, 1))
            elif remaining:
                prefills.append((request, remaining))
        plan.prefill_cap = self._prefill_cap(prefills)
        for request, remaining in prefills:
            if not budget:
                break
            num_new = self._prefill_chunk(remaining, budget, plan)
            if num_new:
                planned.append((request, num_new))
                budget -= num_new
                if request.num_computed_tokens + num_new > len(request.page_ids) * page_size:
                    needing_pages.append((request, num_new))
        return planned, needing_pages

    def _find_pages(self, needing_pages: list[tuple[Request, int]], plan: _StepPlan) -> None:
        """Allocates the pages the planned chunks lack, in rank order; short of pages, the worst-ranked running
        requests are preempted (their chunks are dropped) until the chunk fits or its own request was the worst."""
        for request, num_new in sorted(needing_pages, key=lambda chunk: chunk[0].rank):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted for a better-ranked request's pages
            stop = request.num_computed_tokens + num_new
            if not self._make_room(request, stop, plan):
                return  # it went itself, the last of the running requests
            missing = self._pages_for(stop) - len(request.page_ids)
            request.page_ids += tuple(self.pool.allocate(missing))

    def _make_room(self, request: Request, num_tokens: int, plan: _StepPlan) -> bool:
        """Preempts the worst-ranked running requests until `request` can hold `num_tokens`; False if it went itself."""
        while self._pages_for(num_tokens) - len(request.page_ids) > self.pool.num_allocatable:
            victim = self._running[-1]
            self._preempt(victim)
            plan.preempted = True
            if victim is request:
                return False
        return True

    def _prefill_cap(self, running_prefills: list[tuple[Request, int]]) -> int:
        """The most tokens one prefill chunk may take in this step: the budget shared by the prefills that may advance
        in it (vLLM's "schedulable prefills": the running ones, then waiting ones up to the free sequence slots, long
        ones up to their limit), at most max_num_partial_prefills of them."""
        limit = self.max_num_partial_prefills
        if limit == 1:
            return self.max_num_batched_tokens
        count = len(running_prefills)
        num_long = sum(1 for _, remaining in running_prefills if self._is_long(remaining))
        free_slots = self.max_num_seqs - len(self._running)
        for request in self._waiting[:free_slots]:
            if count >= limit:
                break
            if self._is_long(request.num_tokens_to_compute):
                if num_long >= self.max_long_partial_prefills:
                    continue
                num_long += 1
            count += 1
        return self.max_num_batched_tokens // max(min(count, limit), 1)

    def _prefill_chunk(self, num_remaining: int, token_budget: int, plan: _StepPlan) -> int | None:
        """The size of a prefill's chunk in this step (of `num_remaining` tokens left), counted against the partial-
        prefill limits; 0 if it does not fit the budget unchunked, None if the limits pass it over for this step."""
        is_long = self._is_long(num_remaining)
        if is_long and plan.num_long >= self.max_long_partial_prefills:
            return None
        num_new = self._chunk_size(num_remaining, min(token_budget, plan.prefill_cap))
        if num_new < num_remaining and plan.num_partial >= self.max_num_partial_prefills:
            return None
        if num_new:
            plan.num_partial += num_new < num_remaining
            plan.num_long += is_long
        return num_new

    def _is_long(self, num_remaining: int) -> bool:
        return 0 < self.long_prefill_tokens < num_remaining

    def _preempt_for_waiting(self, plan: _StepPlan) -> None:
        """Priority policy: preempts for the best-ranked waiting request when it waits for a sequence slot or pages
        (module docstring, "Priority preemption")."""
        if not self._waiting or not self._running:
            return
        head = self._waiting[0]
        if head.num_tokens_to_compute == 0:
            return
        if self.adapter_slots is not None and not self.adapter_slots.can_acquire(head.lora_id):
            return  # it waits for an adapter slot, which preemption is not for
        victims = self._victims_for(head)
        for victim in victims:
            self._preempt(victim)
        plan.admit_one = bool(victims)

    def _victims_for(self, head: Request) -> list[Request]:
        """The fewest worst-ranked running requests whose preemption lets `head` start now with the pages of its first
        chunk (at most a whole step's budget), each of a strictly larger priority value and ranked behind it; [] if
        it fits already, or if they cannot make it fit."""
        match = self._cached_prefix(head)
        num_hit = match.num_pages * self.page_size
        first_chunk = self._chunk_size(head.num_tokens_to_compute - num_hit, self.max_num_batched_tokens)
        new_pages = self._pages_for(num_hit + first_chunk) - match.num_pages
        victims: list[Request] = []
        released: collections.Counter[int] = collections.Counter()  # page -> references the victims drop
        candidates = reversed(self._running)
        while (len(self._running) - len(victims) >= self.max_num_seqs
               or new_pages > self._allocatable_after(released, match)):
            victim = next(candidates, None)
            if victim is None or victim.params.priority <= head.params.priority or victim.rank < head.rank:
                return []
            victims.append(victim)
            released.update(victim.page_ids)
        return victims

    def _allocatable_after(self, released: collections.Counter[int], match: PrefixMatch) -> int:
        """Pages a request with cached prefix `match` could allocate after `released` (page -> references dropped)
        went back: the pool's allocatable pages, those the release frees, less the matched ones it would take out."""
        refcount = self.pool.refcount
        freed = sum(1 for page, count in released.items() if refcount(page) == count)
        matched_idle = sum(1 for page in match.page_ids if refcount(page) == released[page])
        return self.pool.num_allocatable + freed - matched_idle

    def _admit_waiting(self, plan: _StepPlan) -> None:
        index = 0  # waiting requests before it are passed over: they wait for a LoRA adapter slot
        while index < len(self._waiting) and plan.token_budget > 0 and len(self._running) < self.max_num_seqs:
            request = self._waiting[index]
            if request.num_tokens_to_compute == 0:
                break  # its last output is sampled; it waits only for finish_request
            if self.adapter_slots is not None and not self.adapter_slots.can_acquire(request.lora_id):
                # Every slot is in use by other adapters' running requests: those behind it may go first (as in
                # vLLM v1), for a while; past that, nothing passes it, so running requests drain and free a slot.
                if request.lora_wait_since is None:
                    request.lora_wait_since = self._num_steps
                if self._num_steps - request.lora_wait_since >= self.config.max_lora_wait_steps:
                    break
                index += 1
                continue
            match = self._cached_prefix(request)
            num_hit = match.num_pages * self.page_size
            num_new = self._prefill_chunk(request.num_tokens_to_compute - num_hit, plan.token_budget, plan)
            if num_new is None:  # the partial-prefill limits pass it over for this step
                if plan.admit_one:
                    break  # the running requests preempted for it keep waiting behind it
                index += 1
                continue
            new_pages = self._pages_for(num_hit + num_new) - match.num_pages
            if not num_new or new_pages > self.pool.num_allocatable - self.pool.num_evictable(match.page_ids):
                break
            self._waiting.pop(index)
            request.lora_wait_since = None
            self._start_running(request, match, plan)
            self._schedule_chunk(request, num_new, plan)
            if plan.admit_one:
                break

    def _cached_prefix(self, request: Request) -> PrefixMatch:
        """Cached pages of the request's leading known tokens, leaving at least its last known token to compute."""
        if request.wants_prompt_logprobs:
            return _NO_PREFIX  # every prompt token must be computed to score it
        max_pages = (request.num_known_tokens - 1) // self.page_size
        pages = request.full_pages(self.page_size, max_pages)
        return self.pool.match_prefix(pages, num_queried_tokens=request.num_known_tokens,
                                      root=prefix_root(request.lora_id))

    def _start_running(self, request: Request, match: PrefixMatch, plan: _StepPlan) -> None:
        if self.adapter_slots is not None:
            request.lora_slot, fresh = self.adapter_slots.acquire(request.lora_id)
            if fresh:
                plan.lora_loads.append((request.lora_slot, request.lora_id))
        self.pool.acquire_prefix(match)
        request.page_ids = tuple(match.page_ids)
        request.page_keys = list(match.keys)
        # A cached page holds the draft model's KV of its tokens too (its pool mirrors the target's pages).
        request.num_computed_tokens = request.num_prefix_hit_tokens = match.num_pages * self.page_size
        request.num_draft_computed_tokens = request.num_computed_tokens
        request.status = RequestStatus.RUNNING
        bisect.insort(self._running, request, key=_RANK)

    def _chunk_size(self, num_remaining: int, token_budget: int) -> int:
        if num_remaining > token_budget and not self.config.enable_chunked_prefill:
            return 0
        return min(num_remaining, token_budget)

    def _schedule_chunk(self, request: Request, num_new: int, plan: _StepPlan) -> None:
        start = request.num_computed_tokens
        stop = start + num_new
        page_ids = request.page_ids
        if stop > len(page_ids) * self.page_size:
            request.page_ids = page_ids = page_ids + tuple(self.pool.allocate(self._pages_for(stop) - len(page_ids)))
        request.num_computed_tokens = stop
        samples = stop == request.num_tokens
        token_ids = request.token_ids(start, stop)
        if samples:
            request.append_pending_token()
        if stop // self.page_size > len(request.page_keys):
            plan.to_register.append(request)
        # Positional: building it by keyword costs twice as much (0.35 us more per sequence, 0.09 ms per step at 256).
        plan.sequences.append(ScheduledSequence(
            request.request_id,  # request_id
            token_ids,  # token_ids
            start,  # start_position
            page_ids,  # page_ids
            samples,  # samples
            # wants_prompt_logits: logits at position p score prompt token p + 1; the last prompt position's logits
            # are the sample's.
            request.params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1,
            request.sampling_row,  # sampling
            0,  # num_draft_tokens: _add_drafts adds them
            request.lora_slot,  # lora_slot
        ))
        plan.token_budget -= num_new

    def _add_drafts(self, plan: _StepPlan) -> None:
        """Extends the step's sampling chunks with proposed drafts, from the token budget and pages left.

        Drafts fill what the batch leaves over: they never preempt, never delay an admission, and a step that
        scores prompts or applies penalties gets none (its programs verify no drafts). Each drafting chunk gets the
        pages for its most drafts first (a draft model writes its KV there), and gives back what it did not use.
        """
        may_draft = not any(c.wants_prompt_logits or c.sampling.params.uses_penalties for c in plan.sequences)
        slots = []
        for chunk in plan.sequences:
            request = self._requests[chunk.request_id]
            most = self._most_drafts(request, plan.token_budget) if may_draft and chunk.samples else 0
            plan.token_budget -= most
            slots.append(DraftSlot(request, chunk.start_position + chunk.num_tokens, most))
        for index, (slot, drafts) in enumerate(zip(slots, self.proposer.propose_batch(slots))):
            plan.token_budget += slot.max_drafts - len(drafts)
            if slot.max_drafts:
                self._release_pages_after(slot.request, slot.chunk_end + len(drafts))
            if drafts:
                slot.request.num_computed_tokens += len(drafts)
                chunk = plan.sequences[index]
                plan.sequences[index] = dataclasses.replace(chunk, token_ids=chunk.token_ids + drafts,
                                                            page_ids=tuple(slot.request.page_ids),
                                                            num_draft_tokens=len(drafts))

    def _most_drafts(self, request: Request, token_budget: int) -> int:
        """Drafts the request may bring to this step, their pages allocated: no more than k, than the token budget,
        than its max_tokens leaves room for (the step emits one token past them) or than free pages can hold (drafts
        never evict a cached prefix)."""
        if not _may_draft(request):
            return 0
        stop = request.num_computed_tokens
        room_in_pages = (len(request.page_ids) + self.pool.num_free) * self.page_size - stop
        most = max(min(self._num_speculative_tokens, token_budget, request.max_new_tokens - request.num_output_tokens,
                       room_in_pages), 0)
        missing_pages = self._pages_for(stop + most) - len(request.page_ids)
        if missing_pages > 0:
            request.page_ids += tuple(self.pool.allocate(missing_pages))
        return most

    def _release_pages_after(self, request: Request, num_tokens: int) -> None:
        """Gives back the request's pages past those covering its first num_tokens positions (never registered:
        they hold no known token's KV)."""
        keep = self._pages_for(num_tokens)
        if len(request.page_ids) > keep:
            self.pool.release(reversed(request.page_ids[keep:]))
            request.page_ids = request.page_ids[:keep]

    def _roll_back_rejected(self, request: Request, num_rejected: int) -> None:
        """Forgets the KV of rejected drafts: the tokens after the accepted run are computed again from the right
        ones, and pages holding nothing but rejected drafts go back (never registered: drafts are not known)."""
        request.num_computed_tokens -= num_rejected
        request.num_draft_computed_tokens = min(request.num_draft_computed_tokens, request.num_computed_tokens)
        self._release_pages_after(request, request.num_computed_tokens)

    def _preempt(self, request: Request) -> None:
        self._running.remove(request)
        self._release_adapter(request)
        self._release_pages(request)
        request.reset_for_recompute()
        bisect.insort(self._waiting, request, key=_RANK)
        self._num_preemptions += 1

    def _register_full_pages(self, request: Request) -> None:
        """Offers the request's computed full pages of known tokens to the prefix cache, each once."""
        if not self.config.enable_prefix_caching:
            return
        page_size = self.page_size
        num_full = min(request.num_computed_tokens, request.num_known_tokens) // page_size
        for index in range(len(request.page_keys), num_full):
            parent = request.page_keys[-1] if request.page_keys else prefix_root(request.lora_id)
            tokens = request.token_ids(index * page_size, (index + 1) * page_size)
            request.page_keys.append(self.pool.register(request.page_ids[index], parent, tokens))

    def _release_adapter(self, request: Request) -> None:
        if self.adapter_slots is not None:
            self.adapter_slots.release(request.lora_slot)
        request.lora_slot = 0

    def _release_pages(self, request: Request) -> None:
        self.pool.release(reversed(request.page_ids))
        request.page_ids = ()
        request.page_keys.clear()

    def _emit(self, plan: _StepPlan) -> SchedulerOutput:
        output = SchedulerOutput(
            step=self._next_step,
            sequences=tuple(plan.sequences),
            num_batched_tokens=self.max_num_batched_tokens - plan.token_budget,
            lora_loads=tuple(plan.lora_loads),
        )
        self._next_step += 1
        if plan.sequences:
            self._steps_in_flight.add(output.step)
            self._num_steps += 1
        return output

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


def check_priority(priority: int, policy: str) -> None:
    """Refuses a priority other than 0 unless requests are scheduled by priority, rather than ignore it (as vLLM)."""
    if priority != 0 and policy != PRIORITY_POLICY:
        raise InvalidRequestError(f"priority {priority} needs priority scheduling, but this engine serves first come, "
                                  f"first served: start it with scheduling_policy {PRIORITY_POLICY} "
                                  f"(--scheduling-policy {PRIORITY_POLICY})", param="priority")


def _may_draft(request: Request) -> bool:
    """Speculation applies to the request's next draws: its only pending token is this step's (every other id is
    known), no grammar constrains it and min_tokens is met (each draw of a run would need its own EOS mask)."""
    return (request.num_pending_tokens == 1 and request.grammar is None
            and request.num_output_tokens > request.params.min_tokens)
