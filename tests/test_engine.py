"""The paged continuous-batching engine against the dense reference decoder, with each fast path on and off."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.proposers import SequenceProposer
from jaxserve.reference.reference_llm import ReferenceLLM

# One shape set for every engine here, so the compiled programs are shared through the persistent cache.
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
              num_kv_pages=40, use_tqdm_on_load=False)
TINY_POOL = dict(ENGINE, num_kv_pages=12)  # 88 token slots for four sequences of up to 64: forces preemption
# Prompt lookup down to one token: drafts are frequent, mostly wrong, so rollback runs often.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


def _workload(seed=0, count=10):
    """Prompts of varied length (some sharing a 17-token prefix) with varied max_tokens."""
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(3, 500, size=17)]
    prompts, params = [], []
    for i in range(count):
        length = int(rng.choice([1, 3, 7, 8, 9, 16, 25, 40]))
        own = [int(t) for t in rng.integers(3, 500, size=length)]
        prompts.append({"prompt_token_ids": shared + own if i % 3 == 0 else own})
        params.append(SamplingParams(max_tokens=int(rng.choice([1, 5, 12])), temperature=0, ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def reference_outputs():
    prompts, params = _workload()
    llm = ReferenceLLM(**{k: v for k, v in ENGINE.items() if k in ("dtype", "max_model_len")})
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("switches", [
    {},
    {"enable_chunked_prefill": False},
    {"enable_prefix_caching": False},
    {"async_scheduling": False},
    {"async_scheduling": False, "enable_prefix_caching": False, "enable_chunked_prefill": False},
    {"attention_backend": "pallas", "pallas_interpret": True},  # the Pallas kernel, run by Pallas' interpreter
    {"speculative_config": NGRAM},
], ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "all-on")
def test_engine_greedy_tokens_equal_the_reference(reference_outputs, switches):
    llm = LLM(**ENGINE, **switches)
    prompts, params = _workload()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_outputs
    assert llm.engine.compiles_after_warmup == 0


@pytest.fixture(scope="module")
def tiny_pool_llm():
    return LLM(**TINY_POOL)


def test_preemption_by_recompute_keeps_outputs_exact(reference_outputs, tiny_pool_llm):
    prompts, params = _workload()
    outputs = tiny_pool_llm.generate(prompts, params, use_tqdm=False)
    assert tiny_pool_llm.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == reference_outputs


class RandomDrafts(SequenceProposer):
    """As many random drafts as allowed: nearly all rejected, so rollback runs at every step."""

    def __init__(self, seed: int):
        self._rng = np.random.default_rng(seed)

    def propose(self, token_ids, max_drafts):
        return tuple(int(t) for t in self._rng.integers(3, 500, max_drafts))


def test_preemption_with_speculation_keeps_outputs_exact(reference_outputs):
    """Drafts take pages too: rejected ones give theirs back, and a preempted request recomputes without them."""
    llm = LLM(**dict(TINY_POOL, num_kv_pages=10), speculative_config=NGRAM)
    # Every sampling chunk gets all the drafts that fit, nearly all of them wrong: the pool fills up.
    llm.engine.scheduler.proposer = RandomDrafts(seed=2)
    prompts, params = _workload()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode.num_draft_tokens > 0
    assert [o.outputs[0].token_ids for o in outputs] == reference_outputs
    assert stats.num_pages_used == 0


def _finish_order(llm, prompts, params, priorities=None) -> tuple[list[int], list[tuple[int, ...]]]:
    """The engine driven step by step: prompt indices in the order their requests finished, and each one's tokens."""
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(f"q{i}", prompt, params, priority=priorities[i] if priorities else None)
    order, tokens = [], {}
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            order.append(int(output.request_id[1:]))
            tokens[order[-1]] = output.outputs[0].token_ids
    return order, [tokens[i] for i in range(len(prompts))]


def test_priority_policy_finishes_urgent_requests_first_and_changes_no_token(tiny_pool_llm):
    # Eight equal requests for four sequence slots and a pool too small for four; the last four added are urgent.
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 500, size=9)] for _ in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    priorities = [1] * 4 + [0] * 4
    fcfs_order, fcfs_tokens = _finish_order(tiny_pool_llm, prompts, params)
    by_priority = LLM(**TINY_POOL, scheduling_policy="priority")
    order, tokens = _finish_order(by_priority, prompts, params, priorities)
    assert sorted(fcfs_order[:4]) == [0, 1, 2, 3] and sorted(order[:4]) == [4, 5, 6, 7]
    assert by_priority.engine.stats().num_preemptions > 0
    assert tokens == fcfs_tokens
    offline = by_priority.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                   priority=priorities)
    assert [o.outputs[0].token_ids for o in offline] == fcfs_tokens


@pytest.fixture(scope="module")
def engine_llm():
    return LLM(**ENGINE)


def test_prefix_cache_hits_skip_prefill(engine_llm):
    prefix = list(range(100, 140))
    before = engine_llm.engine.stats().prefix_hit_tokens
    params = SamplingParams(max_tokens=2, temperature=0)
    engine_llm.generate({"prompt_token_ids": prefix + [7]}, params, use_tqdm=False)
    engine_llm.generate({"prompt_token_ids": prefix + [9]}, params, use_tqdm=False)
    assert engine_llm.engine.stats().prefix_hit_tokens - before >= 32


def test_batch_invariance_of_greedy_output(engine_llm):
    prompts, params = _workload(seed=1, count=6)
    together = engine_llm.generate(prompts, params, use_tqdm=False)
    alone = [engine_llm.generate(p, q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def test_seeded_sampling_is_reproducible_across_batch_mixes(engine_llm):
    target = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=42, ignore_eos=True)
    alone = engine_llm.generate({"prompt_token_ids": [5, 6, 7]}, target, use_tqdm=False)[0]
    others = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]
    mixed = engine_llm.generate([{"prompt_token_ids": [9, 9]}, {"prompt_token_ids": [5, 6, 7]},
                                 {"prompt_token_ids": [3] * 20}], [others[0], target, others[1]], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_steps_where_no_row_truncates_run_the_sampler_without_the_sort(engine_llm, monkeypatch):
    """A seeded temperature-only request draws the same tokens from the untruncated sampler (alone) as from the
    truncating one (beside a top-k request): the variant is exact, and each is chosen where it should be."""
    programs = engine_llm.engine.runner.programs
    chosen, sampler = [], programs.sampler
    monkeypatch.setattr(programs, "sampler",
                        lambda rows, truncation=True: chosen.append(truncation) or sampler(rows, truncation))
    plain = SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True)
    alone = engine_llm.generate({"prompt_token_ids": [4, 5, 6]}, plain, use_tqdm=False)[0]
    assert chosen and not any(chosen)
    chosen.clear()
    truncating = SamplingParams(max_tokens=8, temperature=1.0, top_k=3, seed=6, ignore_eos=True)
    beside = engine_llm.generate([{"prompt_token_ids": [4, 5, 6]}, {"prompt_token_ids": [8, 9]}], [plain, truncating],
                                 use_tqdm=False)
    assert chosen and all(chosen)
    assert beside[0].outputs[0].token_ids == alone.outputs[0].token_ids


def test_n_continuations_with_a_seed_differ_and_reproduce(engine_llm):
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    first = engine_llm.generate({"prompt_token_ids": [11, 12, 13]}, params, use_tqdm=False)[0]
    second = engine_llm.generate({"prompt_token_ids": [11, 12, 13]}, params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({c.token_ids for c in first.outputs}) > 1


def test_aborts_at_random_points_leak_no_pages(engine_llm):
    engine = engine_llm.engine
    rng = np.random.default_rng(3)
    prompts, params = _workload(seed=2, count=8)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"abort-{i}", prompt["prompt_token_ids"], SamplingParams(max_tokens=12, ignore_eos=True))
    live = {f"abort-{i}" for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for output in engine.step():
            live.discard(output.request_id)
        if live and rng.random() < 0.3:
            victim = sorted(live)[int(rng.integers(len(live)))]
            engine.abort_request(victim)
            live.discard(victim)
    stats = engine.stats()
    assert stats.num_pages_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_pages_free + stats.num_pages_cached == ENGINE["num_kv_pages"] - 1


def test_an_engine_shut_down_with_a_step_in_flight_serves_again(engine_llm, reference_outputs):
    """A server's engine loop stops (shutdown) between a step's dispatch and its read-back; the engine, reused, must
    not wait for that step's outputs, and answers as before."""
    engine = engine_llm.engine
    prompts, params = _workload()
    engine.add_request("cut-short", prompts[0]["prompt_token_ids"], params[0])
    engine.step()
    assert engine.has_unfinished_requests()  # the step is on the device, not read back
    engine.shutdown()
    assert not engine.has_unfinished_requests()
    outputs = engine_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference_outputs


def test_no_compile_after_warm_up_across_buckets_and_sampling_mixes(engine_llm):
    varied = [
        SamplingParams(max_tokens=6, temperature=0),
        SamplingParams(max_tokens=6, temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=1),
        SamplingParams(max_tokens=6, temperature=0.7, presence_penalty=0.5, repetition_penalty=1.2, seed=2),
        SamplingParams(max_tokens=6, temperature=0, logit_bias={3: 5.0}, min_tokens=3, logprobs=5),
    ]
    prompts, _ = _workload(seed=4, count=12)
    engine_llm.generate(prompts, [varied[i % 4] for i in range(12)], use_tqdm=False)
    runner = engine_llm.engine.runner
    assert runner.guard.compiles_after_warmup == 0
    used = {b for b, n in runner.bucket_counts.items() if n}
    assert any(b.num_tokens == b.num_seqs for b in used) and any(b.num_tokens > b.num_seqs for b in used)
    assert len(used) >= 4
