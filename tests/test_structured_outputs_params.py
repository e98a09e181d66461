"""StructuredOutputsParams and vLLM's spellings of it offline: JSON Schemas are valid exactly when jsonschema's
meta-schema check says so (tool parameter schemas included), GuidedDecodingParams and `guided_decoding=` (vLLM <=
0.10) work like StructuredOutputsParams and `structured_outputs=`, and vLLM's extra options are accepted or refused
exactly as the HTTP server decides them (its request schema is the oracle)."""

import dataclasses
import json
import subprocess
import sys

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema.validators import validator_for

from jaxserve import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from jaxserve.openai.constraint_checks import tool_schema_checks
from jaxserve.openai.requests import CompletionRequestBody, StructuredOutputsBody
from jaxserve.openai.schema import parse_body
from jaxserve.openai.tool_calls import tool_calling_from_body
from jaxserve.errors import InvalidRequestError

DRAFT_04 = "http://json-schema.org/draft-04/schema#"
DRAFT_07 = "http://json-schema.org/draft-07/schema#"
SCHEMAS = {
    "object": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "$ref into $defs": {"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p"},
    "type list": {"type": ["string", "null"], "maxLength": 3},
    "draft 4 boolean exclusiveMinimum": {"$schema": DRAFT_04, "type": "number", "minimum": 0,
                                         "exclusiveMinimum": True},
    "ECMA pattern": {"type": "string", "pattern": r"^\p{L}+(?<n>[0-9])$"},
    "$defs not an object": {"$defs": 3, "type": "object"},
    "unknown type": {"type": "frob"},
    "negative minLength": {"type": "string", "minLength": -1},
    "required not a list": {"required": "a"},
    "repeated types": {"properties": {"a": {"type": ["string", "string"]}}},
    "boolean exclusiveMinimum in 2020-12": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
    "draft 7 definitions not an object": {"$schema": DRAFT_07, "definitions": 3},
    "$schema not a string": {"$schema": 3, "type": "object"},
    "empty anyOf": {"anyOf": []},
    "additionalProperties a string": {"additionalProperties": "no"},
}


def _oracle(schema):
    """jsonschema's verdict: the SchemaError of the draft `$schema` names (2020-12 by default), or None. `format`
    is not asserted (Python's `re` would judge `pattern`, which is ECMA 262)."""
    latest = jsonschema.Draft202012Validator
    validator = validator_for(schema, default=latest) if isinstance(schema.get("$schema"), str) else latest
    try:
        validator.check_schema(schema, format_checker=None)
    except jsonschema.SchemaError as error:
        return error
    return None


def test_the_schemas_hold_valid_and_invalid_ones():
    verdicts = [_oracle(schema) is None for schema in SCHEMAS.values()]
    assert verdicts.count(True) >= 5 and verdicts.count(False) >= 8


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("form", [dict, json.dumps], ids=["dict", "text"])
def test_a_json_schema_is_accepted_exactly_when_jsonschema_says_it_is_valid(name, form):
    schema = SCHEMAS[name]
    fault = _oracle(schema)
    if fault is None:
        assert StructuredOutputsParams(json=form(schema)).schema == schema
        return
    with pytest.raises(InvalidRequestError) as refused:
        StructuredOutputsParams(json=form(schema))
    assert refused.value.param == "structured_outputs"
    assert str(refused.value) == f"the JSON schema is not valid: {fault.message} (at {fault.json_path})"


# Schemas made of keywords whose values the meta-schema constrains, holding any JSON: mostly invalid, some valid.
KEYWORDS = ["type", "properties", "items", "required", "$defs", "$ref", "enum", "minLength", "anyOf",
            "additionalProperties", "pattern", "$schema", "x-other"]
JSON_LEAVES = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-2, 2) | st.sampled_from(
    ["string", "object", "frob", "#/$defs/a", DRAFT_07, "a(b", ""])
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.sampled_from(KEYWORDS + ["a", "b"]), inner, max_size=3), max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYWORDS), JSON_VALUES, max_size=4))
def test_any_schema_is_accepted_exactly_when_jsonschema_says_it_is_valid(schema):
    fault = _oracle(schema)
    try:
        StructuredOutputsParams(json=schema)
    except InvalidRequestError as refused:
        assert fault is not None and str(refused) == (f"the JSON schema is not valid: {fault.message[:300]}"
                                                      f"{'…' if len(fault.message) > 300 else ''} "
                                                      f"(at {fault.json_path})")
    else:
        assert fault is None


def test_a_long_message_is_cut_but_keeps_its_path():
    schema = {"required": ["a"] * 500}  # jsonschema's message repeats the whole list
    assert len(_oracle(schema).message) > 2000
    with pytest.raises(InvalidRequestError) as refused:
        StructuredOutputsParams(json=schema)
    assert len(str(refused.value)) < 400 and str(refused.value).endswith("… (at $.required)")


def test_a_schema_too_deep_to_check_is_refused_not_a_crash():
    schema = {"type": "string"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(InvalidRequestError, match="nested too deeply") as refused:
        StructuredOutputsParams(json=schema)
    assert refused.value.param == "structured_outputs"


def test_json_must_be_a_schema_and_json_object_a_boolean():
    with pytest.raises(InvalidRequestError, match="json must be a JSON Schema"):
        StructuredOutputsParams(json=5)
    with pytest.raises(InvalidRequestError, match="json_object must be a boolean"):
        StructuredOutputsParams(json_object="yes")
    assert StructuredOutputsParams(regex="a", json_object=None).kind == "regex"  # vLLM's default for it


def _tools(*parameters):
    """A chat body's tool fields, as tool_calling_from_body reads them: one function per schema."""
    return tool_calling_from_body({"tools": [{"type": "function", "function": {"name": f"f{index}", "parameters": p}}
                                             for index, p in enumerate(parameters)], "tool_choice": "auto"})


def test_tool_parameter_schemas_get_the_same_check():
    good, bad = SCHEMAS["object"], SCHEMAS["$defs not an object"]
    checks = tool_schema_checks(_tools(good))
    assert [check.constraint for check in checks] == [StructuredOutputsParams(json=good)]
    with pytest.raises(InvalidRequestError) as refused:
        tool_schema_checks(_tools(good, bad))
    fault = _oracle(bad)
    assert refused.value.param == "tools[1].function.parameters"  # OpenAI's name of the field at fault
    assert str(refused.value) == (f"tools[1].function.parameters is not a usable JSON Schema: the JSON schema is not "
                                  f"valid: {fault.message} (at {fault.json_path})")


# vLLM's fields: StructuredOutputsParams as of vLLM 0.10.2/0.11 (vllm/sampling_params.py), GuidedDecodingParams as
# of vLLM 0.10 (the same, with backend and backend_was_auto).
VLLM_STRUCTURED_OUTPUTS_FIELDS = {"json", "regex", "choice", "grammar", "json_object", "disable_fallback",
                                  "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                                  "structural_tag"}
VLLM_GUIDED_DECODING_FIELDS = VLLM_STRUCTURED_OUTPUTS_FIELDS | {"backend", "backend_was_auto"}
CONSTRAINTS = {"json": {"json": SCHEMAS["object"]}, "json_object": {"json_object": True}, "regex": {"regex": "a+"},
               "choice": {"choice": ["yes", "no"]}, "grammar": {"grammar": 'start: "x"'}}


def test_both_classes_take_every_field_vllm_declares():
    assert {field.name for field in dataclasses.fields(StructuredOutputsParams)} == VLLM_STRUCTURED_OUTPUTS_FIELDS
    assert {field.name for field in dataclasses.fields(GuidedDecodingParams)} == VLLM_GUIDED_DECODING_FIELDS


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_each_constraint_takes_either_spelling(kind):
    newer = SamplingParams(structured_outputs=StructuredOutputsParams(**CONSTRAINTS[kind]))
    older = SamplingParams(guided_decoding=GuidedDecodingParams(**CONSTRAINTS[kind]))
    assert isinstance(older.structured_outputs, GuidedDecodingParams) and older.guided_decoding is None
    assert older.structured_outputs.kind == newer.structured_outputs.kind == kind
    assert dataclasses.asdict(older.structured_outputs).items() > dataclasses.asdict(newer.structured_outputs).items()
    # A StructuredOutputsParams under the older keyword, and the newer class's keyword with the older class, too.
    assert SamplingParams(guided_decoding=newer.structured_outputs).structured_outputs is newer.structured_outputs
    assert SamplingParams(structured_outputs=older.structured_outputs).structured_outputs is older.structured_outputs


def test_guided_decoding_survives_a_copy_with_another_priority():
    params = SamplingParams(guided_decoding=GuidedDecodingParams(regex="a"))
    assert params.with_priority(3).structured_outputs == params.structured_outputs


def test_guided_decoding_and_structured_outputs_together_are_refused():
    with pytest.raises(InvalidRequestError, match="guided_decoding") as refused:
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"),
                       guided_decoding=GuidedDecodingParams(regex="a"))
    assert refused.value.param == "guided_decoding"
    with pytest.raises(InvalidRequestError, match="guided_decoding must be") as refused:
        SamplingParams(guided_decoding={"regex": "a"})
    assert refused.value.param == "guided_decoding"


def _server_verdict(body):
    """None if the server takes the completions body, else its InvalidRequestError."""
    try:
        parse_body(CompletionRequestBody, json.dumps({"prompt": "Hi", **body}))
    except InvalidRequestError as error:
        return error
    return None


def _offline_verdict(cls, keywords):
    try:
        cls(regex="a", **keywords)
    except InvalidRequestError as error:
        return error
    return None


OPTIONS = sorted(VLLM_STRUCTURED_OUTPUTS_FIELDS - set(CONSTRAINTS))
VALUES = [None, True, False, "", " ", "auto", "{}"]


@pytest.mark.parametrize("cls", [StructuredOutputsParams, GuidedDecodingParams])
@pytest.mark.parametrize("option", OPTIONS)
def test_vllm_options_are_taken_or_refused_as_the_server_does(cls, option):
    assert option in StructuredOutputsBody.model_fields  # the server declares it
    for value in VALUES:
        server = _server_verdict({"structured_outputs": {"regex": "a", option: value}})
        offline = _offline_verdict(cls, {option: value})
        assert (server is None) == (offline is None), (option, value, server, offline)
        if offline is not None:
            assert option in str(offline) and offline.param == ("guided_decoding" if cls is GuidedDecodingParams
                                                                 else "structured_outputs")
            if "is not supported" in str(server):
                assert str(offline) == str(server)  # the same words: `<option> is not supported: <reason>`


# GuidedDecodingParams' own options, and the field the server takes them in (vLLM's older top-level spelling).
GUIDED_OPTIONS = {"backend": "guided_decoding_backend", "whitespace_pattern": "guided_whitespace_pattern"}


@pytest.mark.parametrize("option", list(GUIDED_OPTIONS))
def test_guided_decoding_options_are_taken_or_refused_as_the_server_takes_their_top_level_fields(option):
    field = GUIDED_OPTIONS[option]
    for value in [None, "", "auto", "guidance", "llguidance", "xgrammar", "outlines", "lm-format-enforcer", " "]:
        server = _server_verdict({field: value})
        offline = _offline_verdict(GuidedDecodingParams, {option: value})
        assert (server is None) == (offline is None), (option, value, server, offline)
        if offline is not None:
            assert offline.param == "guided_decoding"
            assert str(offline) == str(server).replace(field, option, 1)


def test_options_that_change_nothing_share_the_constraint():
    plain = StructuredOutputsParams(regex="a")
    assert StructuredOutputsParams(regex="a", disable_fallback=True, disable_any_whitespace=True) == plain
    assert hash(StructuredOutputsParams(regex="a", disable_fallback=True)) == hash(plain)
    assert GuidedDecodingParams(regex="a", backend="auto", backend_was_auto=True) == GuidedDecodingParams(regex="a")


def test_refused_options_are_named_by_each_class():
    for cls, param in [(StructuredOutputsParams, "structured_outputs"), (GuidedDecodingParams, "guided_decoding")]:
        for option, value in [("disable_additional_properties", True), ("whitespace_pattern", r"[ ]?"),
                              ("structural_tag", '{"structures": []}')]:
            with pytest.raises(InvalidRequestError, match=f"^{option} is not supported") as refused:
                cls(regex="a", **{option: value})
            assert refused.value.param == param
    with pytest.raises(InvalidRequestError, match="^backend is not supported: the grammar engine is llguidance"):
        GuidedDecodingParams(regex="a", backend="xgrammar")
    with pytest.raises(InvalidRequestError, match="backend_was_auto must be a boolean"):
        GuidedDecodingParams(regex="a", backend_was_auto="yes")
    with pytest.raises(InvalidRequestError, match="not valid") as refused:
        GuidedDecodingParams(json={"type": "frob"})
    assert refused.value.param == "guided_decoding"


def test_guided_decoding_constrains_the_output(tiny_llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=4,
                            guided_decoding=GuidedDecodingParams(choice=["yes", "no"], backend="auto"))
    (output,) = tiny_llm.generate(["Hello"], params, use_tqdm=False)
    assert all(c.text in ("yes", "no") and c.finish_reason == "stop" for c in output.outputs)


def test_importing_jaxserve_leaves_jsonschema_unimported():
    code = "import sys, jaxserve; sys.exit(1 if 'jsonschema' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
