"""The reference sampler follows the definitions of temperature, top-k and top-p (checked statistically)."""

import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.runner.host_sampler import sample

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
