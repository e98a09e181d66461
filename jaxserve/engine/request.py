"""`Request`: the scheduler's mutable view of one sequence being generated."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from jaxserve.sampling_params import SamplingParams
from jaxserve.schedule import PENDING_TOKEN, SamplingRow

if TYPE_CHECKING:
    from jaxserve.engine.structured_output import GrammarMatcher


class RequestStatus(enum.Enum):
    """Where a request is in its life; only RUNNING requests hold pages."""

    WAITING = "waiting"  # queued, never scheduled
    RUNNING = "running"  # holds pages; gets tokens to compute whenever it has some
    PREEMPTED = "preempted"  # its pages were taken back; queued to recompute prompt and outputs
    FINISHED = "finished"  # done or aborted; pages returned


class Request:
    """Tokens, progress and pages of one sequence: computed tokens catch up with known tokens, step by step.

    Token regions, left to right::

        | prompt | outputs read back | pending outputs |
        |<------ known tokens ------>|
        |<------------------- num_tokens ------------->|
        |<-- num_computed_tokens -->|   (anywhere up to num_tokens)

    Pending outputs are sampled on device but not yet read back (async scheduling); they sit in `output_token_ids`
    as PENDING_TOKEN until `resolve_pending_token` fills them in, oldest first.
    """

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                 arrival_index: int, max_new_tokens: int | None = None, *, seed: int = 0,
                 eos_token_ids: tuple[int, ...] = (), grammar: GrammarMatcher | None = None, lora_id: int = 0):
        self.request_id = request_id
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.params = params
        self.arrival_index = arrival_index  # FCFS priority: lower arrived earlier
        # Place in the scheduler's queues, lower first: admitted sooner, preempted later. Fixed by the scheduler on
        # arrival from its policy (Scheduler.add_request); until then first come, first served.
        self.rank: tuple[int, int] = (0, arrival_index)
        # The engine may cap params.max_tokens to the context left; this is the number actually generated at most.
        # At least one: a prompt-only request (max_tokens 0) still samples at its last prompt position (then drops it).
        self.max_new_tokens = max(params.max_tokens if max_new_tokens is None else max_new_tokens, 1)
        self.seed = seed  # of its draws: the request's own seed, or one the engine drew for it
        self.eos_token_ids = eos_token_ids  # the tokenizer's EOS ids, which min_tokens holds back
        # Structured output: where the outputs so far leave the grammar (it follows each token as it is read back;
        # preemption keeps it, since the outputs stay). The engine fills each draw's mask after reading back the
        # token before it, while the step's forward pass already runs (LLMEngine.step).
        self.grammar = grammar
        self.lora_id = lora_id  # its LoRA adapter's id (LoRARequest.lora_int_id); 0: the base model
        self.lora_slot = 0  # the device slot holding that adapter while the request runs; 0: none
        # The scheduler step at which admission first passed it over for want of an adapter slot; None: it was not
        self.lora_wait_since: int | None = None
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Draft-model speculation: leading tokens whose KV the draft model holds, in its pool's copy of these pages
        self.num_draft_computed_tokens = 0
        self.num_pending_tokens = 0
        self.status = RequestStatus.WAITING
        # Block table: page i holds positions [i * page_size, (i + 1) * page_size). A tuple, replaced whenever it
        # changes, so each step's ScheduledSequence takes it as it is (copying it cost 0.03 ms per step at 256).
        self.page_ids: tuple[int, ...] = ()
        self.page_keys: list[int] = []  # prefix-cache key of each leading full page whose content is registered
        self.num_prefix_hit_tokens = 0  # tokens found in the prefix cache at the latest admission
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self._token_ids = list(self.prompt_token_ids)
        # How its tokens are drawn, for the runner: the live outputs, so one row serves every step.
        self.sampling_row = SamplingRow(params=params, prompt_ids=self.prompt_token_ids,
                                        output_ids=self.output_token_ids, eos_token_ids=eos_token_ids, seed=seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus outputs, pending ones included."""
        return len(self._token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows."""
        return len(self._token_ids) - self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens that still need a forward pass; none once the last allowed output is sampled."""
        if self.num_output_tokens >= self.max_new_tokens:
            return 0
        return self.num_tokens - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, stop: int) -> tuple[int, ...]:
        """Tokens at positions [start, stop), PENDING_TOKEN where the id is not read back yet."""
        return tuple(self._token_ids[start:stop])

    def full_pages(self, page_size: int, count: int) -> Iterator[tuple[int, ...]]:
        """The tokens of the first `count` pages, one tuple per page, produced lazily."""
        for index in range(count):
            yield tuple(self._token_ids[index * page_size:(index + 1) * page_size])

    def append_pending_token(self) -> None:
        self._token_ids.append(PENDING_TOKEN)
        self.output_token_ids.append(PENDING_TOKEN)
        self.num_pending_tokens += 1

    def resolve_pending_token(self, token_id: int, accepted_drafts: Sequence[int] = ()) -> None:
        """Replaces the oldest pending output by the id sampled for it, preceded by the drafts the step accepted
        (speculative decoding, where the pending token is the only one)."""
        if self.num_pending_tokens == 0:
            raise RuntimeError(f"request {self.request_id!r} has no pending token to resolve")
        if accepted_drafts and self.num_pending_tokens > 1:
            raise RuntimeError(f"request {self.request_id!r} accepted drafts behind another pending token")
        position = len(self._token_ids) - self.num_pending_tokens
        output_position = position - len(self.prompt_token_ids)
        if accepted_drafts:
            tokens = [*accepted_drafts, token_id]
            self._token_ids[position:position + 1] = tokens
            self.output_token_ids[output_position:output_position + 1] = tokens
        else:
            tokens = (token_id,)
            self._token_ids[position] = token_id
            self.output_token_ids[output_position] = token_id
        self.num_pending_tokens -= 1
        if self.grammar is not None:
            for token in tokens:
                self.grammar.accept(token)

    def reset_for_recompute(self) -> None:
        """Forgets computed state after preemption; prompt and outputs stay, to be computed again."""
        self.num_computed_tokens = self.num_draft_computed_tokens = 0
        self.page_ids = ()
        self.page_keys.clear()
        self.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, pending={self.num_pending_tokens}, pages={len(self.page_ids)})")
