"""The scheduler → runner contract: what one step computes, as plain frozen dataclasses (no JAX).

The engine's scheduler builds a `SchedulerOutput` each step and the model runner's `execute` takes it as it is;
both import this module, so the record is declared once. A new per-sequence step input (an adapter id, draft
tokens, a grammar state) is a new field of `ScheduledSequence`, filled by the scheduler and read by the runner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxserve.sampling_params import SamplingParams

# Stands for a token sampled on device in the previous step whose id the host has not read back yet; the runner
# substitutes the sampled id before the model sees it.
PENDING_TOKEN = -1
# The all-zero page: padded block-table entries point at it, the host pool never hands it out, and the device pool
# keeps it zero, so padding reads zeros and a freed page never leaks into another request's output.
NULL_PAGE = 0


def mask_width(vocab_size: int) -> int:
    """32-bit words in a row of packed token bits (SamplingRow.token_mask)."""
    return -(-vocab_size // 32)


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    """What the runner needs of a sequence to draw its next token."""

    params: SamplingParams  # the request's sampling parameters
    prompt_ids: Sequence[int]  # the prompt (repetition penalty, prompt_logprobs targets)
    # Tokens generated so far (penalties, min_tokens): the request's live list, read when the step's arrays are
    # built, right after scheduling.
    output_ids: Sequence[int]
    eos_token_ids: Sequence[int]  # the tokenizer's EOS ids; min_tokens masks them unless ignore_eos
    seed: int  # the request's seed, or one the engine drew for it
    # Distinct per draw of the row: how many tokens the sequence has generated, this one included. None: the length
    # of output_ids when the arrays are built (the live list then holds this draw's pending token), so one row can
    # serve a request step after step.
    step: int | None = None
    # i32[ceil(vocab / 32)]: the tokens a grammar allows in this draw, as packed bits (bit t % 32 of word t // 32),
    # for `build_sampling_tensors` (the reference builder); None: every token. The engine's steps leave it None and
    # give the runner each step's masks once the tokens they follow are read back (ModelRunner.finish).
    token_mask: np.ndarray | None = None

    @property
    def draw_step(self) -> int:
        return self.step if self.step is not None else len(self.output_ids)


# Not frozen, though nothing changes one after scheduling: a frozen dataclass costs 1.5 us more to build, 0.4 ms of
# host time per step at 256 sequences (benchmarks/host_overhead.py).
@dataclasses.dataclass(slots=True)
class ScheduledSequence:
    """One request's share of a step: a run of consecutive tokens to compute (a prefill chunk or one decode token)."""

    request_id: str  # the scheduler's id of the sequence
    token_ids: tuple[int, ...]  # tokens to compute; PENDING_TOKEN where the id comes from the previous step's sample
    start_position: int  # position of token_ids[0] in the sequence: tokens of it already in the cache
    page_ids: tuple[int, ...]  # block table: exactly the pages covering positions [0, start_position + len(token_ids))
    samples: bool  # all known tokens are computed after this chunk, so the last token's logits are sampled
    wants_prompt_logits: bool  # return logits of every token of the chunk: it scores prompt tokens (prompt_logprobs)
    sampling: SamplingRow  # how the sequence's next token is drawn (used when `samples`) and its prompt scored
    # Speculative decoding: the last num_draft_tokens of token_ids are proposed, not known; the step scores each
    # against the target and keeps the longest accepted run (only in a sampling chunk whose other ids are known).
    num_draft_tokens: int = 0
    lora_slot: int = 0  # the device slot of the request's LoRA adapter; 0: the base model alone

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def draft_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:]


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    """One ragged batch: every sequence computed in one step, decode tokens and prefill chunks mixed."""

    step: int  # increases by one per schedule() call; update_from_output() calls must come in this order
    # Running requests first, then newly admitted ones, each in the scheduler's rank order (arrival or priority).
    sequences: tuple[ScheduledSequence, ...]
    num_batched_tokens: int  # sum of len(token_ids); at most max_num_batched_tokens
    # (slot, adapter id): LoRA adapters this step's requests newly hold a slot for, to be written before it runs
    lora_loads: tuple[tuple[int, int], ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.sequences
