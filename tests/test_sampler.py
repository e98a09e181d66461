"""The on-device sampler against the numpy reference: greedy tokens and log-probabilities agree exactly, draws follow
the rules' definitions statistically, a seeded row ignores its batch, and a bucket compiles once."""

import contextlib
import dataclasses

import jax
import numpy as np
import pytest

from jaxserve import SamplingParams
from jaxserve.reference import host_sampler
from jaxserve.runner.sampler import build_sampling_tensors, needs_truncation, sample
from jaxserve.schedule import SamplingRow

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
VOCAB = 64
EOS = (1, 2)
NUM_TOP = 5
WIDTHS = dict(bias_width=4, stop_width=4, history_width=32)  # fixed, so random batches share one program
sample_jit = jax.jit(sample, static_argnames=("num_top_logprobs", "truncation"))


def _random_params(rng: np.random.Generator, greedy: bool, penalties: bool) -> SamplingParams:
    random_rules = dict(temperature=float(rng.uniform(0.5, 1.5)), top_k=int(rng.choice([0, 5])),
                        top_p=float(rng.choice([1.0, 0.9])), min_p=float(rng.choice([0.0, 0.05])))
    greedy_rules = dict(temperature=0.0) if rng.random() < 0.5 else dict(top_k=1)
    penalty_rules = dict(presence_penalty=float(rng.uniform(-2, 2)), frequency_penalty=float(rng.uniform(-2, 2)),
                         repetition_penalty=float(rng.uniform(0.5, 2))) if penalties else {}
    # Biases drawn from a few ids so that repeats (last one wins) happen.
    bias = tuple((int(rng.integers(0, 8)), float(rng.uniform(-5, 5))) for _ in range(rng.integers(0, 5)))
    return SamplingParams(
        **(greedy_rules if greedy else random_rules), **penalty_rules, logit_bias=bias,
        min_tokens=int(rng.integers(0, 5)),
        stop_token_ids=tuple(int(t) for t in rng.integers(0, 8, rng.integers(0, 3))),
        ignore_eos=bool(rng.random() < 0.3), logprobs=int(rng.integers(0, NUM_TOP + 1)),
    )


def _random_row(rng: np.random.Generator, greedy: bool, penalties: bool = True,
                step: int | None = None) -> SamplingRow:
    """A row drawing after `output`; `step` (None: the draw after the outputs, which counts itself) keys its draw."""
    # Few distinct ids, so that prompt and output overlap and tokens repeat.
    prompt = tuple(int(t) for t in rng.integers(0, 12, rng.integers(1, 11)))
    output = tuple(int(t) for t in rng.integers(0, 12, rng.integers(0, 9)))
    params = _random_params(rng, greedy, penalties)
    # Half the rows follow a grammar that allows about half the vocabulary.
    mask = np.packbits(rng.random(VOCAB) < 0.5, bitorder="little").view(np.int32) if rng.random() < 0.5 else None
    return SamplingRow(params, prompt, output, EOS, seed=int(rng.integers(2**40)),
                       step=len(output) + 1 if step is None else step, token_mask=mask)


def _host_processed(logits: np.ndarray, row: SamplingRow) -> np.ndarray:  # f64[vocab]
    context = host_sampler.SamplingContext(tuple(row.prompt_ids), tuple(row.output_ids), tuple(row.eos_token_ids),
                                           row.token_mask)
    return host_sampler.process_logits(logits, row.params, context)


@pytest.mark.parametrize("penalties", [True, False])
def test_matches_the_host_reference_on_a_random_batch(penalties):
    rng = np.random.default_rng(1 + penalties)
    for _ in range(3):
        rows = [_random_row(rng, greedy=rng.random() < 0.6, penalties=penalties) for _ in range(12)]
        logits = (rng.normal(size=(16, VOCAB)) * 3).astype(np.float32)  # f32[S, V]
        tensors = build_sampling_tensors(rows, 16, **WIDTHS)
        # Histories ship only for rows with a penalty; the others are all padding.
        assert bool((tensors.penalties.history_ids >= 0).any()) == penalties
        out = jax.device_get(sample_jit(logits, tensors, num_top_logprobs=NUM_TOP))
        for i, row in enumerate(rows):
            token = int(out.token_ids[i])
            if row.params.greedy:
                assert token == int(np.argmax(_host_processed(logits[i], row)))
            else:
                assert host_sampler.sampling_probs(_host_processed(logits[i], row), row.params)[token] > 0
            expected = host_sampler.describe_token(logits[i], token, NUM_TOP)
            assert out.logprobs[i] == pytest.approx(expected.logprob, abs=1e-5)
            assert out.ranks[i] == expected.rank
            assert out.top_ids[i].tolist() == [t for t, _ in expected.top]
            np.testing.assert_allclose(out.top_logprobs[i], [lp for _, lp in expected.top], atol=1e-5)


# Probabilities 0.5, 0.25, 0.15, 0.07, 0.03 (cumulative 0.5, 0.75, 0.9, ...).
LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03], dtype=np.float32))
PROBS = np.exp(LOGITS.astype(np.float64))
DRAWS = 4000


def _first(n):
    return np.where(np.arange(5) < n, PROBS, 0) / PROBS[:n].sum()


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=1.0), PROBS),
    (SamplingParams(temperature=0.5), PROBS**2 / (PROBS**2).sum()),
    (SamplingParams(top_k=2), _first(2)),
    (SamplingParams(top_p=0.7), _first(2)),
    (SamplingParams(min_p=0.4), _first(2)),  # keeps probabilities >= 0.4 * 0.5
    (SamplingParams(min_p=0.25, top_k=2), _first(2)),
    # min_p first ({0.5, 0.25} renormalised to {2/3, 1/3}), then top_p=0.6 keeps one; the other order keeps two.
    (SamplingParams(min_p=0.4, top_p=0.6), _first(1)),
], ids=["temperature", "cold", "top_k", "top_p", "min_p", "min_p_top_k", "min_p_before_top_p"])
def test_draws_follow_the_rule_definitions(params, expected):
    rows = [SamplingRow(params, (), (), (), seed=7, step=step) for step in range(DRAWS)]
    assert _close(_frequencies(rows, LOGITS), expected)


def test_draws_after_penalties_and_bias_follow_the_host_distribution():
    params = SamplingParams(temperature=0.8, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.5, logit_bias={4: 2.0}, min_tokens=3, stop_token_ids=(1,))
    rows = [SamplingRow(params, (0, 2), (2, 2), EOS, seed=step, step=0) for step in range(DRAWS)]
    expected = host_sampler.sampling_probs(_host_processed(LOGITS, rows[0]), params)
    assert expected[1] == 0 and _close(_frequencies(rows, LOGITS), expected)


def _frequencies(rows, logits):
    tensors = build_sampling_tensors(rows)
    tokens = sample_jit(np.tile(logits, (len(rows), 1)), tensors, num_top_logprobs=0).token_ids
    return np.bincount(np.asarray(tokens), minlength=len(logits)) / len(rows)


def _close(observed, expected):
    # ~5 standard errors of a binomial proportion: fails on a wrong rule, not on noise.
    tolerance = 5 * np.sqrt(np.maximum(expected * (1 - expected), 1e-4) / DRAWS)
    return np.all(np.abs(observed - expected) <= tolerance)


def test_a_seeded_row_ignores_its_neighbours_and_its_position():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=VOCAB).astype(np.float32)  # f32[V]: flat enough that draws vary

    def tokens(num_rows: int, index: int) -> list[int]:
        drawn = []
        for step in range(8):
            seeded = SamplingRow(SamplingParams(seed=1234), (5, 6), (), EOS, seed=1234, step=step)
            others = [_random_row(rng, greedy=rng.random() < 0.5, step=step) for _ in range(num_rows - 1)]
            rows = others[:index] + [seeded] + others[index:]
            batch_logits = rng.normal(size=(num_rows, VOCAB)).astype(np.float32)
            batch_logits[index] = logits
            out = sample_jit(batch_logits, build_sampling_tensors(rows, **WIDTHS), num_top_logprobs=NUM_TOP)
            drawn.append(int(out.token_ids[index]))
        return drawn

    alone = tokens(1, 0)
    # The documented key, fold_in(key(seed), step), and Gumbel-max over the vocabulary in id order.
    keys = [jax.random.fold_in(jax.random.key(1234), step) for step in range(8)]
    assert alone == [int(np.argmax(logits + jax.random.gumbel(key, (VOCAB,)))) for key in keys]
    assert len(set(alone)) > 1
    assert tokens(8, 5) == alone
    assert tokens(16, 2) == alone


@contextlib.contextmanager
def _counting_compiles():
    compiles = []

    def on_event(event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)


def test_one_program_serves_every_sampling_mix():
    fresh = jax.jit(sample, static_argnames="num_top_logprobs")
    rng = np.random.default_rng(4)
    vocab = 40  # a shape no other test compiles: JAX shares compiled programs between jitted copies of a function

    def run(penalties: bool, greedy_share: float) -> None:
        rows = [_random_row(rng, greedy=rng.random() < greedy_share, penalties=penalties) for _ in range(6)]
        tensors = build_sampling_tensors(rows, 8, **WIDTHS)
        logits = rng.normal(size=(8, vocab)).astype(np.float32)
        jax.block_until_ready(fresh(logits, tensors, num_top_logprobs=NUM_TOP))

    with _counting_compiles() as compiles:
        for penalties, greedy_share in [(True, 0.5), (False, 1.0), (False, 0.0), (True, 1.0), (False, 0.5)]:
            run(penalties, greedy_share)
        assert len(compiles) == 1


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_a_row_samples_the_same_beside_penalties_and_truncation(seeded):
    """Penalties and truncation always run; on a row that uses neither they must change nothing at all."""
    rng = np.random.default_rng(5)
    plain = SamplingRow(SamplingParams(temperature=0.8 if seeded else 0.0, seed=3), tuple(range(5)), (7, 7), EOS,
                        seed=3, step=2)
    busy = SamplingRow(SamplingParams(temperature=1.2, top_p=0.5, top_k=3, min_p=0.1, repetition_penalty=1.5,
                                      presence_penalty=1.0), (1, 2), (3,), EOS, seed=4, step=0)
    logits = (rng.normal(size=(2, VOCAB)) * 3).astype(np.float32)  # f32[2, V]
    alone = sample_jit(logits[:1], build_sampling_tensors([plain], 2, **WIDTHS), num_top_logprobs=NUM_TOP)
    beside = sample_jit(logits, build_sampling_tensors([plain, busy], 2, **WIDTHS), num_top_logprobs=NUM_TOP)
    assert int(alone.token_ids[0]) == int(beside.token_ids[0])
    assert float(alone.logprobs[0]) == float(beside.logprobs[0])


def _untruncated_row(rng: np.random.Generator, greedy: bool) -> SamplingRow:
    """A random row whose draw keeps every token: greedy (with any truncation settings) or top-k/top-p/min-p neutral."""
    row = _random_row(rng, greedy=greedy)
    if greedy:
        return row
    return dataclasses.replace(row, params=dataclasses.replace(row.params, top_k=0, top_p=1.0, min_p=0.0))


def test_the_untruncated_sampler_draws_as_the_full_one_where_no_row_truncates():
    """The variant without the sort is exact, not an approximation, on the steps the runner gives it."""
    rng = np.random.default_rng(8)
    for _ in range(4):
        rows = [_untruncated_row(rng, greedy=rng.random() < 0.4) for _ in range(12)]
        tensors = build_sampling_tensors(rows, 16, **WIDTHS)
        assert not needs_truncation(tensors)
        logits = (rng.normal(size=(16, VOCAB)) * 3).astype(np.float32)  # f32[S, V]
        full = jax.device_get(sample_jit(logits, tensors, num_top_logprobs=NUM_TOP))
        untruncated = jax.device_get(sample_jit(logits, tensors, num_top_logprobs=NUM_TOP, truncation=False))
        for name in ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs"):
            np.testing.assert_array_equal(getattr(untruncated, name), getattr(full, name), err_msg=name)


@pytest.mark.parametrize(("params", "truncates"), [
    (SamplingParams(temperature=0.7), False),
    (SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.1), False),  # greedy: its argmax ignores them
    (SamplingParams(temperature=0.7, top_k=5), True),
    (SamplingParams(temperature=0.7, top_p=0.9), True),
    (SamplingParams(temperature=0.7, min_p=0.05), True),
])
def test_a_step_needs_the_truncating_sampler_only_for_a_drawn_row_that_truncates(params, truncates):
    plain = SamplingRow(SamplingParams(temperature=1.0), (1,), (), EOS, seed=1, step=0)
    tensors = build_sampling_tensors([plain, SamplingRow(params, (1,), (), EOS, seed=2, step=0)], 4)
    assert needs_truncation(tensors) is truncates
    assert not needs_truncation(build_sampling_tensors([plain], 4))  # padding rows never truncate
    # Without the truncating sampler a top-k row could draw outside its k: the variant matters where it is chosen.
    if truncates and params.top_k:
        logits = np.zeros((4, VOCAB), np.float32)  # every token equally likely
        draws = {int(sample_jit(logits, dataclasses.replace(tensors, steps=np.full(4, step, np.int32)),
                                num_top_logprobs=NUM_TOP, truncation=False).token_ids[1]) for step in range(40)}
        assert len(draws) > params.top_k


def test_builder_pads_rows_with_neutral_settings():
    rows = [SamplingRow(SamplingParams(temperature=0, top_p=0.5, logit_bias={3: 1.0}), (1,), (), EOS, 9, 0)]
    tensors = build_sampling_tensors(rows, 4)
    assert tensors.penalties.history_ids.tolist() == [[-1]] * 4  # no row has a penalty: no history shipped
    assert tensors.penalties.repetition.tolist() == [1.0] * 4
    assert tensors.truncation.top_k.tolist() == [0] * 4 and tensors.truncation.top_p.tolist() == [0.5, 1, 1, 1]
    assert tensors.num_rows == 4 and tensors.greedy.tolist() == [True] * 4
    assert tensors.bias_ids.tolist() == [[3], [-1], [-1], [-1]]
    assert tensors.stop_ids.tolist() == [[1, 2], [-1, -1], [-1, -1], [-1, -1]]
    out = sample_jit(np.zeros((4, 8), np.float32), tensors, num_top_logprobs=0)
    assert out.top_ids.shape == (4, 0) and int(out.token_ids[0]) == 3
    with pytest.raises(ValueError, match="bias_width"):
        build_sampling_tensors(rows, 4, bias_width=0)
