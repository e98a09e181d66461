"""Draft-model speculation: a smaller model with the target's tokenizer proposes k greedy tokens per sequence.

The draft runs in the same scheduler iteration as the target, before it, on its own `ModelRunner` (its own compiled
programs, compiled at start-up, and its own KV pool). Its pool has as many pages as the target's and is addressed by
the same block tables: page p of a request holds the target's KV in one pool and the draft's KV of the same tokens
in the other, so the target's page bookkeeping (allocation, preemption, prefix caching) serves both.

Per iteration, on the step the scheduler built:

1. catch-up: one draft step computes every chunk of the batch (prefill chunks and decode tokens alike), starting
   where the draft's KV of that sequence ends (`Request.num_draft_computed_tokens`), so the draft's KV follows
   the target's; a sampling chunk that may draft samples the first draft from its last token;
2. k - 1 decode steps feed each draft back (on the device: the runner's pending-token path) and sample the next;
3. the host reads the drafts back once, after the last step.

Drafts are the draft's argmax, so the proposal is one-hot, as n-gram drafts are, and the target verifies them the
same way (runner/speculative.py). After verification the draft's KV is valid up to the target's computed tokens:
a rejected draft's KV is overwritten later, and when every draft was accepted the last one, never fed to the
draft, is computed by the next catch-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from jaxserve.checkpoint import LoadedModel, ModelPlan, plan_model
from jaxserve.config import EngineConfig
from jaxserve.engine.proposers import DraftSlot, Proposer
from jaxserve.errors import ConfigError
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.schedule import PENDING_TOKEN, SamplingRow, ScheduledSequence, SchedulerOutput
from jaxserve.tokenizer import Tokenizer, load_tokenizer

_DRAFT_ROW = SamplingRow(params=SamplingParams(temperature=0), prompt_ids=(), output_ids=(), eos_token_ids=(), seed=0,
                         step=0)  # the draft's draws: argmax, nothing masked


def plan_draft_model(config: EngineConfig, target: LoadedModel | ModelPlan, tokenizer: Tokenizer) -> ModelPlan:
    """The draft's plan, checked against the target: same vocabulary and tokenizer, context at least max_model_len.
    Raises ConfigError naming the mismatch (ModelLoadError for a bad folder)."""
    folder = Path(config.speculative_config.model)
    draft = plan_model(folder, dtype=config.dtype, tensor_parallel_size=config.tensor_parallel_size)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ConfigError(f"speculative_config: the draft model {folder} has a vocabulary of "
                          f"{draft.config.vocab_size} tokens, the target {target.config.vocab_size}; they must share "
                          "one tokenizer")
    if draft.config.max_position_embeddings < config.require("max_model_len"):
        raise ConfigError(f"speculative_config: the draft model {folder} handles {draft.config.max_position_embeddings} "
                          f"positions, fewer than max_model_len ({config.max_model_len}); lower max_model_len")
    check_same_tokenizer(tokenizer, load_tokenizer(folder), folder)
    return draft


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, folder: Path) -> None:
    """Drafts are token ids: every id must spell the same bytes in both tokenizers, and EOS must be the same."""
    if draft.vocab_size != target.vocab_size or draft.eos_token_ids != target.eos_token_ids:
        raise ConfigError(f"speculative_config: the draft model {folder} has another tokenizer than the target "
                          f"({draft.vocab_size} tokens, EOS {list(draft.eos_token_ids)} against {target.vocab_size}, "
                          f"{list(target.eos_token_ids)})")
    differing = next((i for i in range(target.vocab_size) if draft.token_bytes(i) != target.token_bytes(i)), None)
    if differing is not None:
        raise ConfigError(f"speculative_config: the draft model {folder} has another tokenizer than the target: token "
                          f"{differing} is {draft.token_bytes(differing)!r} there, {target.token_bytes(differing)!r} "
                          "in the target")


class DraftModelProposer(Proposer):
    """Proposes drafts with the draft model's runner, whose pool mirrors the target's pages."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._budget = runner.config.require("max_num_batched_tokens")
        self._page_size = runner.config.block_size
        self._steps = 0  # SchedulerOutput.step of the draft's own steps

    def propose_batch(self, slots: Sequence[DraftSlot]) -> list[tuple[int, ...]]:
        """Drafts for each slot (() where it brings none), after bringing the draft's KV up to each chunk's end.

        Every draft step is dispatched before the first read-back: draft j reaches step j + 1 on the device.
        """
        first, drafting = self._catch_up_rows(slots)
        if not first:
            return [() for _ in slots]
        launched = [(self._run(first), {row.request_id: index for index, row in enumerate(first)})]
        for j in range(1, max((slot.max_drafts for slot in drafting), default=0)):
            feeding = [slot for slot in drafting if slot.max_drafts > j]
            launched.append((self._run([self._feed_back(slot, j) for slot in feeding]),
                             {slot.request.request_id: index for index, slot in enumerate(feeding)}))
        fetched = [(step.fetch(), rows) for step, rows in launched]
        drafts = {}
        for slot in drafting:
            request_id = slot.request.request_id
            drafts[request_id] = tuple(int(batch.token_ids[rows[request_id]]) for batch, rows in
                                       fetched[:slot.max_drafts])
            # Drafts 1 .. k - 1 were fed to the draft; the last one was only sampled.
            slot.request.num_draft_computed_tokens = slot.chunk_end + slot.max_drafts - 1
        return [drafts.get(slot.request.request_id, ()) for slot in slots]

    def _catch_up_rows(self, slots: Sequence[DraftSlot]) -> tuple[list[ScheduledSequence], list[DraftSlot]]:
        """The first step's chunks: each sequence from where its draft KV ends to its chunk's end; the slots that
        draft. A chunk whose catch-up does not fit the draft's token budget computes what fits and does not draft."""
        rows, drafting, budget = [], [], self._budget
        for slot in slots:
            request = slot.request
            start = min(request.num_draft_computed_tokens, slot.chunk_end - 1)
            end = min(slot.chunk_end, start + budget)
            tokens = request.token_ids(start, end)
            if end <= start or PENDING_TOKEN in tokens:
                continue
            drafts = slot.max_drafts > 0 and end == slot.chunk_end
            rows.append(ScheduledSequence(request.request_id, tokens, start, tuple(request.page_ids[:self._pages(end)]),
                                          samples=drafts, wants_prompt_logits=False, sampling=_DRAFT_ROW))
            request.num_draft_computed_tokens = end
            drafting += [slot] if drafts else []
            budget -= end - start
        return rows, drafting

    def _feed_back(self, slot: DraftSlot, j: int) -> ScheduledSequence:
        """Draft step j + 1: draft j (sampled on the device by the step before) at its position, sampling j + 1."""
        position = slot.chunk_end + j - 1
        request = slot.request
        return ScheduledSequence(request.request_id, (PENDING_TOKEN,), position,
                                 tuple(request.page_ids[:self._pages(position + 1)]), samples=True,
                                 wants_prompt_logits=False, sampling=_DRAFT_ROW)

    def _run(self, rows: list[ScheduledSequence]):
        step = SchedulerOutput(step=self._steps, sequences=tuple(rows),
                               num_batched_tokens=sum(row.num_tokens for row in rows))
        self._steps += 1
        return self.runner.execute(step)

    def _pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self._page_size)
