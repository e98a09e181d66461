"""Speculative decoding (n-gram or draft-model drafts verified in the step): the output is the target's, whatever
the drafts."""

import json
import shutil

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint import BUILTIN_MODEL_DIR
from jaxserve.engine.ngram_proposer import NgramProposer
from jaxserve.engine.proposers import SequenceProposer
from jaxserve.errors import ConfigError
from jaxserve.reference import host_sampler
from jaxserve.runner.sampler import build_sampling_tensors
from jaxserve.runner.speculative import DraftArrays, verify_drafts
from jaxserve.schedule import SamplingRow
from jaxserve.speculative_config import SpeculativeConfig
from tests.hf_models import write_tiny_checkpoint
from tests.test_engine import RandomDrafts

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# The shapes of the session's tiny_llm (tests/conftest.py), so both engines see the same step limits.
ENGINE = dict(dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, use_tqdm_on_load=False)


# --- configuration -----------------------------------------------------------------------------------------------

def test_the_ngram_config_takes_vllms_keys_and_defaults():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}') == SpeculativeConfig(
        "ngram", 4, prompt_lookup_max=5, prompt_lookup_min=5)
    one_bound = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (one_bound.prompt_lookup_max, one_bound.prompt_lookup_min) == (3, 3)
    assert SpeculativeConfig.parse({"model": "/drafts/1b", "num_speculative_tokens": 5}).method == "draft_model"


@pytest.mark.parametrize("value, message", [
    ("{not json", "not valid JSON"),
    ('["ngram"]', "must be a JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "unknown method 'eagle'"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 99}, "at most 16"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "must not exceed prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "unknown key"),
])
def test_bad_speculative_configs_are_refused_by_name(value, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.parse(value)


def test_an_engine_refuses_what_it_cannot_speculate_before_compiling():
    with pytest.raises(ConfigError, match="must fit max_num_batched_tokens"):
        LLM(None, **dict(ENGINE, max_num_batched_tokens=8), speculative_config={**NGRAM, "num_speculative_tokens": 8})


# --- drafts ------------------------------------------------------------------------------------------------------

def test_ngram_drafts_follow_the_latest_longest_match():
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=1))
    # The suffix 7 8 9 occurred twice; the latest occurrence is followed by 4 5.
    assert proposer.propose([7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 6, 7, 8, 9], 3) == (4, 5, 6)
    assert proposer.propose([7, 8, 9, 1, 2, 7, 8, 9, 4, 5, 6, 7, 8, 9], 1) == (4,)
    # Only the last token recurs (n = 1), and only one token follows its occurrence.
    assert proposer.propose([3, 1, 2, 3], 3) == (1, 2, 3)
    assert proposer.propose([1, 2, 3, 4], 3) == ()
    strict = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=2))
    assert strict.propose([3, 1, 2, 3], 3) == ()  # a one-token match is below prompt_lookup_min


# --- verification on the device: the distribution of what is emitted is the target's -----------------------------

VOCAB = 6
DRAWS = 20000
verify_jit = jax.jit(verify_drafts, static_argnames="num_top_logprobs")


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8, logit_bias={2: 1.5})],
                         ids=["plain", "top_k", "top_p+bias"])
def test_emitted_tokens_have_the_targets_distribution(params):
    """Row r brings drafts (d1, d2) against fixed target logits at its 3 positions; over many seeds, the first
    emitted token follows the target at position 0, and after an accepted d1 the second follows position 1."""
    rng = np.random.default_rng(7)
    logits = rng.normal(scale=1.2, size=(3, VOCAB)).astype(np.float32)  # f32[K + 1, V]
    drafts = (2, 4)
    rows = [SamplingRow(params, (0,), (), (), seed=seed, step=1) for seed in range(DRAWS)]
    out, verified = verify_jit(np.tile(logits, (DRAWS, 1)), _draft_arrays(DRAWS, drafts),
                               build_sampling_tensors(rows), num_top_logprobs=1)
    first = np.where(np.asarray(verified.num_accepted) > 0, drafts[0], np.asarray(out.token_ids))
    expected = [host_sampler.sampling_probs(host_sampler.process_logits(
        logits[j].astype(np.float64), params, host_sampler.SamplingContext((0,), (), ())), params) for j in (0, 1)]
    assert _close(np.bincount(first, minlength=VOCAB) / DRAWS, expected[0], DRAWS)
    after_d1 = np.asarray(verified.num_accepted) >= 1
    second = np.where(np.asarray(verified.num_accepted)[after_d1] > 1, drafts[1], np.asarray(out.token_ids)[after_d1])
    assert _close(np.bincount(second, minlength=VOCAB) / after_d1.sum(), expected[1], after_d1.sum())


@pytest.mark.parametrize("beside_a_sampled_row", [False, True])
def test_greedy_rows_accept_drafts_while_they_are_the_argmax(beside_a_sampled_row):
    logits = np.full((4, VOCAB), -1.0, np.float32)
    logits[[0, 1, 2, 3], [3, 5, 1, 0]] = 2.0  # argmax per position: 3, 5, 1, 0
    rows = [SamplingRow(SamplingParams(temperature=0), (0,), (), (), seed=0, step=1)] * 3
    tests = [(3, 5, 2), (3, 5, 1), (4, 5, 1)]  # rejected at the third, all accepted, rejected at the first
    if beside_a_sampled_row:  # the step then runs rejection sampling too; greedy rows must not notice
        rows, tests = rows + [SamplingRow(SamplingParams(temperature=1.0), (0,), (), (), seed=3, step=1)], tests + [
            (0, 0, 0)]
    n = len(rows)
    arrays = DraftArrays(token_ids=np.array(tests, np.int32), num_drafts=np.full(n, 3, np.int32),
                         logits_index=np.arange(4 * n, dtype=np.int32).reshape(n, 4))
    out, verified = verify_jit(np.tile(logits, (n, 1)), arrays, build_sampling_tensors(rows), num_top_logprobs=1)
    assert np.asarray(verified.num_accepted)[:3].tolist() == [2, 3, 0]
    # The argmax where the run stopped, or the bonus token.
    assert np.asarray(out.token_ids)[:3].tolist() == [1, 0, 3]


def _draft_arrays(rows, drafts):
    k = len(drafts)
    return DraftArrays(token_ids=np.tile(np.array(drafts, np.int32), (rows, 1)), num_drafts=np.full(rows, k, np.int32),
                       logits_index=np.arange(rows * (k + 1), dtype=np.int32).reshape(rows, k + 1))


def _close(observed, expected, draws):
    # ~5 standard errors of a binomial proportion: fails on a wrong rule, not on noise.
    tolerance = 5 * np.sqrt(np.maximum(expected * (1 - expected), 1e-4) / draws)
    return np.all(np.abs(observed - expected) <= tolerance)


# --- the engine: greedy output identical with and without speculation ---------------------------------------------

class _OracleProposer(SequenceProposer):
    """Proposes the continuation a plain engine generated: every draft is right."""

    def __init__(self, prompts, continuations):
        self._runs = [list(p) + list(c) for p, c in zip(prompts, continuations)]

    def propose(self, token_ids, max_drafts):
        run = next(r for r in self._runs if r[:len(token_ids)] == list(token_ids))
        return tuple(run[len(token_ids):len(token_ids) + max_drafts])


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(None, **ENGINE, speculative_config=NGRAM)


def _repetitive_prompts(count=6, seed=0):
    """Prompts that repeat a phrase, so prompt lookup finds drafts; some share a prefix (prefix caching)."""
    rng = np.random.default_rng(seed)
    phrases = [[int(t) for t in rng.integers(5, 500, int(rng.integers(2, 6)))] for _ in range(count)]
    return [{"prompt_token_ids": (phrases[0] * 2 if i % 3 == 0 else []) + phrase * 3} for i, phrase in
            enumerate(phrases)]


def _token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def plain_greedy(tiny_llm):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2, n=2)
    return params, tiny_llm.generate(_repetitive_prompts(), params, use_tqdm=False)


@pytest.mark.parametrize("proposer", ["ngram", "oracle", "random"])
def test_greedy_output_and_logprobs_are_those_without_speculation(spec_llm, plain_greedy, proposer):
    params, plain = plain_greedy
    prompts = _repetitive_prompts()
    scheduler = spec_llm.engine.scheduler
    ngram = scheduler.proposer
    if proposer == "oracle":
        scheduler.proposer = _OracleProposer([p["prompt_token_ids"] for p in prompts],
                                             [o.outputs[0].token_ids for o in plain])
    elif proposer == "random":
        scheduler.proposer = RandomDrafts(seed=1)
    before = spec_llm.engine.stats().spec_decode
    try:
        outputs = spec_llm.generate(prompts, params, use_tqdm=False)
    finally:
        scheduler.proposer = ngram
    stats = spec_llm.engine.stats()
    assert _token_ids(outputs) == _token_ids(plain)
    for got, want in zip(outputs, plain):
        for a, b in zip(got.outputs, want.outputs):
            assert [list(lp) for lp in a.logprobs] == [list(lp) for lp in b.logprobs]
            np.testing.assert_allclose([v.logprob for lp in a.logprobs for v in lp.values()],
                                       [v.logprob for lp in b.logprobs for v in lp.values()], atol=1e-4)
    drafted = stats.spec_decode.num_draft_tokens - before.num_draft_tokens
    accepted = stats.spec_decode.num_accepted_tokens - before.num_accepted_tokens
    assert drafted > 0
    if proposer == "oracle":
        assert accepted == drafted
    if proposer == "random":
        assert accepted < drafted / 10
    assert stats.num_pages_used == 0 and spec_llm.engine.compiles_after_warmup == 0


def test_stops_and_max_tokens_inside_an_accepted_run_end_the_output_there(spec_llm, tiny_llm):
    prompts = _repetitive_prompts(count=4, seed=3)
    plain = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    scheduler = spec_llm.engine.scheduler
    ngram = scheduler.proposer
    scheduler.proposer = _OracleProposer([p["prompt_token_ids"] for p in prompts],
                                         [o.outputs[0].token_ids for o in plain])
    try:
        # Each stops at its 7th token, by a stop token id or by max_tokens, while drafts reach further.
        by_id = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                stop_token_ids=[o.outputs[0].token_ids[6]]) for o in plain]
        stopped = spec_llm.generate(prompts, by_id, use_tqdm=False)
        short = spec_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                                  use_tqdm=False)
    finally:
        scheduler.proposer = ngram
    for plain_output, by_stop, by_length in zip(plain, stopped, short):
        want = plain_output.outputs[0].token_ids
        first_stop = want.index(want[6])
        assert by_stop.outputs[0].token_ids == want[:first_stop + 1]
        assert by_stop.outputs[0].finish_reason == "stop"
        assert by_length.outputs[0].token_ids == want[:7] and by_length.outputs[0].finish_reason == "length"
    assert spec_llm.engine.stats().num_pages_used == 0


def test_sampled_requests_speculate_and_stay_reproducible_by_seed(spec_llm):
    prompts = _repetitive_prompts(count=4, seed=5)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True, seed=11)
    before = spec_llm.engine.stats().spec_decode.num_drafts
    first = spec_llm.generate(prompts, params, use_tqdm=False)
    again = spec_llm.generate(prompts, params, use_tqdm=False)
    assert _token_ids(first) == _token_ids(again)
    assert spec_llm.engine.stats().spec_decode.num_drafts > before


def test_requests_speculation_cannot_serve_run_as_without_it(spec_llm, tiny_llm):
    """Penalties, grammars and prompt_logprobs switch drafts off (per request, or for the steps they share)."""
    prompts = _repetitive_prompts(count=3, seed=9)
    params = [SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1),
              SamplingParams(temperature=0, max_tokens=8, min_tokens=8, ignore_eos=False)]
    want = tiny_llm.generate(prompts, params, use_tqdm=False)
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    assert _token_ids(got) == _token_ids(want)
    assert spec_llm.engine.compiles_after_warmup == 0


def test_metrics_carry_the_spec_decode_counters_by_position():
    from jaxserve.engine.scheduler_stats import SchedulerStats, SpecDecodeStats
    from jaxserve.server.metrics import ServerMetrics

    spec = SpecDecodeStats(accepted_per_position=[0, 0, 0])
    spec.record(num_drafts=3, num_accepted=2)
    spec.record(num_drafts=2, num_accepted=0)
    stats = SchedulerStats(0, 0, 0, 1, 0, 0, 0, 0, 2, spec_decode=spec)
    text = ServerMetrics(lambda: stats).exposition()[0].decode()
    assert "jaxserve:spec_decode_num_drafts_total 2.0" in text
    assert "jaxserve:spec_decode_num_draft_tokens_total 5.0" in text
    assert "jaxserve:spec_decode_num_accepted_tokens_total 2.0" in text
    assert 'jaxserve:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 1.0' in text
    assert 'jaxserve:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 0.0' in text


# --- draft models ------------------------------------------------------------------------------------------------

def _checkpoint(folder, seed, **config):
    """A random tiny Llama in HF's layout, with the built-in model's tokenizer files beside it (as a draft model's
    folder has its tokenizer)."""
    write_tiny_checkpoint(folder, seed=seed, **config)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(BUILTIN_MODEL_DIR / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    work = tmp_path_factory.mktemp("draft_models")
    return {"target": _checkpoint(work / "target", seed=0),
            "small": _checkpoint(work / "small", seed=1, num_hidden_layers=1)}


@pytest.fixture(scope="module")
def target_greedy(checkpoints):
    target = LLM(str(checkpoints["target"]), **ENGINE)
    prompts = _repetitive_prompts(count=5, seed=13)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1, n=2)
    return prompts, params, target.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("draft", ["target", "small"])
def test_a_draft_model_changes_no_token(checkpoints, target_greedy, draft):
    """The target as its own draft: every draft is accepted. A different random draft: almost none are, and the
    output is still exactly the target's."""
    prompts, params, want = target_greedy
    llm = LLM(str(checkpoints["target"]), **ENGINE,
              speculative_config={"model": str(checkpoints[draft]), "num_speculative_tokens": 3})
    got = llm.generate(prompts, params, use_tqdm=False)
    assert _token_ids(got) == _token_ids(want)
    for a, b in zip(got, want):
        for x, y in zip(a.outputs, b.outputs):
            np.testing.assert_allclose(x.cumulative_logprob, y.cumulative_logprob, atol=1e-4)
    stats = llm.engine.stats()
    spec = stats.spec_decode
    assert spec.num_draft_tokens > 0 and stats.num_pages_used == 0 and llm.engine.compiles_after_warmup == 0
    if draft == "target":
        assert spec.num_accepted_tokens == spec.num_draft_tokens
    else:
        assert spec.num_accepted_tokens < spec.num_draft_tokens / 4


def test_a_draft_model_that_does_not_fit_the_target_is_refused_by_name(checkpoints, tmp_path):
    target = str(checkpoints["target"])

    def start(draft):
        LLM(target, **ENGINE, speculative_config={"model": str(draft), "num_speculative_tokens": 2})

    with pytest.raises(ConfigError, match="vocabulary of 640 tokens, the target 512"):
        start(_checkpoint(tmp_path / "vocab", seed=2, vocab_size=640))
    with pytest.raises(ConfigError, match="handles 32 positions, fewer than max_model_len"):
        start(_checkpoint(tmp_path / "short", seed=2, max_position_embeddings=32))
    swapped = _checkpoint(tmp_path / "swapped", seed=2)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ConfigError, match="another tokenizer than the target: token 300"):
        start(swapped)


def test_streamed_deltas_of_accepted_runs_spell_the_whole_output(spec_llm, tiny_llm):
    """A step may emit several tokens of one sequence: each is its own delta, in order."""
    engine = spec_llm.engine
    scheduler = engine.scheduler
    ngram = scheduler.proposer
    prompts = _repetitive_prompts(count=2, seed=21)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = tiny_llm.generate(prompts, params, use_tqdm=False)
    scheduler.proposer = _OracleProposer([p["prompt_token_ids"] for p in prompts],
                                         [o.outputs[0].token_ids for o in plain])
    before = engine.stats().spec_decode.num_accepted_tokens
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"s{i}", prompt["prompt_token_ids"], params, stream=True)
        deltas, finished = [], []
        while engine.has_unfinished_requests():
            finished += engine.step()
            deltas += engine.pop_deltas()
    finally:
        scheduler.proposer = ngram
    for output in finished:
        own = [d for d in deltas if d.request_id == output.request_id]
        assert [t for d in own for t in d.token_ids] == list(output.outputs[0].token_ids)
        assert "".join(d.text for d in own) == output.outputs[0].text
        assert own[-1].finish_reason == "length"
    assert engine.stats().spec_decode.num_accepted_tokens - before > 10


def test_ngram_histories_follow_their_requests_and_are_dropped_with_them():
    from jaxserve.engine.proposers import DraftSlot
    from jaxserve.engine.request import Request

    proposer = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=2, prompt_lookup_min=1))
    request = Request("a", [4, 5, 6, 4], SamplingParams(), arrival_index=0)
    slot = DraftSlot(request, chunk_end=4, max_drafts=3)
    assert proposer.propose_batch([slot]) == [(5, 6, 4)]
    for token in (5, 6, 9):  # outputs read back since: the history grows with them
        request.append_pending_token()
        request.resolve_pending_token(token)
    assert proposer.propose_batch([slot]) == [proposer.propose([4, 5, 6, 4, 5, 6, 9], 3)] == [()]
    again = Request("a", [7, 8, 7], SamplingParams(), arrival_index=1)  # a later request reusing the id
    assert proposer.propose_batch([DraftSlot(again, 3, 3)]) == [(8, 7)]
    assert proposer.propose_batch([]) == [] and not proposer._histories
