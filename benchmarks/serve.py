"""Online serving benchmark: latency and throughput of any OpenAI-compatible server, driven over HTTP.

Each scenario sends `--num-prompts` streamed requests (`stream: true`, usage in the last chunk) to
`/v1/completions` or `/v1/chat/completions` and times every output chunk as it arrives. Requests arrive as a
Poisson process of `--request-rate` requests/s (`inf`: all at once) and at most `--max-concurrency` are in flight
at a time. `--concurrency-sweep 1,32,100,200` runs one scenario per concurrency level; a comma list of request
rates runs one scenario per rate. Figures follow vLLM's serving benchmark (see `serve_stats.py`): TTFT, TPOT,
ITL and end-to-end latency (mean, p50, p90, p99), request / output-token / total-token throughput, and goodput
(requests/s meeting `--slo-ttft-ms` and `--slo-tpot-ms`); `--metric-percentiles` picks the percentiles. Failed
requests are counted, with their error messages, and left out of the latency figures. With `--duration-s` a
scenario sends no new request once that many seconds have passed (the ones in flight finish): at most
`--num-prompts`, at most that long.

Prompts need no tokenizer on the client: on /v1/completions each prompt is a list of random token ids (the
vocabulary size comes from `--tokenizer-vocab-size` or the server's `GET /tokenizer_info`), so its length is exact;
on chat each prompt is random common English words, about one token each. Every scenario draws fresh prompts from
(`--seed`, scenario index), so a prefix cache cannot reuse one scenario's prompts in the next. With `--ignore-eos`
(the default) every request generates exactly its output length. Lengths are fixed (`--input-len`, `--output-len`)
or uniform within ±`--random-range-ratio` of them. One untimed request checks the server before the first scenario.

    python benchmarks/serve.py --model llama --num-prompts 200 --concurrency-sweep 1,32,100,200 \\
        --out serve.json --plot serve.png
    python benchmarks/serve.py --endpoint chat --request-rate 1,4,16,inf --random-range-ratio 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from serve_stats import PERCENTILES, SLOs, RequestRecord, summarize

# The benchmark often runs on the server's own GPU host: JAX (imported only to describe the machine) must not
# preallocate GPU memory there.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
from bench_machine import machine_description  # noqa: E402

ENDPOINT_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Short, common words: each is one token in Llama-family vocabularies, so a chat prompt's length in words is
# close to its length in tokens.
PROMPT_WORDS = (
    "the be to of and a in that have it for not on with he as you do at this but his by from they we say her she "
    "or an will my one all would there their what so up out if about who get which go me when make can like time no "
    "just him know take people into year your good some could them see other than then now look only come its over "
    "think also back after use two how our work first well way even new want because any these give day most us"
).split()
SSE_DONE = "[DONE]"
CONNECT_TIMEOUT_S = 30.0
ERROR_MESSAGE_CHARS = 300  # failures are tallied by message: keep echoed request bodies from bloating the report


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One load level: how requests arrive and how many may be in flight."""

    request_rate: float  # mean arrivals per second of a Poisson process; inf sends every request at once
    max_concurrency: int | None  # requests in flight at most; None for no limit


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request to send: its prompt and the lengths it asks for."""

    prompt: list[int] | str  # token ids (completions) or text (chat)
    prompt_len: int  # tokens in `prompt` (words for a chat prompt)
    output_len: int  # max_tokens asked for


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """What the benchmark learns from the server before sending load."""

    model: str
    version: Any  # GET /version's JSON, None where the server does not answer it
    vocab_size: int | None  # needed only for token-id prompts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to benchmark")
    parser.add_argument("--model", default=None, help="model name to send (default: the first id of GET /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    parser.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="completions")
    parser.add_argument("--input-len", type=int, default=500, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=200, help="max_tokens per request")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="draw lengths uniformly in [len*(1-R), len*(1+R)] instead of fixed ones")
    parser.add_argument("--num-prompts", type=int, default=200, help="requests per scenario")
    parser.add_argument("--request-rate", type=parse_rates, default=[math.inf],
                        help="Poisson arrival rate(s) in requests/s, comma separated; inf sends all at once")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--concurrency-sweep", type=parse_levels, default=None,
                        help="comma-separated max-concurrency levels, one scenario each (e.g. 1,32,100,200)")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="send ignore_eos so every output has the asked length")
    parser.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrival times")
    parser.add_argument("--slo-ttft-ms", type=float, default=600.0, help="goodput: TTFT at most this")
    parser.add_argument("--slo-tpot-ms", type=float, default=40.0, help="goodput: TPOT at most this")
    parser.add_argument("--duration-s", type=float, default=None,
                        help="stop sending a scenario's requests after this many seconds (those in flight finish)")
    parser.add_argument("--metric-percentiles", type=parse_percentiles, default=list(PERCENTILES),
                        help="comma-separated latency percentiles to report (default 50,90,99)")
    parser.add_argument("--tokenizer-vocab-size", type=int, default=None,
                        help="token ids are drawn below this (default: vocab_size from GET /tokenizer_info)")
    parser.add_argument("--out", type=Path, default=None, help="write every figure as JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of TTFT and TPOT against load here")
    args = parser.parse_args()
    if args.concurrency_sweep and (args.max_concurrency is not None or len(args.request_rate) > 1):
        parser.error("--concurrency-sweep sweeps one request rate; drop --max-concurrency or the rate list")
    if args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")
    if not 0.0 <= args.random_range_ratio < 1.0:
        parser.error("--random-range-ratio must be in [0, 1)")
    return args


def parse_rates(text: str) -> list[float]:
    rates = [float(part) for part in text.split(",")]
    if any(rate <= 0 for rate in rates):
        raise argparse.ArgumentTypeError("request rates must be positive")
    return rates


def parse_percentiles(text: str) -> list[float]:
    percentiles = [float(part) for part in text.split(",")]
    if any(not 0 <= p <= 100 for p in percentiles):
        raise argparse.ArgumentTypeError("percentiles must be in [0, 100]")
    return sorted(percentiles)


def parse_levels(text: str) -> list[int]:
    levels = [int(part) for part in text.split(",")]
    if any(level < 1 for level in levels):
        raise argparse.ArgumentTypeError("concurrency levels must be at least 1")
    return levels


def scenarios_from_args(args: argparse.Namespace) -> list[Scenario]:
    if args.concurrency_sweep:
        return [Scenario(args.request_rate[0], level) for level in args.concurrency_sweep]
    return [Scenario(rate, args.max_concurrency) for rate in args.request_rate]


def sample_lengths(length: int, range_ratio: float, count: int, rng: np.random.Generator) -> list[int]:
    low = max(1, int(length * (1 - range_ratio)))
    high = max(low, int(length * (1 + range_ratio)))
    return rng.integers(low, high, size=count, endpoint=True).tolist()


def random_token_prompt(length: int, vocab_size: int, rng: np.random.Generator) -> list[int]:
    return rng.integers(0, vocab_size, size=length).tolist()


def random_word_prompt(length: int, rng: np.random.Generator) -> str:
    return " ".join(rng.choice(PROMPT_WORDS, size=length).tolist())


def build_requests(args: argparse.Namespace, count: int, vocab_size: int | None,
                   rng: np.random.Generator) -> list[RequestSpec]:
    input_lens = sample_lengths(args.input_len, args.random_range_ratio, count, rng)
    output_lens = sample_lengths(args.output_len, args.random_range_ratio, count, rng)
    specs = []
    for input_len, output_len in zip(input_lens, output_lens):
        if args.endpoint == "chat":
            prompt: list[int] | str = random_word_prompt(input_len, rng)
        else:
            prompt = random_token_prompt(input_len, vocab_size, rng)
        specs.append(RequestSpec(prompt, input_len, output_len))
    return specs


def request_body(spec: RequestSpec, model: str, endpoint: str, ignore_eos: bool) -> dict[str, Any]:
    """A streamed, greedy request; the usage chunk gives exact token counts."""
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                            "temperature": 0.0}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        body["max_completion_tokens"] = spec.output_len
    else:
        body["prompt"] = spec.prompt
        body["max_tokens"] = spec.output_len
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def arrival_offsets_s(count: int, rate: float, rng: np.random.Generator) -> list[float]:
    """Send times after the scenario's start: a Poisson process (exponential gaps, the first request at 0), or all
    at 0 for rate inf."""
    if math.isinf(rate):
        return [0.0] * count
    gaps = rng.exponential(1.0 / rate, size=count - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def sse_data(line: str) -> str | None:
    """The payload of an SSE `data:` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    return line[len("data:"):].strip()


def chunk_has_output(chunk: dict[str, Any]) -> bool:
    """Whether a streamed chunk carries output text (the usage-only and finish-only chunks do not)."""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content"):
            return True
    return False


def error_message(body: bytes | str) -> str:
    """The message of an OpenAI-style error body (`{"error": {"message": ...}}`), or the body's start."""
    try:
        payload = json.loads(body)
        error = payload.get("error", payload)
        message = str(error.get("message", error) if isinstance(error, dict) else error)
    except (ValueError, AttributeError):
        message = body if isinstance(body, str) else body.decode(errors="replace")
    return message[:ERROR_MESSAGE_CHARS]


async def read_stream(response: httpx.Response, start_s: float, spec: RequestSpec) -> RequestRecord:
    chunk_times: list[float] = []
    usage: dict[str, Any] = {}
    async for line in response.aiter_lines():
        arrived_s = time.perf_counter()
        data = sse_data(line)
        if not data:
            continue
        if data == SSE_DONE:
            break
        chunk = json.loads(data)
        if not isinstance(chunk, dict) or "error" in chunk:
            return RequestRecord(start_s, error=f"error in stream: {error_message(data)}", status=response.status_code)
        if chunk_has_output(chunk):
            chunk_times.append(arrived_s)
        usage = chunk.get("usage") or usage
    else:
        return RequestRecord(start_s, error=f"stream ended before {SSE_DONE}", status=response.status_code)
    if not chunk_times:
        return RequestRecord(start_s, error="no output chunk in the stream", status=response.status_code)
    return RequestRecord(start_s, tuple(chunk_times), usage.get("completion_tokens") or len(chunk_times),
                         usage.get("prompt_tokens") or spec.prompt_len, status=response.status_code)


async def send_request(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                       spec: RequestSpec) -> RequestRecord:
    start_s = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                message = error_message(await response.aread())
                return RequestRecord(start_s, error=f"HTTP {response.status_code}: {message}",
                                     status=response.status_code)
            return await read_stream(response, start_s, spec)
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: a chunk that is not JSON
        return RequestRecord(start_s, error=f"{type(exc).__name__}: {exc}")


async def run_scenario(client: httpx.AsyncClient, args: argparse.Namespace, server: ServerInfo,
                       scenario: Scenario, specs: list[RequestSpec], rng: np.random.Generator,
                       duration_s: float | None = None) -> tuple[list[RequestRecord], float]:
    """Send every request on its arrival schedule; the records, and the seconds from first send to last reply.

    With `duration_s`, a request whose turn (its arrival, then a free concurrency slot) comes later than that after
    the start is not sent. Turns come in the specs' order (the semaphore wakes its waiters first in, first out), so
    the records are those of the first len(records) specs.
    """
    path = ENDPOINT_PATHS[args.endpoint]
    limit = asyncio.Semaphore(scenario.max_concurrency or len(specs))
    start = time.perf_counter()
    deadline = math.inf if duration_s is None else start + duration_s

    async def limited(spec: RequestSpec) -> RequestRecord | None:
        async with limit:
            if time.perf_counter() > deadline:
                return None
            return await send_request(client, path, request_body(spec, server.model, args.endpoint,
                                                                 args.ignore_eos), spec)

    tasks = []
    for spec, offset in zip(specs, arrival_offsets_s(len(specs), scenario.request_rate, rng)):
        if start + offset > deadline:
            break
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(limited(spec)))
    records = await asyncio.gather(*tasks)
    return [record for record in records if record is not None], time.perf_counter() - start


async def get_json(client: httpx.AsyncClient, path: str) -> Any:
    """The JSON of a GET, or None where the server does not answer it."""
    try:
        response = await client.get(path)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):  # ValueError: a page that is not JSON
        return None


async def discover_server(client: httpx.AsyncClient, args: argparse.Namespace) -> ServerInfo:
    model = args.model
    if model is None:
        models = await get_json(client, "/v1/models")
        if not models or not models.get("data"):
            raise SystemExit(f"GET {args.base_url}/v1/models gave no model (is the server up?); pass --model")
        model = models["data"][0]["id"]
    vocab_size = args.tokenizer_vocab_size
    if vocab_size is None and args.endpoint == "completions":
        vocab_size = (await get_json(client, "/tokenizer_info") or {}).get("vocab_size")
        if vocab_size is None:
            raise SystemExit("GET /tokenizer_info gave no vocab_size: pass --tokenizer-vocab-size for token-id prompts")
    return ServerInfo(model, await get_json(client, "/version"), vocab_size)


async def check_server(client: httpx.AsyncClient, args: argparse.Namespace, server: ServerInfo) -> None:
    """One untimed request, so that a misconfigured run stops with the server's message before any scenario."""
    # Its own seed stream (scenarios use [seed, index]): its prompt must not prime a prefix cache for them.
    spec = build_requests(args, 1, server.vocab_size, np.random.default_rng([args.seed, 2**32 - 1]))[0]
    record = await send_request(client, ENDPOINT_PATHS[args.endpoint],
                                request_body(spec, server.model, args.endpoint, args.ignore_eos), spec)
    if not record.succeeded:
        raise SystemExit(f"the first request to {args.base_url} failed: {record.error}")


def request_rows(specs: list[RequestSpec], records: list[RequestRecord]) -> list[dict[str, Any]]:
    """Per-request lengths and outcome, for the JSON (chunk times are left out: they are the bulk of the data)."""
    first_send_s = min(record.start_s for record in records)
    return [{"sent_at_s": record.start_s - first_send_s, "requested_prompt_tokens": spec.prompt_len,
             "requested_output_tokens": spec.output_len, "prompt_tokens": record.prompt_tokens,
             "output_tokens": record.output_tokens, "output_chunks": len(record.chunk_times_s),
             "status": record.status, "error": record.error}
            for spec, record in zip(specs, records)]


async def run_benchmark(args: argparse.Namespace) -> tuple[ServerInfo, list[dict[str, Any]]]:
    scenarios = scenarios_from_args(args)
    pool = max(s.max_concurrency or args.num_prompts for s in scenarios)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # Streams may legitimately stay silent for long (a deep queue): no read or pool timeout.
    timeout = httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=None, write=CONNECT_TIMEOUT_S, pool=None)
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    slos = SLOs(args.slo_ttft_ms, args.slo_tpot_ms)
    results = []
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=timeout, limits=limits) as client:
        server = await discover_server(client, args)
        await check_server(client, args, server)
        for index, scenario in enumerate(scenarios):
            rng = np.random.default_rng([args.seed, index])
            specs = build_requests(args, args.num_prompts, server.vocab_size, rng)
            records, duration_s = await run_scenario(client, args, server, scenario, specs, rng, args.duration_s)
            specs = specs[:len(records)]
            summary = summarize(records, duration_s, slos, args.metric_percentiles)
            results.append({**dataclasses.asdict(scenario), **summary,
                            "per_request": request_rows(specs, records)})
            print(f"{describe(scenario)}: {summary['completed']}/{summary['requests']} completed in "
                  f"{duration_s:.1f} s", flush=True)
            for message, count in summary["errors"].items():
                print(f"    {count} failed: {message}", flush=True)
    return server, results


def describe(scenario: Scenario) -> str:
    return f"rate {scenario.request_rate:g} req/s, max concurrency {scenario.max_concurrency or 'unlimited'}"


def load_axis(args: argparse.Namespace, results: list[dict[str, Any]]) -> tuple[str, list[float]]:
    """What the load varies by across scenarios: concurrency levels, or request rates."""
    if args.concurrency_sweep:
        return "max concurrency", [r["max_concurrency"] for r in results]
    return "request rate (req/s)", [r["request_rate"] for r in results]


def plot_latency(results: list[dict[str, Any]], axis: tuple[str, list[float]], title: str, path: Path) -> None:
    """TTFT and TPOT at the lowest and highest percentile reported (p50, p99 by default) against load, one panel
    each."""
    import matplotlib  # here, not at the top: only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label, loads = axis
    # An infinite rate has no place on a numeric axis: then scenarios stand at even steps, labelled.
    positions = loads if all(math.isfinite(x) for x in loads) else list(range(len(loads)))
    figure, panels = plt.subplots(1, 2, figsize=(11, 4.5))
    for panel, metric, name in zip(panels, ("ttft_ms", "tpot_ms"), ("TTFT", "TPOT")):
        for percentile, style in zip(percentile_extremes(results), ("o-", "s--")):
            values = [r[metric][percentile] for r in results]
            panel.plot(positions, [math.nan if v is None else v for v in values], style, label=percentile)
        panel.set_xticks(positions, [f"{x:g}" for x in loads])
        panel.set(xlabel=label, ylabel=f"{name} (ms)", title=name)
        panel.grid(alpha=0.3)
        panel.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def percentile_extremes(results: list[dict[str, Any]]) -> list[str]:
    """The lowest and highest percentile the figures carry ("p50", "p99" by default): the ones table and plot show."""
    keys = [key for key in results[0]["ttft_ms"] if key != "mean"]
    return list(dict.fromkeys((keys[0], keys[-1])))


def format_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per scenario: outcome counts, throughputs, and latency at the extreme percentiles (p50/p99) in ms."""
    latency_columns = [(metric, p) for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms")
                       for p in percentile_extremes(results)]
    latency_header = " ".join(f"{metric.split('_')[0].upper() + ' ' + p:>10}" for metric, p in latency_columns)
    lines = [f"{'rate':>6} {'conc':>5} {'ok':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>10} {'tot tok/s':>10} "
             f"{'goodput':>7} {latency_header}"]
    for r in results:
        latencies = " ".join(f"{format_ms(r[metric][p]):>10}" for metric, p in latency_columns)
        lines.append(f"{r['request_rate']:>6g} {r['max_concurrency'] or '-':>5} {r['completed']:>5} {r['failed']:>4} "
                     f"{r['request_throughput']:>7.2f} {r['output_token_throughput']:>10.1f} "
                     f"{r['total_token_throughput']:>10.1f} {r['goodput']:>7.2f} {latencies}")
    return "\n".join(lines)


def rate_for_json(rate: float) -> float | str:
    """JSON has no infinity: an unpaced scenario's rate is written "inf"."""
    return rate if math.isfinite(rate) else "inf"


def settings_for_json(args: argparse.Namespace) -> dict[str, Any]:
    """The command line's settings, minus the API key (results files get shared)."""
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    settings["request_rate"] = [rate_for_json(rate) for rate in args.request_rate]
    settings["api_key"] = "***" if args.api_key else None
    return settings


def main() -> None:
    args = parse_args()
    server, results = asyncio.run(run_benchmark(args))
    spread = f" (±{args.random_range_ratio:.0%})" if args.random_range_ratio else ""
    title = (f"{server.model} via {args.endpoint}: {args.input_len} in / {args.output_len} out{spread}, "
             f"{args.num_prompts} requests per point")
    report = {
        "machine": machine_description(),
        "server": {"base_url": args.base_url, "model": server.model, "version": server.version},
        "settings": settings_for_json(args),
        "scenarios": [{**r, "request_rate": rate_for_json(r["request_rate"])} for r in results],
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, allow_nan=False))
    if args.plot:
        plot_latency(results, load_axis(args, results), title, args.plot)
    print(f"{title}; server {server.version or 'version unknown'}; client {report['machine']['platform']}; "
          f"goodput SLOs TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms")
    print(format_table(results))


if __name__ == "__main__":
    main()
