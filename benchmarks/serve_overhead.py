"""What the HTTP path costs over the offline engine: the same greedy work through `jaxserve serve` and `LLM.generate`.

Two sides run the same prompts on the same engine settings (`--config`, default the tiny CPU preset):

    http     `jaxserve serve` in a subprocess, started once, driven over HTTP with streamed /v1/completions requests
             (serve.py's request code); at concurrency C at most C requests are in flight, and a new one is sent as
             soon as one finishes
    offline  `LLM.from_config(config)` in a subprocess of its own (every loaded XLA:CPU program holds hundreds
             of memory maps: one engine per process), running the prompts in batches of C, one `llm.generate(batch)`
             per batch (C = 1: one prompt at a time)

Every request has `--input-len` random token ids and generates exactly `--output-len` tokens (greedy, ignore_eos).
Each concurrency level first runs an untimed warm-up on both sides, which is also the correctness check: the server's
streamed text of every prompt must equal `LLM.generate`'s. Then `--rounds` rounds alternate the sides (the one that
goes first swaps every round and level); every round and level draws fresh prompts, the same for both sides, so
neither prefix cache reuses an earlier round's pages. While one side works the other idles, blocked on a queue.

Per level the script reports medians over rounds of the wall time of a round, output tokens/s and the per-request
end-to-end latency (http: request sent to last output chunk; offline: the `llm.generate` call of the request's
batch), and the http/offline ratios taken within each round. For the http side it adds serve_stats' TTFT, TPOT and
ITL percentiles, pooled over the timed rounds. The load generator runs on the same machine and its work (HTTP, JSON)
counts on the http side: that is the overhead a client on the same host pays.

    python benchmarks/serve_overhead.py --out overhead.json
    python benchmarks/serve_overhead.py --concurrency 1,2,4 --input-len 128 --output-len 64 --rounds 9
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import multiprocessing
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

# serve first: it sets up the environment before JAX is imported (through bench_machine).
from serve import (ENDPOINT_PATHS, SSE_DONE, RequestSpec, Scenario, ServerInfo, discover_server, parse_levels,
                   random_token_prompt, request_body, run_scenario, sse_data)
from serve_stats import SLOs, RequestRecord, e2e_latency_s, summarize
from bench_machine import machine_description

REPO = Path(__file__).resolve().parent.parent
SIDES = ("http", "offline")
WARM_UP_ROUND = 0  # prompt index of the untimed warm-up and check; timed rounds use 1..rounds
SERVER_START_TIMEOUT_S = 600.0  # model load and every bucket's compile on a cold compilation cache
HTTP_TIMEOUT = httpx.Timeout(connect=30.0, read=None, write=30.0, pool=None)  # a queued stream may stay silent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "tiny-cpu.yaml",
                        help="engine settings (YAML preset) for both sides")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=32, help="generated tokens per request")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per round and concurrency level")
    parser.add_argument("--concurrency", type=parse_levels, default=[1, 4],
                        help="comma-separated levels: requests in flight (http), batch size (offline)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per side and level, alternated")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    parser.add_argument("--slo-ttft-ms", type=float, default=600.0, help="goodput of the http side: TTFT at most")
    parser.add_argument("--slo-tpot-ms", type=float, default=40.0, help="goodput of the http side: TPOT at most")
    parser.add_argument("--out", type=Path, default=None, help="write every figure as JSON here")
    args = parser.parse_args()
    if args.num_prompts < 1 or args.rounds < 1:
        parser.error("--num-prompts and --rounds must be at least 1")
    return args


def make_specs(args: argparse.Namespace, round_index: int, level_index: int, vocab_size: int) -> list[RequestSpec]:
    """Fresh random prompts for one round and level, the same for both sides."""
    rng = np.random.default_rng([args.seed, round_index, level_index])
    return [RequestSpec(random_token_prompt(args.input_len, vocab_size, rng), args.input_len, args.output_len)
            for _ in range(args.num_prompts)]


# ---- offline side: one LLM in a child process ----

@dataclasses.dataclass(frozen=True)
class OfflineRun:
    """One round of prompts through `llm.generate`, in batches."""

    wall_s: float
    output_tokens: int
    request_latency_s: list[float]  # per request: the generate call of its batch
    texts: list[str]


def run_offline(llm: Any, prompts: list[list[int]], output_len: int, batch_size: int) -> OfflineRun:
    """The prompts in consecutive batches, one `generate` call each: C requests at a time, as the http side."""
    from jaxserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    latencies, texts, tokens = [], [], 0
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = [{"prompt_token_ids": prompt} for prompt in prompts[first:first + batch_size]]
        sent = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        latencies += [time.perf_counter() - sent] * len(batch)
        texts += [output.outputs[0].text for output in outputs]
        tokens += sum(len(output.outputs[0].token_ids) for output in outputs)
    return OfflineRun(time.perf_counter() - start, tokens, latencies, texts)


_llm: Any = None  # the offline side's LLM, built once in its worker process


def build_llm(config: Path) -> None:
    """The worker process's initializer: the LLM every `generate_round` call there uses."""
    global _llm
    from jaxserve.entrypoints.llm import LLM
    from jaxserve.config import load_config

    _llm = LLM.from_config(load_config(config, {}), use_tqdm_on_load=False)


def generate_round(prompts: list[list[int]], output_len: int, batch_size: int) -> OfflineRun:
    return run_offline(_llm, prompts, output_len, batch_size)


class OfflineProcess:
    """The offline side: one worker process holding the LLM; `run` blocks until its round has finished there."""

    def __init__(self, config: Path):
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=build_llm, initargs=(config,))
        start = time.perf_counter()
        self._pool.submit(int).result()  # returns once the initializer has built the LLM
        self.startup_s = time.perf_counter() - start

    def run(self, prompts: list[list[int]], output_len: int, batch_size: int) -> OfflineRun:
        return self._pool.submit(generate_round, prompts, output_len, batch_size).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


# ---- http side: `jaxserve serve` in a child process ----

def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_health(process: subprocess.Popen, base_url: str, log_path: Path) -> float:
    """Seconds until GET /health answers 200; fails with the log's tail if the server exits or never answers."""
    start = time.perf_counter()
    while time.perf_counter() - start < SERVER_START_TIMEOUT_S:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return time.perf_counter() - start
        time.sleep(0.5)
    raise RuntimeError(f"no healthy server after {SERVER_START_TIMEOUT_S:g} s:\n{log_path.read_text()[-4000:]}")


@contextlib.contextmanager
def running_server(config: Path, log_dir: Path, *flags: str,
                   env: dict[str, str] | None = None) -> Iterator[tuple[str, float]]:
    """`jaxserve serve --config CONFIG [flags]` on a free loopback port (in `env`, default this process's); yields
    its base URL and start-up seconds."""
    port = unused_port()
    log_path = log_dir / "server.log"
    command = [sys.executable, "-m", "jaxserve.cli", "serve", "--config", str(config), "--port", str(port), *flags]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    try:
        base_url = f"http://127.0.0.1:{port}"
        yield base_url, wait_for_health(process, base_url, log_path)
    finally:
        process.send_signal(signal.SIGTERM)  # the server drains: nothing is in flight by now
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def streamed_text(client: httpx.AsyncClient, body: dict[str, Any]) -> str:
    """The completion text a streamed request delivers, chunk texts joined (the check needs text, not timings)."""
    pieces = []
    async with client.stream("POST", ENDPOINT_PATHS["completions"], json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            data = sse_data(line)
            if data == SSE_DONE:
                break
            if data:
                pieces += [choice.get("text") or "" for choice in json.loads(data).get("choices") or ()]
    return "".join(pieces)


async def streamed_texts(client: httpx.AsyncClient, server: ServerInfo, specs: list[RequestSpec],
                         concurrency: int) -> list[str]:
    """Every spec's streamed text, at most `concurrency` in flight (the load the timed rounds put on the server)."""
    limit = asyncio.Semaphore(concurrency)

    async def one(spec: RequestSpec) -> str:
        async with limit:
            return await streamed_text(client, request_body(spec, server.model, "completions", ignore_eos=True))

    return list(await asyncio.gather(*(one(spec) for spec in specs)))


@dataclasses.dataclass(frozen=True)
class HttpRun:
    """One round of prompts through the server."""

    wall_s: float
    records: list[RequestRecord]

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.records if r.succeeded)

    @property
    def request_latency_s(self) -> list[float]:
        return [e2e_latency_s(r) for r in self.records if r.succeeded]


class HttpSide:
    """The load generator: serve.py's scenario runner on a loop of its own, so rounds can be called one by one."""

    def __init__(self, base_url: str, concurrency_levels: list[int]):
        self._loop = asyncio.new_event_loop()
        pool = max(concurrency_levels)
        self._client = httpx.AsyncClient(base_url=base_url, timeout=HTTP_TIMEOUT,
                                         limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool))
        discovery = argparse.Namespace(base_url=base_url, model=None, tokenizer_vocab_size=None, endpoint="completions")
        self.server = self._loop.run_until_complete(discover_server(self._client, discovery))
        # What serve.run_scenario reads from its command line.
        self._scenario_args = argparse.Namespace(endpoint="completions", ignore_eos=True)

    def run(self, specs: list[RequestSpec], concurrency: int) -> HttpRun:
        records, wall_s = self._loop.run_until_complete(run_scenario(
            self._client, self._scenario_args, self.server, Scenario(math.inf, concurrency), specs,
            np.random.default_rng()))  # the rng only paces Poisson arrivals: unused at rate inf
        failures = [r.error for r in records if not r.succeeded]
        if failures:
            raise RuntimeError(f"{len(failures)} of {len(records)} requests failed, first: {failures[0]}")
        return HttpRun(wall_s, records)

    def texts(self, specs: list[RequestSpec], concurrency: int) -> list[str]:
        return self._loop.run_until_complete(streamed_texts(self._client, self.server, specs, concurrency))

    def close(self) -> None:
        self._loop.run_until_complete(self._client.aclose())
        # Streams left at [DONE] hold unfinished line iterators: close them here, as asyncio.run would.
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()


# ---- rounds and figures ----

def check_level(http: HttpSide, offline: OfflineProcess, args: argparse.Namespace, level_index: int,
                concurrency: int) -> dict[str, Any]:
    """Untimed warm-up of both sides at this level; the texts of the two must agree prompt by prompt."""
    specs = make_specs(args, WARM_UP_ROUND, level_index, http.server.vocab_size)
    http_texts = http.texts(specs, concurrency)
    offline_texts = offline.run([s.prompt for s in specs], args.output_len, concurrency).texts
    mismatches = [i for i, (a, b) in enumerate(zip(http_texts, offline_texts)) if a != b]
    return {"prompts": len(specs), "agree": len(specs) - len(mismatches), "mismatched_prompts": mismatches,
            "first_mismatch": None if not mismatches else {"http": http_texts[mismatches[0]],
                                                           "offline": offline_texts[mismatches[0]]}}


def run_level(http: HttpSide, offline: OfflineProcess, args: argparse.Namespace, level_index: int,
              concurrency: int) -> dict[str, list]:
    """The timed rounds at one level, sides alternated; every run of each side, in round order."""
    runs: dict[str, list] = {side: [] for side in SIDES}
    for round_index in range(1, args.rounds + 1):
        specs = make_specs(args, round_index, level_index, http.server.vocab_size)
        order = SIDES if (round_index + level_index) % 2 else SIDES[::-1]
        for side in order:
            if side == "http":
                runs[side].append(http.run(specs, concurrency))
            else:
                runs[side].append(offline.run([s.prompt for s in specs], args.output_len, concurrency))
        print(f"concurrency {concurrency} round {round_index}: " + ", ".join(
            f"{side} {runs[side][-1].wall_s:.2f} s" for side in order), flush=True)
    return runs


def side_figures(runs: list[HttpRun] | list[OfflineRun], expected_tokens: int) -> dict[str, Any]:
    """Medians over rounds: wall time, output tokens/s, per-request latency."""
    short = [r.output_tokens for r in runs if r.output_tokens != expected_tokens]
    if short:
        raise RuntimeError(f"a round generated {short[0]} tokens, expected {expected_tokens}")
    return {
        "wall_s": statistics.median(r.wall_s for r in runs),
        "output_tokens_per_s": statistics.median(r.output_tokens / r.wall_s for r in runs),
        "request_latency_ms": statistics.median(statistics.median(r.request_latency_s) * 1e3 for r in runs),
        "wall_s_per_round": [r.wall_s for r in runs],
    }


def per_round_ratios(runs: dict[str, list]) -> dict[str, float]:
    """http / offline within each round (both ran the same prompts there), then the median over rounds."""
    pairs = list(zip(runs["http"], runs["offline"]))
    return {
        "wall_s": statistics.median(a.wall_s / b.wall_s for a, b in pairs),
        "output_tokens_per_s": statistics.median((a.output_tokens / a.wall_s) / (b.output_tokens / b.wall_s)
                                                 for a, b in pairs),
        "request_latency_ms": statistics.median(statistics.median(a.request_latency_s)
                                                / statistics.median(b.request_latency_s) for a, b in pairs),
    }


def level_report(runs: dict[str, list], check: dict[str, Any], concurrency: int, args: argparse.Namespace,
                 slos: SLOs) -> dict[str, Any]:
    """Every figure of one level; the http side's latency statistics pool the requests of all timed rounds."""
    expected = args.num_prompts * args.output_len
    pooled = summarize([r for run in runs["http"] for r in run.records], sum(run.wall_s for run in runs["http"]), slos)
    return {
        "concurrency": concurrency,
        "check": check,
        "http": {**side_figures(runs["http"], expected), "serve_stats": pooled},
        "offline": side_figures(runs["offline"], expected),
        "ratio_http_over_offline": per_round_ratios(runs),
    }


def run_level_with_check(http: HttpSide, offline: OfflineProcess, args: argparse.Namespace, level_index: int,
                         concurrency: int, slos: SLOs) -> dict[str, Any]:
    check = check_level(http, offline, args, level_index, concurrency)
    runs = run_level(http, offline, args, level_index, concurrency)
    return level_report(runs, check, concurrency, args, slos)


def format_table(levels: list[dict[str, Any]]) -> str:
    """Per level: both sides, then their ratio; TTFT/TPOT/ITL are the http side's."""
    lines = [f"{'conc':>4} {'side':<15} {'wall s':>7} {'out tok/s':>9} {'req E2E ms':>10} {'TTFT p50/p99':>14} "
             f"{'TPOT p50/p99':>14} {'ITL p50/p99':>14} {'texts agree':>11}"]
    for level in levels:
        stats = level["http"]["serve_stats"]
        latency = [f"{stats[m]['p50']:.1f}/{stats[m]['p99']:.1f}" for m in ("ttft_ms", "tpot_ms", "itl_ms")]
        check = f"{level['check']['agree']}/{level['check']['prompts']}"
        for side in SIDES:
            row = level[side]
            # Latency percentiles and the check exist for the http side only.
            extra = " ".join(f"{cell:>14}" for cell in latency) + f" {check:>11}" if side == "http" else ""
            lines.append(f"{level['concurrency']:>4} {side:<15} {row['wall_s']:>7.2f} "
                         f"{row['output_tokens_per_s']:>9.1f} {row['request_latency_ms']:>10.1f} {extra}".rstrip())
        ratio = level["ratio_http_over_offline"]
        lines.append(f"{level['concurrency']:>4} {'http / offline':<15} {ratio['wall_s']:>6.2f}x "
                     f"{ratio['output_tokens_per_s']:>8.2f}x {ratio['request_latency_ms']:>9.2f}x")
    return "\n".join(lines)


def run_benchmark(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Server first (it fills the compilation cache), then the offline LLM; then each level's check and rounds."""
    slos = SLOs(args.slo_ttft_ms, args.slo_tpot_ms)
    with running_server(args.config, log_dir) as (base_url, server_startup_s):
        print(f"server ready in {server_startup_s:.1f} s", flush=True)
        offline = OfflineProcess(args.config)
        print(f"offline LLM ready in {offline.startup_s:.1f} s", flush=True)
        try:
            http = HttpSide(base_url, args.concurrency)
            try:
                levels = [run_level_with_check(http, offline, args, level_index, concurrency, slos)
                          for level_index, concurrency in enumerate(args.concurrency)]
            finally:
                http.close()
        finally:
            offline.close()
    return {"server": {"model": http.server.model, "version": http.server.version, "startup_s": server_startup_s},
            "offline_startup_s": offline.startup_s, "levels": levels}


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="serve-overhead-") as log_dir:
        result = run_benchmark(args, Path(log_dir))
    report = {"machine": machine_description(),
              "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
              **result}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, allow_nan=False))
    mismatched = sum(len(level["check"]["mismatched_prompts"]) for level in result["levels"])
    print(f"{args.config.name}: {args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} generated "
          f"(greedy, ignore_eos), {args.rounds} rounds per side alternated, medians; {report['machine']['device']} "
          f"({report['machine']['cpu_count']} cores); texts {'agree' if not mismatched else f'DIFFER in {mismatched}'}")
    print(format_table(result["levels"]))
    if mismatched:
        sys.exit(1)


if __name__ == "__main__":
    main()
