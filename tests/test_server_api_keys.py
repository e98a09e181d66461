"""Per-key quotas (--api-keys-file): the file's checks, the token buckets, and the server's answers.

In-process tests run the app on the shared tiny engine with a clock the test moves, so Retry-After values are exact
and no test waits for a window to pass; a held-open stream is an ASGI exchange whose client reads one event and then
nothing. One live server (the real `jaxserve serve`) checks what needs a process: the official client over HTTP and
SIGHUP reloading the file.
"""

import asyncio
import contextlib
import json
import logging
import signal
from unittest import mock

import httpx
import httpx2
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from jaxserve import SamplingParams
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.errors import ConfigError, InvalidRequestError
from jaxserve.server import api_keys as api_keys_module
from jaxserve.server.api_keys import ApiKeys
from jaxserve.server.api_keys_file import ApiKeySpec, load_api_keys_file
from jaxserve.server.app import create_app
from jaxserve.server.context import ServerContext
from jaxserve.server.config import ServerConfig
from jaxserve.server.quotas import KeyQuota, QuotaExceeded, QuotaTooSmall, TokenBucket, TokenTally
from tests.live_server import running_server

MODEL = "jaxserve-builtin"
HI = [{"role": "user", "content": "hi"}]
PROMPT = [1, 17, 42, 99, 7, 300]  # token ids: its length is exact, whatever the tokenizer
OPEN = {"name": "open", "key": "sk-open-5d1f", "max_concurrent_requests": 8}  # no rate limits
PACED = {"name": "paced", "key": "sk-paced-93ac", "requests_per_minute": 2}  # one request every 30 s
METERED = {"name": "metered", "key": "sk-metered-0b7e", "tokens_per_minute": 60}  # one token a second
SINGLE = {"name": "single", "key": "sk-single-c4e2", "max_concurrent_requests": 1}
ALL_KEYS = [OPEN, PACED, METERED, SINGLE]
ANSWER_TIMEOUT_S = 120  # bounds every wait on the server: a stalled server fails the test rather than hanging it


# --- helpers ------------------------------------------------------------------------------------------------------


class FakeClock:
    """The quotas' clock, moved by the test."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def write_keys(path, *entries) -> None:
    path.write_text(yaml.safe_dump({"keys": list(entries)}))


def completion(max_tokens: int, stream: bool = False, **extra) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream, **extra}


class Served:
    """The app on the shared tiny engine, its context and clock, and clients for it."""

    def __init__(self, app, context: ServerContext, clock: FakeClock):
        self.app = app
        self.context = context
        self.clock = clock

    def http(self, key: str | None = None) -> httpx2.AsyncClient:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=self.app), base_url="http://test",
                                  headers=headers, timeout=ANSWER_TIMEOUT_S)

    def openai(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url="http://test/v1", api_key=key, max_retries=0, timeout=ANSWER_TIMEOUT_S,
                                  http_client=self.http())

    async def post(self, key: str | None, body: dict) -> httpx2.Response:
        async with self.http(key) as client:
            return await client.post("/v1/completions", json=body)

    async def metrics(self) -> dict[tuple[str, tuple], float]:
        async with self.http() as client:
            text = (await client.get("/metrics")).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}


@contextlib.asynccontextmanager
async def serving(llm, keys_file, **config):
    clock = FakeClock()
    context = ServerContext(engine=AsyncEngine(llm.engine), tokenizer=llm.tokenizer,
                            config=ServerConfig(api_keys_file=keys_file, **config), max_model_len=llm.max_model_len,
                            vocab_size=llm.model.config.vocab_size, clock=clock)
    app = create_app(context)
    async with app.test_app():  # starts the engine thread (before_serving) and stops it after
        yield Served(app, context, clock)


def run_served(llm, keys_file, scenario, **config):
    async def main():
        async with serving(llm, keys_file, **config) as served:
            return await scenario(served)

    return asyncio.run(main())


class HeldStream:
    """A streamed completion whose client reads the first event and then nothing: the server's next send waits, so
    the exchange stays open until the client reads on, leaves, or is dropped after --stream-timeout."""

    def __init__(self, app, key: str, body: dict):
        self._app = app
        self._body = json.dumps(body).encode()
        self._headers = [(b"host", b"test"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(self._body)).encode()),
                         (b"authorization", f"Bearer {key}".encode())]
        self.status: int | None = None  # the response's status, once sent
        self.received: list[bytes] = []  # the body chunks sent so far
        self._first_event = asyncio.Event()  # the first body chunk arrived
        self._reading = asyncio.Event()  # the client reads again: every send completes
        self._left = asyncio.Event()  # the client closed its connection
        self._body_sent = False  # the request body went to the app
        self._task: asyncio.Task | None = None  # the exchange

    async def open(self) -> "HeldStream":
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": self._headers, "client": ("127.0.0.1", 4242), "server": ("test", 80)}
        self._task = asyncio.create_task(self._app(scope, self._receive, self._send))
        first = asyncio.create_task(self._first_event.wait())
        await asyncio.wait([first, self._task], timeout=ANSWER_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        first.cancel()
        assert self.status == 200 and self._first_event.is_set(), self.status
        return self

    async def leave(self) -> None:
        """The client closes its connection; returns once the exchange has ended."""
        self._left.set()
        await self.ended()

    async def read_to_end(self) -> bytes:
        self._reading.set()
        await self.ended()
        return b"".join(self.received)

    async def ended(self) -> None:
        await asyncio.wait_for(self._task, ANSWER_TIMEOUT_S)

    async def _receive(self) -> dict:
        if not self._body_sent:
            self._body_sent = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self._left.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            if self._first_event.is_set():
                await self._reading.wait()  # a client that stopped reading: the send waits until it reads again
            self.received.append(message.get("body", b""))
            self._first_event.set()


def assert_rate_limited(error: openai.RateLimitError, kind: str, retry_after: str) -> None:
    assert error.response.headers["retry-after"] == retry_after, error.response.headers
    assert error.body["code"] == "rate_limit_exceeded" and error.body["type"] == kind, error.body


# --- the keys file ------------------------------------------------------------------------------------------------

BAD_FILES = [
    ("unknown field", {"keys": [{"name": "a", "key": "k1", "requests_per_min": 5}]},
     "keys[0] (name 'a'): unknown field 'requests_per_min'"),
    ("unknown top-level field", {"keys": [{"name": "a", "key": "k1"}], "limits": {}}, "unknown field 'limits'"),
    ("duplicate name", {"keys": [{"name": "a", "key": "k1"}, {"name": "a", "key": "k2"}]},
     "keys[1]: duplicate name 'a' (also keys[0])"),
    ("duplicate key", {"keys": [{"name": "a", "key": "k1"}, {"name": "b", "key": "k1"}]},
     "keys[1] (name 'b'): duplicate key, the same as 'a'"),
    ("zero limit", {"keys": [{"name": "a", "key": "k1", "requests_per_minute": 0}]},
     "requests_per_minute must be a positive integer"),
    ("negative limit", {"keys": [{"name": "a", "key": "k1", "tokens_per_minute": -5}]},
     "tokens_per_minute must be a positive integer"),
    ("fractional limit", {"keys": [{"name": "a", "key": "k1", "tokens_per_minute": 2.5}]},
     "tokens_per_minute must be a positive integer"),
    ("boolean limit", {"keys": [{"name": "a", "key": "k1", "max_concurrent_requests": True}]},
     "max_concurrent_requests must be a positive integer"),
    ("empty key", {"keys": [{"name": "a", "key": ""}]}, "(name 'a'): `key` must not be empty"),
    ("key with a space", {"keys": [{"name": "a", "key": "k 1"}]}, "`key` must not contain whitespace"),
    ("numeric key", {"keys": [{"name": "a", "key": 12345}]}, "`key` must be a string (quote it in YAML)"),
    ("missing name", {"keys": [{"key": "k1"}]}, "keys[0]: `name` must be a non-empty string"),
    ("no keys", {"keys": []}, "`keys` must be a non-empty list"),
    ("a bare list", [{"name": "a", "key": "k1"}], "expected a mapping with a `keys` list"),
]


@pytest.mark.parametrize("data, message", [case[1:] for case in BAD_FILES], ids=[case[0] for case in BAD_FILES])
def test_bad_files_name_the_entry_and_field(tmp_path, data, message):
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as refused:
        load_api_keys_file(path)
    assert str(refused.value).startswith(f"{path}: ") and message in str(refused.value)
    assert "k1" not in str(refused.value)  # a key never shows in a message


def test_unreadable_files_and_syntax_errors_do_not_quote_the_key(tmp_path):
    with pytest.raises(ConfigError, match="api keys file not found"):
        load_api_keys_file(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("keys:\n  - name: a\n    key: [sk-secret-1\n")
    with pytest.raises(ConfigError, match=r"not valid YAML or JSON at line \d+, column \d+") as refused:
        load_api_keys_file(broken)
    assert "sk-secret" not in str(refused.value)


def test_json_files_and_optional_limits(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"name": "a", "key": "k1", "tokens_per_minute": 100},
                                         {"name": "b", "key": "k2", "requests_per_minute": None}]}))
    assert load_api_keys_file(path) == (ApiKeySpec("a", "k1", tokens_per_minute=100), ApiKeySpec("b", "k2"))
    assert "k1" not in repr(load_api_keys_file(path))


def test_api_key_and_api_keys_file_exclude_each_other(tmp_path):
    with pytest.raises(ConfigError, match="api_key and api_keys_file exclude each other"):
        ServerConfig(api_key="k", api_keys_file=tmp_path / "keys.yaml")


# --- quotas (no server) -------------------------------------------------------------------------------------------


def test_a_bucket_refills_at_its_limit_a_minute_and_never_beyond():
    bucket = TokenBucket(per_minute=60, now=0.0)
    bucket.take(60, now=0.0)
    assert bucket.wait_s(15, now=0.0) == 15.0 and bucket.wait_s(15, now=10.0) == 5.0
    assert bucket.wait_s(15, now=15.0) == 0.0
    assert bucket.level(now=1000.0) == 60.0
    bucket.give_back(100, now=1000.0)
    assert bucket.level(now=1000.0) == 60.0
    assert bucket.resized(30, now=1000.0).level(now=1000.0) == 30.0


def test_a_refused_request_takes_nothing_and_a_cancelled_one_gives_everything_back():
    clock = FakeClock()
    quota = KeyQuota(ApiKeySpec("a", "k", requests_per_minute=1, tokens_per_minute=100, max_concurrent_requests=2),
                     clock)
    with pytest.raises(QuotaTooSmall, match="allows 100 tokens per minute"):
        quota.try_take(101, TokenTally(prompt=1))
    ticket = quota.try_take(100, TokenTally(prompt=1))
    with pytest.raises(QuotaExceeded) as refused:
        quota.try_take(1, TokenTally(prompt=1))
    # Both buckets are empty: the request waits for the slower one (a request in 60 s, 1 token in 0.6 s).
    assert (refused.value.limit, refused.value.retry_after_s) == ("requests_per_minute", 60)
    ticket.cancel()
    ticket.cancel()  # a second call does nothing
    assert quota.in_flight == 0
    quota.try_take(100, TokenTally(prompt=1)).settle()


def test_authentication_compares_every_key(monkeypatch):
    keys = ApiKeys([ApiKeySpec(f"n{i}", f"k{i}") for i in range(5)], FakeClock())
    compared = []
    real = api_keys_module.hmac.compare_digest
    monkeypatch.setattr(api_keys_module.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    assert keys.authenticate("k0").name == "n0" and len(compared) == 5
    assert keys.authenticate("k9") is None and keys.authenticate("") is None and len(compared) == 15


# --- in-process server, clock moved by the test -------------------------------------------------------------------


def test_requests_need_one_of_the_keys(tiny_llm, tmp_path):
    write_keys(tmp_path / "keys.yaml", *ALL_KEYS)

    async def scenario(served):
        async with served.http() as client:
            assert (await client.get("/health")).status_code == 200  # the probes stay open
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {OPEN['key']}"},
                            {"Authorization": OPEN["key"]}):
                denied = await client.get("/v1/models", headers=headers)
                assert denied.status_code == 401 and denied.headers["www-authenticate"] == "Bearer"
                assert denied.json()["error"]["type"] == "authentication_error"
            for key in ALL_KEYS:
                answer = await client.get("/v1/models", headers={"Authorization": f"Bearer {key['key']}"})
                assert answer.status_code == 200
        async with served.openai("sk-wrong") as wrong:
            with pytest.raises(openai.AuthenticationError):
                await wrong.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)

    run_served(tiny_llm, tmp_path / "keys.yaml", scenario)


def test_over_requests_per_minute_is_429_with_retry_after_until_the_window_lets_it_through(tiny_llm, tmp_path):
    write_keys(tmp_path / "keys.yaml", *ALL_KEYS)

    async def scenario(served):
        async with served.openai(PACED["key"]) as paced, served.openai(OPEN["key"]) as unlimited:
            for _ in range(2):
                await paced.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            with pytest.raises(openai.RateLimitError) as limited:
                await paced.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            assert_rate_limited(limited.value, "requests", "30")
            assert "key 'paced' is over its limit of 2 requests per minute" in limited.value.message
            # Another key is not held back by this one's quota.
            await unlimited.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            served.clock.advance(29)
            with pytest.raises(openai.RateLimitError) as still:
                await paced.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
            assert_rate_limited(still.value, "requests", "1")
            served.clock.advance(1)
            await paced.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        return await served.metrics()

    samples = run_served(tiny_llm, tmp_path / "keys.yaml", scenario)
    assert samples[("jaxserve:api_key_requests_total", (("key_name", "paced"),))] == 3
    assert samples[("jaxserve:api_key_rate_limited_total",
                    (("key_name", "paced"), ("limit", "requests_per_minute")))] == 2


def test_tokens_per_minute_reserve_max_tokens_and_settle_to_what_was_used(tiny_llm, tmp_path):
    write_keys(tmp_path / "keys.yaml", *ALL_KEYS)
    # A stop token a few tokens in: the first request ends long before its max_tokens.
    [greedy] = tiny_llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=3, temperature=0,
                                                                                ignore_eos=True), use_tqdm=False)
    stop_token = greedy.outputs[0].token_ids[2]
    generated = ("jaxserve:api_key_generation_tokens_total", (("key_name", "metered"),))
    prompt_tokens = ("jaxserve:api_key_prompt_tokens_total", (("key_name", "metered"),))

    async def scenario(served):
        async with served.openai(METERED["key"]) as metered:
            await metered.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                             extra_body={"ignore_eos": True, "stop_token_ids": [stop_token]})
            samples = await served.metrics()
            assert samples[prompt_tokens] == len(PROMPT) and samples[generated] <= 3
            # 6 + 20 were reserved; what went unused came back: exactly the rest of the minute's 60 is left.
            left = 60 - int(samples[prompt_tokens] + samples[generated])
            with pytest.raises(openai.RateLimitError) as limited:
                await metered.completions.create(model=MODEL, prompt=PROMPT, max_tokens=left - len(PROMPT) + 1)
            assert_rate_limited(limited.value, "tokens", "1")  # one token short, at one token a second
            await metered.completions.create(model=MODEL, prompt=PROMPT, max_tokens=left - len(PROMPT),
                                             extra_body={"ignore_eos": True})
            # More than a whole minute's tokens can never pass: refused for good, not told to retry.
            with pytest.raises(openai.BadRequestError) as too_large:
                await metered.completions.create(model=MODEL, prompt=PROMPT, max_tokens=55)
            assert too_large.value.body["param"] == "max_tokens"
            with pytest.raises(openai.RateLimitError) as empty:
                await metered.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
            assert_rate_limited(empty.value, "tokens", "10")
            served.clock.advance(10)
            await metered.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)

    run_served(tiny_llm, tmp_path / "keys.yaml", scenario)


@pytest.mark.parametrize("ending", ["client reads to the end", "client leaves", "client dropped"])
def test_max_concurrent_requests_holds_a_slot_until_the_exchange_ends(tiny_llm, tmp_path, ending):
    write_keys(tmp_path / "keys.yaml", *ALL_KEYS)

    async def scenario(served):
        quota = served.context.api_keys.quota("single")
        held = await HeldStream(served.app, SINGLE["key"], completion(40, stream=True)).open()
        refused = await served.post(SINGLE["key"], completion(2))
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert "max_concurrent_requests" in refused.json()["error"]["message"]
        assert quota.in_flight == 1
        if ending == "client reads to the end":
            assert (await held.read_to_end()).endswith(b"data: [DONE]\n\n")
        elif ending == "client leaves":
            await held.leave()
        else:
            await held.ended()  # its send waits past --stream-timeout: the server drops it
        assert quota.in_flight == 0
        assert (await served.post(SINGLE["key"], completion(2))).status_code == 200
        return await served.metrics()

    # The dropped client's timeout is long enough for the refused request to come first, even on a busy machine.
    samples = run_served(tiny_llm, tmp_path / "keys.yaml", scenario,
                         stream_timeout_s=1.0 if ending == "client dropped" else 60.0)
    assert samples[("jaxserve:api_key_rate_limited_total",
                    (("key_name", "single"), ("limit", "max_concurrent_requests")))] == 1
    assert samples[("jaxserve:api_key_requests_total", (("key_name", "single"),))] == 2


def test_a_request_the_engine_refuses_after_admission_gives_its_slot_back(tiny_llm, tmp_path):
    write_keys(tmp_path / "keys.yaml", *ALL_KEYS)

    async def scenario(served):
        # What the engine would refuse is refused while the body is checked, before admission takes anything...
        early = await served.post(SINGLE["key"], completion(2, stop_token_ids=[10**6]))
        assert early.status_code == 400 and early.json()["error"]["param"] == "stop_token_ids"
        # ...and a refusal only the engine thread can make (here: an adapter unloaded meanwhile) gives it all back.
        refusal = InvalidRequestError("the LoRA adapter was unloaded", param="model")
        with mock.patch.object(served.context.engine.engine, "add_request", side_effect=refusal):
            for stream in (False, True):
                refused = await served.post(SINGLE["key"], completion(2, stream=stream))
                assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"
                assert served.context.api_keys.quota("single").in_flight == 0
        return await served.metrics()

    samples = run_served(tiny_llm, tmp_path / "keys.yaml", scenario)
    assert samples[("jaxserve:api_key_requests_total", (("key_name", "single"),))] == 2  # the last two were admitted


def test_metrics_count_by_key_name_and_never_show_a_key(tiny_llm, tmp_path):
    write_keys(tmp_path / "keys.yaml", *ALL_KEYS)

    async def scenario(served):
        assert (await served.post(OPEN["key"], completion(3))).status_code == 200
        async with served.http() as client:
            return (await client.get("/metrics")).text, await served.metrics()

    text, samples = run_served(tiny_llm, tmp_path / "keys.yaml", scenario)
    for key in ALL_KEYS:
        assert key["key"] not in text
        assert ("jaxserve:api_key_requests_total", (("key_name", key["name"]),)) in samples  # declared at 0
    assert samples[("jaxserve:api_key_requests_total", (("key_name", "open"),))] == 1
    assert samples[("jaxserve:api_key_prompt_tokens_total", (("key_name", "open"),))] == len(PROMPT)
    assert samples[("jaxserve:api_key_generation_tokens_total", (("key_name", "open"),))] == 3
    assert samples[("jaxserve:api_key_requests_total", (("key_name", "paced"),))] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_scoring_with_max_tokens_0_counts_what_usage_says(tiny_llm, tmp_path, stream):
    """echo with max_tokens 0 (how evaluation scripts score a prompt) generates nothing: the key's quota and the
    metrics count its prompt and no generated token, exactly the usage the client sees."""
    write_keys(tmp_path / "keys.yaml", OPEN)
    body = {"model": MODEL, "prompt": [PROMPT, PROMPT[:4]], "max_tokens": 0, "echo": True, "logprobs": 1, "n": 2}

    async def scenario(served):
        async with served.openai(OPEN["key"]) as client:
            if stream:
                events = [event async for event in await client.completions.create(
                    **body, stream=True, stream_options={"include_usage": True})]
                answered = events[-1].usage
            else:
                answered = (await client.completions.create(**body)).usage
        return answered, await served.metrics()

    answered, samples = run_served(tiny_llm, tmp_path / "keys.yaml", scenario)
    assert answered.completion_tokens == 0 and answered.prompt_tokens == len(PROMPT) + 4
    assert samples[("jaxserve:api_key_generation_tokens_total", (("key_name", "open"),))] == 0
    assert samples[("jaxserve:api_key_prompt_tokens_total", (("key_name", "open"),))] == answered.prompt_tokens
    assert samples[("jaxserve:generation_tokens_total", ())] == 0


def test_reload_swaps_keys_keeps_in_flight_accounting_and_refuses_a_bad_file(tiny_llm, tmp_path, caplog):
    path = tmp_path / "keys.yaml"
    write_keys(path, OPEN, SINGLE)
    new = {"name": "new", "key": "sk-new-61aa"}

    async def scenario(served):
        held = await HeldStream(served.app, SINGLE["key"], completion(40, stream=True)).open()
        write_keys(path, SINGLE, new)
        assert await served.context.reload_api_keys()
        assert (await served.post(OPEN["key"], completion(2))).status_code == 401
        assert (await served.post(new["key"], completion(2))).status_code == 200
        # The held stream still holds single's one slot across the reload.
        assert (await served.post(SINGLE["key"], completion(2))).status_code == 429
        await held.leave()
        assert (await served.post(SINGLE["key"], completion(2))).status_code == 200
        write_keys(path, OPEN, {**new, "name": "open"})
        with caplog.at_level(logging.ERROR, logger="jaxserve.server.api_keys"):
            assert not await served.context.reload_api_keys()
        assert (await served.post(new["key"], completion(2))).status_code == 200
        assert (await served.post(OPEN["key"], completion(2))).status_code == 401

    run_served(tiny_llm, path, scenario)
    assert "kept the previous API keys" in caplog.text and "duplicate name 'open'" in caplog.text


# --- live: the official client over HTTP, SIGHUP -----------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api-keys")
    write_keys(tmp / "keys.yaml", OPEN, PACED)
    with running_server(tmp, "--api-keys-file", str(tmp / "keys.yaml")) as server:
        yield server, tmp / "keys.yaml"


def live_client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=ANSWER_TIMEOUT_S)


@pytest.mark.slow
def test_live_429_is_the_official_clients_rate_limit_error(live):
    server, _ = live
    with live_client(server, PACED["key"]) as paced:
        paced.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        paced.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        with pytest.raises(openai.RateLimitError) as limited:
            paced.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert 1 <= int(limited.value.response.headers["retry-after"]) <= 30
    with live_client(server, "sk-wrong") as wrong, pytest.raises(openai.AuthenticationError):
        wrong.models.list()


@pytest.mark.slow
def test_live_sighup_reloads_the_file_while_a_stream_runs_and_a_bad_file_keeps_the_old_keys(live):
    server, path = live
    new = {"name": "new", "key": "sk-new-61aa"}

    def status(key: str) -> int:
        return httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                         timeout=ANSWER_TIMEOUT_S).status_code

    with httpx.Client(base_url=server.base_url, timeout=ANSWER_TIMEOUT_S,
                      headers={"Authorization": f"Bearer {OPEN['key']}"}) as client:
        with client.stream("POST", "/v1/completions", json=completion(400, stream=True)) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            write_keys(path, OPEN, new)
            server.process.send_signal(signal.SIGHUP)
            # The reload runs on the server's loop soon after: each attempt is one request, so the loop is bounded.
            assert any(status(new["key"]) == 200 for _ in range(500)), server.log()[-2000:]
            assert status(PACED["key"]) == 401
            events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and not any('"error"' in event for event in events)
    path.write_text("keys: [")
    server.process.send_signal(signal.SIGHUP)
    for _ in range(500):  # each attempt is one request: the loop is bounded and paced by the server
        assert status(new["key"]) == 200 and status(OPEN["key"]) == 200
        if "kept the previous API keys" in server.log():
            break
    else:
        raise AssertionError(f"no log line for the refused file:\n{server.log()[-2000:]}")
    assert "Traceback" not in server.log()
