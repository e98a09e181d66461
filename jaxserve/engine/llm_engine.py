"""`LLMEngine`: the continuous-batching loop — schedule, execute, read back, update, stream or finish.

With async scheduling the host schedules and prepares step N+1 while the device runs step N; the only sync per step
is reading back step N's sampled tokens. Requests using penalties need their previous token on the host, so a step
that carries one waits for the step before it.

Structured output keeps the overlap: a grammar's mask for a draw must follow the token drawn just before, so a step
with constrained rows is dispatched in two parts (ModelRunner.start / finish): its forward pass first, then, while
that runs, step N is read back, the grammars follow its tokens and the masks are filled, and then its sampler. Only
a step whose variant runs as one program (penalties, prompt scores, drafts) reads step N back before dispatching.

Prompt log-probabilities (prompt_logprobs) arrive with the samples of the steps that compute the prompt, chunk by
chunk; they are kept by prompt position, so a preempted request recomputing its prompt, or the n continuations of
one prompt each computing it, fill each position once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Mapping, Sequence as SequenceOf

import jax
import numpy as np

from jaxserve.checkpoint import LoadedModel, ModelPlan
from jaxserve.config import EngineConfig
from jaxserve.engine.logprobs import SampledToken, candidate_logprobs
from jaxserve.engine.lora_registry import LoraRegistry
from jaxserve.engine.prompt_checks import check_prompt_tokens
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.scheduler_stats import SchedulerStats
from jaxserve.engine.sequence import Sequence
from jaxserve.engine.draft_model import DraftModelProposer, plan_draft_model
from jaxserve.engine.startup import start_runner
from jaxserve.engine.step_phases import StepPhaseTimes
from jaxserve.engine.structured_output import CompiledGrammar, GrammarCompiler
from jaxserve.errors import ConstraintFailedError, InvalidRequestError, JaxserveError, ModelNotFoundError
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import CompletionDelta, Logprob, RequestOutput
from jaxserve.runner.step_results import AcceptedDrafts, PendingStep, PromptScores, SampledBatch
from jaxserve.sampling_params import SamplingParams
from jaxserve.schedule import ScheduledSequence, SchedulerOutput
from jaxserve.speculative_config import DRAFT_MODEL_METHOD
from jaxserve.structured_outputs import PARAM
from jaxserve.tokenizer import Tokenizer


@dataclasses.dataclass
class _Tracked:
    """One submitted prompt: its n continuations and what the caller sees."""

    request_id: str  # the caller's id
    prompt: str | None  # prompt text, when given as text
    prompt_token_ids: tuple[int, ...]  # what the model sees
    children: list[str]  # scheduler request ids of the continuations
    sequences: dict[str, Sequence]  # child id -> output assembly
    num_prompt_top: int | None  # prompt_logprobs: top candidates per prompt token; None when not asked for
    prompt_logprobs: dict[int, dict[int, Logprob]]  # prompt position (from 1) -> its candidates, filled chunk by chunk
    stream: bool = False  # each step's new tokens are reported as CompletionDelta (pop_deltas)

    def record_prompt_scores(self, scores: PromptScores, tokenizer: Tokenizer) -> None:
        """Files one chunk's scores by prompt position; a position already filled (recomputed) keeps its first."""
        for j in range(len(scores.token_ids)):
            if scores.first_position + j not in self.prompt_logprobs:
                token = _sampled_token(scores, j, self.num_prompt_top)
                self.prompt_logprobs[scores.first_position + j] = candidate_logprobs(token, tokenizer)

    def prompt_logprobs_output(self) -> list[dict[int, Logprob] | None] | None:
        """vLLM's form: None for the first prompt token (nothing predicts it), then each token's candidates."""
        if self.num_prompt_top is None:
            return None
        return [None] + [self.prompt_logprobs[p] for p in range(1, len(self.prompt_token_ids))]


@dataclasses.dataclass(frozen=True)
class _ReadBack:
    """A step's samples, read back and handed to the scheduler, before they reach the outputs."""

    schedule: SchedulerOutput  # what was scheduled
    batch: SampledBatch  # its samples on the host
    sampled: dict[str, int]  # request id -> its sampled token, for the rows still running
    accepted: dict[str, AcceptedDrafts]  # request id -> the drafts the step accepted before that token


@dataclasses.dataclass(frozen=True)
class _InFlight:
    """A dispatched step awaiting read-back."""

    schedule: SchedulerOutput  # what was scheduled
    step: PendingStep  # the device work


class LLMEngine:
    """Owns the scheduler and the model runner; `step()` advances every request by one iteration."""

    def __init__(self, model: LoadedModel | ModelPlan, tokenizer: Tokenizer, config: EngineConfig,
                 progress: bool = True):
        """`config` with max_model_len resolved (EngineConfig.with_model_limit); the pool is sized here. Given a
        ModelPlan, its weights are read while the step programs compile (`start_runner`)."""
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        spec = config.speculative_config
        draft = plan_draft_model(config, model, tokenizer) if spec and spec.method == DRAFT_MODEL_METHOD else None
        self.runner, self.config, self.startup_stats, self.draft_runner = start_runner(model, config, progress, draft)
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, config.grammar_compile_timeout_s)
        self.scheduler = Scheduler(self.config, proposer=DraftModelProposer(self.draft_runner) if draft else None)
        # The LoRA adapters served; None: enable_lora is off
        self.loras = (LoraRegistry(model.stored_config, model.config, config.max_lora_rank,
                                   config.max_cpu_loras or config.max_loras) if config.enable_lora else None)
        self._tracked: dict[str, _Tracked] = {}
        self._parent_of: dict[str, str] = {}
        self._constrained: set[str] = set()  # child requests under a grammar (structured output)
        self._lora_of: dict[str, int] = {}  # child request -> the LoRA adapter it holds (none: absent)
        self._arrivals = itertools.count()
        self._draw_seeds = np.random.default_rng(config.seed)
        self._in_flight: _InFlight | None = None
        self._deltas: list[CompletionDelta] = []
        self._finished: list[RequestOutput] = []  # finished in the current step() (or one that failed): pop_finished
        self._failed: list[tuple[str, JaxserveError]] = []  # (request id, why) ended with an error: pop_failed
        self.phase_times = StepPhaseTimes()  # host time per phase of step(), summed

    def add_request(self, request_id: str, prompt_token_ids: SequenceOf[int], params: SamplingParams,
                    prompt: str | None = None, stream: bool = False, priority: int | None = None,
                    lora_request: LoRARequest | None = None, load_lora: bool = True,
                    grammar: CompiledGrammar | None = None) -> None:
        """Queues a prompt for `params.n` continuations; raises InvalidRequestError (changing nothing) if it cannot run.

        With `stream`, every token the request's continuations gain is also reported through `pop_deltas`.
        `priority` (vLLM's keyword; None: `params.priority`) orders it under the priority scheduling policy.
        `lora_request`: the LoRA adapter to run with; with `load_lora` (the offline API) it is added first if it is
        not served (LoraAdapterError if it cannot serve), without it (the server, which resolved the name earlier)
        an adapter no longer served is refused (ModelNotFoundError). `grammar`: `params.structured_outputs` compiled
        already (the server awaits it on its event loop); without it the constraint is compiled here, or found in the
        cache.
        """
        params = params.with_priority(priority)
        if request_id in self._tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        ids = tuple(prompt_token_ids)
        max_new = self.check_request(ids, params)
        lora_id = self._lora_id(lora_request, load_lora)
        arrivals = [next(self._arrivals) for _ in range(params.n)]
        # Scheduler ids unique per arrival, whatever the caller's ids: an id reused after an abort, while a step of the
        # old request is still in flight, must not take that step's rows, nor "a" with n > 1 collide with "a#1".
        children = [f"{request_id}#{arrival}" for arrival in arrivals]
        base_seed = params.seed if params.seed is not None else int(self._draw_seeds.integers(2**32))
        tracked = _Tracked(request_id, prompt, ids, children, sequences={}, num_prompt_top=params.prompt_logprobs,
                           prompt_logprobs={}, stream=stream)
        constraint = params.structured_outputs
        if grammar is not None and grammar.constraint != constraint:
            raise ValueError("the compiled grammar given is not the request's structured_outputs")
        if constraint is not None and grammar is None:
            grammar = self.grammars.check(constraint)  # may refuse
        grammars = [grammar.matcher() if grammar is not None else None for _ in children]
        for index, (child, arrival) in enumerate(zip(children, arrivals)):
            # A prompt-only request (max_tokens 0) still samples once, at its last prompt position, and drops it.
            self.scheduler.add_request(Request(child, ids, params, arrival, max_new_tokens=max(max_new, 1),
                                               # As vLLM: continuation i draws with seed + i.
                                               seed=base_seed + index, eos_token_ids=self.tokenizer.eos_token_ids,
                                               grammar=grammars[index], lora_id=lora_id))
            tracked.sequences[child] = Sequence(self.tokenizer, ids, params, max_new, index=index)
            self._parent_of[child] = request_id
            self._hold_lora(child, lora_id)
            if constraint:
                self._constrained.add(child)
        self._tracked[request_id] = tracked

    def check_request(self, prompt_token_ids: SequenceOf[int], params: SamplingParams) -> int:
        """Raises InvalidRequestError, changing nothing, if `add_request` would refuse this prompt and params for
        anything but its LoRA adapter or grammar (the model's and the step programs' limits, the scheduler's
        admission); returns the most tokens it will generate. Every way in checks each request with it before
        running any, so that one bad request never stops the others."""
        ids = tuple(prompt_token_ids)
        check_prompt_tokens(ids, vocab_size=self.vocab_size, max_model_len=self.config.max_model_len,
                            generates=params.max_tokens > 0)
        max_new = self._max_new_tokens(len(ids), params)
        self._check_runner_limits(params)
        self.scheduler.check_admissible(len(ids), max(max_new, 1), params.priority, scores_only=params.max_tokens == 0)
        return max_new

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Serves a LoRA adapter to requests from now on (vLLM's `add_lora`); False if it was served already."""
        if self.loras is None:
            raise InvalidRequestError("LoRA adapters are off: start the engine with enable_lora (--enable-lora)",
                                      param="lora_request")
        return self.loras.add(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Stops serving an adapter to new requests; those queued or running with it finish with it."""
        removed = self.loras.remove(lora_name) if self.loras is not None else None
        if removed is not None:
            self.scheduler.adapter_slots.forget(removed.lora_int_id)
        return removed is not None

    def list_loras(self) -> list[LoRARequest]:
        return self.loras.served() if self.loras is not None else []

    def _lora_id(self, lora_request: LoRARequest | None, load: bool) -> int:
        if lora_request is None:
            return 0
        if load or self.loras is None:
            self.add_lora(lora_request)
        elif self.loras.get(lora_request.lora_name) != lora_request:
            raise ModelNotFoundError(f"the LoRA adapter {lora_request.lora_name!r} was unloaded before this request "
                                     "reached the engine", param="model")
        self.loras.ensure_read(lora_request.lora_int_id)  # may raise: before anything of the request is kept
        return lora_request.lora_int_id

    def _hold_lora(self, child: str, lora_id: int) -> None:
        """The child keeps its adapter in host memory until it ends (`_forget`), so steps never read a folder."""
        if lora_id:
            self.loras.hold(lora_id)
            self._lora_of[child] = lora_id

    def abort_request(self, request_id: str) -> None:
        """Stops a request at any point; its pages are free when this returns."""
        tracked = self._tracked.pop(request_id, None)
        for child in tracked.children if tracked else ():
            self.scheduler.abort_request(child)
            self._forget(child)

    def abort_all_requests(self) -> list[str]:
        """After a failed step: drops every request and the step in flight; returns the aborted request ids.

        A failure inside the device step may have consumed the donated pool, so the runner gets a fresh one.
        """
        aborted = list(self._tracked)
        for request_id in aborted:
            self.abort_request(request_id)
        self._in_flight = None
        self.scheduler.forget_steps_in_flight()
        # Pages registered for the failed step may never have been written, and a replaced pool holds zeros: a later
        # prompt must not find either by its content.
        self.scheduler.pool.forget_contents()
        if self.scheduler.adapter_slots is not None:
            # The failure may have come from writing a slot its bookkeeping already gave an adapter.
            self.scheduler.adapter_slots.reset()
        self._deltas.clear()
        self._finished.clear()
        self.runner.replace_lost_pool()
        if self.draft_runner is not None:
            self.draft_runner.replace_lost_pool()
        return aborted

    def shutdown(self) -> None:
        """Ends every request once the step on the device is done: no device work may outlive the engine (the
        runtime aborts a process that exits while a step runs)."""
        if self._in_flight is not None:
            with contextlib.suppress(Exception):  # its results are dropped anyway; only its end matters
                self._in_flight.step.fetch()
            self._in_flight = None
            self.scheduler.forget_steps_in_flight()  # else the next step, if the engine serves again, waits on it
        for request_id in list(self._tracked):
            self.abort_request(request_id)

    def pop_deltas(self) -> list[CompletionDelta]:
        """The streaming requests' new tokens since the last call, in the order they were generated."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def scheduler_requests(self, request_id: str) -> list[Request]:
        """The scheduler's requests of a live request, one per continuation (their tokens and pages as the host knows
        them); [] once it ended."""
        tracked = self._tracked.get(request_id)
        return [self.scheduler.get_request(child) for child in tracked.children] if tracked is not None else []

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked) or self._in_flight is not None

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    @property
    def compiles_after_warmup(self) -> int:
        """XLA compiles since start-up finished; anything but 0 is a bug (logged when raising is switched off)."""
        return self.runner.guard.compiles_after_warmup + (
            self.draft_runner.guard.compiles_after_warmup if self.draft_runner is not None else 0)

    def step(self) -> list[RequestOutput]:
        """One iteration; returns the requests that finished in it. If it raises, those that finished before the
        failure are kept for `pop_finished`."""
        if self._in_flight is not None and not self._may_overlap():
            self._finished += self._complete(self._in_flight)
            self._in_flight = None
        self._schedule_and_dispatch()
        return self.pop_finished()

    def pop_failed(self) -> list[tuple[str, JaxserveError]]:
        """The requests that ended with an error of their own since the last call (their output constraint failed),
        each with the error its caller gets instead of an output; the engine and the other requests go on."""
        failed, self._failed = self._failed, []
        return failed

    def pop_finished(self) -> list[RequestOutput]:
        """The requests finished since the last call: after a step raised, those it finished first (their callers
        must hear of them before `abort_all_requests` ends the others)."""
        finished, self._finished = self._finished, []
        return finished

    def _schedule_and_dispatch(self) -> None:
        """Schedules and dispatches the next step, then assembles the step still in flight (async overlap)."""
        with jax.profiler.TraceAnnotation("schedule"), self.phase_times.timing("schedule"):
            schedule = self.scheduler.schedule()
        with self.phase_times.timing("dispatch"):
            for slot, lora_id in schedule.lora_loads:
                self.runner.write_lora_slot(slot, self.loras.slot_weights(lora_id))
            started = None if schedule.is_empty else self.runner.start(schedule)
        read_back = None
        if started is not None and self._in_flight is not None and self._constrains(schedule):
            read_back = self._read_back(self._in_flight)  # the masks follow its tokens
        if started is not None:
            with self.phase_times.timing("masks"):
                masks = self._grammar_masks(schedule, started.bucket.num_seqs)
            with self.phase_times.timing("dispatch"):
                dispatched = _InFlight(schedule, self.runner.finish(started, masks))
        else:
            dispatched = None
        if self._in_flight is not None:
            self._finished += self._assemble(read_back if read_back is not None else self._read_back(self._in_flight))
        self._in_flight = dispatched
        self.phase_times.steps += 1

    def _may_overlap(self) -> bool:
        """Async overlap schedules a step before the previous one's tokens are read back, which penalties cannot
        wait for (they count the outputs), nor a step after one that verified drafts (how many it accepted decides
        where the next tokens go). Speculation waits only for the steps that may bring drafts: a draft continues
        the tokens read back, so a step scheduled before the read-back brings none, and while the proposer expects
        none (an n-gram finds no earlier occurrence) the steps overlap as plain ones do."""
        if not self.config.async_scheduling or any(
                request.params.uses_penalties
                for request in map(self.scheduler.get_request, self._parent_of) if request is not None):
            return False
        if self._in_flight is not None and any(s.num_draft_tokens for s in self._in_flight.schedule.sequences):
            return False
        return not self.scheduler.drafts_expected()

    def _constrains(self, schedule: SchedulerOutput) -> bool:
        """Some row of the step draws under a grammar."""
        return bool(self._constrained) and any(s.samples and s.request_id in self._constrained
                                               for s in schedule.sequences)

    def _grammar_masks(self, schedule: SchedulerOutput,
                       num_rows: int) -> Mapping[int, np.ndarray]:  # row -> i32[W]; none without a grammar
        """The masks of the step's constrained draws, each following every token read back so far (a grammar
        already done, its request finishing, draws unconstrained: that sample is never used), filled together in
        place in the step's i32[num_rows, W] array (FilledMasks)."""
        if not self._constrained:
            return {}
        grammars = {}  # row -> its sequence's matcher
        for row, scheduled in enumerate(schedule.sequences):
            if scheduled.samples and scheduled.request_id in self._constrained:
                grammar = self.scheduler.get_request(scheduled.request_id).grammar
                if not grammar.done:
                    grammars[row] = grammar
        return self.grammars.masks.filled(grammars, num_rows) if grammars else {}

    def _complete(self, in_flight: _InFlight) -> list[RequestOutput]:
        """Reads a step's samples back, hands them to the scheduler and to each sequence's output assembly."""
        return self._assemble(self._read_back(in_flight))

    def _read_back(self, in_flight: _InFlight) -> _ReadBack:
        """Waits for a step's samples and hands them to the scheduler (grammars follow them there)."""
        with self.phase_times.timing("wait"):
            batch = in_flight.step.fetch()
        with self.phase_times.timing("outputs"):
            self._record_prompt_scores(in_flight.schedule, batch)
            sampled = {s.request_id: int(batch.token_ids[row]) for row, s in enumerate(in_flight.schedule.sequences)
                       if s.samples and s.request_id in self._parent_of}
            accepted = {in_flight.schedule.sequences[row].request_id: drafts
                        for row, drafts in batch.accepted_drafts.items()}
            self.scheduler.update_from_output(in_flight.schedule, sampled, {
                request_id: len(drafts.token_ids) for request_id, drafts in accepted.items()})
        return _ReadBack(in_flight.schedule, batch, sampled, accepted)

    def _assemble(self, read_back: _ReadBack) -> list[RequestOutput]:
        """A read-back step's tokens into each sequence's output: the requests that finished with them."""
        finished = []
        with self.phase_times.timing("outputs"):
            for row, scheduled in enumerate(read_back.schedule.sequences):
                # (A continuation may have ended meanwhile with its request: its output constraint failed.)
                if scheduled.request_id in read_back.sampled and scheduled.request_id in self._parent_of:
                    output = self._append_run(scheduled, read_back.accepted.get(scheduled.request_id),
                                              read_back.batch, row)
                    finished += [output] if output is not None else []
        return finished

    def _append_run(self, scheduled: ScheduledSequence, drafts: AcceptedDrafts | None, batch: SampledBatch,
                    row: int) -> RequestOutput | None:
        """Appends a row's accepted drafts, then its sampled token, one by one until its sequence finishes (a stop
        string or max_tokens may land inside the run): the output it finished with, or None."""
        num_top = self._logprobs_of(scheduled)
        tokens = [_sampled_token(drafts, j, num_top) for j in range(len(drafts.token_ids))] if drafts else []
        for token in [*tokens, _sampled_token(batch, row, num_top)]:
            output = self._append(scheduled.request_id, token)
            if scheduled.request_id not in self._parent_of:  # finished with this token
                return output
        return None

    def _record_prompt_scores(self, schedule: SchedulerOutput, batch: SampledBatch) -> None:
        for row, scores in batch.prompt_scores.items():
            parent = self._parent_of.get(schedule.sequences[row].request_id)
            if parent is not None:  # else finished or aborted since the step was dispatched
                self._tracked[parent].record_prompt_scores(scores, self.tokenizer)

    def _logprobs_of(self, scheduled) -> int:
        return self._tracked[self._parent_of[scheduled.request_id]].sequences[scheduled.request_id].params.logprobs or 0

    def _append(self, child: str, token: SampledToken) -> RequestOutput | None:
        tracked = self._tracked[self._parent_of[child]]
        sequence = tracked.sequences[child]
        grammar = self.scheduler.get_request(child).grammar
        if grammar is not None and grammar.failure is not None:
            self._fail(tracked, ConstraintFailedError(
                f"the output constraint cannot go on after {len(sequence.token_ids) + 1} generated tokens (the grammar "
                f"allows no complete output from there): {grammar.failure}", param=PARAM))
            return None
        text = sequence.append(token, grammar_done=grammar is not None and grammar.done)
        if tracked.stream:
            kept = sequence.max_new_tokens > 0  # a prompt-only request's one sample is not an output
            # The whole prompt is scored before a continuation's first token is sampled.
            first = len(sequence.token_ids) == int(kept)
            self._deltas.append(CompletionDelta(
                request_id=tracked.request_id, index=sequence.index, text=text,
                token_ids=(token.token_id,) if kept else (),
                logprobs=sequence.logprobs[-1:] if sequence.logprobs is not None else None,
                finish_reason=sequence.finish_reason, stop_reason=sequence.stop_reason,
                prompt_logprobs=tracked.prompt_logprobs_output() if first else None))
        if not sequence.finished:
            return None
        self.scheduler.finish_request(child, sequence.finish_reason)
        self._forget(child)
        if any(not s.finished for s in tracked.sequences.values()):
            return None
        del self._tracked[tracked.request_id]
        return RequestOutput(request_id=tracked.request_id, prompt=tracked.prompt,
                             prompt_token_ids=tracked.prompt_token_ids,
                             outputs=[tracked.sequences[c].to_output() for c in tracked.children], finished=True,
                             prompt_logprobs=tracked.prompt_logprobs_output())

    def _fail(self, tracked: _Tracked, error: JaxserveError) -> None:
        """Ends a request with `error` (pop_failed), all its continuations with it."""
        self.abort_request(tracked.request_id)
        self._failed.append((tracked.request_id, error))

    def _forget(self, child: str) -> None:
        self._parent_of.pop(child, None)
        self._constrained.discard(child)
        lora_id = self._lora_of.pop(child, 0)
        if lora_id:
            self.loras.release(lora_id)

    def _max_new_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        room = self.config.max_model_len - prompt_len
        if params.max_tokens > room and self.config.max_tokens_policy == "reject":
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"({self.config.max_model_len})", param="max_tokens")
        return min(params.max_tokens, room)

    def _check_runner_limits(self, params: SamplingParams) -> None:
        limits = self.runner.config
        if len(params.logit_bias) > limits.max_logit_bias:
            raise InvalidRequestError(f"logit_bias has {len(params.logit_bias)} entries; at most "
                                      f"{limits.max_logit_bias} are allowed", param="logit_bias")
        if len(params.stop_token_ids) + len(self.tokenizer.eos_token_ids) > limits.max_stop_ids:
            raise InvalidRequestError(f"at most {limits.max_stop_ids - len(self.tokenizer.eos_token_ids)} "
                                      "stop_token_ids are allowed", param="stop_token_ids")
        if any(not 0 <= t < self.vocab_size for t, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias names a token outside the vocabulary [0, {self.vocab_size})",
                                      param="logit_bias")
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids names a token outside the vocabulary [0, {self.vocab_size})",
                                      param="stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > limits.max_logprobs:
                raise InvalidRequestError(f"{name} must be at most {limits.max_logprobs} (max_logprobs), got "
                                          f"{getattr(params, name)}", param=name)
        if params.top_k > self.vocab_size:
            raise InvalidRequestError(f"top_k must be at most the vocabulary size ({self.vocab_size}), got "
                                      f"{params.top_k}", param="top_k")


def _sampled_token(batch: SampledBatch | PromptScores | AcceptedDrafts, row: int, num_top: int) -> SampledToken:
    top = tuple((int(t), float(lp)) for t, lp in zip(batch.top_ids[row, :num_top], batch.top_logprobs[row, :num_top]))
    return SampledToken(token_id=int(batch.token_ids[row]), logprob=float(batch.logprobs[row]),
                        rank=int(batch.ranks[row]), top=top)
