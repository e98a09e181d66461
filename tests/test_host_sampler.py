"""The reference sampler follows the definitions of its rules: temperature, top-k, top-p and min-p (checked
statistically), and penalties, logit_bias and min_tokens (checked on the processed logits)."""

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.reference.host_sampler import SamplingContext, log_softmax, process_logits, sample, sampling_probs

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03], dtype=np.float32))
DRAWS = 4000


def _frequencies(params, seed=0):
    rng = np.random.default_rng(seed)
    counts = np.bincount([sample(LOGITS, params, rng).token_id for _ in range(DRAWS)], minlength=len(LOGITS))
    return counts / DRAWS


def _close(observed, expected):
    # ~5 standard errors of a binomial proportion: fails on a wrong rule, not on noise.
    tolerance = 5 * np.sqrt(np.maximum(expected * (1 - expected), 1e-4) / DRAWS)
    return np.all(np.abs(observed - expected) <= tolerance)


def test_temperature_one_reproduces_the_distribution():
    assert _close(_frequencies(SamplingParams(temperature=1.0)), np.exp(LOGITS))


def test_temperature_sharpens_as_softmax_of_scaled_logits():
    expected = np.exp(LOGITS / 0.5) / np.exp(LOGITS / 0.5).sum()
    assert _close(_frequencies(SamplingParams(temperature=0.5)), expected)


def test_top_k_renormalises_over_the_k_most_likely():
    p = np.exp(LOGITS)
    expected = np.where(np.arange(5) < 2, p, 0) / p[:2].sum()
    assert _close(_frequencies(SamplingParams(top_k=2)), expected)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    p = np.exp(LOGITS)  # cumulative 0.5, 0.75, 0.9: top_p=0.7 keeps the first two
    expected = np.where(np.arange(5) < 2, p, 0) / p[:2].sum()
    assert _close(_frequencies(SamplingParams(top_p=0.7)), expected)


def test_greedy_and_logprobs_report_rank_and_top_list():
    token = sample(LOGITS, SamplingParams(temperature=0, logprobs=3), np.random.default_rng(0))
    assert token.token_id == 0 and token.rank == 1
    assert [t for t, _ in token.top] == [0, 1, 2]
    assert token.logprob == pytest.approx(np.log(0.5), abs=1e-5)


def test_same_seed_same_draws():
    def draws(seed):
        rng = np.random.default_rng(seed)
        return [sample(LOGITS, SamplingParams(temperature=1.0), rng).token_id for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def _processed(params, prompt=(), output=(), eos=()):
    return process_logits(PENALTY_LOGITS, params, SamplingContext(tuple(prompt), tuple(output), tuple(eos)))


# Both signs and a zero, so the repetition rule's two branches are visible.
PENALTY_LOGITS = np.array([1.0, 2.0, -1.0, 0.5, -2.0, 3.0, 0.0, -0.5], dtype=np.float32)


def test_penalties_change_exactly_the_logits_of_seen_tokens():
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    # Token 1 is only in the prompt, 2 in both, 3 generated twice, 6 (logit 0) generated once.
    processed = _processed(params, prompt=(1, 2), output=(2, 3, 3, 6))
    expected = PENALTY_LOGITS.astype(np.float64)
    expected[1] = 2.0 / 2  # prompt only: repetition, no frequency or presence
    expected[2] = -1.0 * 2 - 0.25 - 0.5  # negative logit multiplied, then one occurrence
    expected[3] = 0.5 / 2 - 2 * 0.25 - 0.5
    expected[6] = 0.0 - 0.25 - 0.5  # zero is not positive: multiplied (stays 0)
    np.testing.assert_allclose(processed, expected, rtol=0, atol=1e-12)


def test_logit_bias_adds_to_the_named_ids_only():
    params = SamplingParams(logit_bias=((0, 1.5), (4, -3.0), (4, 10.0), (99, 5.0)))
    expected = PENALTY_LOGITS.astype(np.float64)
    expected[0] += 1.5
    expected[4] += 10.0  # a repeated id keeps its last bias; id 99 is outside the vocabulary and ignored
    np.testing.assert_allclose(_processed(params), expected, rtol=0, atol=1e-12)


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    params = SamplingParams(min_tokens=2, stop_token_ids=(3,))
    before = _processed(params, output=(1,), eos=(5,))
    assert np.isneginf(before[[3, 5]]).all() and np.isfinite(np.delete(before, [3, 5])).all()
    assert np.isfinite(_processed(params, output=(1, 1), eos=(5,))).all()
    ignoring = _processed(SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=(3,)), eos=(5,))
    assert np.isneginf(ignoring[3]) and np.isfinite(ignoring[5])


def test_min_tokens_holds_back_a_greedy_eos():
    eos = int(np.argmax(PENALTY_LOGITS))
    params = SamplingParams(temperature=0, min_tokens=3)
    rng = np.random.default_rng(0)
    tokens = []
    for _ in range(4):
        context = SamplingContext((), tuple(tokens), (eos,))
        tokens.append(sample(PENALTY_LOGITS, params, rng, context).token_id)
    assert eos not in tokens[:3] and tokens[3] == eos


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely():
    p = np.exp(LOGITS)  # min_p=0.4 keeps probabilities >= 0.2: the first two
    expected = np.where(np.arange(5) < 2, p, 0) / p[:2].sum()
    assert _close(_frequencies(SamplingParams(min_p=0.4)), expected)


def test_min_p_applies_before_top_p():
    # vLLM v1 order: min_p keeps {0.5, 0.25}, renormalised to {2/3, 1/3}; top_p=0.6 then keeps only the first.
    # The other order (top_p on the full distribution first) would keep both.
    probs = sampling_probs(LOGITS.astype(np.float64), SamplingParams(min_p=0.4, top_p=0.6))
    np.testing.assert_allclose(probs, [1, 0, 0, 0, 0], atol=1e-12)


def test_top_k_keeps_every_token_tied_with_the_kth():
    tied = np.array([2.0, 1.0, 1.0, 0.0])
    probs = sampling_probs(tied, SamplingParams(top_k=2))
    weights = np.exp(tied) * [1, 1, 1, 0]
    np.testing.assert_allclose(probs, weights / weights.sum(), atol=1e-12)


def test_logprobs_are_reported_from_the_raw_logits():
    params = SamplingParams(temperature=0.5, presence_penalty=2.0, logit_bias={1: 4.0}, logprobs=2)
    context = SamplingContext((), (0, 0), ())
    token = sample(PENALTY_LOGITS, params, np.random.default_rng(0), context)
    raw = log_softmax(PENALTY_LOGITS.astype(np.float64))
    assert token.logprob == pytest.approx(raw[token.token_id], abs=1e-6)
    assert [t for t, _ in token.top] == [5, 1]
