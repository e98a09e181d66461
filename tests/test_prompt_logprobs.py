"""prompt_logprobs (scoring, as lm-evaluation-harness uses it): the paged engine against the dense reference decoder,
against the model's own full-sequence logits, and against HF transformers."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.reference.reference_llm import ReferenceLLM
from jaxserve.runner.buckets import BucketSet
from tests.hf_models import jaxserve_logits

# The shapes of tests/test_engine.py, so the sampling programs are shared through the persistent cache.
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, block_size=8,
              num_kv_pages=40, use_tqdm_on_load=False)
TINY_POOL = dict(ENGINE, num_kv_pages=12)  # 88 token slots for four sequences of up to 64: forces preemption
# 2 + 9 + 23 tokens leave 30 of the 64-token budget to the 50-token prompt: it is scored in two chunks, the first
# ending mid-page, so its last token scores the first token of the next chunk.
LENGTHS = (2, 9, 23, 50, 1)
LOGPROB_ATOL = 1e-4


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": [int(t) for t in rng.integers(3, 500, size=n)]} for n in lengths]


def _scoring(k, **overrides):
    """The lm-evaluation-harness request: score the prompt, generate one token."""
    return SamplingParams(**{**dict(max_tokens=1, temperature=0, prompt_logprobs=k), **overrides})


@pytest.fixture(scope="module")
def engine_llm():
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def reference_llm():
    return ReferenceLLM(dtype="float32", max_model_len=64)


def _assert_well_formed(output, k):
    """One entry per prompt token: None first, then the actual token plus exactly the k best, ranked from 1."""
    scored = output.prompt_logprobs
    assert len(scored) == len(output.prompt_token_ids) and scored[0] is None
    for token, candidates in zip(output.prompt_token_ids[1:], scored[1:]):
        assert token in candidates and len(candidates) in (k, k + 1)
        assert sorted(c.rank for c in candidates.values())[:k] == list(range(1, k + 1))
        assert all(c.logprob <= 0 for c in candidates.values())


def _assert_same_scores(actual, expected):
    assert len(actual) == len(expected) and actual[0] is None and expected[0] is None
    for got, want in zip(actual[1:], expected[1:]):
        assert got.keys() == want.keys()
        for token, candidate in want.items():
            assert got[token].logprob == pytest.approx(candidate.logprob, abs=LOGPROB_ATOL)
            assert (got[token].rank, got[token].decoded_token) == (candidate.rank, candidate.decoded_token)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_engine_prompt_logprobs_equal_the_reference(engine_llm, reference_llm, k):
    prompts, params = _prompts(LENGTHS), _scoring(k)
    engine = engine_llm.generate(prompts, params, use_tqdm=False)
    reference = reference_llm.generate(prompts, params, use_tqdm=False)
    for got, want in zip(engine, reference):
        _assert_well_formed(got, k)
        _assert_same_scores(got.prompt_logprobs, want.prompt_logprobs)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert engine[-1].prompt_logprobs == [None]  # a one-token prompt has nothing to score


def test_scoring_and_generating_requests_share_a_batch(engine_llm, reference_llm):
    prompts = _prompts((30, 12, 45, 7), seed=1)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
    params = [_scoring(2), greedy, _scoring(3, max_tokens=4, presence_penalty=0.5, top_p=0.9, seed=2), seeded]
    mixed = engine_llm.generate(prompts, params, use_tqdm=False)
    alone = [engine_llm.generate(p, q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
    reference = reference_llm.generate(prompts[:3], params[:3], use_tqdm=False)
    for got, want in zip([mixed[0], mixed[2]], [reference[0], reference[2]]):
        _assert_same_scores(got.prompt_logprobs, want.prompt_logprobs)
    assert mixed[1].prompt_logprobs is None and mixed[3].prompt_logprobs is None
    assert mixed[1].outputs[0].token_ids == reference[1].outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in alone]
    assert engine_llm.engine.runner.guard.compiles_after_warmup == 0


def test_only_prefill_steps_of_scoring_requests_run_the_prompt_logits_variant(engine_llm):
    runner = engine_llm.engine.runner

    def scoring_steps():
        return sum(n for bucket, n in runner.bucket_counts.items() if bucket.prompt_logits)

    before = scoring_steps()
    engine_llm.generate(_prompts((20, 30)), SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    assert scoring_steps() == before
    engine_llm.generate(_prompts((20,)), _scoring(1, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert scoring_steps() == before + 1  # the one prefill step; its seven decode steps run the plain variant
    assert runner.guard.compiles_after_warmup == 0


def test_a_scoring_request_gets_no_prefix_cache_hit(engine_llm, reference_llm):
    prefix = _prompts((40,), seed=2)[0]["prompt_token_ids"]
    greedy = SamplingParams(max_tokens=2, temperature=0)
    engine_llm.generate({"prompt_token_ids": prefix + [7]}, greedy, use_tqdm=False)
    hits = engine_llm.engine.stats().prefix_hit_tokens
    scored = {"prompt_token_ids": prefix + [9]}
    [output] = engine_llm.generate(scored, _scoring(1), use_tqdm=False)
    assert engine_llm.engine.stats().prefix_hit_tokens == hits
    _assert_same_scores(output.prompt_logprobs, reference_llm.generate(scored, _scoring(1), use_tqdm=False)[0]
                        .prompt_logprobs)
    engine_llm.generate({"prompt_token_ids": prefix + [11]}, greedy, use_tqdm=False)
    assert engine_llm.engine.stats().prefix_hit_tokens > hits  # the prefix was cached all along


def test_n_continuations_share_one_prompt_scoring(engine_llm, reference_llm):
    prompt = _prompts((26,), seed=3)[0]
    [output] = engine_llm.generate(prompt, _scoring(2, n=3, max_tokens=3, temperature=1.0, seed=4), use_tqdm=False)
    [reference] = reference_llm.generate(prompt, _scoring(2, max_tokens=3), use_tqdm=False)
    assert len(output.outputs) == 3
    _assert_same_scores(output.prompt_logprobs, reference.prompt_logprobs)


def test_prompt_logprobs_are_the_log_softmax_of_the_full_sequence_logits(engine_llm):
    prompt = _prompts((37,), seed=4)[0]["prompt_token_ids"]
    [output] = engine_llm.generate({"prompt_token_ids": prompt}, _scoring(3), use_tqdm=False)
    logits = jaxserve_logits(engine_llm.model.load(progress=False), np.array([prompt]))[0].astype(np.float64)  # f64[tokens, vocab]
    expected = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)  # f64[tokens, vocab]
    for i, candidates in enumerate(output.prompt_logprobs[1:], start=1):
        row = expected[i - 1]  # f64[vocab]: position i - 1 predicts token i
        assert candidates[prompt[i]].logprob == pytest.approx(row[prompt[i]], abs=LOGPROB_ATOL)
        assert candidates[prompt[i]].rank == 1 + int(np.sum(row > row[prompt[i]]))
        assert set(np.argsort(-row)[:3].tolist()) <= candidates.keys()


def test_preempted_scoring_requests_keep_exact_scores(reference_llm):
    llm = LLM(**TINY_POOL)
    prompts = _prompts((40, 35, 44, 38, 30), seed=5)
    params = _scoring(1, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > 0
    for got, want in zip(outputs, reference_llm.generate(prompts, params, use_tqdm=False)):
        _assert_same_scores(got.prompt_logprobs, want.prompt_logprobs)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert llm.engine.runner.guard.compiles_after_warmup == 0


def test_the_prompt_logits_variant_is_compiled_once_per_token_count():
    buckets = BucketSet.for_limits(max_num_batched_tokens=64, max_num_seqs=4)
    scoring = [b for b in buckets.all_buckets() if b.prompt_logits]
    assert [b.num_tokens for b in scoring] == [16, 32, 64]
    assert buckets.select(40, 2, prompt_logits=True) == scoring[-1]


@pytest.mark.parity
def test_prompt_logprobs_match_hf_transformers(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from jaxserve.checkpoint import BUILTIN_MODEL_DIR
    from tests.hf_models import hf_logits, save_tiny_hf_llama

    hf_model = save_tiny_hf_llama(tmp_path, "llama31", vocab_size=512)  # vocab 512: the built-in tokenizer serves it
    # The engine shapes of tests/test_generate_parity.py; the 40-token prompt is scored in two chunks.
    llm = LLM(model=tmp_path, tokenizer=BUILTIN_MODEL_DIR, dtype="float32", max_model_len=128, max_num_seqs=2,
              max_num_batched_tokens=32, use_tqdm_on_load=False)
    prompt = [int(t) for t in np.random.default_rng(6).integers(3, 512, size=40)]
    [output] = llm.generate({"prompt_token_ids": prompt}, _scoring(2), use_tqdm=False)
    logits = hf_logits(hf_model, np.array([prompt]))[0].astype(np.float64)  # f64[tokens, vocab]
    expected = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)  # f64[tokens, vocab]
    actual = [output.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
    np.testing.assert_allclose(actual, expected[np.arange(len(prompt) - 1), prompt[1:]], atol=LOGPROB_ATOL)
