"""Priority preemption on the engine with the built-in model: an urgent request arriving while low-priority requests
hold every sequence slot runs at once (issue 36: before, it waited for all of them and finished last of 17)."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams

SLOTS = 16
# The slots fill with low-priority requests; the pool holds them all and the urgent one (4 pages each at most).
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=SLOTS, max_num_batched_tokens=64, block_size=8,
              num_kv_pages=80, scheduling_policy="priority", use_tqdm_on_load=False)
LOW, URGENT = 1, 0  # lower is served first, as in vLLM
LOW_TOKENS, URGENT_TOKENS = 24, 8
STEPS_BEFORE_URGENT = 4  # every low-priority request is decoding by then


@pytest.fixture(scope="module")
def llm():
    return LLM(**ENGINE)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 500, size=8)] for _ in range(count)]


def _run(llm, low_prompts, urgent_prompt=None) -> tuple[list[str], dict[str, tuple[int, ...]], int]:
    """Low-priority requests first; the urgent one (if any) after STEPS_BEFORE_URGENT steps. Returns request ids in
    the order they finished, each one's tokens, and the step at which the urgent one was added."""
    engine = llm.engine
    for index, prompt in enumerate(low_prompts):
        engine.add_request(f"low{index}", prompt, SamplingParams(max_tokens=LOW_TOKENS, temperature=0,
                                                                 ignore_eos=True), priority=LOW)
    order, tokens, step = [], {}, 0
    while engine.has_unfinished_requests():
        if step == STEPS_BEFORE_URGENT and urgent_prompt is not None:
            assert engine.stats().num_running == SLOTS and engine.stats().num_waiting == 0
            engine.add_request("urgent", urgent_prompt, SamplingParams(max_tokens=URGENT_TOKENS, temperature=0,
                                                                       ignore_eos=True), priority=URGENT)
        for output in engine.step():
            order.append(output.request_id)
            tokens[output.request_id] = tuple(output.outputs[0].token_ids)
        step += 1
    return order, tokens, STEPS_BEFORE_URGENT


def test_an_urgent_request_preempts_a_low_priority_one_holding_a_slot_and_finishes_first(llm):
    low_prompts = _prompts(SLOTS, seed=11)
    _, alone, _ = _run(llm, low_prompts)
    preemptions_before = llm.engine.stats().num_preemptions
    order, tokens, _ = _run(llm, low_prompts, urgent_prompt=_prompts(1, seed=12)[0])
    assert len(order) == SLOTS + 1
    # It needs 8 tokens where each low-priority request needs 24 more: with a slot at once it finishes first.
    assert order[0] == "urgent"
    # One victim, the newest of the least urgent; it recomputes once the urgent request leaves, so it ends last.
    assert llm.engine.stats().num_preemptions - preemptions_before == 1
    assert order[-1] == f"low{SLOTS - 1}"
    assert {rid: t for rid, t in tokens.items() if rid != "urgent"} == alone  # preemption changes no token
