"""Qwen3's own chat template (ChatML with tools, tool calls and responses, reasoning_content, enable_thinking)
renders through the chat route's path (body schema, tool calls' arguments as objects, chat_template_kwargs) exactly
as transformers renders it."""

import copy
import json

import pytest

from jaxserve.openai.bodies import chat_template_variables
from jaxserve.openai.prompts import chat_prompt
from jaxserve.openai.requests import ChatCompletionRequestBody
from jaxserve.openai.schema import parse_body
from jaxserve.openai.tool_call_formats import HERMES
from jaxserve.openai.tool_calls import tool_calling_from_body
from jaxserve.tokenizer import load_tokenizer
from tests.chat_templates import QWEN3
from tests.scripted_model import write_scripted_qwen3

transformers_templates = pytest.importorskip("transformers.utils.chat_template_utils")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Today's weather",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
CONVERSATIONS = {
    "plain": dict(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]),
    "no-thinking": dict(messages=[{"role": "user", "content": "Hi!"}],
                        chat_template_kwargs={"enable_thinking": False}),
    "tools-and-calls": dict(messages=[
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}], tools=[WEATHER]),
    "earlier-turns-think": dict(messages=[
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"}], chat_template_kwargs={"enable_thinking": True}),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(write_scripted_qwen3(tmp_path_factory.mktemp("qwen3")))


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_the_qwen3_template_renders_as_transformers_renders_it(tokenizer, name):
    fields = parse_body(ChatCompletionRequestBody, CONVERSATIONS[name]).model_dump(exclude_none=True)
    calling = tool_calling_from_body(fields, HERMES)
    ours = chat_prompt(tokenizer, fields["messages"], True, **chat_template_variables(fields, calling)).text
    messages = copy.deepcopy(fields["messages"])
    for message in messages:  # as vLLM hands them over: a call's arguments as an object, calls' content ""
        if message.get("tool_calls"):
            message.setdefault("content", "")
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    [expected], _ = transformers_templates.render_jinja_template(
        conversations=[messages], tools=fields.get("tools"), chat_template=QWEN3, add_generation_prompt=True,
        **fields.get("chat_template_kwargs", {}))
    assert ours == expected
    assert ours.endswith("<think>\n\n</think>\n\n") == (name == "no-thinking")
