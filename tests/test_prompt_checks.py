"""A bad prompt gets the same error, message and field, whichever way it comes in: LLM.generate, run-batch's parsing,
or the engine's own add_request. (The HTTP routes: tests/test_server_errors.py.)"""

import json

import pytest

from jaxserve import SamplingParams
from jaxserve.entrypoints.batch_runner import BatchModels, _parse_line
from jaxserve.errors import InvalidRequestError

BAD_PROMPTS = [
    pytest.param([], "prompt is empty", id="empty"),
    pytest.param([5, 100_000], "token id 100000 is outside the vocabulary", id="outside-vocabulary"),
    pytest.param(list(range(5, 69)), "prompt has 64 tokens, but max_model_len is 64", id="too-long"),
]

# (what LLM.generate is given, the same prompt as a completions body's "prompt" field, message)
BAD_FORMS = [
    pytest.param("", "", "prompt is empty", id="empty-text"),
    pytest.param("a\ud800", "a\ud800", "prompt is not valid Unicode text", id="lone-surrogate"),
]

# A body's wrong JSON types are caught by its declared schema (openai/requests.py), which run-batch shares with
# the server; LLM.generate, given Python objects, names the same fault in its own words. Both name the field.
# (what LLM.generate is given, its message, the body's "prompt", the schema's message)
BAD_TYPES = [
    pytest.param(42, "a prompt must be text or token ids, got int", 42, "prompt must be text, token ids", id="a-number"),
    pytest.param({"prompt_token_ids": [5, "a"]}, "token ids must be a list of integers", [5, "a"],
                 "prompt.1: Input should be a valid integer", id="not-ids"),
    pytest.param({"prompt_token_ids": [5, True]}, "token ids must be a list of integers", [5, True],
                 "prompt.1: Input should be a valid integer", id="a-bool"),
]


def _offline_error(llm, prompt) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    return refused.value


def _batch_error(llm, body_prompt) -> dict:
    line = json.dumps({"custom_id": "x", "url": "/v1/completions", "body": {"prompt": body_prompt, "max_tokens": 1}})
    return _parse_line(llm, 1, line, BatchModels(("tiny",))).error["error"]


@pytest.mark.parametrize("token_ids, message", BAD_PROMPTS)
def test_offline_batch_and_engine_refuse_alike(tiny_llm, token_ids, message):
    offline = _offline_error(tiny_llm, {"prompt_token_ids": token_ids})
    batch = _batch_error(tiny_llm, token_ids)
    with pytest.raises(InvalidRequestError) as engine:
        tiny_llm.engine.add_request("direct", token_ids, SamplingParams(max_tokens=1))
    assert message in str(offline)
    assert str(offline) == batch["message"] == str(engine.value)
    assert offline.param == batch["param"] == engine.value.param == "prompt"
    assert not tiny_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("offline_prompt, body_prompt, message", BAD_FORMS)
def test_offline_and_batch_refuse_bad_forms_alike(tiny_llm, offline_prompt, body_prompt, message):
    offline = _offline_error(tiny_llm, offline_prompt)
    batch = _batch_error(tiny_llm, body_prompt)
    assert message in str(offline)
    assert (str(offline), offline.param) == (batch["message"], batch["param"])


@pytest.mark.parametrize("offline_prompt, offline_message, body_prompt, body_message", BAD_TYPES)
def test_wrong_types_are_named_offline_and_by_the_schema(tiny_llm, offline_prompt, offline_message, body_prompt,
                                                          body_message):
    offline = _offline_error(tiny_llm, offline_prompt)
    batch = _batch_error(tiny_llm, body_prompt)
    assert str(offline).startswith(offline_message) and batch["message"].startswith(body_message)
    assert offline.param == batch["param"] == "prompt"


def test_batch_takes_one_prompt_per_line(tiny_llm):
    assert _batch_error(tiny_llm, ["a", "b"])["message"] == "run-batch takes one prompt per line, got a list of prompts"
