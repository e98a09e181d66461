"""POST /v1/responses through the official `openai` client: `responses.create` (text and items), the raw event stream
and `responses.stream(...).get_final_response()`, a function-call round trip, `responses.parse` with a pydantic
model, log-probabilities, usage, and bad fields answered with a 400 naming them.

A Responses request is the chat completions request it converts to: greedy answers, token counts and
log-probabilities must equal what /v1/chat/completions answers for the same conversation (that route is the oracle
of the conversion; the SDK's parsers and stream state are the oracle of the shapes). Tools need more than the tiny
model's 512 tokens of context, so this server has 2048 (the programs of tests/test_server_slow_clients.py's server,
found in the compilation cache)."""

import json
from typing import Annotated, Literal

import httpx
import httpx2
import openai
import pydantic
import pytest

from jaxserve.openai.answers import ErrorResponse
from jaxserve.openai.responses_api_answers import ResponsesResponse, ResponseStreamEvent
from jaxserve.openai.responses_output import ResponseAssembly, ResponseSettings
from jaxserve.openai.tool_calls import ToolCallParser, tool_calling_from_body
from jaxserve.outputs import CompletionDelta
from jaxserve.server.sse import DONE, sse_event
from tests.live_server import running_server

pytestmark = pytest.mark.slow

MODEL = "jaxserve-builtin"
GREEDY = {"model": MODEL, "temperature": 0}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
# Small and closed (no other properties), so a forced call ends by itself within a few tokens.
ADD = {"type": "function", "name": "add", "description": "Adds two digits.", "strict": True,
       "parameters": {"type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "required": ["a", "b"],
                      "additionalProperties": False}}
CHAT_ADD = {"type": "function", "function": {key: value for key, value in ADD.items() if key != "type"}}
CAPITALS = {"structured_outputs": {"choice": ["Paris", "Rome"]}}  # vLLM's: an answer that ends by itself
LOGPROB_TOLERANCE = 1e-4  # two requests batched differently: float32 sums may differ a little


class City(pydantic.BaseModel):
    name: Annotated[str, pydantic.Field(max_length=6)]
    size: Literal["small", "big"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("responses"), "--max-model-len", "2048",
                        "--num-kv-pages", "256") as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    # Strict: every answer must validate as the SDK's own types, not only be read by them.
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300,
                       _strict_response_validation=True) as c:
        yield c


def _chat_answer(client, messages, **request):
    return client.chat.completions.create(model=MODEL, temperature=0, messages=messages, **request)


def _assert_same_answer(response, chat):
    """A Response holds what the chat completion of the same conversation holds."""
    choice = chat.choices[0]
    assert response.output_text == choice.message.content
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert response.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"


# --- answers -------------------------------------------------------------------------------------------------------


def test_text_input_is_one_user_message_after_the_instructions(client):
    response = client.responses.create(input="Name a colour.", instructions="Be brief.", max_output_tokens=12,
                                       **GREEDY)
    chat = _chat_answer(client, [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Name a colour."}], max_tokens=12)
    _assert_same_answer(response, chat)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"]
    assert response.instructions == "Be brief." and response.max_output_tokens == 12
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.usage.output_tokens_details.reasoning_tokens == 0


def test_items_are_the_conversation_chat_renders(client):
    """Roles, text parts (input_text, output_text) and an earlier answer sent back as history."""
    items = [{"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": "Name a colour."},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Red.", "annotations": [], "logprobs": []}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Another."},
                                                              {"type": "input_text", "text": "One."}]}]
    response = client.responses.create(input=items, instructions="Answer in English.", max_output_tokens=10,
                                       **GREEDY)
    chat = _chat_answer(client, [{"role": "system", "content": "Answer in English."},
                                 {"role": "developer", "content": "Be brief."},
                                 {"role": "user", "content": "Name a colour."},
                                 {"role": "assistant", "content": "Red."},
                                 {"role": "user", "content": [{"type": "text", "text": "Another."},
                                                              {"type": "text", "text": "One."}]}], max_tokens=10)
    _assert_same_answer(response, chat)


def test_the_raw_stream_is_the_sdk_event_sequence_and_adds_up_to_the_whole_answer(client):
    request = dict(input="Name a colour.", max_output_tokens=9, **GREEDY)
    whole = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert deltas > 0 and events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == events[-4].text == whole.output_text
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == whole.output_text and final.usage == whole.usage
    assert final.output[0].id == events[2].item.id == events[-2].item.id


def test_the_stream_helper_gives_the_completed_response(client):
    """An answer that ends by itself (a choice constraint: the tiny model's noise never says EOS) completes."""
    request = dict(input="The capital of France?", max_output_tokens=20, extra_body=CAPITALS, **GREEDY)
    with client.responses.stream(**request) as stream:
        final = stream.get_final_response()
    whole = client.responses.create(**request)
    assert final.status == whole.status == "completed" and final.incomplete_details is None
    assert final.output_text == whole.output_text and final.output_text in ("Paris", "Rome")
    assert final.usage == whole.usage


def test_parse_with_a_pydantic_model_gives_the_model(client):
    """text.format json_schema (what responses.parse sends for text_format), whole and streamed."""
    request = dict(input="A city.", text_format=City, max_output_tokens=60, **GREEDY)
    whole = client.responses.parse(**request)
    with client.responses.stream(**request) as stream:
        streamed = stream.get_final_response()
    assert whole.status == "completed" and isinstance(whole.output_parsed, City)
    assert streamed.output_parsed == whole.output_parsed
    assert whole.text.format.type == "json_schema" and whole.text.format.name == "City"


def test_json_object_format_answers_a_json_object(client):
    response = client.responses.create(input="Some JSON.", text={"format": {"type": "json_object"}},
                                       max_output_tokens=40, **GREEDY)
    chat = _chat_answer(client, [{"role": "user", "content": "Some JSON."}], max_tokens=40,
                        response_format={"type": "json_object"})
    _assert_same_answer(response, chat)
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)


def test_output_logprobs_are_chats(client):
    request = dict(input="Name a colour.", max_output_tokens=6, **GREEDY)
    response = client.responses.create(**request, include=["message.output_text.logprobs"], top_logprobs=2)
    chat = _chat_answer(client, [{"role": "user", "content": "Name a colour."}], max_tokens=6, logprobs=True,
                        top_logprobs=2)
    logprobs = response.output[0].content[0].logprobs
    expected = [entry for entry in chat.choices[0].logprobs.content]
    assert [entry.token for entry in logprobs] == [entry.token for entry in expected]
    for got, want in zip(logprobs, expected):
        assert got.bytes == want.bytes and abs(got.logprob - want.logprob) < LOGPROB_TOLERANCE
        assert [top.token for top in got.top_logprobs] == [top.token for top in want.top_logprobs]
    streamed = [event for event in client.responses.create(**request, include=["message.output_text.logprobs"],
                                                           top_logprobs=2, stream=True)
                if event.type == "response.output_text.delta"]
    assert [entry.token for event in streamed for entry in event.logprobs] == [entry.token for entry in logprobs]


def test_store_metadata_and_identifiers_are_accepted(client):
    """store (true is OpenAI's default) is accepted and nothing is stored, as in vLLM; metadata comes back."""
    response = client.responses.create(input="Hi", max_output_tokens=2, store=True, metadata={"run": "7"},
                                       user="u1", safety_identifier="s1", prompt_cache_key="k", **GREEDY)
    assert response.metadata == {"run": "7"} and len(response.output) == 1
    assert client.responses.create(input="Hi", max_output_tokens=2, store=False, **GREEDY).status == "incomplete"


# --- function calls ------------------------------------------------------------------------------------------------


def test_a_forced_call_and_its_output_sent_back(client):
    """A named call (one function_call item), then the answer to its output: the round trip renders as chat's
    assistant tool_calls and tool message."""
    ask = {"role": "user", "content": "Add 1 and 2."}
    called = client.responses.create(input=[ask], tools=[ADD], tool_choice={"type": "function", "name": "add"},
                                     max_output_tokens=40, **GREEDY)
    [call] = called.output
    assert called.status == "completed" and call.type == "function_call" and call.status == "completed"
    assert call.name == "add" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"a", "b"} and all(0 <= value <= 9 for value in arguments.values())
    assert called.tools[0].name == "add" and called.tool_choice.name == "add"

    answered = client.responses.create(
        input=[ask, *called.output, {"type": "function_call_output", "call_id": call.call_id, "output": "3"}],
        tools=[ADD], tool_choice="none", max_output_tokens=8, **GREEDY)
    chat = _chat_answer(client, [ask, {"role": "assistant", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": "add", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "3"}], tools=[CHAT_ADD], tool_choice="none",
        max_tokens=8)
    _assert_same_answer(answered, chat)


def test_streamed_calls_are_the_whole_answers_calls(client):
    request = dict(input="Add 4 and 5.", tools=[ADD], tool_choice="required", parallel_tool_calls=False,
                   max_output_tokens=40, **GREEDY)
    whole = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))
    kinds = [event.type for event in events]
    pieces = kinds.count("response.function_call_arguments.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * pieces, "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    joined = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    [call] = whole.output
    assert joined == events[-3].arguments == call.arguments and events[-3].name == call.name
    with client.responses.stream(**request) as stream:
        [streamed] = stream.get_final_response().output
    assert (streamed.name, streamed.arguments, streamed.status) == (call.name, call.arguments, "completed")


# --- every answer as /openapi.json declares it ---------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    {"input": "Hi", "max_output_tokens": 3, "include": ["message.output_text.logprobs"], "top_logprobs": 1},
    {"input": "Hi", "max_output_tokens": 3, "stream": True},
    {"input": "Hi", "tools": [ADD], "tool_choice": "required", "parallel_tool_calls": False,
     "max_output_tokens": 40, "stream": True},
    {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "n", "schema": DIGIT}}, "metadata": {"a": "b"}},
], ids=["logprobs", "stream", "stream-calls", "json-schema"])
def test_answers_are_the_declared_models(server, body):
    """Exactly the declared fields (the models forbid others), streamed events one by one."""
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        response = http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        ResponsesResponse.model_validate(response.json())
        return
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [ResponseStreamEvent.model_validate_json(line[len("data: "):]).root for line in lines[:-1]]
    assert events[-1].type in ("response.completed", "response.incomplete")


def test_the_route_is_in_the_openapi_document(server):
    document = httpx.get(server.base_url + "/openapi.json", timeout=60).json()
    operation = document["paths"]["/v1/responses"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("ResponsesRequestBody")
    assert "text/event-stream" in operation["responses"]["200"]["content"]


# --- the assembly read by the SDK, without a server ----------------------------------------------------------------


SETTINGS = ResponseSettings(model=MODEL, instructions=None, max_output_tokens=None, temperature=None, top_p=None,
                            top_logprobs=None, parallel_tool_calls=True, tool_choice="auto", tools=(ADD,),
                            text={"format": {"type": "text"}}, reasoning=None, metadata={})
USAGE = {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
         "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8}


def _step(text, finish_reason=None):
    return CompletionDelta(request_id="r", index=0, text=text, token_ids=(1,), logprobs=None,
                           finish_reason=finish_reason, stop_reason=None)


def _replaying(events):
    """A client whose server streams `events` (then [DONE]), for the SDK to read as it reads a stream."""
    body = b"".join(sse_event(event) for event in events) + DONE
    transport = httpx2.MockTransport(lambda request: httpx2.Response(
        200, content=body, headers={"content-type": "text/event-stream"}))
    return openai.OpenAI(base_url="http://jaxserve.test/v1", api_key="unused", max_retries=0,
                         http_client=httpx2.Client(transport=transport))


def _assembled(steps, reader=None):
    assembly = ResponseAssembly(SETTINGS, reader, None)
    events = assembly.opening()
    for step in steps:
        events += assembly.step(step)
    return assembly, events


def test_calls_read_as_the_text_grows_are_function_call_items_the_sdk_completes():
    """tool_choice auto: the answer turns out to be two parallel calls, split across steps anywhere."""
    reader = ToolCallParser(tool_calling_from_body({"tools": [CHAT_ADD]}))
    assembly, events = _assembled([_step('{"name": "add", "parameters": {"a": 1'),
                                   _step(', "b": 2}}; {"name": "ad'),
                                   _step('d", "parameters": {"a": 3, "b": 4}}', "stop")], reader)
    events += assembly.finish(USAGE)
    with _replaying(events).responses.stream(model=MODEL, input="x", tools=[ADD]) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and [item.type for item in final.output] == ["function_call"] * 2
    assert [json.loads(item.arguments) for item in final.output] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert [item.call_id for item in final.output] == [item["call_id"] for item in assembly.response()["output"]]


def test_an_answer_cut_by_max_output_tokens_ends_incomplete():
    assembly, events = _assembled([_step("Red"), _step(" and", "length")])
    events += assembly.finish(USAGE)
    streamed = list(_replaying(events).responses.create(model=MODEL, input="x", stream=True))
    last = streamed[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == "Red and" and last.response.output[0].status == "incomplete"
    with pytest.raises(RuntimeError, match="response.completed"):  # the SDK's helper wants a completed response
        with _replaying(events).responses.stream(model=MODEL, input="x") as stream:
            stream.get_final_response()


def test_a_failure_after_the_stream_began_is_an_error_event_then_response_failed():
    assembly, events = _assembled([_step("Red")])
    events += assembly.fail("the engine failed", "server_error", None)
    streamed = list(_replaying(events).responses.create(model=MODEL, input="x", stream=True))
    assert [event.type for event in streamed[-2:]] == ["error", "response.failed"]
    assert streamed[-2].message == "the engine failed" and streamed[-1].response.error.code == "server_error"
    assert [event.sequence_number for event in streamed] == list(range(len(streamed)))


# --- bad input -----------------------------------------------------------------------------------------------------


BAD_FIELDS = [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [ADD], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "name": "sub"}}, "tool_choice"),
    ({"tools": [{**ADD, "parameters": {"type": "string"}}], "tool_choice": "required"}, "tools[0].parameters"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object", "required": 3}}}},
     "text"),
    ({"text": {"format": {"type": "json_schema", "name": "n"}}}, "text"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "3"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "add", "arguments": "{"}]}, "input"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 5}, "max_tokens"),
]


@pytest.mark.parametrize("fields, param", BAD_FIELDS, ids=[param for _, param in BAD_FIELDS])
def test_bad_fields_are_a_400_naming_them(server, fields, param):
    body = {"model": MODEL, "input": "Hi", **fields}
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        response = http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    ErrorResponse.model_validate(response.json())
    assert response.json()["error"]["param"] == param, response.json()


def test_the_sdk_raises_bad_request_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input="Hi", previous_response_id="resp_1", **GREEDY)
    assert refused.value.param == "previous_response_id" and "stateless" in refused.value.message
