"""What callers see of their requests: each continuation's sampled tokens assembled into text, log-probabilities and
a finish reason (Sequence), streamed as CompletionDelta where asked for, and each request's RequestOutput once its
last continuation ends.

Prompt log-probabilities (prompt_logprobs) arrive with the samples of the steps that compute the prompt, chunk by
chunk; they are kept by prompt position, so a preempted request recomputing its prompt, or the n continuations of
one prompt each computing it, fill each position once.

The engine decides when a continuation's tokens arrive and what ends it in the scheduler; this module knows nothing
of scheduling, adapters or grammars beyond the "grammar done" it is told.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxserve.engine.logprobs import SampledToken, candidate_logprobs
from jaxserve.engine.sequence import Sequence
from jaxserve.outputs import CompletionDelta, Logprob, RequestOutput
from jaxserve.runner.step_results import AcceptedDrafts, PromptScores, SampledBatch
from jaxserve.sampling_params import SamplingParams
from jaxserve.schedule import SchedulerOutput
from jaxserve.tokenizer import Tokenizer


@dataclasses.dataclass
class TrackedRequest:
    """One submitted prompt: its n continuations and what the caller sees."""

    request_id: str  # the caller's id
    prompt: str | None  # prompt text, when given as text
    prompt_token_ids: tuple[int, ...]  # what the model sees
    continuations: list[str]  # scheduler request ids of the continuations
    sequences: dict[str, Sequence]  # continuation id -> its output so far
    num_prompt_top: int | None  # prompt_logprobs: top candidates per prompt token; None when not asked for
    prompt_logprobs: dict[int, dict[int, Logprob]]  # prompt position (from 1) -> its candidates, filled chunk by chunk
    stream: bool = False  # each step's new tokens are reported as CompletionDelta (pop_deltas)

    def record_prompt_scores(self, scores: PromptScores, tokenizer: Tokenizer) -> None:
        """Files one chunk's scores by prompt position; a position already filled (recomputed) keeps its first."""
        for j in range(len(scores.token_ids)):
            if scores.first_position + j not in self.prompt_logprobs:
                token = sampled_token(scores, j, self.num_prompt_top)
                self.prompt_logprobs[scores.first_position + j] = candidate_logprobs(token, tokenizer)

    def prompt_logprobs_output(self) -> list[dict[int, Logprob] | None] | None:
        """vLLM's form: None for the first prompt token (nothing predicts it), then each token's candidates."""
        if self.num_prompt_top is None:
            return None
        return [None] + [self.prompt_logprobs[p] for p in range(1, len(self.prompt_token_ids))]


@dataclasses.dataclass(frozen=True)
class Appended:
    """What one token did to its continuation."""

    ended: str | None  # the continuation's finish reason when this token ended it; None: it goes on
    output: RequestOutput | None  # the request's output when this token ended its last continuation


class OutputAssembly:
    """The live requests' outputs, by request and by continuation."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._tracked: dict[str, TrackedRequest] = {}  # request id -> its outputs
        self._request_of: dict[str, str] = {}  # live continuation -> its request id
        self._deltas: list[CompletionDelta] = []  # streamed requests' new tokens, not yet popped

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tracked

    def __bool__(self) -> bool:
        return bool(self._tracked)

    def track(self, request_id: str, prompt: str | None, prompt_token_ids: tuple[int, ...], params: SamplingParams,
              continuations: list[str], max_new_tokens: int, stream: bool) -> None:
        """Starts assembling a request's continuations (continuation i is choice i); max_new_tokens 0: the prompt
        is only scored."""
        tracked = TrackedRequest(request_id, prompt, prompt_token_ids, continuations, sequences={},
                                 num_prompt_top=params.prompt_logprobs, prompt_logprobs={}, stream=stream)
        for index, continuation in enumerate(continuations):
            tracked.sequences[continuation] = Sequence(self._tokenizer, prompt_token_ids, params, max_new_tokens,
                                                       index=index)
            self._request_of[continuation] = request_id
        self._tracked[request_id] = tracked

    def request_ids(self) -> list[str]:
        return list(self._tracked)

    def continuations_of(self, request_id: str) -> list[str]:
        """A live request's continuations, ended ones included; [] once the request ended."""
        tracked = self._tracked.get(request_id)
        return list(tracked.continuations) if tracked is not None else []

    def is_live(self, continuation: str) -> bool:
        """The continuation has not ended (nor its request)."""
        return continuation in self._request_of

    def live_continuations(self) -> Iterable[str]:
        return self._request_of.keys()

    def request_of(self, continuation: str) -> str:
        return self._request_of[continuation]

    def num_tokens(self, continuation: str) -> int:
        """Tokens a live continuation has generated so far."""
        return len(self._sequence(continuation).token_ids)

    def logprobs_of(self, continuation: str) -> int:
        """Top log-probabilities a live continuation reports per token (0: none)."""
        return self._sequence(continuation).params.logprobs or 0

    def forget(self, request_id: str) -> list[str]:
        """Drops a request (aborted or failed) and returns its continuations; unknown ids give []."""
        tracked = self._tracked.pop(request_id, None)
        for continuation in tracked.continuations if tracked is not None else ():
            self._request_of.pop(continuation, None)
        return tracked.continuations if tracked is not None else []

    def record_prompt_scores(self, schedule: SchedulerOutput, batch: SampledBatch) -> None:
        """Files a read-back step's prompt scores with the requests still live."""
        for row, scores in batch.prompt_scores.items():
            request_id = self._request_of.get(schedule.sequences[row].request_id)
            if request_id is not None:  # else finished or aborted since the step was dispatched
                self._tracked[request_id].record_prompt_scores(scores, self._tokenizer)

    def append(self, continuation: str, token: SampledToken, grammar_done: bool) -> Appended:
        """One sampled token of a live continuation: its text and log-probabilities, its delta when streamed,
        and whether it ended the continuation (or the whole request). `grammar_done`: its grammar allows nothing
        after this token."""
        tracked = self._tracked[self._request_of[continuation]]
        sequence = tracked.sequences[continuation]
        text = sequence.append(token, grammar_done=grammar_done)
        if tracked.stream:
            self._deltas.append(_delta(tracked, sequence, token, text))
        if not sequence.finished:
            return Appended(None, None)
        del self._request_of[continuation]
        if any(not s.finished for s in tracked.sequences.values()):
            return Appended(sequence.finish_reason, None)
        del self._tracked[tracked.request_id]
        return Appended(sequence.finish_reason, RequestOutput(
            request_id=tracked.request_id, prompt=tracked.prompt, prompt_token_ids=tracked.prompt_token_ids,
            outputs=[tracked.sequences[c].to_output() for c in tracked.continuations], finished=True,
            prompt_logprobs=tracked.prompt_logprobs_output()))

    def pop_deltas(self) -> list[CompletionDelta]:
        """The streaming requests' new tokens since the last call, in the order they were generated."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def _sequence(self, continuation: str) -> Sequence:
        return self._tracked[self._request_of[continuation]].sequences[continuation]


def _delta(tracked: TrackedRequest, sequence: Sequence, token: SampledToken, text: str) -> CompletionDelta:
    kept = sequence.max_new_tokens > 0  # a prompt-only request's one sample is not an output
    # The whole prompt is scored before a continuation's first token is sampled.
    first = len(sequence.token_ids) == int(kept)
    return CompletionDelta(
        request_id=tracked.request_id, index=sequence.index, text=text, token_ids=(token.token_id,) if kept else (),
        logprobs=sequence.logprobs[-1:] if sequence.logprobs is not None else None,
        finish_reason=sequence.finish_reason, stop_reason=sequence.stop_reason,
        prompt_logprobs=tracked.prompt_logprobs_output() if first else None)


def sampled_token(batch: SampledBatch | PromptScores | AcceptedDrafts, row: int, num_top: int) -> SampledToken:
    """Row `row` of a read-back batch as one token with its `num_top` best candidates."""
    top = tuple((int(t), float(lp)) for t, lp in zip(batch.top_ids[row, :num_top], batch.top_logprobs[row, :num_top]))
    return SampledToken(token_id=int(batch.token_ids[row]), logprob=float(batch.logprobs[row]),
                        rank=int(batch.ranks[row]), top=top)
