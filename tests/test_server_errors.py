"""Bad requests against the live server: each gets its own status and OpenAI's error JSON (never HTML, never a
500), the API key never shows in an answer, and the server keeps serving afterwards."""

import json

import httpx
import openai
import pytest

from tests.live_server import running_server

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
    ("prompt a lone surrogate", "POST", COMPLETIONS, b'{"prompt": "a\\ud800"}', 400, "prompt"),
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
    ("prompt longer than max_model_len", "POST", COMPLETIONS, _completion(prompt="hello " * 600), 400, "prompt"),
    ("token prompt longer than max_model_len", "POST", COMPLETIONS, _completion(prompt=[5] * 600), 400, "prompt"),
    ("conversation longer than max_model_len", "POST", CHAT,
     _chat(messages=[{"role": "user", "content": "hello " * 600}]), 400, "messages"),
    ("empty messages", "POST", CHAT, _chat(messages=[]), 400, "messages"),
    ("body over --max-body-bytes", "POST", COMPLETIONS, _completion(prompt="x" * (MAX_BODY_BYTES + 1)), 413, None),
    ("tokenize a number", "POST", "/tokenize", {"prompt": 5}, 400, "prompt"),
    ("detokenize outside the vocabulary", "POST", "/detokenize", {"tokens": [5, 100000]}, 400, "tokens"),
    ("detokenize not ids", "POST", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("GET on completions", "GET", COMPLETIONS, None, 405, None),
    ("GET on chat", "GET", CHAT, None, 405, None),
    ("POST on health", "POST", "/health", {}, 405, None),
    ("unknown /v1 path", "POST", "/v1/embeddings", {"input": "x"}, 404, None),
    ("unknown path", "GET", "/nowhere", None, 404, None),
]


# a completions `prompt` and the message LLM.generate and run-batch give for the same fault (tests/test_prompt_checks.py)
SAME_AS_OFFLINE = [
    ([], "prompt is empty"),
    (42, "a prompt must be text or token ids, got int"),
    ([5, "a"], "token ids must be a list of integers"),
    (["Hi", [5, 100000]], "token id 100000 is outside the vocabulary [0, "),
]


def _send(http: httpx.Client, method: str, path: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, bytes):
        return http.request(method, path, content=body, headers={"Content-Type": "application/json"}, **kwargs)
    return http.request(method, path, json=body, **kwargs)


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
                               ("GET", "/v1/models", None), ("POST", "/start_profile", None)]:
        response = httpx.request(method, server.base_url + path, json=body, headers=headers, timeout=60)
        _assert_openai_error(response, 401, None)
        assert response.json()["error"]["type"] == "authentication_error"


def test_health_needs_no_key(server):
    assert httpx.get(server.base_url + "/health", timeout=60).status_code == 200


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


def test_server_still_serves_after_the_whole_table(server, http):
    for _, method, path, body, status, _ in BAD_REQUESTS:
        assert _send(http, method, path, body).status_code == status
    assert http.get("/health").status_code == 200
    response = http.post(COMPLETIONS, json=_completion(max_tokens=4, temperature=0))
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    chat = http.post(CHAT, json=_chat(max_tokens=3, temperature=0))
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
    assert "Traceback" not in server.log()
