"""Structured output through the live server: every way a body may ask for a constraint (OpenAI's response_format,
vLLM's structured_outputs and its older guided_* fields) works on /v1/completions and /v1/chat/completions, streamed
or not, and every spelling of one constraint gives the same greedy text. An invalid constraint is a 400 whose error
names the field that gave it, and requests sent alongside the refused ones, plain or constrained, complete
unchanged."""

import json

import httpx
import pytest

from jaxserve import StructuredOutputsParams
from tests.live_server import completions_meanwhile
from tests.test_server_errors import CHAT, COMPLETIONS, _assert_openai_error
from tests.test_server_openai import MODEL, PROMPT, client, server  # noqa: F401 (the live server's fixtures)
from tests.test_structured_output import SCHEMAS
from tests.test_structured_output_combinations import CHOICES, GRAMMAR, REGEX, _assert_matches

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Where?"}]  # greedy, the random model closes a JSON object here
MAX_TOKENS = 60  # every constraint below ends well within this
SCHEMA = SCHEMAS["$ref"]
ENDPOINTS = {"completions": COMPLETIONS, "chat": CHAT}

# (id, the body's fields, the constraint they ask for)
WAYS = [
    ("response_format json_object", {"response_format": {"type": "json_object"}},
     StructuredOutputsParams(json_object=True)),
    ("response_format json_schema",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "points", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ("structured_outputs json", {"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
    ("structured_outputs json_object", {"structured_outputs": {"json_object": True}},
     StructuredOutputsParams(json_object=True)),
    ("structured_outputs regex", {"structured_outputs": {"regex": REGEX}}, StructuredOutputsParams(regex=REGEX)),
    ("structured_outputs choice", {"structured_outputs": {"choice": list(CHOICES)}},
     StructuredOutputsParams(choice=CHOICES)),
    ("structured_outputs grammar", {"structured_outputs": {"grammar": GRAMMAR}},
     StructuredOutputsParams(grammar=GRAMMAR)),
    ("guided_json", {"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ("guided_json as text", {"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=SCHEMA)),
    ("guided_regex", {"guided_regex": REGEX}, StructuredOutputsParams(regex=REGEX)),
    ("guided_choice", {"guided_choice": list(CHOICES)}, StructuredOutputsParams(choice=CHOICES)),
    ("guided_grammar", {"guided_grammar": GRAMMAR}, StructuredOutputsParams(grammar=GRAMMAR)),
]

# (id, the body's fields, the param the 400 names)
BAD_CONSTRAINTS = [
    ("response_format with an invalid schema",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    ("response_format json_schema without json_schema", {"response_format": {"type": "json_schema"}},
     "response_format"),
    ("structured_outputs json an invalid schema", {"structured_outputs": {"json": {"type": "frob"}}},
     "structured_outputs"),
    ("structured_outputs regex not a regex", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ("structured_outputs choice empty", {"structured_outputs": {"choice": []}}, "structured_outputs"),
    ("structured_outputs grammar naming an unknown rule", {"structured_outputs": {"grammar": "start: foo"}},
     "structured_outputs"),
    ("structured_outputs with two constraints", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs"),
    ("guided_json an invalid schema", {"guided_json": {"type": "frob"}}, "guided_json"),
    ("guided_json text that is not JSON", {"guided_json": "{"}, "guided_json"),
    ("guided_regex not a regex", {"guided_regex": "a(b"}, "guided_regex"),
    ("guided_choice empty", {"guided_choice": []}, "guided_choice"),
    ("guided_grammar naming an unknown rule", {"guided_grammar": "start: foo"}, "guided_grammar"),
    ("structured_outputs and guided_choice together", {"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]},
     "guided_choice"),
]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def _body(endpoint: str, **fields) -> dict:
    asked = {"prompt": PROMPT} if endpoint == "completions" else {"messages": MESSAGES}
    return {"model": MODEL, **asked, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}


@pytest.fixture(scope="module")
def answers(client):
    """(endpoint, way id) -> (text, finish_reason) of the greedy answer and of the streamed one, asked once."""
    asked = {}

    def answer(endpoint: str, way: str) -> tuple[tuple[str, str], tuple[str, str]]:
        if (endpoint, way) not in asked:
            fields = next(f for name, f, _ in WAYS if name == way)
            create = client.completions.create if endpoint == "completions" else client.chat.completions.create
            whole = create(**_body(endpoint), extra_body=fields).choices[0]
            pieces = [chunk.choices[0] for chunk in create(**_body(endpoint), extra_body=fields, stream=True)
                      if chunk.choices]
            asked[endpoint, way] = (_text(whole), whole.finish_reason), (
                "".join(_text(p) for p in pieces), pieces[-1].finish_reason)
        return asked[endpoint, way]

    return answer


def _text(choice) -> str:
    """A completions choice's text, a chat choice's content or a streamed chat delta's."""
    if hasattr(choice, "text"):
        return choice.text
    return (choice.message.content if hasattr(choice, "message") else choice.delta.content) or ""


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("way, constraint", [(name, c) for name, _, c in WAYS], ids=[name for name, _, _ in WAYS])
def test_each_way_of_asking_for_a_constraint_is_honoured(answers, endpoint, way, constraint):
    whole, streamed = answers(endpoint, way)
    assert whole == streamed
    text, finish_reason = whole
    assert finish_reason == "stop", text
    _assert_matches(constraint, text)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_spelling_of_one_constraint_gives_the_same_greedy_text(answers, endpoint):
    by_constraint = {}
    for name, _, constraint in WAYS:
        by_constraint.setdefault(constraint, {})[name] = answers(endpoint, name)[0]
    assert len(by_constraint) == 5  # JSON Schema, any object, regex, choice, grammar
    for spellings in by_constraint.values():
        assert len(set(spellings.values())) == 1, spellings


@pytest.mark.parametrize("fields, param", [case[1:] for case in BAD_CONSTRAINTS],
                         ids=[case[0] for case in BAD_CONSTRAINTS])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_invalid_constraint_is_a_400_naming_its_field(http, endpoint, stream, fields, param):
    _assert_openai_error(http.post(ENDPOINTS[endpoint], json=_body(endpoint, stream=stream, **fields)), 400, param)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_grammar_that_cannot_go_on_is_an_error_not_a_stop(http, endpoint):
    """A 400 naming the constraint, streamed too: the grammar fails with the first token, before any event went out
    (a later failure is the stream's last event, the status being out)."""
    from tests.test_structured_output import NO_FINITE_OUTPUT

    fields = {"guided_grammar": NO_FINITE_OUTPUT}
    for stream in (False, True):
        response = http.post(ENDPOINTS[endpoint], json=_body(endpoint, stream=stream, **fields))
        _assert_openai_error(response, 400, "structured_outputs")
        assert "cannot go on" in response.json()["error"]["message"]


def _refuse_them_all(http: httpx.Client) -> None:
    for _, fields, param in BAD_CONSTRAINTS:
        for endpoint in ENDPOINTS:
            for stream in (False, True):
                test_an_invalid_constraint_is_a_400_naming_its_field(http, endpoint, stream, fields, param)


def test_requests_alongside_refused_constraints_complete_unchanged(server, http):
    plain = _body("completions", max_tokens=12, ignore_eos=True)
    constrained = _body("completions", guided_regex=REGEX)
    solo = [http.post(COMPLETIONS, json=body).json()["choices"] for body in (plain, constrained)]
    with completions_meanwhile(server.base_url, plain) as plain_answers, \
            completions_meanwhile(server.base_url, constrained) as constrained_answers:
        for _ in range(2):
            _refuse_them_all(http)
    for answers, alone in zip((plain_answers, constrained_answers), solo):
        assert len(answers) > 1 and all(answer["choices"] == alone for answer in answers), answers[:2]
    assert "Traceback" not in server.log()
