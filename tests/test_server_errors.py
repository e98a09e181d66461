"""Bad requests against the live server: each gets its own status and OpenAI's error JSON (never HTML, never a
500), the API key never shows in an answer, and requests in flight meanwhile complete unchanged."""

import gzip
import json

import httpx
import openai
import pytest

from tests.live_server import completions_meanwhile, running_server

pytestmark = pytest.mark.slow

API_KEY = "sk-test-7f3a9c"  # the server requires it on /v1 routes
MAX_BODY_BYTES = 64 * 1024  # the server's --max-body-bytes
MODEL = "jaxserve-builtin"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("server"), "--api-key", API_KEY,
                        "--max-body-bytes", str(MAX_BODY_BYTES)) as live:
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def _completion(**fields):
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}


def _chat(**fields):
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}


def _tool(name, parameters=None):
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters else {})}}


# (name, method, path, body: a dict sent as JSON or bytes sent as they are, status, param)
BAD_REQUESTS = [
    ("malformed JSON", "POST", COMPLETIONS, b'{"prompt": "Hello", ', 400, None),
    ("body not an object", "POST", COMPLETIONS, b'["Hello"]', 400, None),
    ("max_tokens a string", "POST", COMPLETIONS, _completion(max_tokens="a"), 400, "max_tokens"),
    ("temperature a string", "POST", COMPLETIONS, _completion(temperature="hot"), 400, "temperature"),
    ("n a fraction", "POST", COMPLETIONS, _completion(n=1.5), 400, "n"),
    ("stream a string", "POST", COMPLETIONS, _completion(stream="yes"), 400, "stream"),
    ("stop a number", "POST", COMPLETIONS, _completion(stop=5), 400, "stop"),
    ("prompt a number", "POST", COMPLETIONS, _completion(prompt=5), 400, "prompt"),
    ("prompt empty list", "POST", COMPLETIONS, _completion(prompt=[]), 400, "prompt"),
    ("prompt an empty token-id list among others", "POST", COMPLETIONS, _completion(prompt=[[5], []]), 400, "prompt"),
    ("prompt token ids not integers", "POST", COMPLETIONS, _completion(prompt=[5, "a"]), 400, "prompt"),
    ("prompt a lone surrogate (not valid JSON text)", "POST", COMPLETIONS, b'{"prompt": "a\\ud800"}', 400, None),
    ("temperature NaN", "POST", COMPLETIONS, b'{"prompt": "Hello", "temperature": NaN}', 400, "temperature"),
    ("stream_options a string", "POST", COMPLETIONS, _completion(stream=True, stream_options="x"), 400,
     "stream_options"),
    ("logit_bias a list", "POST", COMPLETIONS, _completion(logit_bias=[1, 2]), 400, "logit_bias"),
    ("stop_token_ids a number", "POST", COMPLETIONS, _completion(stop_token_ids=5), 400, "stop_token_ids"),
    ("ignore_eos a string", "POST", COMPLETIONS, _completion(ignore_eos="yes"), 400, "ignore_eos"),
    ("messages a string", "POST", CHAT, _chat(messages="hi"), 400, "messages"),
    ("image content part", "POST", CHAT,
     _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
     400, "messages"),
    ("message without role", "POST", CHAT, _chat(messages=[{"content": "Hi"}]), 400, "messages"),
    ("chat logprobs a string", "POST", CHAT, _chat(logprobs="yes"), 400, "logprobs"),
    ("unknown model", "POST", COMPLETIONS, _completion(model="gpt-9"), 404, "model"),
    ("unknown model (chat)", "POST", CHAT, _chat(model="gpt-9"), 404, "model"),
    ("temperature negative", "POST", COMPLETIONS, _completion(temperature=-1), 400, "temperature"),
    ("top_p zero", "POST", COMPLETIONS, _completion(top_p=0), 400, "top_p"),
    ("n zero", "POST", COMPLETIONS, _completion(n=0), 400, "n"),
    ("n over the server's max_n", "POST", COMPLETIONS, _completion(n=1000), 400, "n"),
    ("logprobs 50", "POST", COMPLETIONS, _completion(logprobs=50), 400, "logprobs"),
    ("chat top_logprobs 50", "POST", CHAT, _chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("max_tokens negative", "POST", COMPLETIONS, _completion(max_tokens=-1), 400, "max_tokens"),
    ("max_completion_tokens zero", "POST", CHAT, _chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("logit_bias outside the vocabulary", "POST", COMPLETIONS, _completion(logit_bias={"100000": 1}), 400,
     "logit_bias"),
    ("logit_bias outside the vocabulary, streamed", "POST", COMPLETIONS,
     _completion(logit_bias={"100000": 1}, stream=True), 400, "logit_bias"),
    ("logit_bias outside the vocabulary, streamed chat", "POST", CHAT, _chat(logit_bias={"100000": 1}, stream=True),
     400, "logit_bias"),
    ("stop token id past int32", "POST", COMPLETIONS, _completion(stop_token_ids=[2**40]), 400, "stop_token_ids"),
    ("top_k past the vocabulary", "POST", COMPLETIONS, _completion(top_k=2**40), 400, "top_k"),
    ("presence_penalty 5", "POST", COMPLETIONS, _completion(presence_penalty=5), 400, "presence_penalty"),
    ("priority a fraction", "POST", COMPLETIONS, _completion(priority=0.5), 400, "priority"),
    ("priority under fcfs (the server's policy)", "POST", COMPLETIONS, _completion(priority=1), 400, "priority"),
    ("priority under fcfs, streamed chat", "POST", CHAT, _chat(priority=-1, stream=True), 400, "priority"),
    ("prompt longer than max_model_len", "POST", COMPLETIONS, _completion(prompt="hello " * 600), 400, "prompt"),
    ("token prompt longer than max_model_len", "POST", COMPLETIONS, _completion(prompt=[5] * 600), 400, "prompt"),
    ("conversation longer than max_model_len", "POST", CHAT,
     _chat(messages=[{"role": "user", "content": "hello " * 600}]), 400, "messages"),
    ("empty messages", "POST", CHAT, _chat(messages=[]), 400, "messages"),
    ("body over --max-body-bytes", "POST", COMPLETIONS, _completion(prompt="x" * (MAX_BODY_BYTES + 1)), 413, None),
    ("tokenize a number", "POST", "/tokenize", {"prompt": 5}, 400, "prompt"),
    ("detokenize outside the vocabulary", "POST", "/detokenize", {"tokens": [5, 100000]}, 400, "tokens"),
    ("detokenize not ids", "POST", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("an unknown field", "POST", COMPLETIONS, _completion(temprature=0.5), 400, "temprature"),
    ("an unknown chat field", "POST", CHAT, _chat(frobnicate=True), 400, "frobnicate"),
    ("the deprecated functions", "POST", CHAT, _chat(functions=[{"name": "f"}]), 400, "functions"),
    ("a tool without a function", "POST", CHAT, _chat(tools=[{"type": "function"}]), 400, "tools"),
    ("a tool named with a space", "POST", CHAT, _chat(tools=[_tool("get weather")]), 400, "tools"),
    ("two tools of one name", "POST", CHAT, _chat(tools=[_tool("f"), _tool("f")]), 400, "tools"),
    ("a tool whose parameters are not a schema", "POST", CHAT, _chat(tools=[_tool("f", {"minimum": "x"})]), 400,
     "tools[0].function.parameters"),
    *((f"a forced call of a function whose parameters are a {kind} (OpenAI refuses it)", "POST", CHAT,
       _chat(tools=[_tool("f"), _tool("g", {"type": kind})], tool_choice=choice), 400, "tools[1].function.parameters")
      for kind, choice in [("string", "required"), ("array", {"type": "function", "function": {"name": "g"}}),
                           ("integer", "auto")]),
    ("tool_choice required without tools", "POST", CHAT, _chat(tool_choice="required"), 400, "tool_choice"),
    ("tool_choice naming no tool", "POST", CHAT,
     _chat(tools=[_tool("f")], tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    ("tool_choice of an unknown kind", "POST", CHAT, _chat(tools=[_tool("f")], tool_choice="always"), 400,
     "tool_choice"),
    ("forced calls and a response_format", "POST", CHAT,
     _chat(tools=[_tool("f")], tool_choice="required", response_format={"type": "json_object"}), 400, "tool_choice"),
    ("a tool message without tool_call_id", "POST", CHAT,
     _chat(messages=[{"role": "user", "content": "Hi"}, {"role": "tool", "content": "x"}]), 400, "messages"),
    *((f"a {role} message without content (OpenAI refuses it)", "POST", CHAT,
       _chat(messages=[{"role": "user", "content": "Hi"}, {"role": role, "tool_call_id": "1"}
                       if role == "tool" else {"role": role}]), 400, "messages[1].content")
      for role in ["system", "developer", "user", "assistant", "tool"]),
    ("a message whose content is null", "POST", CHAT, _chat(messages=[{"role": "user", "content": None}]), 400,
     "messages[0].content"),
    ("a call whose arguments are not JSON", "POST", CHAT, _chat(messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f",
                                                                                          "arguments": "{x"}}]}]),
     400, "messages"),
    ("calls on a user message", "POST", CHAT, _chat(messages=[
        {"role": "user", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f",
                                                                                    "arguments": "{}"}}]}]),
     400, "messages"),
    ("response_format with an invalid schema", "POST", CHAT,
     _chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}), 400,
     "response_format"),
    ("response_format json_schema without json_schema", "POST", CHAT, _chat(response_format={"type": "json_schema"}),
     400, "response_format"),
    ("response_format of an unknown type", "POST", CHAT, _chat(response_format={"type": "yaml"}), 400,
     "response_format"),
    ("guided_regex not a regex", "POST", COMPLETIONS, _completion(guided_regex="a(b"), 400, "guided_regex"),
    ("guided_grammar naming an unknown rule", "POST", COMPLETIONS, _completion(guided_grammar="start: foo"), 400,
     "guided_grammar"),
    ("two output constraints", "POST", COMPLETIONS, _completion(guided_regex="a", guided_choice=["a"]), 400,
     "guided_choice"),
    ("structured_outputs without a constraint", "POST", COMPLETIONS, _completion(structured_outputs={}), 400,
     "structured_outputs"),
    ("another grammar engine", "POST", COMPLETIONS,
     _completion(guided_choice=["a"], guided_decoding_backend="xgrammar"), 400, "guided_decoding_backend"),
    ("best_of 3", "POST", COMPLETIONS, _completion(best_of=3), 400, "best_of"),
    ("suffix", "POST", COMPLETIONS, _completion(suffix="end"), 400, "suffix"),
    ("annotations echoed in the history", "POST", CHAT, _chat(messages=[
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "annotations": [{"x": 1}]}]),
     400, "messages"),
    ("stream_options without stream", "POST", COMPLETIONS, _completion(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("an unknown role", "POST", CHAT, _chat(messages=[{"role": "wizard", "content": "Hi"}]), 400, "messages"),
    ("max_tokens past the context", "POST", COMPLETIONS, _completion(max_tokens=10_000), 400, "max_tokens"),
    ("max_completion_tokens past the context", "POST", CHAT, _chat(max_completion_tokens=10_000), 400,
     "max_completion_tokens"),
    ("text far beyond max_model_len, refused untokenized", "POST", COMPLETIONS, _completion(prompt="x" * 60_000), 400,
     "prompt"),
    ("tokenize text far beyond max_model_len", "POST", "/tokenize", {"prompt": "x" * 60_000}, 400, "prompt"),
    ("detokenize more ids than any sequence", "POST", "/detokenize", {"tokens": [5] * 5000}, 400, "tokens"),
    ("deeply nested JSON", "POST", COMPLETIONS, b'{"prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", 400, None),
    ("a body that is not UTF-8", "POST", COMPLETIONS, b'{"prompt": "caf\xe9"}', 400,
     None),
    ("retrieve another model", "GET", "/v1/models/gpt-9", None, 404, "model"),
    ("GET on completions", "GET", COMPLETIONS, None, 405, None),
    ("GET on chat", "GET", CHAT, None, 405, None),
    ("POST on health", "POST", "/health", {}, 405, None),
    ("unknown /v1 path", "POST", "/v1/audio/speech", {"input": "x"}, 404, None),
    ("unknown path", "GET", "/nowhere", None, 404, None),
]


# (name, headers, body bytes, status): what a body is sent as, besides being JSON
BAD_ENCODINGS = [
    ("gzip", {"Content-Type": "application/json", "Content-Encoding": "gzip"}, gzip.compress(b'{"prompt": "Hi"}'), 415),
    ("form", {"Content-Type": "application/x-www-form-urlencoded"}, b"prompt=Hi", 415),
    ("text", {"Content-Type": "text/plain"}, b'{"prompt": "Hi"}', 415),
    ("latin-1", {"Content-Type": "application/json; charset=latin-1"}, '{"prompt": "café"}'.encode("latin-1"), 415),
]


# a completions `prompt` and the message run-batch (and, for faults of content, LLM.generate) gives for the same fault
# (tests/test_prompt_checks.py)
SAME_AS_OFFLINE = [
    ([], "prompt is empty"),
    (42, "prompt must be text, token ids, or a list of either"),
    ([5, "a"], "prompt.1: Input should be a valid integer"),
    ([[5], [5, 100000]], "token id 100000 is outside the vocabulary [0, "),
]


def _send(http: httpx.Client, method: str, path: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, bytes):
        return http.request(method, path, content=body, headers={"Content-Type": "application/json"}, **kwargs)
    return http.request(method, path, json=body, **kwargs)


def _send_once_more_if_cut(http: httpx.Client, method: str, path: str, body) -> httpx.Response:
    """`_send`, again once if the connection closed before a response was read: a 413 answered (and the connection
    closed) while the client still sends the body it refuses can reach the client as a reset instead (HTTP allows
    both); a server that crashed fails the checks after the table."""
    try:
        return _send(http, method, path, body)
    except httpx.RemoteProtocolError:
        return _send(http, method, path, body)


def _assert_openai_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    assert API_KEY not in response.text


@pytest.mark.parametrize("name, method, path, body, status, param", BAD_REQUESTS, ids=[r[0] for r in BAD_REQUESTS])
def test_bad_request_gets_its_status_and_openai_error(http, name, method, path, body, status, param):
    _assert_openai_error(_send(http, method, path, body), status, param)



@pytest.mark.parametrize("name, headers, body, status", BAD_ENCODINGS, ids=[r[0] for r in BAD_ENCODINGS])
def test_bodies_not_sent_as_plain_utf8_json_are_refused(http, name, headers, body, status):
    _assert_openai_error(http.post(COMPLETIONS, content=body, headers=headers), status, None)


def test_wrong_methods_unknown_routes_and_missing_keys_say_what_to_do(server, http):
    not_allowed = http.get(COMPLETIONS)
    assert "POST" in not_allowed.headers["allow"].split(", ") and "POST" in not_allowed.json()["error"]["message"]
    unknown = http.get("/nowhere")
    assert "/openapi.json" in unknown.json()["error"]["message"]
    denied = httpx.get(server.base_url + "/v1/models", timeout=60)
    assert denied.status_code == 401 and denied.headers["www-authenticate"] == "Bearer"
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL


@pytest.mark.parametrize("prompt, message", SAME_AS_OFFLINE, ids=[m for _, m in SAME_AS_OFFLINE])
def test_bad_prompts_get_the_offline_message(http, prompt, message):
    response = http.post(COMPLETIONS, json=_completion(prompt=prompt))
    _assert_openai_error(response, 400, "prompt")
    assert response.json()["error"]["message"].startswith(message)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}], ids=["missing", "wrong", "no scheme",
                                                                                 "basic"])
def test_v1_routes_need_the_api_key(server, headers):
    for method, path, body in [("POST", COMPLETIONS, _completion()), ("POST", CHAT, _chat()),
                               ("GET", "/v1/models", None), ("POST", "/start_profile", None),
                               ("POST", "/tokenize", {"prompt": "Hi"}), ("POST", "/detokenize", {"tokens": [5]}),
                               ("GET", "/tokenizer_info", None), ("GET", "/openapi.json", None)]:
        response = httpx.request(method, server.base_url + path, json=body, headers=headers, timeout=60)
        _assert_openai_error(response, 401, None)
        assert response.json()["error"]["type"] == "authentication_error"


def test_probes_need_no_key(server):
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(server.base_url + path, timeout=60).status_code == 200


def test_official_client_raises_its_typed_errors(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt="Hello", temperature=-1)
        assert bad.value.body["param"] == "temperature"
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-9", messages=HI)
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0, timeout=60) as client:
        with pytest.raises(openai.AuthenticationError) as denied:
            client.models.list()
        assert API_KEY not in json.dumps(denied.value.body)


def test_chunked_body_over_the_limit_is_413(http):
    body = json.dumps(_completion(prompt="x" * (MAX_BODY_BYTES + 1))).encode()
    pieces = (body[start:start + 4096] for start in range(0, len(body), 4096))  # no Content-Length: read to the cap
    response = http.post(COMPLETIONS, content=pieces, headers={"Content-Type": "application/json"})
    _assert_openai_error(response, 413, None)


def test_requests_in_flight_complete_unchanged_through_the_whole_table(server, http):
    greedy = _completion(max_tokens=12, temperature=0, ignore_eos=True)
    solo = http.post(COMPLETIONS, json=greedy).json()
    with completions_meanwhile(server.base_url, greedy, {"Authorization": f"Bearer {API_KEY}"}) as meanwhile:
        for _, method, path, body, status, _ in BAD_REQUESTS:
            assert _send_once_more_if_cut(http, method, path, body).status_code == status
        for _, headers, body, status in BAD_ENCODINGS:
            # A connection the server closed after the table's 413 may still sit in the client's pool: once more.
            try:
                response = http.post(COMPLETIONS, content=body, headers=headers)
            except httpx.RemoteProtocolError:
                response = http.post(COMPLETIONS, content=body, headers=headers)
            assert response.status_code == status
        test_chunked_body_over_the_limit_is_413(http)
    assert len(meanwhile) > 1 and all(answer["choices"] == solo["choices"] for answer in meanwhile)
    assert http.get("/health").status_code == 200
    chat = http.post(CHAT, json=_chat(max_tokens=3, temperature=0))
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    assert "Traceback" not in server.log()
