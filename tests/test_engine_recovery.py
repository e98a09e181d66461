"""The engine's state after the unusual: a step that fails or is interrupted, an id reused while a step of the old
request is in flight, caller ids that look like continuations' ids; and min_tokens, counted as the reference does.
Expected tokens come from the dense reference decoder."""

import dataclasses
import itertools

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.reference.reference_llm import ReferenceLLM

# test_engine.py's shapes, so the compiled programs are shared through the persistent cache.
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
              num_kv_pages=40, use_tqdm_on_load=False)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 500, size=25)]  # three full pages of 8 and one token


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def reference():
    return ReferenceLLM(dtype=ENGINE["dtype"], max_model_len=ENGINE["max_model_len"])


def _tokens(llm_or_reference, prompts, params=GREEDY) -> list[tuple[int, ...]]:
    outputs = llm_or_reference.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in outputs]


def _failing_on(calls: set[int], error: BaseException, real):
    """`real`, raising `error` instead on the calls numbered in `calls` (from 0)."""
    counter = itertools.count()

    def maybe_fail(*args):
        if next(counter) in calls:
            raise error
        return real(*args)

    return maybe_fail


def test_a_dispatch_that_fails_leaves_no_unwritten_page_in_the_prefix_cache(llm, reference, monkeypatch):
    """The batch's full prompt pages are registered when it is built: after the dispatch fails, a later prompt must
    not find them (they hold no KV)."""
    prompt = [11] + PROMPT[1:]
    engine = llm.engine
    monkeypatch.setattr(engine.runner, "start", _failing_on({0}, RuntimeError("injected"), engine.runner.start))
    engine.add_request("doomed", prompt, GREEDY)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert engine.abort_all_requests() == ["doomed"]
    assert _tokens(llm, [prompt]) == _tokens(reference, [prompt])


def test_a_pool_replaced_after_a_failure_leaves_no_cached_page_to_match(llm, reference, monkeypatch):
    """A failure that consumed the donated pool gets zeros in its place: pages cached before it hold nothing now."""
    prompt = [12] + PROMPT[1:]
    engine = llm.engine
    assert _tokens(llm, [prompt]) == _tokens(reference, [prompt])  # its pages are cached now
    real_finish = engine.runner.finish

    def finish_consuming_the_pool(*args):
        jax.tree.map(lambda page: page.delete(), engine.runner.pool)
        raise RuntimeError("injected after the pool was donated")

    monkeypatch.setattr(engine.runner, "finish", finish_consuming_the_pool)
    engine.add_request("doomed", [1, 2, 3], GREEDY)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    monkeypatch.setattr(engine.runner, "finish", real_finish)
    engine.abort_all_requests()
    assert _tokens(llm, [prompt]) == _tokens(reference, [prompt])


def test_requests_that_finished_before_a_step_failed_are_still_reported(llm, monkeypatch):
    """Without async overlap a step reads the previous one back (finishing requests) before dispatching: if the
    dispatch fails, the finished ones are kept for pop_finished, and only the others are aborted."""
    engine = llm.engine
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, async_scheduling=False))
    engine.add_request("short", [5, 6, 7], dataclasses.replace(GREEDY, max_tokens=1), stream=True)
    engine.add_request("long", [8, 9, 10], GREEDY, stream=True)
    assert engine.step() == []
    monkeypatch.setattr(engine.runner, "start", _failing_on({0}, RuntimeError("injected"), engine.runner.start))
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert [d.request_id for d in engine.pop_deltas()] == ["short", "long"]
    [short] = engine.pop_finished()
    assert (short.request_id, len(short.outputs[0].token_ids), short.finished) == ("short", 1, True)
    assert engine.abort_all_requests() == ["long"]


def test_an_interrupted_generate_leaves_the_offline_llm_usable(llm, reference, monkeypatch):
    """Ctrl-C between a dispatch and its read-back (async overlap: the next step already scheduled)."""
    engine = llm.engine
    monkeypatch.setattr(engine.runner, "start", _failing_on({2}, KeyboardInterrupt(), engine.runner.start))
    prompts = [PROMPT[:5], PROMPT[5:9]]
    with pytest.raises(KeyboardInterrupt):
        _tokens(llm, prompts)
    assert not engine.has_unfinished_requests()
    assert _tokens(llm, prompts) == _tokens(reference, prompts)


def test_an_id_reused_while_a_step_of_its_aborted_request_is_in_flight_gets_its_own_tokens(llm, reference):
    engine = llm.engine
    engine.add_request("x", [5, 6, 7], GREEDY)
    engine.step()  # x's prefill samples on the device, not read back yet
    engine.abort_request("x")
    engine.add_request("x", [9, 10, 11], GREEDY)
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert [tuple(o.outputs[0].token_ids) for o in finished] == _tokens(reference, [[9, 10, 11]])


def test_a_caller_id_spelled_like_a_continuation_id_does_not_collide(llm, reference):
    engine = llm.engine
    engine.add_request("a#1", [5, 6, 7], GREEDY)
    engine.add_request("a", [9, 10, 11], dataclasses.replace(GREEDY, n=2))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, [tuple(c.token_ids) for c in o.outputs]) for o in engine.step())
    assert finished == {"a#1": _tokens(reference, [[5, 6, 7]]), "a": _tokens(reference, [[9, 10, 11]]) * 2}


def test_min_tokens_holds_stop_ids_back_for_as_many_draws_as_the_reference(llm, reference):
    """min_tokens counts the tokens before a draw: with min_tokens k, the k-th token is the first that may stop."""
    [free] = _tokens(llm, [[5, 6, 7]])
    params = [SamplingParams(max_tokens=6, temperature=0, min_tokens=k, stop_token_ids=[free[stop]])
              for k, stop in [(1, 0), (2, 1), (2, 0), (3, 3), (0, 0)]]
    prompts = [{"prompt_token_ids": [5, 6, 7]}] * len(params)
    engine_out, reference_out = (x.generate(prompts, params, use_tqdm=False) for x in (llm, reference))
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in engine_out] == [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in reference_out]
    assert tuple(engine_out[-1].outputs[0].token_ids) == free[:1]  # min_tokens 0: the first token may stop
