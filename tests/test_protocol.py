"""The declared request schemas: strict JSON types, unknown fields refused (or dropped when allowed), refused fields
accepted only with values that ask for nothing, and errors that name the field."""

import json

import pytest

from jaxserve.openai.bodies import CONSTRAINT_KEYWORDS, sampling_params_from_body
from jaxserve.openai.requests import ChatCompletionRequestBody, CompletionRequestBody
from jaxserve.openai.schema import CONSTRAINT_FIELDS, parse_body, refusal_of
from jaxserve.errors import InvalidRequestError

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"prompt": "Hi"}


def _refused_fields(model):
    return [(name, refusal_of(field)) for name, field in model.model_fields.items() if refusal_of(field)]


@pytest.mark.parametrize("model, base", [(CompletionRequestBody, COMPLETION), (ChatCompletionRequestBody, CHAT)],
                         ids=["completions", "chat"])
def test_refused_fields_take_only_values_that_ask_for_nothing(model, base):
    for name, refusal in _refused_fields(model):
        for neutral in [None, *refusal.neutral]:
            parse_body(model, json.dumps({**base, name: neutral}))


@pytest.mark.parametrize("field, value", [("functions", [{"name": "f"}]), ("best_of", 2), ("suffix", "x"),
                                          ("guided_decoding_backend", "xgrammar"), ("return_token_ids", True),
                                          ("use_beam_search", True), ("service_tier", "flex")])
def test_a_refused_field_asking_for_something_is_named(field, value):
    model, base = (CompletionRequestBody, COMPLETION) if field in ("best_of", "suffix") else (
        ChatCompletionRequestBody, CHAT)
    with pytest.raises(InvalidRequestError, match=f"{field} is not supported") as refused:
        parse_body(model, json.dumps({**base, field: value}))
    assert refused.value.param == field


def test_unknown_fields_are_refused_unless_allowed():
    with pytest.raises(InvalidRequestError, match="unknown field 'temprature'") as refused:
        parse_body(CompletionRequestBody, json.dumps({**COMPLETION, "temprature": 0}))
    assert refused.value.param == "temprature"
    body = parse_body(CompletionRequestBody, json.dumps({**COMPLETION, "temprature": 0}), allow_unknown_fields=True)
    assert body.temperature is None
    with pytest.raises(InvalidRequestError, match="best_of is not supported"):  # declared ones are still refused
        parse_body(CompletionRequestBody, json.dumps({**COMPLETION, "best_of": 4}), allow_unknown_fields=True)


@pytest.mark.parametrize("raw, param", [
    ('{"prompt": "Hi", "stream": "yes"}', "stream"),
    ('{"prompt": "Hi", "n": 2.0}', "n"),
    ('{"prompt": "Hi", "temperature": NaN}', "temperature"),
    ('{"prompt": "Hi", "temperature": Infinity}', "temperature"),
    ('{"prompt": "Hi", "stop_token_ids": [1, true]}', "stop_token_ids"),
    ('{"prompt": "Hi", "max_tokens": "3"}', "max_tokens"),
    ('{"prompt": "Hi", "priority": 1.0}', "priority"),
    ('{"max_tokens": 3}', "prompt"),
    ('[1, 2]', None),
    ('{"prompt": ', None),
])
def test_json_types_are_taken_as_they_are(raw, param):
    with pytest.raises(InvalidRequestError) as refused:
        parse_body(CompletionRequestBody, raw)
    assert refused.value.param == param


def test_lists_longer_than_max_model_len_are_refused_before_validation():
    with pytest.raises(InvalidRequestError, match="stop_token_ids holds 9 items") as refused:
        parse_body(CompletionRequestBody, json.dumps({**COMPLETION, "stop_token_ids": list(range(9))}), max_items=8)
    assert refused.value.param == "stop_token_ids"
    with pytest.raises(InvalidRequestError, match="prompt holds 9 items"):
        parse_body(CompletionRequestBody, json.dumps({"prompt": [[1], list(range(9))]}), max_items=8)
    assert parse_body(CompletionRequestBody, json.dumps({"prompt": list(range(8))}), max_items=8).prompt


@pytest.mark.parametrize("field, value", [
    ("guided_choice", [f"c{i}" for i in range(9)]),
    ("guided_json", {"enum": list(range(9))}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": list(range(9))}}}),
    ("structured_outputs", {"choice": [f"c{i}" for i in range(9)]}),
])
def test_constraints_longer_than_max_model_len_are_accepted(field, value):
    """Their lists are the grammar's data, not prompt tokens: a 9-way choice fits an 8-token context."""
    assert getattr(parse_body(CompletionRequestBody, json.dumps({**COMPLETION, field: value}), max_items=8), field)


def test_the_fields_exempt_from_the_length_check_are_those_that_give_a_constraint():
    assert set(CONSTRAINT_KEYWORDS) == CONSTRAINT_FIELDS


def test_unknown_fields_are_dropped_before_their_length_is_measured():
    body = json.dumps({**COMPLETION, "extra_tags": list(range(9))})
    assert parse_body(CompletionRequestBody, body, allow_unknown_fields=True, max_items=8).prompt == "Hi"


@pytest.mark.parametrize("allowed", [False, True])
def test_an_unknown_nested_field_is_named_by_its_path(allowed):
    """--allow-unknown-fields drops top-level fields only, so the error about a nested one does not suggest it."""
    raw = json.dumps({**COMPLETION, "stream": True, "stream_options": {"include_usage": True, "extra": 1}})
    with pytest.raises(InvalidRequestError) as refused:
        parse_body(CompletionRequestBody, raw, allow_unknown_fields=allowed)
    assert str(refused.value) == "unknown field 'stream_options.extra': this server does not implement it"
    assert refused.value.param == "stream_options"


def test_stream_obfuscation_is_refused_unless_off():
    options = {"include_usage": True, "include_obfuscation": False}
    assert parse_body(CompletionRequestBody, json.dumps({**COMPLETION, "stream_options": options})).stream_options
    with pytest.raises(InvalidRequestError, match="include_obfuscation is not supported") as refused:
        parse_body(CompletionRequestBody, json.dumps({**COMPLETION, "stream_options": {"include_obfuscation": True}}))
    assert refused.value.param == "stream_options"


@pytest.mark.parametrize("model, base, chat", [(CompletionRequestBody, COMPLETION, False),
                                               (ChatCompletionRequestBody, CHAT, True)], ids=["completions", "chat"])
def test_priority_reaches_the_sampling_params(model, base, chat):
    for sent, expected in [({"priority": -3}, -3), ({"priority": None}, 0), ({}, 0)]:
        fields = parse_body(model, json.dumps({**base, **sent})).model_dump(exclude_none=True)
        assert sampling_params_from_body(fields, chat=chat, default_max_tokens=4).priority == expected


def test_openai_answer_fields_echoed_back_in_the_history_pass_when_empty():
    """Clients append OpenAI's answer message to the history as it came (annotations [], audio null)."""
    echoed = {"role": "assistant", "content": "Hello", "annotations": [], "audio": None, "refusal": None}
    body = {**CHAT, "messages": [*CHAT["messages"], echoed, {"role": "user", "content": "More"}]}
    assert len(parse_body(ChatCompletionRequestBody, json.dumps(body)).messages) == len(body["messages"])
    with pytest.raises(InvalidRequestError, match="annotations is not supported"):
        parse_body(ChatCompletionRequestBody, json.dumps({**body, "messages": [{**echoed, "annotations": [{"a": 1}]}]}))
