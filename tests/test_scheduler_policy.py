"""The scheduler's step policy, driven directly: which chunks each step takes (decodes first, then prefill chunks under
the partial-prefill limits), priority preemption for a waiting request, and the limits' validation."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.cli import _build_parser
from jaxserve.cli import main as cli_main
from jaxserve.config import FIELD_NAMES, EngineConfig, load_config
from jaxserve.engine.request import Request, RequestStatus
from jaxserve.engine.scheduler import Scheduler
from jaxserve.errors import ConfigError
from jaxserve.sampling_params import SamplingParams
from tests.test_scheduler import (MODES, FakeEngine, _finish_done, _request, _step, assert_pool_drained, configs,
                                  make_config, reference_outputs, workloads)

# A burst, in arrival order: two long prompts with short ones between and after them.
BURST = [("L0", 40), ("s1", 4), ("s2", 4), ("L3", 30), ("s4", 4)]
BURST_LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64)


def _batches(scheduler: Scheduler) -> list[list[tuple[str, int]]]:
    """Every step until all requests finish (each at its max_tokens): (request id, tokens) per chunk, in batch order."""
    batches = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        batches.append([(s.request_id, s.num_tokens) for s in output.sequences])
        scheduler.update_from_output(output, {s.request_id: 9 for s in output.sequences if s.samples})
        _finish_done(scheduler, [s.request_id for s in output.sequences])
    return batches


def _burst(**limits) -> list[list[tuple[str, int]]]:
    scheduler = Scheduler(make_config(**BURST_LIMITS, **limits))
    for index, (request_id, length) in enumerate(BURST):
        prompt = tuple(range(10 * index + 1, 10 * index + 1 + length))
        scheduler.add_request(Request(request_id, prompt, SamplingParams(max_tokens=2), index))
    return _batches(scheduler)


def _first_token_step(batches, request_id: str, prompt_len: int) -> int:
    computed = 0
    for step, batch in enumerate(batches):
        computed += sum(n for rid, n in batch if rid == request_id)
        if computed >= prompt_len:
            return step
    raise AssertionError(f"{request_id} never finished its prompt")


def test_by_default_a_long_prompt_takes_whole_steps_and_the_short_ones_behind_it_wait():
    # vLLM's defaults (max_num_partial_prefills 1): what the scheduler did before the limits existed.
    assert _burst() == [
        [("L0", 16)],
        [("L0", 16)],
        [("L0", 8), ("s1", 4), ("s2", 4)],
        [("L0", 1), ("s1", 1), ("s2", 1), ("L3", 13)],
        [("L3", 16)],
        [("L3", 1), ("s4", 4)],
        [("L3", 1), ("s4", 1)],
    ]


def test_partial_prefills_let_short_prompts_start_beside_a_long_one():
    batches = _burst(max_num_partial_prefills=2, long_prefill_token_threshold=8)
    assert batches == [
        # Two prompts may prefill, so a chunk takes at most 16 / 2 tokens: L0 gets 8, the short ones the rest.
        [("L0", 8), ("s1", 4), ("s2", 4)],
        # Decodes first; L3 is long and L0 holds the one long slot, so L3 is passed over and s4 starts.
        [("s1", 1), ("s2", 1), ("L0", 8), ("s4", 4)],
        # Only L0 may prefill now (L3 is still passed over): its chunk may take the whole budget left.
        [("s4", 1), ("L0", 15)],
        [("L0", 9)],  # 9 tokens left is still long (> 8), so L3 waits one more step
        [("L0", 1), ("L3", 15)],
        [("L3", 15)],
        [("L3", 1)],
    ]
    before = _burst()
    assert len(batches) == len(before)  # the same work in as many steps
    first_tokens = {rid: (_first_token_step(before, rid, n), _first_token_step(batches, rid, n)) for rid, n in BURST}
    assert first_tokens == {"L0": (2, 3), "s1": (2, 0), "s2": (2, 0), "L3": (5, 5), "s4": (5, 1)}


def test_the_threshold_defaults_to_four_percent_of_max_model_len():
    assert make_config(max_model_len=48).long_prefill_tokens == 0  # no long prompts with one partial prefill
    assert make_config(max_model_len=1000, max_num_partial_prefills=2).long_prefill_tokens == 40
    assert make_config(max_model_len=1000, max_num_partial_prefills=2,
                       long_prefill_token_threshold=7).long_prefill_tokens == 7


def test_at_most_max_num_partial_prefills_chunks_leave_their_prompt_unfinished():
    scheduler = Scheduler(make_config(**BURST_LIMITS, max_num_partial_prefills=2, max_long_partial_prefills=2,
                                      long_prefill_token_threshold=64))  # no prompt is long
    for index in range(4):
        scheduler.add_request(_request(f"m{index}", tuple(range(20 * index + 1, 20 * index + 21)), 0, index))
    # Each of the two prefills that may advance gets 16 / 2 tokens; the third and fourth would be partial too.
    assert [(s.request_id, s.num_tokens) for s in scheduler.schedule().sequences] == [("m0", 8), ("m1", 8)]


def test_running_decodes_go_first_even_behind_a_better_ranked_prefill():
    scheduler = Scheduler(make_config(scheduling_policy="priority", max_num_batched_tokens=8, max_model_len=64))
    scheduler.add_request(_request("low0", (1, 2, 3), 1, 0))
    scheduler.add_request(_request("low1", (4, 5, 6), 1, 1))
    assert _step(scheduler) == ["low0", "low1"]
    scheduler.add_request(_request("urgent", tuple(range(10, 30)), 0, 2))  # ranked ahead of both once running
    batches = [[(s.request_id, s.num_tokens) for s in _scheduled(scheduler)] for _ in range(3)]
    # Rank order alone would give the urgent prefill the whole budget and stall both decodes for two steps.
    assert batches == [[("low0", 1), ("low1", 1), ("urgent", 6)],
                       [("low0", 1), ("low1", 1), ("urgent", 6)],
                       [("low0", 1), ("low1", 1), ("urgent", 6)]]


def _scheduled(scheduler: Scheduler):
    output = scheduler.schedule()
    scheduler.update_from_output(output, {s.request_id: 9 for s in output.sequences if s.samples})
    return output.sequences


@pytest.mark.parametrize("chunked,caching,overlap", [m for m in MODES if m[0]])
@settings(max_examples=30, deadline=None)
@given(data=st.data(), partial=st.integers(2, 4), long_share=st.floats(0, 1), threshold=st.integers(0, 12))
def test_every_request_gets_its_reference_outputs_under_partial_prefill_limits(chunked, caching, overlap, data,
                                                                                partial, long_share, threshold):
    workload = data.draw(workloads())
    config = data.draw(configs(workload, chunked, caching))
    config = EngineConfig(**{**config.__dict__, "max_num_partial_prefills": partial,
                             "max_long_partial_prefills": max(1, round(partial * long_share)),
                             "long_prefill_token_threshold": threshold})
    engine = FakeEngine(config, overlap)
    results = engine.run(workload)
    assert results == {f"r{i}": reference_outputs(w.prompt, w.max_tokens) for i, w in enumerate(workload)}
    assert_pool_drained(engine.scheduler)


# Priority preemption: a waiting request of strictly higher priority takes a slot or pages from running ones.

def _priority_scheduler(**overrides) -> Scheduler:
    return Scheduler(make_config(scheduling_policy="priority", **overrides))


def test_an_urgent_request_waiting_for_a_slot_preempts_the_least_urgent_running_one():
    scheduler = _priority_scheduler(max_num_seqs=2)
    scheduler.add_request(_request("low0", (1, 2, 3), 1, 0))
    scheduler.add_request(_request("low1", (4, 5, 6), 1, 1))
    assert _step(scheduler) == ["low0", "low1"]
    scheduler.add_request(_request("urgent", (7, 8, 9), 0, 2))
    assert _step(scheduler) == ["low0", "urgent"]  # low1, the newest of the least urgent, gives its slot
    assert scheduler.get_request("low1").status is RequestStatus.PREEMPTED
    assert scheduler.stats().num_preemptions == 1
    assert _step(scheduler) == ["urgent", "low0"]  # and is not re-admitted while the slots are taken


def test_a_waiting_request_preempts_nobody_of_its_own_priority_or_more_urgent():
    scheduler = _priority_scheduler(max_num_seqs=2)
    scheduler.add_request(_request("a", (1, 2, 3), 0, 0))
    scheduler.add_request(_request("b", (4, 5, 6), 1, 1))
    assert _step(scheduler) == ["a", "b"]
    scheduler.add_request(_request("same", (7, 8, 9), 1, 2))
    scheduler.add_request(_request("less", (10, 11, 12), 2, 3))
    for _ in range(3):
        assert _step(scheduler) == ["a", "b"]
    assert scheduler.stats().num_preemptions == 0


def test_aging_protects_a_running_request_from_later_urgent_arrivals():
    # One level of priority per 4 steps: after 4 steps a running priority-1 request outranks any priority-0 arrival.
    scheduler = _priority_scheduler(max_num_seqs=1, priority_aging_steps=4, max_model_len=64)
    scheduler.add_request(Request("old", (1, 2, 3), SamplingParams(max_tokens=20, priority=1), 0))
    for _ in range(5):
        assert _step(scheduler) == ["old"]
    scheduler.add_request(_request("urgent", (4, 5, 6), 0, 1))
    assert _step(scheduler) == ["old"]
    assert scheduler.stats().num_preemptions == 0


def test_no_preemption_when_the_victims_could_not_make_room():
    # Pages: 5 usable. "a" (priority 0) holds 3, "low" (priority 1) 2; the urgent prompt needs 3: preempting "low"
    # alone frees 2, and "a" is as urgent as it, so nothing is preempted and it waits.
    scheduler = _priority_scheduler(num_kv_pages=6, max_model_len=20, enable_prefix_caching=False)
    scheduler.add_request(_request("a", tuple(range(1, 10)), 0, 0))
    scheduler.add_request(_request("low", (10, 11, 12, 13, 14), 1, 1))
    assert _step(scheduler) == ["a", "low"]
    scheduler.add_request(_request("urgent", tuple(range(20, 29)), 0, 2))
    assert _step(scheduler) == ["a", "low"]
    assert scheduler.stats().num_preemptions == 0


def test_first_come_first_served_never_preempts_for_a_waiting_request():
    scheduler = Scheduler(make_config(max_num_seqs=2))
    for index in range(3):
        scheduler.add_request(_request(f"r{index}", (index + 1, 2, 3), 0, index))
    for _ in range(3):
        assert _step(scheduler) == ["r0", "r1"]
    assert scheduler.stats().num_preemptions == 0


# The limits' validation: a bad value is a ConfigError naming the setting and its flag.

@pytest.mark.parametrize("overrides, flag", [
    (dict(max_num_partial_prefills=0), "--max-num-partial-prefills"),
    (dict(max_long_partial_prefills=0), "--max-long-partial-prefills"),
    (dict(long_prefill_token_threshold=-1), "--long-prefill-token-threshold"),
    (dict(max_num_partial_prefills=2, max_long_partial_prefills=3), "--max-long-partial-prefills"),
    (dict(max_num_partial_prefills=2, enable_chunked_prefill=False, max_num_batched_tokens=48),
     "--max-num-partial-prefills"),
    (dict(max_num_partial_prefills=2, long_prefill_token_threshold=49), "--long-prefill-token-threshold"),
])
def test_bad_partial_prefill_limits_are_refused_naming_the_flag(overrides, flag):
    with pytest.raises(ConfigError, match=flag):
        make_config(**overrides)


def test_the_limits_are_flags(capsys):
    args = _build_parser().parse_args(["serve", "--max-num-partial-prefills", "4", "--max-long-partial-prefills", "2",
                                       "--long-prefill-token-threshold", "256"])
    config = load_config(None, {name: getattr(args, name) for name in FIELD_NAMES if hasattr(args, name)})
    assert (config.max_num_partial_prefills, config.max_long_partial_prefills,
            config.long_prefill_token_threshold) == (4, 2, 256)
    # A bad value stops the command before anything loads, naming the flag.
    assert cli_main(["generate", "--max-num-partial-prefills", "2", "--max-long-partial-prefills", "3"]) == 2
    assert "--max-long-partial-prefills" in capsys.readouterr().err
