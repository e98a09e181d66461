"""`LLMEngine`: the continuous-batching loop — schedule, execute, read back, update, stream or finish.

With async scheduling the host schedules and prepares step N+1 while the device runs step N; the only sync per step
is reading back step N's sampled tokens. Requests using penalties need their previous token on the host, so a step
that carries one waits for the step before it.

Structured output keeps the overlap: a grammar's mask for a draw must follow the token drawn just before, so a step
with constrained rows is dispatched in two parts (ModelRunner.start / finish): its forward pass first, then, while
that runs, step N is read back, the grammars follow its tokens and the masks are filled, and then its sampler. Only
a step whose variant runs as one program (penalties, prompt scores, drafts) reads step N back before dispatching.

What callers see (text, logprobs, deltas, outputs) is assembled by engine/output_assembly.py; whether a request can
run at all is engine/request_checks.py's; the LoRA adapters' lifecycle is engine/engine_loras.py's.
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
from jaxserve.engine.draft_model import DraftModelProposer, plan_draft_model
from jaxserve.engine.engine_loras import EngineLoras
from jaxserve.engine.logprobs import SampledToken
from jaxserve.engine.lora_registry import LoraRegistry
from jaxserve.engine.output_assembly import OutputAssembly, sampled_token
from jaxserve.engine.request import Request
from jaxserve.engine.request_checks import checked_max_new_tokens
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.scheduler_stats import SchedulerStats
from jaxserve.engine.startup import start_runner
from jaxserve.engine.step_phases import StepPhaseTimes
from jaxserve.engine.structured_output import CompiledGrammar, GrammarCompiler
from jaxserve.errors import ConstraintFailedError, InvalidRequestError, JaxserveError
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import CompletionDelta, RequestOutput
from jaxserve.runner.step_results import AcceptedDrafts, PendingStep, SampledBatch
from jaxserve.sampling_params import SamplingParams
from jaxserve.schedule import ScheduledSequence, SchedulerOutput
from jaxserve.speculative_config import DRAFT_MODEL_METHOD
from jaxserve.structured_outputs import PARAM
from jaxserve.tokenizer import Tokenizer


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
        # The LoRA adapters served (none without enable_lora) and the continuations holding them
        self.loras = EngineLoras(LoraRegistry(model.stored_config, model.config, config.max_lora_rank,
                                              config.max_cpu_loras or config.max_loras) if config.enable_lora else None,
                                 self.scheduler.adapter_slots)
        self.outputs = OutputAssembly(tokenizer)  # what callers see of each live request
        self._constrained: set[str] = set()  # continuations under a grammar (structured output)
        self._arrivals = itertools.count()
        self._draw_seeds = np.random.default_rng(config.seed)
        self._in_flight: _InFlight | None = None
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
        if request_id in self.outputs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        ids = tuple(prompt_token_ids)
        max_new = self.check_request(ids, params)
        lora_id = self.loras.resolve(lora_request, load_lora)
        arrivals = [next(self._arrivals) for _ in range(params.n)]
        # Scheduler ids unique per arrival, whatever the caller's ids: an id reused after an abort, while a step of the
        # old request is still in flight, must not take that step's rows, nor "a" with n > 1 collide with "a#1".
        children = [f"{request_id}#{arrival}" for arrival in arrivals]
        base_seed = params.seed if params.seed is not None else int(self._draw_seeds.integers(2**32))
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
            self.loras.hold(child, lora_id)
            if constraint:
                self._constrained.add(child)
        self.outputs.track(request_id, prompt, ids, params, children, max_new, stream)

    def check_request(self, prompt_token_ids: SequenceOf[int], params: SamplingParams) -> int:
        """Raises InvalidRequestError, changing nothing, if `add_request` would refuse this prompt and params for
        anything but its LoRA adapter or grammar (the model's and the step programs' limits, the scheduler's
        admission); returns the most tokens it will generate. Every way in checks each request with it before
        running any, so that one bad request never stops the others."""
        return checked_max_new_tokens(tuple(prompt_token_ids), params, self.config, self.vocab_size,
                                      len(self.tokenizer.eos_token_ids), self.scheduler)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Serves a LoRA adapter to requests from now on (vLLM's `add_lora`); False if it was served already."""
        return self.loras.add(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Stops serving an adapter to new requests; those queued or running with it finish with it."""
        return self.loras.remove(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return self.loras.served()

    def abort_request(self, request_id: str) -> None:
        """Stops a request at any point; its pages are free when this returns."""
        for continuation in self.outputs.forget(request_id):
            self.scheduler.abort_request(continuation)
            self._forget(continuation)

    def abort_all_requests(self) -> list[str]:
        """After a failed step: drops every request and the step in flight; returns the aborted request ids.

        A failure inside the device step may have consumed the donated pool, so the runner gets a fresh one.
        """
        aborted = self.outputs.request_ids()
        for request_id in aborted:
            self.abort_request(request_id)
        self._in_flight = None
        self.scheduler.forget_steps_in_flight()
        # Pages registered for the failed step may never have been written, and a replaced pool holds zeros: a later
        # prompt must not find either by its content.
        self.scheduler.pool.forget_contents()
        self.loras.forget_slots()
        self.outputs.pop_deltas()
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
        for request_id in self.outputs.request_ids():
            self.abort_request(request_id)

    def pop_deltas(self) -> list[CompletionDelta]:
        """The streaming requests' new tokens since the last call, in the order they were generated."""
        return self.outputs.pop_deltas()

    def scheduler_requests(self, request_id: str) -> list[Request]:
        """The scheduler's requests of a live request, one per continuation (their tokens and pages as the host knows
        them); [] once it ended."""
        return [self.scheduler.get_request(c) for c in self.outputs.continuations_of(request_id)]

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs) or self._in_flight is not None

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
                for request in map(self.scheduler.get_request, self.outputs.live_continuations())
                if request is not None):
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
            self.outputs.record_prompt_scores(in_flight.schedule, batch)
            sampled = {s.request_id: int(batch.token_ids[row]) for row, s in enumerate(in_flight.schedule.sequences)
                       if s.samples and self.outputs.is_live(s.request_id)}
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
                if scheduled.request_id in read_back.sampled and self.outputs.is_live(scheduled.request_id):
                    output = self._append_run(scheduled, read_back.accepted.get(scheduled.request_id),
                                              read_back.batch, row)
                    finished += [output] if output is not None else []
        return finished

    def _append_run(self, scheduled: ScheduledSequence, drafts: AcceptedDrafts | None, batch: SampledBatch,
                    row: int) -> RequestOutput | None:
        """Appends a row's accepted drafts, then its sampled token, one by one until its continuation ends (a stop
        string or max_tokens may land inside the run): the request's output if it ended with it, or None."""
        continuation = scheduled.request_id
        num_top = self.outputs.logprobs_of(continuation)
        tokens = [sampled_token(drafts, j, num_top) for j in range(len(drafts.token_ids))] if drafts else []
        for token in [*tokens, sampled_token(batch, row, num_top)]:
            output = self._append(continuation, token)
            if not self.outputs.is_live(continuation):  # ended with this token
                return output
        return None

    def _append(self, continuation: str, token: SampledToken) -> RequestOutput | None:
        grammar = self.scheduler.get_request(continuation).grammar
        if grammar is not None and grammar.failure is not None:
            self._fail(self.outputs.request_of(continuation), ConstraintFailedError(
                f"the output constraint cannot go on after {self.outputs.num_tokens(continuation) + 1} generated "
                f"tokens (the grammar allows no complete output from there): {grammar.failure}", param=PARAM))
            return None
        appended = self.outputs.append(continuation, token, grammar_done=grammar is not None and grammar.done)
        if appended.ended is not None:
            self.scheduler.finish_request(continuation, appended.ended)
            self._forget(continuation)
        return appended.output

    def _fail(self, request_id: str, error: JaxserveError) -> None:
        """Ends a request with `error` (pop_failed), all its continuations with it."""
        self.abort_request(request_id)
        self._failed.append((request_id, error))

    def _forget(self, continuation: str) -> None:
        """What the engine kept for a continuation that ended: its grammar's place and its adapter's hold."""
        self._constrained.discard(continuation)
        self.loras.release(continuation)
