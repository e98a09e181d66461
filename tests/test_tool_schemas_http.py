"""Tool and response schemas as clients write them, through the live server and the official client: pydantic
models with nested models, enums, optional fields, lists of models and recursion, which pydantic (and the openai
SDK's pydantic_function_tool) write with $defs and $ref. Every tool_choice, whole and streamed, and response_format:
the answers parse into the pydantic models (pydantic is the oracle).

The rendered tools need more than the tiny model's 512 tokens of context, so this server has 2048 (the programs are
those of tests/test_server_slow_clients.py's server, found in the compilation cache)."""

import enum
from typing import Annotated, Literal, Optional

import openai
import pydantic
import pytest

from tests.live_server import running_server

pytestmark = pytest.mark.slow

MODEL = "jaxserve-builtin"
ASK = [{"role": "user", "content": "Plan it."}]


class Mode(str, enum.Enum):
    train = "train"
    boat = "boat"


class Leg(pydantic.BaseModel):
    days: Annotated[int, pydantic.Field(ge=1, le=7)]


class Trip(pydantic.BaseModel):
    """A nested model, an enum, an optional field and a list of models: $defs and $refs."""

    legs: Annotated[list[Leg], pydantic.Field(max_length=2)]
    mode: Mode
    note: Optional[Literal["ok"]] = None


class Chain(pydantic.BaseModel):
    """Recursive: its $ref points at its own definition."""

    value: Annotated[int, pydantic.Field(ge=0, le=9)]
    next: Optional["Chain"] = None


TOOLS = {model.__name__: openai.pydantic_function_tool(model) for model in (Trip, Chain)}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("tool-schemas"), "--max-model-len", "2048",
                        "--num-kv-pages", "256") as live:
        with openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=300) as c:
            yield c


@pytest.mark.parametrize("name", TOOLS)
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_calls_of_pydantic_tools_parse_whole_and_streamed(client, name, choice):
    """The tools' parameters refer to $defs (such calls used to be refused: "Pointer '/$defs/Leg' does not
    exist"); whole and accumulated from the stream, the arguments parse into the pydantic model."""
    tool = TOOLS[name]
    assert "$defs" in tool["function"]["parameters"]
    request = dict(model=MODEL, messages=ASK, tools=list(TOOLS.values()), parallel_tool_calls=False,
                   tool_choice="required" if choice == "required" else {"type": "function", "function": {"name": name}},
                   max_tokens=400, temperature=0)
    whole = client.chat.completions.parse(**request).choices[0]
    with client.chat.completions.stream(**request) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert whole.finish_reason == streamed.finish_reason == "tool_calls"
    [call], [streamed_call] = whole.message.tool_calls, streamed.message.tool_calls
    if choice == "named":
        assert call.function.name == name
    model = {"Trip": Trip, "Chain": Chain}[call.function.name]
    assert isinstance(call.function.parsed_arguments, model)
    assert streamed_call.function.parsed_arguments == call.function.parsed_arguments


def test_with_tool_choice_auto_such_tools_render_and_answers_are_read(client):
    answer = client.chat.completions.create(model=MODEL, messages=ASK, tools=list(TOOLS.values()), max_tokens=8,
                                            temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("model", [Trip, Chain])
def test_response_format_of_the_same_models_parses(client, model):
    answer = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=model, max_tokens=400,
                                           temperature=0).choices[0]
    assert answer.finish_reason == "stop" and isinstance(answer.message.parsed, model)
