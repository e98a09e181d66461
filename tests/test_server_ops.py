"""The server's operations, live: /metrics, the profiler routes, /openapi.json, admission control, many clients
leaving mid-stream, and the SIGTERM drain. Each server is the real `jaxserve serve` in a subprocess."""

import asyncio
import concurrent.futures
import json
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.live_server import running_server

pytestmark = pytest.mark.slow

CLIENT_TIMEOUT_S = 120  # generous: a stalled server fails the test rather than hanging it
SCRAPE_ATTEMPTS = 2000  # bounds the loops that wait for the server to catch up (each attempt is one request)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    with running_server(tmp, "--profile-dir", str(tmp / "profiles")) as live:
        yield live


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    """Admits only what the engine runs at once (max_num_seqs 4 in configs/tiny-cpu.yaml), queues nothing."""
    with running_server(tmp_path_factory.mktemp("small"), "--max-waiting-requests", "0") as live:
        yield live


# --- helpers ------------------------------------------------------------------------------------------------------


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by (sample name, sorted labels)."""
    response = httpx.get(base_url + "/metrics", timeout=CLIENT_TIMEOUT_S)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def post(live, route: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(live.base_url + route, json=body, timeout=CLIENT_TIMEOUT_S)


def completion_body(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}


async def sse_payloads(lines):
    """The JSON events of an SSE stream, then the string "[DONE]"."""
    async for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


async def read_stream(response: httpx.Response) -> list:
    return [payload async for payload in sse_payloads(response.aiter_lines())]


def streamed_usage(payloads: list) -> dict:
    """The usage event's counts, after checking that the stream ended properly."""
    assert payloads[-1] == "[DONE]", payloads[-3:]
    usage_events = [p for p in payloads[:-1] if p.get("usage")]
    assert len(usage_events) == 1 and not any("error" in p for p in payloads[:-1]), payloads[-3:]
    return usage_events[0]["usage"]


def streamed_tokens(payloads: list) -> int:
    return streamed_usage(payloads)["completion_tokens"]


def async_client(base_url: str, connections: int = 16) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url, timeout=CLIENT_TIMEOUT_S,
                             limits=httpx.Limits(max_connections=connections))


# --- metrics, profiler, OpenAPI -----------------------------------------------------------------------------------


ENGINE_SERIES = ["jaxserve:num_requests_running", "jaxserve:num_requests_waiting", "jaxserve:kv_pages_used",
                 "jaxserve:kv_pages_cached", "jaxserve:kv_pages_free", "jaxserve:kv_cache_usage_perc",
                 "jaxserve:prefix_cache_hit_rate", "jaxserve:prefix_cache_queries_total",
                 "jaxserve:prefix_cache_hits_total", "jaxserve:num_preemptions_total",
                 "jaxserve:num_engine_steps_total"]


def test_metrics_parse_and_move_with_streaming_and_plain_completions(server):
    before = scrape(server.base_url)
    for name in ENGINE_SERIES:
        assert (name, ()) in before, name
    plain = post(server, "/v1/completions", completion_body("metrics, plain", 5, False)).json()["usage"]

    async def streamed():
        async with async_client(server.base_url) as client:
            body = completion_body("metrics, streamed", 7, True)
            async with client.stream("POST", "/v1/completions", json=body) as r:
                return streamed_usage(await read_stream(r))

    stream = asyncio.run(streamed())
    after = scrape(server.base_url)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("jaxserve:prompt_tokens_total") == plain["prompt_tokens"] + stream["prompt_tokens"]
    assert moved("jaxserve:generation_tokens_total") == 5 + 7
    assert moved("jaxserve:request_success_total", finished_reason="length") == 2
    assert moved("jaxserve:time_to_first_token_seconds_count") == 2
    assert moved("jaxserve:e2e_request_latency_seconds_count") == 2
    assert moved("jaxserve:inter_token_latency_seconds_count") == (5 - 1) + (7 - 1)
    assert moved("jaxserve:e2e_request_latency_seconds_bucket", le="+Inf") == 2
    assert value(after, "jaxserve:prefix_cache_queries_total") > value(before, "jaxserve:prefix_cache_queries_total")
    assert value(after, "jaxserve:kv_pages_used") == 0


def test_metrics_cover_chat_completions(server):
    before = scrape(server.base_url)
    response = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                                                      "max_tokens": 4, "ignore_eos": True})
    assert response.status_code == 200, response.text
    after = scrape(server.base_url)
    assert value(after, "jaxserve:generation_tokens_total") - value(before, "jaxserve:generation_tokens_total") == 4
    assert (value(after, "jaxserve:time_to_first_token_seconds_count")
            - value(before, "jaxserve:time_to_first_token_seconds_count")) == 1


def test_profiler_routes_write_a_trace(server):
    started = post(server, "/start_profile")
    assert started.status_code == 200, started.text
    again = post(server, "/start_profile")
    assert again.status_code == 409 and again.json()["error"]["message"]
    assert post(server, "/v1/completions", completion_body("profiled", 3, False)).status_code == 200
    stopped = post(server, "/stop_profile")
    assert stopped.status_code == 200, stopped.text
    assert list(Path(stopped.json()["profile_dir"]).rglob("*.xplane.pb")), "no trace written"
    assert post(server, "/stop_profile").status_code == 409


def test_profiler_routes_are_404_without_a_profile_dir(small_server):
    for route in ("/start_profile", "/stop_profile"):
        response = post(small_server, route)
        assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def test_openapi_lists_every_route_of_the_app(tiny_llm):
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.app import create_app
    from jaxserve.server.context import ServerContext
    from jaxserve.server.config import ServerConfig
    from jaxserve.server.openapi import openapi_path

    context = ServerContext(engine=AsyncEngine(tiny_llm.engine), tokenizer=tiny_llm.tokenizer, config=ServerConfig(),
                            max_model_len=tiny_llm.max_model_len, vocab_size=tiny_llm.model.config.vocab_size)
    app = create_app(context)

    async def fetch():
        return await (await app.test_client().get("/openapi.json")).get_json()

    document = asyncio.run(fetch())
    assert document["openapi"].startswith("3.1")
    routes = {(openapi_path(rule), method.lower()) for rule in app.url_map.iter_rules()
              for method in rule.methods - {"HEAD", "OPTIONS"}}
    listed = {(path, method) for path, operations in document["paths"].items() for method in operations}
    assert routes == listed
    assert {"/v1/completions", "/metrics", "/health", "/openapi.json", "/start_profile"} <= set(document["paths"])
    # Bodies and answers are the declared models, not "any object".
    completions = document["paths"]["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequestBody"}
    assert completions["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionResponse"}
    body = document["components"]["schemas"]["ChatCompletionRequestBody"]
    assert body["additionalProperties"] is False and "messages" in body["required"]
    assert body["properties"]["functions"]["x-jaxserve-refused"]


def test_several_served_names_are_listed_and_accepted(tiny_llm):
    from jaxserve.engine.async_engine import AsyncEngine
    from jaxserve.server.app import create_app
    from jaxserve.server.context import ServerContext
    from jaxserve.server.config import ServerConfig

    context = ServerContext(engine=AsyncEngine(tiny_llm.engine), tokenizer=tiny_llm.tokenizer,
                            config=ServerConfig(served_model_names=("llama", "llama-8b")),
                            max_model_len=tiny_llm.max_model_len, vocab_size=tiny_llm.model.config.vocab_size)

    async def fetch():
        client = create_app(context).test_client()
        listed = await (await client.get("/v1/models")).get_json()
        one, other = await client.get("/v1/models/llama-8b"), await client.get("/v1/models/gpt-9")
        return listed, await one.get_json(), other.status_code

    listed, one, other = asyncio.run(fetch())
    assert [card["id"] for card in listed["data"]] == ["llama", "llama-8b"]
    assert one["id"] == "llama-8b" and other == 404


def test_openapi_is_served(server):
    document = httpx.get(server.base_url + "/openapi.json", timeout=CLIENT_TIMEOUT_S).json()
    assert "post" in document["paths"]["/v1/completions"] and "get" in document["paths"]["/metrics"]
    # The start-up log says what runs, without JAX's TPU probe, and its progress bars all end full.
    log = server.log()
    assert "serving builtin (builtin) in float32" in log and "libtpu" not in log
    assert log.splitlines()[0].endswith("starting: the built-in model; loading the model, then compiling its step "
                                         "programs")
    # Programs a program store holds are not lowered: the lowering bar counts the others, and is left out when none.
    lowering = re.search(r"lower (\d+) step programs", log)
    for verb in ("lower", "compile") if lowering else ("compile",):
        bar = re.search(rf"{verb} (\d+) step programs: 100%\|[^|]*\| (\d+)/(\d+)", log)
        assert bar is not None and bar[1] == bar[2] == bar[3], log[:3000]


# --- the event loop stays free ---------------------------------------------------------------------------------

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # `server` runs with the default --max-body-bytes


def _maximal_bodies() -> list[tuple[str, bytes]]:
    """Text prompts as large as the server takes, which used to be tokenized whole on the event loop (a 7 MB prompt
    stalled /health for 5 s). (A body of a quarter-million tiny JSON objects still holds the interpreter for as long
    as parsing it takes, ~80 ms on a 2-core CPU: test_a_flood_of_messages_is_refused_before_validation.)"""
    text = json.dumps({"prompt": "word " * ((DEFAULT_MAX_BODY_BYTES - 1024) // 5)}).encode()
    return [("/v1/completions", text), ("/tokenize", text)]


def test_a_flood_of_messages_is_refused_before_validation(server):
    message = {"role": "user", "content": "x"}
    count = (DEFAULT_MAX_BODY_BYTES - 1024) // (len(json.dumps(message)) + 2)
    answer = post(server, "/v1/chat/completions", {"messages": [message] * count})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
    assert f"messages holds {count} items" in answer.json()["error"]["message"]


# The stall this guards against lasted 5 s; parsing a maximal body legitimately holds the interpreter ~80 ms on a
# 2-core CPU, and a loaded CI machine adds its own pauses (130 ms seen once), so the bound sits well between.
HEALTH_LATENCY_BOUND_S = 0.5


def test_health_answers_within_half_a_second_while_maximal_bodies_are_processed(server):
    def send(path: str, body: bytes) -> httpx.Response:
        return httpx.post(server.base_url + path, content=body, headers={"Content-Type": "application/json"},
                          timeout=CLIENT_TIMEOUT_S)

    with httpx.Client(base_url=server.base_url, timeout=CLIENT_TIMEOUT_S) as health, \
            concurrent.futures.ThreadPoolExecutor(2) as senders:
        health.get("/health")  # connected before the bodies start
        sent = [senders.submit(send, path, body) for path, body in _maximal_bodies()]
        latencies = []
        while not all(future.done() for future in sent):
            start = time.perf_counter()
            assert health.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
        answers = [future.result() for future in sent]
    assert [answer.status_code for answer in answers] == [400, 400]
    assert [answer.json()["error"]["param"] for answer in answers] == ["prompt", "prompt"]
    assert len(latencies) >= 3 and max(latencies) < HEALTH_LATENCY_BOUND_S, latencies


# --- admission, disconnects, drain --------------------------------------------------------------------------------


def test_beyond_capacity_requests_get_503_with_retry_after(small_server):
    async def one(client, i):
        async with client.stream("POST", "/v1/completions", json=completion_body(f"flood {i}", 48, True)) as r:
            if r.status_code != 200:
                return r.status_code, r.headers.get("retry-after"), json.loads(await r.aread())
            return r.status_code, None, streamed_tokens(await read_stream(r))

    async def flood():
        async with async_client(small_server.base_url, connections=32) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    before = scrape(small_server.base_url)
    results = asyncio.run(flood())
    served = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 503]
    assert served and refused and len(served) + len(refused) == len(results), [r[:2] for r in results]
    assert all(tokens == 48 for _, _, tokens in served)
    for _, retry_after, body in refused:
        assert int(retry_after) >= 1 and body["error"]["type"] == "service_unavailable"
    moved = (value(scrape(small_server.base_url), "jaxserve:num_requests_rejected_total", reason="overloaded")
             - value(before, "jaxserve:num_requests_rejected_total", reason="overloaded"))
    assert moved == len(refused)


NUM_CLIENTS = 128
LEAVER_EVERY = 5  # every fifth client leaves after its first chunk: 26 of 128, about 20%
FINISHER_TOKENS = 16
LEAVER_TOKENS = 400  # far more than a leaver gets before its abort lands
MAX_NUM_SEQS = 4  # configs/tiny-cpu.yaml: sequences per engine step


def test_many_streaming_clients_some_leaving_mid_stream(server):
    async def finisher(client, i):
        async with client.stream("POST", "/v1/completions",
                                 json=completion_body(f"client {i} stays", FINISHER_TOKENS, True)) as r:
            assert r.status_code == 200
            return streamed_tokens(await read_stream(r))

    async def leaver(client, i):
        async with client.stream("POST", "/v1/completions",
                                 json=completion_body(f"client {i} leaves", LEAVER_TOKENS, True)) as r:
            assert r.status_code == 200
            await anext(sse_payloads(r.aiter_lines()))
        return None  # leaving the block closes the connection mid-stream

    async def load():
        async with async_client(server.base_url, connections=NUM_CLIENTS) as client:
            return await asyncio.gather(*((leaver if i % LEAVER_EVERY == 0 else finisher)(client, i)
                                          for i in range(NUM_CLIENTS)))

    before = scrape(server.base_url)
    results = asyncio.run(load())
    num_leavers = len(range(0, NUM_CLIENTS, LEAVER_EVERY))
    assert [r for r in results if r is not None] == [FINISHER_TOKENS] * (NUM_CLIENTS - num_leavers)

    def settled(samples):
        aborted = (value(samples, "jaxserve:request_success_total", finished_reason="abort")
                   - value(before, "jaxserve:request_success_total", finished_reason="abort"))
        return value(samples, "jaxserve:kv_pages_used") == 0 and aborted == num_leavers

    # The server notices each departure on its own schedule: scrape until every abort has freed its pages.
    samples = next((s for s in (scrape(server.base_url) for _ in range(SCRAPE_ATTEMPTS)) if settled(s)), None)
    assert samples is not None, "pages still used or aborts missing after the clients left"
    assert value(samples, "jaxserve:num_requests_running") == value(samples, "jaxserve:num_requests_waiting") == 0
    # Had the leavers run to their end, their tokens alone would have taken this many steps: they were cut short.
    steps = value(samples, "jaxserve:num_engine_steps_total") - value(before, "jaxserve:num_engine_steps_total")
    assert steps < num_leavers * LEAVER_TOKENS / MAX_NUM_SEQS
    log = server.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-4000:]


def test_sigterm_drains_in_flight_streams_then_exits_0(tmp_path):
    async def drain(live):
        async with async_client(live.base_url) as client:
            async with client.stream("POST", "/v1/completions", json=completion_body("a long one", 300, True)) as r:
                payloads = sse_payloads(r.aiter_lines())
                first = await anext(payloads)
                live.process.send_signal(signal.SIGTERM)
                # The signal is handled on the server's event loop: /health fails from then on.
                for _ in range(SCRAPE_ATTEMPTS):
                    health = await client.get("/health")
                    if health.status_code == 503:
                        break
                refused = await client.post("/v1/completions", json=completion_body("too late", 2, False))
                rest = [payload async for payload in payloads]
        return health, refused, [first, *rest]

    with running_server(tmp_path) as live:
        health, refused, payloads = asyncio.run(drain(live))
        exit_code = live.process.wait(timeout=CLIENT_TIMEOUT_S)
    assert health.status_code == 503
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "service_unavailable"
    assert streamed_tokens(payloads) == 300
    assert exit_code == 0
    assert "Traceback" not in live.log(), live.log()[-4000:]


def test_sigterm_past_the_drain_timeout_ends_streams_with_an_error_and_exits_0(tmp_path):
    async def cut(live):
        async with async_client(live.base_url) as client:
            async with client.stream("POST", "/v1/completions", json=completion_body("cut short", 400, True)) as r:
                payloads = sse_payloads(r.aiter_lines())
                await anext(payloads)
                live.process.send_signal(signal.SIGTERM)
                return [payload async for payload in payloads]

    with running_server(tmp_path, "--drain-timeout", "0") as live:
        payloads = asyncio.run(cut(live))
        exit_code = live.process.wait(timeout=CLIENT_TIMEOUT_S)
    assert payloads[-1] == "[DONE]" and payloads[-2]["error"]["type"] == "service_unavailable", payloads[-3:]
    assert exit_code == 0
    assert "Traceback" not in live.log(), live.log()[-4000:]
