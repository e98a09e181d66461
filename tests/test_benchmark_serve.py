"""benchmarks/serve.py: its statistics on hand-made timings, and a whole run against a stub streaming server."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import hypercorn.asyncio
from hypercorn.config import Config
from quart import Quart, request

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import serve as serve_benchmark  # noqa: E402
import serve_stats  # noqa: E402
from serve_stats import RequestRecord, SLOs, summarize  # noqa: E402

STUB_MODEL = "stub-model"
STUB_VOCAB = 1000
STUB_ERROR = "stub rejects every fourth request"
SERVER_START_DEADLINE_S = 15.0

# Hand-made timings (binary-exact seconds, so the expected figures are exact too).
THREE_CHUNKS = RequestRecord(start_s=0.0, chunk_times_s=(0.125, 0.375, 0.625), output_tokens=3, prompt_tokens=10)
# Four tokens in two chunks: TPOT divides by tokens, ITL counts chunks.
TWO_CHUNKS_FOUR_TOKENS = RequestRecord(start_s=1.0, chunk_times_s=(1.25, 1.375), output_tokens=4, prompt_tokens=20)
ONE_TOKEN = RequestRecord(start_s=2.0, chunk_times_s=(2.5,), output_tokens=1, prompt_tokens=5)
FAILED = RequestRecord(start_s=0.5, error="HTTP 400: too long", status=400)
DONE = [THREE_CHUNKS, TWO_CHUNKS_FOUR_TOKENS, ONE_TOKEN]
DURATION_S = 4.0


def test_per_request_metrics():
    assert serve_stats.ttft_s(THREE_CHUNKS) == 0.125
    assert serve_stats.e2e_latency_s(THREE_CHUNKS) == 0.625
    assert serve_stats.tpot_s(THREE_CHUNKS) == 0.25
    assert serve_stats.inter_chunk_gaps_s(THREE_CHUNKS) == [0.25, 0.25]
    assert serve_stats.tpot_s(TWO_CHUNKS_FOUR_TOKENS) == pytest.approx(0.125 / 3)
    assert serve_stats.inter_chunk_gaps_s(TWO_CHUNKS_FOUR_TOKENS) == [0.125]


def test_one_token_output_has_no_tpot_and_no_gaps():
    assert serve_stats.tpot_s(ONE_TOKEN) is None
    assert serve_stats.inter_chunk_gaps_s(ONE_TOKEN) == []
    assert serve_stats.ttft_s(ONE_TOKEN) == serve_stats.e2e_latency_s(ONE_TOKEN) == 0.5


def test_summary_figures():
    summary = summarize(DONE, DURATION_S, SLOs(ttft_ms=600, tpot_ms=40))
    assert (summary["requests"], summary["completed"], summary["failed"]) == (3, 3, 0)
    assert (summary["prompt_tokens"], summary["output_tokens"]) == (35, 8)
    assert summary["request_throughput"] == 0.75
    assert summary["output_token_throughput"] == 2.0
    assert summary["total_token_throughput"] == 43 / 4
    # TTFT 125, 250, 500 ms; percentiles interpolate linearly between sorted values, as numpy and vLLM do.
    assert summary["ttft_ms"] == pytest.approx({"mean": 875 / 3, "p50": 250, "p90": 450, "p99": 495})
    # The 1-token request has no TPOT: only 250 and 41.67 ms count.
    tpot_fast = 125 / 3
    assert summary["tpot_ms"] == pytest.approx({"mean": (250 + tpot_fast) / 2, "p50": (250 + tpot_fast) / 2,
                                                "p90": tpot_fast + 0.9 * (250 - tpot_fast),
                                                "p99": tpot_fast + 0.99 * (250 - tpot_fast)})
    # ITL pools every gap: 250, 250 (first request) and 125 (second).
    assert summary["itl_ms"] == pytest.approx({"mean": 625 / 3, "p50": 250, "p90": 250, "p99": 250})
    assert summary["e2e_latency_ms"] == pytest.approx({"mean": 500, "p50": 500, "p90": 600, "p99": 622.5})


def test_goodput_counts_requests_meeting_every_slo():
    # Bounds are inclusive: TTFT 250 and TPOT 250 meet SLOs of 250; the third request's TTFT of 500 does not.
    assert summarize(DONE, DURATION_S, SLOs(ttft_ms=250, tpot_ms=250))["goodput"] == 2 / 4
    # A 1-token output meets any TPOT SLO; both others miss a 40 ms one.
    assert summarize(DONE, DURATION_S, SLOs(ttft_ms=600, tpot_ms=40))["goodput"] == 1 / 4


def test_failed_request_is_counted_but_excluded_from_figures():
    slos = SLOs(ttft_ms=600, tpot_ms=40)
    with_failure = summarize([*DONE, FAILED], DURATION_S, slos)
    without = summarize(DONE, DURATION_S, slos)
    assert (with_failure["requests"], with_failure["completed"], with_failure["failed"]) == (4, 3, 1)
    assert with_failure["errors"] == {"HTTP 400: too long": 1}
    unchanged = ("prompt_tokens", "output_tokens", "request_throughput", "total_token_throughput", "goodput",
                 "ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms")
    assert {key: with_failure[key] for key in unchanged} == {key: without[key] for key in unchanged}


def test_all_failed_gives_empty_distributions():
    summary = summarize([FAILED], DURATION_S, SLOs(ttft_ms=600, tpot_ms=40))
    assert summary["completed"] == 0 and summary["request_throughput"] == 0 and summary["goodput"] == 0
    assert summary["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}


def test_arrivals_are_poisson_or_all_at_once():
    rng = np.random.default_rng(0)
    assert serve_benchmark.arrival_offsets_s(3, math.inf, rng) == [0.0, 0.0, 0.0]
    offsets = serve_benchmark.arrival_offsets_s(2000, 50.0, rng)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / (len(offsets) - 1) == pytest.approx(1 / 50, rel=0.1)  # mean gap 1/rate (seeded draw)


def test_lengths_fixed_or_within_the_range_ratio():
    rng = np.random.default_rng(0)
    assert serve_benchmark.sample_lengths(500, 0.0, 4, rng) == [500] * 4
    lengths = serve_benchmark.sample_lengths(100, 0.5, 1000, rng)
    assert min(lengths) == 50 and max(lengths) == 150
    assert min(serve_benchmark.sample_lengths(1, 0.9, 100, rng)) >= 1


def test_only_chunks_with_text_count_as_output():
    assert serve_benchmark.chunk_has_output({"choices": [{"text": " a"}]})
    assert serve_benchmark.chunk_has_output({"choices": [{"delta": {"content": "a"}}]})
    assert not serve_benchmark.chunk_has_output({"choices": [{"delta": {"role": "assistant"}}]})
    assert not serve_benchmark.chunk_has_output({"choices": [{"text": "", "finish_reason": "length"}]})
    assert not serve_benchmark.chunk_has_output({"choices": [], "usage": {"completion_tokens": 3}})


def test_error_messages_from_openai_bodies_or_raw_text():
    assert serve_benchmark.error_message(b'{"error": {"message": "too long", "code": 400}}') == "too long"
    assert serve_benchmark.error_message(b"<html>Bad Request</html>") == "<html>Bad Request</html>"
    assert serve_benchmark.sse_data("data: [DONE]") == "[DONE]" and serve_benchmark.sse_data(": keep-alive") is None


def sse(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def completion_stream(max_tokens: int, prompt_tokens: int):
    """Text chunks, a finish chunk, then the usage chunk `stream_options.include_usage` asks for."""
    for index in range(max_tokens):
        yield sse({"object": "text_completion", "choices": [{"index": 0, "text": f" t{index}", "finish_reason": None}]})
    yield sse({"object": "text_completion", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    yield sse({"object": "text_completion", "choices": [],
               "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                         "total_tokens": prompt_tokens + max_tokens}})
    yield sse("[DONE]")


def chat_stream(max_tokens: int):
    """A role-only first chunk and no usage chunk, as some servers send: the client must count chunks itself."""
    yield sse({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    for index in range(max_tokens):
        yield sse({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": f" w{index}"}}]})
    yield sse({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    yield sse("[DONE]")


def is_benchmark_request(body: dict) -> bool:
    """What serve.py must send: the model, a stream with usage, ignore_eos."""
    return (body.get("model") == STUB_MODEL and body.get("stream") is True and body.get("ignore_eos") is True
            and body.get("stream_options") == {"include_usage": True})


def stub_app(fail_every: int | None) -> Quart:
    """An OpenAI-shaped streaming server; with `fail_every` k, every k-th request it receives gets a 400."""
    app = Quart(__name__)
    app.config["RESPONSE_TIMEOUT"] = None
    arrivals = itertools.count(1)

    def rejection(body: dict | None):
        if body is None or not is_benchmark_request(body):
            return {"error": {"message": f"unexpected request {body}", "code": 400}}, 400
        if fail_every and next(arrivals) % fail_every == 0:
            return {"error": {"message": STUB_ERROR, "type": "BadRequestError", "code": 400}}, 400
        return None

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": STUB_MODEL, "object": "model", "owned_by": "test"}]}

    @app.get("/version")
    async def version():
        return {"version": "stub-1"}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return {"vocab_size": STUB_VOCAB, "eos_token": "</s>"}

    @app.post("/v1/completions")
    async def completions():
        body = await request.get_json(silent=True)
        if error := rejection(body):
            return error
        prompt = body["prompt"]
        if not all(isinstance(token, int) and 0 <= token < STUB_VOCAB for token in prompt):
            return {"error": {"message": "prompt must be token ids below the vocabulary size"}}, 400
        return completion_stream(body["max_tokens"], len(prompt)), 200, {"Content-Type": "text/event-stream"}

    @app.post("/v1/chat/completions")
    async def chat():
        body = await request.get_json(silent=True)
        if error := rejection(body):
            return error
        return chat_stream(body["max_completion_tokens"]), 200, {"Content-Type": "text/event-stream"}

    return app


def wait_until_serving(url: str) -> None:
    import httpx2

    deadline = time.monotonic() + SERVER_START_DEADLINE_S
    while True:
        try:
            httpx2.get(f"{url}/v1/models", timeout=SERVER_START_DEADLINE_S).raise_for_status()
            return
        except httpx2.TransportError:
            if time.monotonic() > deadline:
                raise


@contextlib.contextmanager
def running_stub(fail_every: int | None = None) -> Iterator[str]:
    """The stub on a free 127.0.0.1 port, served by Hypercorn on its own loop in a thread; yields its base URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{listener.detach()}"]  # Hypercorn owns (and closes) the bound socket: no port race
    config.accesslog = None
    config.graceful_timeout = 1.0
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    serving = hypercorn.asyncio.serve(stub_app(fail_every), config, shutdown_trigger=stop.wait)
    thread = threading.Thread(target=loop.run_until_complete, args=(serving,), daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(url)
        yield url
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)
        loop.close()


def run_benchmark(url: str, tmp_path: Path, *flags: str) -> tuple[dict, str]:
    """serve.py in a subprocess, as a user runs it; its JSON report and its stdout."""
    out = tmp_path / "serve.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(BENCHMARKS / "serve.py"), "--base-url", url, "--out", str(out), *flags],
                          capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    return json.loads(out.read_text()), done.stdout


def assert_completed_requests_got_their_lengths(scenario: dict) -> None:
    completed = [row for row in scenario["per_request"] if row["error"] is None]
    assert len(completed) == scenario["completed"]
    for row in completed:
        assert row["output_tokens"] == row["requested_output_tokens"]
        assert row["prompt_tokens"] == row["requested_prompt_tokens"]
    assert scenario["output_tokens"] == sum(row["requested_output_tokens"] for row in completed)


@pytest.mark.slow
def test_completions_concurrency_sweep_end_to_end(tmp_path):
    plot = tmp_path / "latency.png"
    with running_stub(fail_every=4) as url:
        report, stdout = run_benchmark(url, tmp_path, "--concurrency-sweep", "1,4", "--num-prompts", "8",
                                       "--input-len", "16", "--output-len", "6", "--random-range-ratio", "0.5",
                                       "--plot", str(plot))
    assert report["server"] == {"base_url": url, "model": STUB_MODEL, "version": {"version": "stub-1"}}
    assert "platform" in report["machine"]
    scenarios = report["scenarios"]
    assert [s["max_concurrency"] for s in scenarios] == [1, 4]
    for scenario in scenarios:
        # The untimed check request is the stub's 1st; each scenario then holds 2 of every 4th of its 8 requests.
        assert (scenario["requests"], scenario["completed"], scenario["failed"]) == (8, 6, 2)
        assert scenario["errors"] == {f"HTTP 400: {STUB_ERROR}": 2}
        assert scenario["request_rate"] == "inf"
        assert_completed_requests_got_their_lengths(scenario)
        assert scenario["ttft_ms"]["p50"] > 0 and scenario["tpot_ms"]["p99"] > 0
    assert plot.read_bytes().startswith(b"\x89PNG")
    table = stdout.strip().splitlines()
    assert table[-3].split()[:2] == ["rate", "conc"] and len(table[-2:]) == 2


@pytest.mark.slow
def test_chat_poisson_arrivals_end_to_end(tmp_path):
    with running_stub() as url:
        report, _ = run_benchmark(url, tmp_path, "--endpoint", "chat", "--request-rate", "200,inf",
                                  "--max-concurrency", "3", "--num-prompts", "6", "--input-len", "12",
                                  "--output-len", "5")
    assert report["settings"]["request_rate"] == [200.0, "inf"]
    assert [(s["request_rate"], s["max_concurrency"]) for s in report["scenarios"]] == [(200.0, 3), ("inf", 3)]
    for scenario in report["scenarios"]:
        assert (scenario["completed"], scenario["failed"]) == (6, 0)
        # No usage chunk from this stub: output tokens are counted chunks, the role-only chunk not among them.
        assert_completed_requests_got_their_lengths(scenario)


@pytest.mark.slow
def test_serve_overhead_runs_both_sides_and_they_agree(tmp_path):
    """serve_overhead.py on a few short prompts: the real server and the offline LLM, their texts compared."""
    out = tmp_path / "overhead.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "serve_overhead.py"), "--num-prompts", "2", "--input-len",
                           "8", "--output-len", "4", "--rounds", "1", "--concurrency", "1,2", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert [level["concurrency"] for level in report["levels"]] == [1, 2]
    for level in report["levels"]:
        assert level["check"] == {"prompts": 2, "agree": 2, "mismatched_prompts": [], "first_mismatch": None}
        assert level["http"]["serve_stats"]["output_tokens"] == level["http"]["serve_stats"]["completed"] * 4 == 8
        assert level["http"]["serve_stats"]["ttft_ms"]["p50"] > 0 and level["offline"]["output_tokens_per_s"] > 0
        assert all(ratio > 0 for ratio in level["ratio_http_over_offline"].values())
    assert done.stdout.strip().splitlines()[-1].split()[1:4] == ["http", "/", "offline"]
