"""Each step's padded inputs on the host (StepArrays), built from the scheduler's chunks: the host's share of a step
before its transfer. Pure numpy; `StepInputBuilder` keeps what it carries from step to step (the rows of recent
sequences, where the previous step sampled each)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.runner.buckets import BucketSet, StepBucket
from jaxserve.runner.input_rows import InputRows
from jaxserve.runner.paged_inputs import ChunkLayout, build_metadata
from jaxserve.runner.sampler import build_sampling_tensors
from jaxserve.runner.speculative import build_draft_arrays
from jaxserve.runner.step import StepArrays
from jaxserve.runner.step_results import prompt_targets
from jaxserve.schedule import PENDING_TOKEN, ScheduledSequence, SchedulerOutput


class StepInputBuilder:
    """Picks each step's bucket and builds its padded host inputs."""

    def __init__(self, config: EngineConfig, buckets: BucketSet, num_speculative_tokens: int, with_lora: bool):
        self._config = config
        self._buckets = buckets
        self._num_speculative_tokens = num_speculative_tokens  # drafts per row of a verifying step (K)
        self._with_lora = with_lora  # steps carry each token's adapter slot
        # Penalties read the output history padded to a power of two that holds the longest sequence.
        self._history_width = 1 << (config.require("max_model_len") - 1).bit_length()
        self.last_rows: dict[str, int] = {}  # request id -> its row in the previous step's samples
        # Block tables and sampling settings of the sequences in recent steps, rewritten only where they changed.
        self._rows = InputRows(buckets.max_rows, config.max_pages_per_seq, config.max_logit_bias, config.max_stop_ids)

    def record_samples(self, chunks: Sequence[ScheduledSequence]) -> None:
        """The step just dispatched samples these chunks' rows: the next step's pending tokens come from them."""
        self.last_rows = {c.request_id: row for row, c in enumerate(chunks) if c.samples}

    def forget_samples(self) -> None:
        """The previous step's samples are lost (it failed): no pending token may read them."""
        self.last_rows = {}

    def prepare(self, schedule: SchedulerOutput) -> tuple[StepBucket, StepArrays]:
        """The bucket of this batch and its padded inputs as host arrays (pure numpy: the host's share of a step)."""
        chunks = schedule.sequences
        layout = ChunkLayout.of(chunks)
        # A step without sequences (warm-up, padding) leaves the kept rows alone.
        slots = self._rows.slots(chunks, layout.num_pages) if chunks else None
        bucket = self._buckets.select(schedule.num_batched_tokens, len(chunks),
                                      prompt_logits=any(c.wants_prompt_logits for c in chunks),
                                      penalties=slots is not None and self._rows.any_penalties(slots),
                                      drafts=any(c.num_draft_tokens for c in chunks))
        return bucket, self._step_arrays(chunks, bucket, layout, slots)

    def _step_arrays(self, chunks: Sequence[ScheduledSequence], bucket: StepBucket, layout: ChunkLayout,
                     slots: np.ndarray | None) -> StepArrays:
        """`slots` (i32[n]): the chunks' kept rows (InputRows.slots); None: no chunks."""
        total = layout.num_tokens
        flat_ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), np.int32, total)
        pending = flat_ids == PENDING_TOKEN  # bool[total]
        token_ids = np.zeros(bucket.num_tokens, np.int32)
        token_ids[:total] = np.where(pending, 0, flat_ids)
        pending_rows = np.full(bucket.num_tokens, -1, np.int32)
        if pending.any():
            source_rows = np.fromiter((self.last_rows.get(c.request_id, -1) for c in chunks), np.int32, len(chunks))
            pending_rows[:total] = np.where(pending, source_rows[layout.token_rows], -1)
            if (pending_rows[:total][pending] < 0).any():
                raise RuntimeError("a pending token has no sample in the previous step")
        sample_index = np.zeros(bucket.num_seqs, np.int32)
        sample_index[: len(chunks)] = layout.last_token
        inputs = build_metadata(chunks, num_tokens=bucket.num_tokens, num_seqs=bucket.num_seqs,
                                max_pages=self._config.max_pages_per_seq, page_size=self._config.block_size,
                                block_tables=self._rows.block_table_rows(slots, bucket.num_seqs)
                                if slots is not None else None, layout=layout)
        return StepArrays(token_ids=token_ids, pending_rows=pending_rows, positions=inputs.positions,
                          metadata=inputs.metadata, sample_index=sample_index,
                          sampling=self._sampling_tensors(chunks, bucket, slots),
                          prompt_targets=prompt_targets(chunks, bucket.num_tokens) if bucket.prompt_logits
                          else None,
                          drafts=build_draft_arrays(chunks, layout.last_token, bucket.num_seqs,
                                                    self._num_speculative_tokens) if bucket.drafts else None,
                          lora_slots=_token_lora_slots(chunks, layout, bucket.num_tokens) if self._with_lora
                          else None)

    def _sampling_tensors(self, chunks: Sequence[ScheduledSequence], bucket: StepBucket, slots: np.ndarray | None):
        """The rows' sampling settings but their token masks (allowed: None): from the kept rows (slots), or built
        afresh (the reference path)."""
        history_width = self._history_width if bucket.penalties else 1
        if slots is not None:
            return self._rows.sampling_tensors(chunks, slots, bucket.num_seqs, history_width)
        return dataclasses.replace(build_sampling_tensors(
            [c.sampling for c in chunks], bucket.num_seqs, bias_width=self._config.max_logit_bias,
            stop_width=self._config.max_stop_ids, history_width=history_width, mask_width=1), allowed=None)

    def padding_arrays(self, bucket: StepBucket) -> StepArrays:
        """Inputs of a step with no sequences: the shapes and dtypes of the bucket's program."""
        return self._step_arrays([], bucket, ChunkLayout.of([]), None)


def _token_lora_slots(chunks: Sequence[ScheduledSequence], layout: ChunkLayout,
                      num_tokens: int) -> np.ndarray:  # i32[num_tokens]
    """Each token's adapter slot, its chunk's; padding tokens take slot 0 (none)."""
    slots = np.zeros(num_tokens, np.int32)
    per_chunk = np.fromiter((c.lora_slot for c in chunks), np.int32, len(chunks))  # i32[n]
    slots[:layout.num_tokens] = per_chunk[layout.token_rows]
    return slots
