"""The live server with `--reasoning-parser qwen3 --tool-call-parser hermes`, driven by the official openai client,
on a tiny Qwen3 whose greedy answer is a known script (tests/scripted_model.py): its reasoning comes back as
reasoning_content (streamed as delta.reasoning_content), chat_template_kwargs reach Qwen3's own template
(enable_thinking), output constraints and forced calls apply after the free reasoning, and calls stream as tool-call
deltas in Hermes' format.
"""

import json

import jsonschema
import openai
import pytest

from tests.live_server import running_server
from tests.scripted_model import CONTENT, REASONING, write_scripted_qwen3

ASK = [{"role": "user", "content": "What is the weather in Rome?"}]
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                      "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}}
GREEDY = dict(max_tokens=40, temperature=0)
CALLING = dict(max_tokens=160, temperature=0)  # room for a whole call, spelled mostly byte by byte

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    work = tmp_path_factory.mktemp("reasoning-server")
    folder = write_scripted_qwen3(work / "qwen3")
    # Qwen3's tool header alone is some 400 byte-level tokens of the built-in vocabulary.
    with running_server(work, "--model", str(folder), "--max-model-len", "1024", "--reasoning-parser", "qwen3",
                        "--tool-call-parser", "hermes") as server:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def streamed(client, model, **request) -> dict:
    """The streamed answer put back together: reasoning, content, calls (by index), finish reason."""
    said = {"reasoning": "", "content": "", "calls": {}, "finish_reason": None}
    for chunk in client.chat.completions.create(model=model, stream=True, **request):
        for choice in chunk.choices:
            delta = choice.delta
            said["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            said["content"] += delta.content or ""
            for call in delta.tool_calls or ():
                entry = said["calls"].setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = entry["id"] or call.id
                entry["name"] = entry["name"] or call.function.name
                entry["arguments"] += call.function.arguments or ""
            said["finish_reason"] = choice.finish_reason or said["finish_reason"]
    return said


def test_reasoning_comes_back_apart_whole_and_streamed(client, model):
    choice = client.chat.completions.create(model=model, messages=ASK, **GREEDY).choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == (REASONING, CONTENT)
    assert choice.finish_reason == "stop"
    said = streamed(client, model, messages=ASK, **GREEDY)
    assert (said["reasoning"], said["content"], said["finish_reason"]) == (REASONING, CONTENT, "stop")


def test_chat_template_kwargs_reach_the_template(client, model):
    thinking = client.chat.completions.create(model=model, messages=ASK, **GREEDY)
    direct = client.chat.completions.create(model=model, messages=ASK, **GREEDY,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # Qwen3's template closes an empty think block in the prompt; the script then answers at once.
    assert (direct.choices[0].message.reasoning_content, direct.choices[0].message.content) == (None, "hello")
    assert direct.usage.prompt_tokens > thinking.usage.prompt_tokens


@pytest.mark.parametrize("constraint", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "verdict", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
        "additionalProperties": False}}}},
    {"extra_body": {"structured_outputs": {"choice": ["sunny", "rainy"]}}},
], ids=["json_schema", "choice"])
def test_output_constraints_apply_after_the_free_reasoning(client, model, constraint):
    message = client.chat.completions.create(model=model, messages=ASK, **GREEDY, **constraint).choices[0].message
    assert message.reasoning_content == REASONING  # unconstrained: the script's own words
    if "response_format" in constraint:
        jsonschema.validate(json.loads(message.content), constraint["response_format"]["json_schema"]["schema"])
    else:
        assert message.content.strip() in ("sunny", "rainy")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_calls_come_in_hermes_form_after_the_reasoning(client, model, tool_choice):
    request = dict(messages=ASK, tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False, **CALLING)
    choice = client.chat.completions.create(model=model, **request).choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    assert choice.message.reasoning_content == REASONING and choice.message.content is None
    said = streamed(client, model, **request)
    assert said["reasoning"] == REASONING and said["finish_reason"] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in said["calls"].values()] == [("get_weather", call.function.arguments)]


def test_with_tool_choice_auto_an_answer_without_calls_is_content(client, model):
    choice = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], **GREEDY).choices[0]
    assert (choice.message.reasoning_content, choice.message.content, choice.message.tool_calls) == (
        REASONING, CONTENT, None)


def test_a_history_with_reasoning_and_calls_renders(client, model):
    called = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False, **CALLING).choices[0].message
    history = [*ASK, {"role": "assistant", "content": None, "reasoning_content": called.reasoning_content,
                      "tool_calls": [call.model_dump() for call in called.tool_calls]},
               {"role": "tool", "tool_call_id": called.tool_calls[0].id, "content": "sunny"}]
    answer = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], **GREEDY)
    assert answer.choices[0].message.content is not None
