"""A dispatched step's results on their way to the host: `PendingStep.fetch` reads a step's samples back, with the
prompt scores and accepted drafts of the rows that asked for them, as one `SampledBatch`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from jaxserve.runner.sampler import SamplerOutput
from jaxserve.runner.speculative import VerifiedDrafts
from jaxserve.runner.step import StepResult
from jaxserve.schedule import ScheduledSequence

@dataclasses.dataclass(frozen=True)
class PromptScores:
    """The prompt tokens one chunk scores, each predicted by the token before it: entry j is at first_position + j."""

    first_position: int  # prompt position of entry 0: the chunk's start_position + 1
    token_ids: np.ndarray  # i32[n]: the scored prompt tokens
    logprobs: np.ndarray  # f32[n]: of each scored token, from the raw logits
    ranks: np.ndarray  # i32[n]
    top_ids: np.ndarray  # i32[n, max_logprobs]
    top_logprobs: np.ndarray  # f32[n, max_logprobs]


@dataclasses.dataclass(frozen=True)
class PromptSpan:
    """Where one chunk's scored prompt tokens sit in the flattened step."""

    row: int  # the chunk's index in the step
    first_token: int  # index in the step's T tokens of the chunk's first token
    first_position: int  # prompt position it scores: the chunk's start_position + 1
    count: int  # tokens scored: the chunk's tokens that have a following prompt token


@dataclasses.dataclass(frozen=True)
class AcceptedDrafts:
    """One row's drafts that the target accepted, in order, each scored by the target."""

    token_ids: np.ndarray  # i32[a]: the accepted drafts
    logprobs: np.ndarray  # f32[a]: of each, from the raw logits
    ranks: np.ndarray  # i32[a]
    top_ids: np.ndarray  # i32[a, max_logprobs]
    top_logprobs: np.ndarray  # f32[a, max_logprobs]


@dataclasses.dataclass(frozen=True)
class SampledBatch:
    """A step's samples on the host, row i belonging to the i-th scheduled chunk."""

    token_ids: np.ndarray  # i32[n]
    logprobs: np.ndarray  # f32[n]: of the sampled tokens, from the raw logits
    ranks: np.ndarray  # i32[n]
    top_ids: np.ndarray  # i32[n, max_logprobs]
    top_logprobs: np.ndarray  # f32[n, max_logprobs]
    prompt_scores: dict[int, PromptScores] = dataclasses.field(default_factory=dict)  # row -> its prompt scores
    # Row -> its accepted drafts, which come before its sampled token; rows that brought drafts only (even if none
    # was accepted)
    accepted_drafts: dict[int, AcceptedDrafts] = dataclasses.field(default_factory=dict)


class PendingStep:
    """A dispatched step; `fetch` waits for its samples and prompt scores (the only host sync of a step)."""

    def __init__(self, result: StepResult, num_rows: int, prompt_spans: Sequence[PromptSpan] = (),
                 draft_rows: Sequence[int] = ()):
        self._outputs = (result.sampled, result.prompt_scores, result.drafts)
        self._num_rows = num_rows
        self._prompt_spans = prompt_spans
        self._draft_rows = draft_rows  # rows that brought drafts
        for leaf in jax.tree.leaves(self._outputs):
            leaf.copy_to_host_async()

    def fetch(self) -> SampledBatch:
        with jax.profiler.TraceAnnotation("read_back"):
            host, prompt, drafts = jax.device_get(self._outputs)
        n = self._num_rows
        return SampledBatch(token_ids=host.token_ids[:n], logprobs=host.logprobs[:n], ranks=host.ranks[:n],
                            top_ids=host.top_ids[:n], top_logprobs=host.top_logprobs[:n],
                            prompt_scores={span.row: _span_scores(prompt, span) for span in self._prompt_spans},
                            accepted_drafts={row: _accepted(drafts, row) for row in self._draft_rows})


def prompt_spans(chunks: Sequence[ScheduledSequence]) -> list[PromptSpan]:
    """The chunks that score prompt tokens, each with its tokens that have a following prompt token.

    The scheduler marks a chunk only while it starts before the prompt's last token, so each span has one at least.
    """
    spans, first = [], 0
    for row, chunk in enumerate(chunks):
        if chunk.wants_prompt_logits:
            count = min(chunk.num_tokens, len(chunk.sampling.prompt_ids) - 1 - chunk.start_position)
            spans.append(PromptSpan(row, first, chunk.start_position + 1, count))
        first += chunk.num_tokens
    return spans


def prompt_targets(chunks: Sequence[ScheduledSequence], num_tokens: int) -> np.ndarray:
    """i32[T]: the prompt token each scoring chunk's token predicts; 0 where nothing is scored."""
    targets = np.zeros(num_tokens, np.int32)
    for span in prompt_spans(chunks):
        scored = chunks[span.row].sampling.prompt_ids[span.first_position:span.first_position + span.count]
        targets[span.first_token:span.first_token + span.count] = scored
    return targets


def _span_scores(scores: SamplerOutput, span: PromptSpan) -> PromptScores:
    """One chunk's share of a step's prompt scores (host arrays over the step's T tokens)."""
    tokens = slice(span.first_token, span.first_token + span.count)
    return PromptScores(first_position=span.first_position, token_ids=scores.token_ids[tokens],
                        logprobs=scores.logprobs[tokens], ranks=scores.ranks[tokens],
                        top_ids=scores.top_ids[tokens], top_logprobs=scores.top_logprobs[tokens])


def _accepted(drafts: VerifiedDrafts, row: int) -> AcceptedDrafts:
    """One row's accepted drafts (host arrays of a step's VerifiedDrafts)."""
    count = int(drafts.num_accepted[row])
    scores = drafts.accepted
    return AcceptedDrafts(token_ids=scores.token_ids[row, :count], logprobs=scores.logprobs[row, :count],
                          ranks=scores.ranks[row, :count], top_ids=scores.top_ids[row, :count],
                          top_logprobs=scores.top_logprobs[row, :count])

