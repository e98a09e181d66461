"""`PoolingEngine`: the continuous-batching loop of a pooling engine (`--runner pooling`): each request is a prompt
turned into one embedding (vLLM's pooling runner for a decoder, `--convert embed`).

Prompts run through the generating engine's Scheduler unchanged, as prompt-only requests (max_tokens 0): each step
hands out prompt chunks under the token budget, a long prompt over several steps, many prompts batched in one. The
runner's pooling program (runner/pooling_step.py) returns per chunk the last token's final hidden state (LAST) or
the sum of the chunk's (MEAN, added up here over the prompt's chunks in float64 and divided by its length). The
chunk that ends a prompt is where the scheduler would sample; nothing is sampled (its pending token is resolved
with a placeholder id that nothing reads) and the request finishes as soon as the step is read back, its pages
released: an embedding request keeps no pages.

The prefix cache: LAST pooling keeps it (the engine's default): a page is registered only once computed, and holds
the same keys and values whichever request computed it, so a later prompt sharing a prefix (an embedding model's
instruction, say) skips it, and its last token, always computed, sees the same context. Its pages stay allocatable
(cached pages are evicted on demand), so nothing is held. MEAN pooling turns it off (EngineConfig.with_pooler): a
prefix found in the cache would leave its tokens' hidden states out of the mean. A preempted prompt starts again at
position 0, where its sum restarts.

Async overlap as in LLMEngine: step N+1 is scheduled and dispatched before step N is read back.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from jaxserve.checkpoint import LoadedModel, ModelPlan
from jaxserve.config import EngineConfig
from jaxserve.engine.prompt_checks import check_prompt_tokens
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.scheduler_stats import SchedulerStats
from jaxserve.engine.startup import start_runner
from jaxserve.errors import InvalidRequestError, JaxserveError
from jaxserve.outputs import PoolingOutput, PoolingRequestOutput
from jaxserve.pooler_config import MEAN_POOLING
from jaxserve.pooling_params import PoolingParams
from jaxserve.runner.pooling_step import PendingPooling
from jaxserve.sampling_params import SamplingParams
from jaxserve.schedule import SchedulerOutput
from jaxserve.tokenizer import Tokenizer

# What the scheduler's prompt-only requests carry: they sample once at their last prompt position, which a pooling
# step replaces by its pooled vector.
_PROMPT_ONLY = SamplingParams(max_tokens=0, temperature=0)
_PLACEHOLDER_TOKEN = 0  # resolves the pending token of a prompt's final chunk; never read
_NORM_EPSILON = 1e-12  # torch.nn.functional.normalize's, which sentence-transformers' Normalize module uses


@dataclasses.dataclass
class _Pooled:
    """One live prompt: what it is and, for MEAN pooling, its hidden states summed so far."""

    request_id: str  # the caller's id
    prompt: str | None  # its text, when given as text
    prompt_token_ids: tuple[int, ...]  # what the model sees (after truncation)
    params: PoolingParams  # its settings
    total: np.ndarray | None = None  # f64[hidden]: MEAN: the sum of the hidden states of its first `counted` tokens
    counted: int = 0  # MEAN: tokens summed in `total`

    def add(self, start: int, count: int, chunk_sum: np.ndarray) -> None:  # chunk_sum f32[hidden]
        """A chunk's sum of hidden states (positions start .. start + count); a chunk at 0 starts the sum again (a
        preempted prompt is recomputed from its start)."""
        if start == 0:
            self.total, self.counted = np.zeros(chunk_sum.shape, np.float64), 0
        if start != self.counted:
            raise RuntimeError(f"a MEAN-pooled prompt's chunk starts at {start}, after {self.counted} summed tokens")
        self.total += chunk_sum
        self.counted += count


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A dispatched pooling step awaiting read-back."""

    schedule: SchedulerOutput  # what was scheduled
    step: PendingPooling  # the device work


class PoolingEngine:
    """Owns the scheduler and a pooling runner; `step()` advances every prompt by one chunk at most."""

    def __init__(self, model: LoadedModel | ModelPlan, tokenizer: Tokenizer, config: EngineConfig,
                 progress: bool = True):
        """`config`: a pooling engine's, its pooler resolved (EngineConfig.with_pooler) and max_model_len too."""
        if not config.pooling or config.pooler_config is None or config.pooler_config.pooling_type is None:
            raise ValueError("a PoolingEngine needs runner pooling with its pooler resolved (with_pooler)")
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.runner, self.config, self.startup_stats, _ = start_runner(model, config, progress)
        self.scheduler = Scheduler(self.config)
        self._mean = self.config.pooler_config.pooling_type == MEAN_POOLING  # else LAST
        self._live: dict[str, _Pooled] = {}  # scheduler id -> its prompt
        self._scheduled_as: dict[str, str] = {}  # the caller's request id -> scheduler id
        self._arrivals = itertools.count()
        self._in_flight: _InFlight | None = None
        self._finished: list[PoolingRequestOutput] = []  # finished in the current step() (or one that failed)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: PoolingParams,
                    prompt: str | None = None, priority: int | None = None) -> None:
        """Queues a prompt to embed; raises InvalidRequestError (changing nothing) if it cannot run."""
        _check_pooling(params)
        params = params.with_priority(priority)
        if request_id in self._scheduled_as:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        ids = self.check_request(prompt_token_ids, params)
        arrival = next(self._arrivals)
        # Unique per arrival: an id reused after an abort, while a step of the old request is in flight, must not
        # take that step's rows.
        scheduled = f"{request_id}#{arrival}"
        self.scheduler.add_request(Request(scheduled, ids, _PROMPT_ONLY.with_priority(params.priority), arrival,
                                           max_new_tokens=1))
        self._live[scheduled] = _Pooled(request_id, prompt, ids, params)
        self._scheduled_as[request_id] = scheduled

    def check_request(self, prompt_token_ids: Sequence[int], params: PoolingParams) -> tuple[int, ...]:
        """The prompt as it will run (truncate_prompt_tokens applied); InvalidRequestError, changing nothing, if
        `add_request` would refuse it: tokens outside the vocabulary, none, more than max_model_len, more than the
        pool holds, shorter embeddings asked for, or a priority the policy refuses."""
        _check_pooling(params)
        if params.dimensions is not None:
            raise InvalidRequestError(f"dimensions: this model's embeddings have "
                                      f"{self.runner.model_config.hidden_size} dimensions and it is not a Matryoshka "
                                      "model, so they cannot be shortened", param="dimensions")
        ids = params.truncated(prompt_token_ids, self.config.max_model_len)
        check_prompt_tokens(ids, vocab_size=self.vocab_size, max_model_len=self.config.max_model_len,
                            generates=False)
        self.scheduler.check_admissible(len(ids), 1, params.priority, scores_only=True)
        return ids

    def abort_request(self, request_id: str) -> None:
        """Stops a request at any point; its pages are free when this returns."""
        scheduled = self._scheduled_as.pop(request_id, None)
        if scheduled is not None:
            self.scheduler.abort_request(scheduled)
            del self._live[scheduled]

    def abort_all_requests(self) -> list[str]:
        """After a failed step: drops every request and the step in flight; returns the aborted request ids."""
        aborted = list(self._scheduled_as)
        for request_id in aborted:
            self.abort_request(request_id)
        self._in_flight = None
        self.scheduler.forget_steps_in_flight()
        self.scheduler.pool.forget_contents()  # pages of the failed step may never have been written
        self._finished.clear()
        self.runner.replace_lost_pool()
        return aborted

    def shutdown(self) -> None:
        """Ends every request once the step on the device is done (no device work may outlive the engine)."""
        if self._in_flight is not None:
            try:
                self._in_flight.step.fetch()
            except Exception:  # its results are dropped anyway; only its end matters
                pass
            self._in_flight = None
            self.scheduler.forget_steps_in_flight()
        for request_id in list(self._scheduled_as):
            self.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._live) or self._in_flight is not None

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    @property
    def compiles_after_warmup(self) -> int:
        """XLA compiles since start-up finished; anything but 0 is a bug."""
        return self.runner.guard.compiles_after_warmup

    def step(self) -> list[PoolingRequestOutput]:
        """One iteration; returns the prompts embedded in it. If it raises, those finished before the failure are
        kept for `pop_finished`."""
        if self._in_flight is not None and not self.config.async_scheduling:
            self._finished += self._complete(self._in_flight)
            self._in_flight = None
        schedule = self.scheduler.schedule()
        dispatched = None if schedule.is_empty else _InFlight(schedule, self.runner.run_pooling(schedule))
        if self._in_flight is not None:
            self._finished += self._complete(self._in_flight)
        self._in_flight = dispatched
        return self.pop_finished()

    def pop_finished(self) -> list[PoolingRequestOutput]:
        finished, self._finished = self._finished, []
        return finished

    def pop_deltas(self) -> list:
        """Nothing streams from a pooling engine (AsyncEngine asks every engine)."""
        return []

    def pop_failed(self) -> list[tuple[str, JaxserveError]]:
        """No pooling request ends with an error of its own (AsyncEngine asks every engine)."""
        return []

    def _complete(self, in_flight: _InFlight) -> list[PoolingRequestOutput]:
        """Reads a step back: sums its MEAN chunks, finishes the prompts whose last chunk it computed."""
        pooled = in_flight.step.fetch()  # f32[n, hidden]
        schedule = in_flight.schedule
        self.scheduler.update_from_output(schedule, {c.request_id: _PLACEHOLDER_TOKEN
                                                     for c in schedule.sequences if c.samples})
        finished = []
        for row, chunk in enumerate(schedule.sequences):
            live = self._live.get(chunk.request_id)
            if live is None:
                continue  # aborted since the step was dispatched
            if self._mean:
                live.add(chunk.start_position, chunk.num_tokens, pooled[row])
            if chunk.samples:
                finished.append(self._finish(chunk.request_id, live, pooled[row]))
        return finished

    def _finish(self, scheduled: str, live: _Pooled, last: np.ndarray) -> PoolingRequestOutput:
        """The prompt's embedding; its pages go back at once."""
        if self._mean:
            if live.counted != len(live.prompt_token_ids):
                raise RuntimeError(f"a MEAN-pooled prompt of {len(live.prompt_token_ids)} tokens summed "
                                   f"{live.counted}")
            vector = live.total / live.counted
        else:
            vector = last.astype(np.float64)
        normalize = live.params.use_activation
        if normalize is None:
            normalize = self.config.pooler_config.normalize
        if normalize:
            vector = vector / max(float(np.linalg.norm(vector)), _NORM_EPSILON)
        self.scheduler.finish_request(scheduled, "stop")
        del self._live[scheduled]
        del self._scheduled_as[live.request_id]
        return PoolingRequestOutput(request_id=live.request_id, outputs=PoolingOutput(vector.astype(np.float32)),
                                    prompt_token_ids=live.prompt_token_ids, finished=True, prompt=live.prompt)


def _check_pooling(params) -> None:
    """Refuses a generation request (SamplingParams) on this engine, naming the setting that would run it."""
    if not isinstance(params, PoolingParams):
        raise InvalidRequestError("this engine embeds prompts (runner pooling): requests take PoolingParams; "
                                  "generating text needs an engine of runner generate", param="runner")
