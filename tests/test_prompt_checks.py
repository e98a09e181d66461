"""A bad prompt gets the same error, message and field, whichever way it comes in: LLM.generate, run-batch's parsing,
or the engine's own add_request. (The HTTP routes: tests/test_server_errors.py.)"""

import json

import pytest

from jaxserve import SamplingParams
from jaxserve.entrypoints.batch_runner import _parse_line
from jaxserve.errors import InvalidRequestError

BAD_PROMPTS = [
    pytest.param([], "prompt is empty", id="empty"),
    pytest.param([5, 100_000], "token id 100000 is outside the vocabulary", id="outside-vocabulary"),
    pytest.param(list(range(5, 69)), "prompt has 64 tokens, but max_model_len is 64", id="too-long"),
]


def _offline_error(llm, token_ids) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate({"prompt_token_ids": token_ids}, SamplingParams(max_tokens=1), use_tqdm=False)
    return refused.value


@pytest.mark.parametrize("token_ids, message", BAD_PROMPTS)
def test_offline_batch_and_engine_refuse_alike(tiny_llm, token_ids, message):
    offline = _offline_error(tiny_llm, token_ids)
    line = json.dumps({"custom_id": "x", "url": "/v1/completions", "body": {"prompt": token_ids or "", "max_tokens": 1}})
    batch = _parse_line(tiny_llm, 1, line).error["error"]
    with pytest.raises(InvalidRequestError) as engine:
        tiny_llm.engine.add_request("direct", token_ids, SamplingParams(max_tokens=1))
    assert message in str(offline)
    assert str(offline) == batch["message"] == str(engine.value)
    assert offline.param == batch["param"] == engine.value.param == "prompt"
    assert not tiny_llm.engine.has_unfinished_requests()


def test_empty_text_is_refused_like_empty_ids(tiny_llm):
    assert str(_offline_error(tiny_llm, [])) == str(_offline_error_text(tiny_llm))


def _offline_error_text(llm) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate("", SamplingParams(max_tokens=1), use_tqdm=False)
    return refused.value
