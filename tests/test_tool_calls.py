"""Tool calls: the parser reads the same calls from an answer however its text is cut into pieces, gives plain text
back as content, and the grammar that forces calls makes even the built-in random model answer with calls whose
arguments match their schemas (jsonschema is the oracle)."""

import enum
import json
from typing import Optional

import jsonschema
import numpy as np
import openai
import pydantic
import pytest

from jaxserve import SamplingParams
from jaxserve.openai.requests import ChatCompletionRequestBody
from jaxserve.openai.schema import parse_body
from jaxserve.openai.tool_calls import (ToolCalling, ToolCallParser, delta_tool_calls, parse_answer, template_messages,
                                        tool_calling_from_body)
from jaxserve.errors import InvalidRequestError

# Small, so that a whole call fits the tiny model's 64-token context.
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"],
    "additionalProperties": False}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}


def _calling(choice="auto", parallel=True, tools=(WEATHER, TIME)):
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": list(tools), "tool_choice": choice,
            "parallel_tool_calls": parallel}
    return tool_calling_from_body(parse_body(ChatCompletionRequestBody, body).model_dump(exclude_none=True))


ANSWERS = [  # (text, content, [(name, arguments, complete)])
    ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "",
     [("get_weather", '{"city": "Paris", "days": 2}', True)]),
    ('{"name":"get_time","parameters":{"zone":"a}\\"{["}}; {"name": "get_weather", "arguments": {}}', "",
     [("get_time", '{"zone":"a}\\"{["}', True), ("get_weather", "{}", True)]),
    (' <|python_tag|>{"name": "get_time", "parameters": {"zone": [1, {"b": []}]}} and then text', "",
     [("get_time", '{"zone": [1, {"b": []}]}', True)]),
    ('{"name": "get_time", "parameters": {"zone": "UT', "", [("get_time", '{"zone": "UT', False)]),
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ('{"name": "send_mail", "parameters": {}}', '{"name": "send_mail", "parameters": {}}', []),
    ('  {"name": "get_w', '  {"name": "get_w', []),
]


@pytest.mark.parametrize("text, content, calls", ANSWERS)
def test_an_answer_reads_the_same_however_it_streams(text, content, calls):
    whole = parse_answer(text, _calling())
    assert "".join(whole.content) == content
    assert [(c.name, c.arguments, c.complete) for c in whole.calls] == calls
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text)):
            parser = ToolCallParser(_calling())
            events = [event for piece in pieces for event in parser.feed(piece)] + parser.finish()
            assert "".join(parser.content) == content
            streamed = delta_tool_calls(events)
            assert [(d["function"]["name"], d["function"]["arguments"]) for d in streamed] == [
                (name, arguments) for name, arguments, _ in calls]
            assert [d["id"] for d in streamed] == [c.id for c in parser.calls]


def test_without_parallel_calls_a_second_call_is_dropped():
    text = '{"name": "get_time", "parameters": {}}; {"name": "get_time", "parameters": {}}'
    assert len(parse_answer(text, _calling(parallel=True)).calls) == 2
    assert len(parse_answer(text, _calling(parallel=False)).calls) == 1


def test_a_named_choice_reads_only_calls_of_that_function():
    named = _calling({"type": "function", "function": {"name": "get_time"}})
    assert named.choice == "function" and named.function == "get_time"
    assert parse_answer('{"name": "get_weather", "parameters": {}}', named).calls == []


@pytest.mark.parametrize("choice, forced", [("auto", False), ("none", False), ("required", True),
                                            ({"type": "function", "function": {"name": "get_time"}}, True)])
def test_only_required_and_named_choices_force_calls_by_grammar(choice, forced):
    calling = _calling(choice)
    assert calling.forces_calls is forced and (calling.constraint() is not None) is forced


@pytest.mark.parametrize("body, param, fault", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "more than once"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "not one of the tools"),
])
def test_tool_choice_and_tools_must_agree(body, param, fault):
    with pytest.raises(InvalidRequestError, match=fault) as refused:
        tool_calling_from_body(body)
    assert refused.value.param == param


def test_no_tools_and_choice_none_or_auto_asks_nothing():
    assert tool_calling_from_body({"tool_choice": "none"}) is None
    assert tool_calling_from_body({"tool_choice": "auto", "parallel_tool_calls": False}) is None
    assert _calling("auto").constraint() is None and _calling("none").constraint() is None


def test_call_arguments_reach_the_template_as_objects():
    messages = template_messages([{"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}])
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}


@pytest.mark.parametrize("choice, parallel", [("required", True), ("required", False),
                                               ({"type": "function", "function": {"name": "get_weather"}}, True)],
                         ids=["required", "required one", "named"])
def test_forced_calls_of_the_random_model_match_their_schemas(tiny_llm, choice, parallel):
    calling = _calling(choice, parallel)
    params = SamplingParams(max_tokens=56, temperature=1.0, seed=7, n=4, structured_outputs=calling.constraint())
    [output] = tiny_llm.generate(["Hi"], params, use_tqdm=False)
    finished = [c for c in output.outputs if c.finish_reason == "stop"]
    assert finished, [c.text for c in output.outputs]
    for completion in output.outputs:
        answer = parse_answer(completion.text, calling)
        assert answer.calls and "".join(answer.content) == ""
        assert len(answer.calls) == 1 or (parallel and choice == "required")
        if isinstance(choice, dict):
            assert {call.name for call in answer.calls} == {"get_weather"}
    for completion in finished:
        for call in parse_answer(completion.text, calling).calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_a_forced_call_leaves_no_room_for_whitespace():
    grammar = _calling("required", parallel=False).constraint().grammar
    assert grammar.count('"whitespace_flexible": false') == 2 and grammar.startswith("start: call\n")


def test_tool_calling_names_its_tools_and_their_schemas():
    calling = _calling()
    assert isinstance(calling, ToolCalling) and calling.names == ("get_weather", "get_time")
    assert calling.parameter_schemas() == [(0, SCHEMAS["get_weather"]), (1, SCHEMAS["get_time"])]


class Color(str, enum.Enum):
    red = "red"
    green = "green"


class Point(pydantic.BaseModel):
    x: int
    y: int


class Shape(pydantic.BaseModel):
    """Nested models, an enum, an optional field and a list of models: pydantic writes $defs and $refs."""

    color: Color
    points: list[Point]
    label: Optional[str] = None


class Chain(pydantic.BaseModel):
    """A recursive model: its $ref points at its own definition."""

    value: int
    next: Optional["Chain"] = None


PYDANTIC_CALLS = [  # (the model, instances that are valid calls of it)
    (Shape, [Shape(color=Color.red, points=[Point(x=1, y=2)], label=None),
             Shape(color=Color.green, points=[], label="a")]),
    (Chain, [Chain(value=1, next=Chain(value=2, next=None)), Chain(value=3)]),
]


@pytest.mark.parametrize("model, instances", PYDANTIC_CALLS, ids=[m.__name__ for m, _ in PYDANTIC_CALLS])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_of_tools_with_defs_and_refs_compile_and_accept_exactly_valid_arguments(tiny_llm, model,
                                                                                          instances, choice):
    """The official client's pydantic_function_tool writes $defs/$ref (and strict, recursive) schemas; the grammar
    that forces calls nests them one level down and must resolve them there: valid calls (pydantic's own dumps) are
    accepted to the end, and a value outside the enum or a missing field is not."""
    tool = openai.pydantic_function_tool(model)
    assert "$defs" in tool["function"]["parameters"]
    name = tool["function"]["name"]
    calling = _calling("required" if choice == "required" else {"type": "function", "function": {"name": name}},
                       parallel=False, tools=(WEATHER, tool))
    grammar = tiny_llm.engine.grammars.check(calling.constraint())

    def accepts(arguments: str) -> bool:
        matcher = grammar.matcher()
        text = json.dumps({"name": name, "parameters": json.loads(arguments)}, separators=(",", ":"))
        ids = tiny_llm.tokenizer.encode(text, add_special_tokens=False)
        return all(_take(matcher, token) for token in ids) and matcher.accepts_end

    for instance in instances:
        assert accepts(instance.model_dump_json())
        model.model_validate_json(instance.model_dump_json())  # pydantic agrees it is valid
    broken = json.loads(instances[0].model_dump_json())
    broken.pop(next(iter(broken)))
    assert not accepts(json.dumps(broken))


def _take(matcher, token: int) -> bool:
    allowed = np.unpackbits(matcher.next_mask().view(np.uint8), bitorder="little")
    if not allowed[token]:
        return False
    matcher.accept(token)
    return True
