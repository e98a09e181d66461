"""The offline `LLM` API on the built-in model: vLLM-shaped results, stops, logprobs, seeds and bad input."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.errors import ConfigError, InvalidRequestError, ModelLoadError

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _only(outputs):
    assert len(outputs) == 1
    return outputs[0].outputs[0]


def test_result_has_vllm_shape(tiny_llm):
    [result] = tiny_llm.generate("Hello there", GREEDY, use_tqdm=False)
    completion = result.outputs[0]
    assert result.prompt == "Hello there"
    assert result.prompt_token_ids == tuple(tiny_llm.get_tokenizer().encode("Hello there"))
    assert len(completion.token_ids) == 12 and completion.finish_reason == "length"
    assert completion.text == tiny_llm.get_tokenizer().decode(completion.token_ids)


def test_text_and_token_id_prompts_agree(tiny_llm):
    ids = tiny_llm.get_tokenizer().encode("Once upon a time")
    by_text, by_ids = tiny_llm.generate(["Once upon a time", {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_greedy_is_deterministic_and_independent_of_batch_position(tiny_llm):
    prompts = ["alpha beta", "a much longer prompt that pads differently", "x"]
    batched = tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    alone = tiny_llm.generate(prompts[1], GREEDY, use_tqdm=False)
    assert batched[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_logprobs_hold_top_k_and_the_sampled_token(tiny_llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=2, ignore_eos=True)
    completion = _only(tiny_llm.generate("abc", params, use_tqdm=False))
    assert len(completion.logprobs) == 6
    for token, candidates in zip(completion.token_ids, completion.logprobs):
        assert token in candidates and len(candidates) in (2, 3)
        best = max(candidates.values(), key=lambda c: c.logprob)
        assert best.rank == 1 and all(c.logprob <= 0 for c in candidates.values())
    total = sum(c[t].logprob for t, c in zip(completion.token_ids, completion.logprobs))
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_seeded_sampling_reproduces_and_differs_across_seeds(tiny_llm):
    def run(seed):
        params = SamplingParams(max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True)
        return _only(tiny_llm.generate("seed test", params, use_tqdm=False)).token_ids

    assert run(11) == run(11)
    assert run(11) != run(12)
    # All 64 bits count: seeds equal modulo 2**32 draw differently (they used to alias), and int64's ends are taken.
    assert run(1) != run(2**32 + 1) and run(0) != run(2**62)
    assert run(2**63 - 1) == run(2**63 - 1) != run(-2**63)


def test_logprobs_beyond_max_logprobs_are_refused_not_cut(tiny_llm):
    """vLLM's rule: asking for more top log-probabilities than the engine computes is an error, never fewer."""
    limit = tiny_llm.config.max_logprobs
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequestError, match=f"at most {limit}") as refused:
            tiny_llm.generate("x", SamplingParams(max_tokens=2, **{field: limit + 1}), use_tqdm=False)
        assert refused.value.param == field
    assert len(_only(tiny_llm.generate("x", SamplingParams(max_tokens=2, logprobs=limit),
                                       use_tqdm=False)).logprobs[0]) >= limit


def test_max_tokens_0_scores_a_prompt_that_fills_the_context(tiny_llm):
    """Scoring (prompt_logprobs with max_tokens 0) generates nothing, so the prompt may be max_model_len long; its
    logprobs are the ones a longer request gets for the same prompt tokens."""
    ids = list(range(5, 5 + tiny_llm.max_model_len))
    [scored] = tiny_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=1),
                                 use_tqdm=False)
    assert scored.outputs[0].token_ids == () and scored.outputs[0].text == ""
    assert scored.outputs[0].finish_reason == "length" and len(scored.prompt_logprobs) == len(ids)
    [shorter] = tiny_llm.generate({"prompt_token_ids": ids[:-1]}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                                  use_tqdm=False)
    for full, cut in zip(scored.prompt_logprobs[1:], shorter.prompt_logprobs[1:]):
        assert {t: c.logprob for t, c in full.items()} == pytest.approx({t: c.logprob for t, c in cut.items()},
                                                                        abs=1e-5)
    with pytest.raises(InvalidRequestError, match="at least one token must be generated"):
        tiny_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1), use_tqdm=False)


def test_stop_token_id_ends_generation_and_stays_out_of_text(tiny_llm):
    reference = _only(tiny_llm.generate("stop here", GREEDY, use_tqdm=False)).token_ids
    stop_id = reference[4]
    first = reference.index(stop_id)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    completion = _only(tiny_llm.generate("stop here", params, use_tqdm=False))
    assert completion.token_ids == reference[: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_id
    assert completion.text == tiny_llm.get_tokenizer().decode(reference[:first])


def test_stop_string_truncates_the_text(tiny_llm):
    full = _only(tiny_llm.generate("strings", GREEDY, use_tqdm=False)).text
    assert len(full) > 6
    stop = full[3:6]
    completion = _only(tiny_llm.generate("strings", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                                   stop=[stop]), use_tqdm=False))
    assert completion.text == full[: full.index(stop)]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop


def test_generation_stops_at_the_end_of_the_context(tiny_llm):
    ids = list(range(5, 5 + 60))  # 60 tokens of a 64-token context leave room for 4
    completion = _only(tiny_llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=50, ignore_eos=True),
                                         use_tqdm=False))
    assert len(completion.token_ids) == 4 and completion.finish_reason == "length"


def test_chat_applies_the_template(tiny_llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    [result] = tiny_llm.chat(messages, GREEDY, use_tqdm=False)
    rendered = tiny_llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    assert result.prompt_token_ids == tuple(tiny_llm.get_tokenizer().encode(rendered, add_special_tokens=False))
    assert len(result.outputs[0].token_ids) == 12


def test_a_chat_message_without_content_is_refused_before_anything_runs(tiny_llm):
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]: a user message needs content") as caught:
        tiny_llm.chat([[{"role": "user", "content": "fine"}], [{"role": "system", "content": "x"}, {"role": "user"}]],
                      GREEDY, use_tqdm=False)
    assert caught.value.param == "messages[1].content"


@pytest.mark.parametrize("prompt, message", [
    ("", "prompt is empty"),
    ({"prompt_token_ids": []}, "prompt is empty"),
    ({"prompt_token_ids": [1, 10**6]}, "outside the vocabulary"),
    ({"prompt_token_ids": [-1]}, "outside the vocabulary"),
    ({"prompt_token_ids": list(range(64))}, "max_model_len is 64"),
    ({"prompt_token_ids": "abc"}, "list of integers"),
    (42, "text or token ids"),
])
def test_bad_prompts_are_rejected_before_anything_runs(tiny_llm, prompt, message):
    with pytest.raises(InvalidRequestError, match=message):
        tiny_llm.generate(["fine prompt", prompt], GREEDY, use_tqdm=False)


def test_sampling_params_count_must_match(tiny_llm):
    with pytest.raises(InvalidRequestError, match="2 sampling params for 3 prompts"):
        tiny_llm.generate(["a", "b", "c"], [GREEDY, GREEDY], use_tqdm=False)


def test_bad_engine_settings_are_precise(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        LLM(dtype="float8")
    with pytest.raises(ModelLoadError, match=str(tmp_path / "nowhere")):
        LLM(model=tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(max_model_len=10**7)


def test_engine_keeps_working_after_a_rejected_request(tiny_llm):
    before = _only(tiny_llm.generate("steady", GREEDY, use_tqdm=False)).token_ids
    with pytest.raises(InvalidRequestError):
        tiny_llm.generate({"prompt_token_ids": [10**6]}, GREEDY, use_tqdm=False)
    after = _only(tiny_llm.generate("steady", GREEDY, use_tqdm=False)).token_ids
    assert before == after and np.all(np.array(before) < tiny_llm.model.config.vocab_size)


@pytest.mark.parametrize("params, message", [
    (SamplingParams(stop_token_ids=[2**40]), "stop_token_ids names a token outside the vocabulary"),
    (SamplingParams(top_k=2**40), "top_k must be at most the vocabulary size"),
    (SamplingParams(logit_bias={10**6: 1.0}), "logit_bias names a token outside the vocabulary"),
])
def test_ids_the_sampler_cannot_hold_are_refused_and_the_engine_goes_on(tiny_llm, params, message):
    """Such values would overflow the step's int32 sampling arrays and fail the whole batch."""
    before = _only(tiny_llm.generate("steady", GREEDY, use_tqdm=False)).token_ids
    with pytest.raises(InvalidRequestError, match=message):
        tiny_llm.generate("steady", params, use_tqdm=False)
    assert _only(tiny_llm.generate("steady", GREEDY, use_tqdm=False)).token_ids == before


def test_a_vanishing_temperature_decodes_greedily(tiny_llm):
    """Logits divided by 1e-300 overflow float32; like vLLM, temperatures below 1e-5 mean greedy."""
    greedy = _only(tiny_llm.generate("steady", GREEDY, use_tqdm=False)).token_ids
    tiny = SamplingParams(max_tokens=12, temperature=1e-300, ignore_eos=True, seed=3)
    assert _only(tiny_llm.generate("steady", tiny, use_tqdm=False)).token_ids == greedy


def test_priorities_are_one_per_prompt_and_refused_under_fcfs(tiny_llm):
    """As vLLM: `priority=[...]` pairs with the prompts, and a priority other than 0 needs the priority policy."""
    before = _only(tiny_llm.generate("steady", GREEDY, use_tqdm=False)).token_ids
    assert _only(tiny_llm.generate("steady", GREEDY, use_tqdm=False, priority=[0])).token_ids == before
    with pytest.raises(InvalidRequestError, match="got 1 priorities for 2 prompts") as mismatched:
        tiny_llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0])
    chat = [{"role": "user", "content": "Hi"}]
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority") as refused:
        tiny_llm.chat(chat, GREEDY, use_tqdm=False, priority=[1])
    assert mismatched.value.param == refused.value.param == "priority"
    assert tiny_llm.engine.stats().num_waiting == 0
    assert _only(tiny_llm.generate("steady", GREEDY, use_tqdm=False)).token_ids == before
