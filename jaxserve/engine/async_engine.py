"""`AsyncEngine`: the engine on a thread of its own, driven from asyncio without polling.

Handlers call `generate()`, an async iterator over one request's deltas and its final output, and leave it early to
abort the request; on a pooling engine (`--runner pooling`, engine/pooling_engine.py), `encode()`, which returns
one prompt's embedding. Commands (add, abort, ping, LoRA adapter changes, stop) reach the engine thread through a
queue: the thread blocks on it while it has nothing to run and drains it between steps while it does. Results go
back to the event loop with one `call_soon_threadsafe` per step, for all requests of the step together.

A thread rather than a process: JAX releases the GIL while the device runs and the step's host work is small, so the
HTTP handlers and the loop share the interpreter well, and no request or result has to be pickled between processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.pooling_engine import PoolingEngine
from jaxserve.engine.scheduler_stats import SchedulerStats
from jaxserve.engine.startup import StartupStats
from jaxserve.engine.structured_output import CompiledGrammar, GrammarCompiler
from jaxserve.errors import EngineDeadError, EngineStepError
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import CompletionDelta, PoolingRequestOutput, RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

EngineEvent = CompletionDelta | RequestOutput  # what generate() yields; the RequestOutput comes last


@dataclasses.dataclass(frozen=True)
class _Add:
    request_id: str  # unique among live requests
    prompt_token_ids: tuple[int, ...]  # what the model sees
    params: SamplingParams | PoolingParams  # how to sample; PoolingParams: an embedding (a pooling engine)
    prompt: str | None  # prompt text, when the request gave text
    lora_request: LoRARequest | None  # its LoRA adapter; None: the base model
    grammar: CompiledGrammar | None  # params.structured_outputs compiled on the event loop; None without one


@dataclasses.dataclass(frozen=True)
class _Abort:
    request_id: str  # a request whose caller left; unknown or finished ids are ignored


@dataclasses.dataclass(frozen=True)
class _Ping:
    answer: asyncio.Future  # resolved with the scheduler's stats once the thread reads this command


@dataclasses.dataclass(frozen=True)
class _Call:
    method: str  # an LLMEngine method run on the engine thread between steps (add_lora, remove_lora)
    argument: object  # its one argument
    answer: asyncio.Future  # resolved with its result, or failed with its exception


@dataclasses.dataclass(frozen=True)
class _Stop:
    pass


class AsyncEngine:
    """Owns the engine thread; every public method runs on the event loop that called `start`."""

    def __init__(self, engine: LLMEngine | PoolingEngine):
        self.engine = engine
        self.stats: SchedulerStats = engine.stats()  # refreshed by the engine thread after every step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue] = {}  # live request id -> its events; touched on the loop only
        self._idle = asyncio.Event()  # set while no request is live; what a draining server waits for
        self._idle.set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None  # why the engine thread ended, when it ended unasked
        self._calls: set[asyncio.Future] = set()  # answers of adapter changes the engine thread has not given yet

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Ends the engine thread after its current step; requests still running get EngineDeadError."""
        if self._thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join)
        self._fail_streams(EngineDeadError("the engine is shutting down"))

    @property
    def config(self) -> EngineConfig:
        """The engine's settings (read only: they never change while it serves)."""
        return self.engine.config

    @property
    def startup_stats(self) -> StartupStats:
        """Where the engine's start-up time went, and where its programs came from (store, cache, compiled)."""
        return self.engine.startup_stats

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles output constraints on its own threads; safe to call from the event loop or any thread."""
        return self.engine.grammars

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        """`LLMEngine.check_request`, from any thread: it reads only settings that never change while serving."""
        return self.engine.check_request(prompt_token_ids, params)

    def add_lora_before_start(self, lora_request: LoRARequest) -> None:
        """Serves an adapter from the start (--lora-modules): before `start`, on the calling thread, since the engine
        thread is not running yet; a bad folder raises here."""
        if self._thread is not None:
            raise RuntimeError("the engine thread runs: use add_lora")
        self.engine.add_lora(lora_request)

    @property
    def num_live_requests(self) -> int:
        """Requests submitted whose final output has not been delivered yet."""
        return len(self._streams)

    async def wait_idle(self) -> None:
        """Returns once no request is live (at once when none is)."""
        await self._idle.wait()

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       prompt: str | None = None, priority: int | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[EngineEvent]:
        """Yields the request's deltas, then its RequestOutput; leaving early (close, cancel) aborts the request.

        Raises InvalidRequestError when the engine refuses the request, EngineStepError when a step running it
        failed, EngineDeadError when the engine thread is gone. Use it under `contextlib.aclosing` so that the
        abort happens as soon as the caller leaves. `priority` (vLLM's keyword; None: `params.priority`) orders the
        request under the priority scheduling policy. `lora_request`: the LoRA adapter it runs with.
        """
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already live")
        # Compiled (or found in the cache) here, awaited on the loop: the engine thread never waits for a grammar.
        constraint = params.structured_outputs
        grammar = await self.engine.grammars.compiled(constraint) if constraint is not None else None
        events: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = events
        self._idle.clear()
        self._commands.put(_Add(request_id, tuple(prompt_token_ids), params.with_priority(priority), prompt,
                                lora_request, grammar))
        try:
            while True:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if isinstance(event, RequestOutput):
                    return
        finally:
            if self._forget_stream(request_id):
                self._commands.put(_Abort(request_id))

    async def encode(self, request_id: str, prompt_token_ids: Sequence[int], params: PoolingParams,
                     prompt: str | None = None) -> PoolingRequestOutput:
        """A pooling engine's embedding of one prompt; cancelling the call aborts the request. Raises as `generate`
        does."""
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already live")
        events: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = events
        self._idle.clear()
        self._commands.put(_Add(request_id, tuple(prompt_token_ids), params, prompt, None, None))
        try:
            event = await events.get()
            if isinstance(event, BaseException):
                raise event
            return event
        finally:
            if self._forget_stream(request_id):
                self._commands.put(_Abort(request_id))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """`LLMEngine.add_lora` on the engine thread (it reads the folder there); raises what it raises."""
        return await self._call("add_lora", lora_request)

    async def remove_lora(self, lora_name: str) -> bool:
        """`LLMEngine.remove_lora` on the engine thread: new requests can no longer use the adapter."""
        return await self._call("remove_lora", lora_name)

    async def _call(self, method: str, argument: object):
        self._check_alive()
        answer = asyncio.get_running_loop().create_future()
        self._calls.add(answer)
        self._commands.put(_Call(method, argument, answer))
        try:
            return await answer
        finally:
            self._calls.discard(answer)

    async def check_health(self, timeout: float) -> SchedulerStats:
        """Proves the engine thread takes commands (it answers between steps); raises EngineDeadError otherwise."""
        self._check_alive()
        answer = asyncio.get_running_loop().create_future()
        self._commands.put(_Ping(answer))
        try:
            return await asyncio.wait_for(answer, timeout)
        except TimeoutError:
            raise EngineDeadError(f"the engine did not answer within {timeout:g} s") from None

    def _check_alive(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError(f"the engine is not running ({self._failure or 'stopped'})")

    # --- the engine thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                commands = self._next_commands(block=not self.engine.has_unfinished_requests())
                if any(isinstance(c, _Stop) for c in commands):
                    self.engine.shutdown()
                    return
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    self._step()
                self.stats = self.engine.stats()
        except BaseException as e:  # the loop itself broke: nothing more will run, so every caller must hear
            log.exception("the engine thread failed")
            self._failure = e
            self._call_on_loop(self._fail_streams, EngineDeadError(f"the engine thread failed: {e!r}"))

    def _next_commands(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        with contextlib.suppress(queue.Empty):
            while True:
                commands.append(self._commands.get_nowait())
        return commands

    def _apply(self, command) -> None:
        if isinstance(command, _Add):
            try:
                if isinstance(command.params, PoolingParams):
                    self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                            prompt=command.prompt)
                else:
                    self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                            prompt=command.prompt, stream=True, lora_request=command.lora_request,
                                            load_lora=False, grammar=command.grammar)
            except Exception as e:  # refused (InvalidRequestError) or broken: only this request hears of it
                self._call_on_loop(self._deliver, [(command.request_id, e)])
        elif isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
        elif isinstance(command, _Ping):
            self._call_on_loop(_resolve, command.answer, self.engine.stats())
        elif isinstance(command, _Call):
            try:
                result = getattr(self.engine, command.method)(command.argument)
            except Exception as e:  # refused (a bad adapter folder): the caller hears of it, the engine goes on
                self._call_on_loop(_fail, command.answer, e)
            else:
                self._call_on_loop(_resolve, command.answer, result)

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as e:
            log.exception("an engine step failed; its requests end with an error, the engine goes on")
            failure = EngineStepError(f"the engine failed while running this request: {e!r}")
            # What the step completed before it failed still reaches its callers, ahead of the others' error.
            events = self._events(self.engine.pop_finished())
            self._call_on_loop(self._deliver, events + [(rid, failure) for rid in self.engine.abort_all_requests()])
            return
        events = self._events(finished)
        if events:
            self._call_on_loop(self._deliver, events)

    def _events(self, finished: list[RequestOutput]) -> list[tuple[str, EngineEvent | BaseException]]:
        """The streaming requests' new tokens since the last step, then the requests `finished` and those that
        ended with an error of their own."""
        return ([(d.request_id, d) for d in self.engine.pop_deltas()] + [(o.request_id, o) for o in finished]
                + self.engine.pop_failed())

    def _call_on_loop(self, callback, *args) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is left to hear
            self._loop.call_soon_threadsafe(callback, *args)

    # --- back on the event loop ---------------------------------------------------------------------------------

    def _deliver(self, events: list[tuple[str, EngineEvent | BaseException]]) -> None:
        for request_id, event in events:
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # the caller left; its abort is on the way to the engine thread
            stream.put_nowait(event)
            if isinstance(event, (RequestOutput, PoolingRequestOutput, BaseException)):
                self._forget_stream(request_id)

    def _forget_stream(self, request_id: str) -> bool:
        """Drops a live request's stream; False if it was not live (finished, or forgotten already)."""
        if self._streams.pop(request_id, None) is None:
            return False
        if not self._streams:
            self._idle.set()
        return True

    def _fail_streams(self, error: BaseException) -> None:
        """Every caller still waiting on the engine thread hears `error`: requests and adapter changes alike."""
        for request_id in list(self._streams):
            self._deliver([(request_id, error)])
        for answer in list(self._calls):
            _fail(answer, error)


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():  # a health check that timed out has cancelled its future
        future.set_result(value)


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
