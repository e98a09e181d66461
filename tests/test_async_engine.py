"""AsyncEngine: the engine thread driven from asyncio — streaming, aborts, health, failures — in-process."""

import asyncio
import contextlib
import itertools

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.errors import EngineDeadError, EngineStepError, InvalidRequestError
from jaxserve.outputs import CompletionDelta, RequestOutput

PROMPT = (1, 17, 42, 99, 7, 300)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)  # outlives any test that leaves it early
ANSWER_TIMEOUT_S = 60  # bounds a wait that should end at once, so that a bug fails instead of hanging


@pytest.fixture(scope="module")
def llm():
    # The shapes of configs/tiny-cpu.yaml: the server tests compile the same programs (persistent cache).
    return LLM(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, dtype="float32", use_tqdm_on_load=False)


@pytest.fixture(scope="module")
def reference_tokens(llm):
    """The offline API's greedy tokens for PROMPT, with no engine thread involved."""
    [output] = llm.generate([{"prompt_token_ids": list(PROMPT)}], GREEDY, use_tqdm=False)
    return output.outputs[0].token_ids


def run_with_engine(llm, body):
    """Runs `body(async_engine)` on a fresh event loop with the engine thread started, and stops it after."""

    async def main():
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            return await body(engine)
        finally:
            await engine.stop()

    return asyncio.run(main())


async def collect(events):
    return [event async for event in events]


def _split(events):
    *deltas, final = events
    assert isinstance(final, RequestOutput)
    assert deltas and all(isinstance(d, CompletionDelta) for d in deltas)
    return deltas, final


def test_deltas_concatenate_to_the_final_output(llm, reference_tokens):
    deltas, final = _split(run_with_engine(llm, lambda engine: collect(engine.generate("r", PROMPT, GREEDY))))
    [output] = final.outputs
    assert "".join(d.text for d in deltas) == output.text
    assert tuple(t for d in deltas for t in d.token_ids) == output.token_ids == reference_tokens
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]


def test_n_continuations_stream_side_by_side(llm):
    params = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    deltas, final = _split(run_with_engine(llm, lambda engine: collect(engine.generate("r", PROMPT, params))))
    assert {d.index for d in deltas} == {0, 1}
    for output in final.outputs:
        mine = [d for d in deltas if d.index == output.index]
        assert "".join(d.text for d in mine) == output.text
        assert tuple(t for d in mine for t in d.token_ids) == output.token_ids
        assert len(output.token_ids) == 10


def test_leaving_early_aborts_the_request_and_frees_its_pages(llm):
    async def body(engine):
        async with contextlib.aclosing(engine.generate("long", PROMPT, LONG)) as events:
            await anext(events)
            busy = await engine.check_health(ANSWER_TIMEOUT_S)
        # Commands run in order: the abort sent on leaving is applied before this ping is answered.
        after = await engine.check_health(ANSWER_TIMEOUT_S)
        return busy, after, engine.num_live_requests

    busy, after, live = run_with_engine(llm, body)
    assert busy.num_pages_used > 0 and busy.num_running == 1
    assert (after.num_pages_used, after.num_running, after.num_waiting, live) == (0, 0, 0, 0)


def test_wait_idle_returns_once_no_request_is_live(llm):
    async def body(engine):
        await asyncio.wait_for(engine.wait_idle(), ANSWER_TIMEOUT_S)  # nothing live: at once
        idle = asyncio.ensure_future(engine.wait_idle())
        seen_idle_while_live = []
        async for event in engine.generate("r", PROMPT, GREEDY):
            seen_idle_while_live.append(idle.done())
        await asyncio.wait_for(idle, ANSWER_TIMEOUT_S)
        return seen_idle_while_live

    assert not any(run_with_engine(llm, body))


def test_health_check_answers_while_running_and_fails_once_stopped(llm):
    async def body(engine):
        stats = await engine.check_health(ANSWER_TIMEOUT_S)
        await engine.stop()
        with pytest.raises(EngineDeadError):
            await engine.check_health(ANSWER_TIMEOUT_S)
        with pytest.raises(EngineDeadError):
            await collect(engine.generate("late", PROMPT, GREEDY))
        return stats

    assert run_with_engine(llm, body).num_running == 0


def test_a_refused_request_raises_without_disturbing_the_others(llm, reference_tokens):
    async def body(engine):
        good = asyncio.ensure_future(collect(engine.generate("good", PROMPT, GREEDY)))
        with pytest.raises(InvalidRequestError) as refused:
            await collect(engine.generate("bad", (llm.engine.vocab_size + 5,), GREEDY))
        return refused.value, await good

    refused, events = run_with_engine(llm, body)
    assert refused.param == "prompt"
    assert _split(events)[1].outputs[0].token_ids == reference_tokens


def test_a_failed_step_errors_its_requests_and_the_engine_goes_on(llm, reference_tokens, monkeypatch):
    real_step, calls = llm.engine.step, itertools.count()

    def step_failing_once():
        if next(calls) == 3:  # both requests are running by then, neither has finished
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step_failing_once)

    async def body(engine):
        running = await asyncio.gather(*(collect(engine.generate(f"r{i}", PROMPT, GREEDY)) for i in range(2)),
                                       return_exceptions=True)
        after = await collect(engine.generate("after", PROMPT, GREEDY))
        return running, after, await engine.check_health(ANSWER_TIMEOUT_S)

    running, after, stats = run_with_engine(llm, body)
    assert all(isinstance(result, EngineStepError) for result in running), running
    assert _split(after)[1].outputs[0].token_ids == reference_tokens
    assert stats.num_pages_used == 0
