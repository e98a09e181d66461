"""SamplingParams rejects out-of-range values with an error that names the parameter."""

import pytest

from jaxserve import SamplingParams
from jaxserve.errors import InvalidRequestError


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed=1.5), "seed"),
    (dict(seed=2**63), "seed"),  # outside int64, as vLLM's bound
    (dict(seed=-2**63 - 1), "seed"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(priority=1.5), "priority"),
    (dict(priority=True), "priority"),
])
def test_out_of_range_values_are_rejected(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)


def test_list_forms_are_accepted_and_frozen():
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[3])
    assert params.stop == ("a", "b") and params.stop_token_ids == (3,)
    assert SamplingParams(stop="x").stop == ("x",)


def test_greedy_when_temperature_zero_or_top_k_one():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize("kwargs, param", [
    (dict(n=0), "n"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),  # as vLLM: it could not be honoured
    (dict(min_p=1.5), "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(logit_bias={5: 200.0}), "logit_bias"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
])
def test_out_of_range_extended_values_are_rejected(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_logit_bias_accepts_json_style_string_keys():
    assert SamplingParams(logit_bias={"7": -1.5}).logit_bias == ((7, -1.5),)
