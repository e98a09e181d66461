"""Reliability under abuse: `jaxserve serve` on the built-in model, driven by many misbehaving clients in one run.

The server runs `configs/tiny-cpu.yaml` with `--scheduling-policy priority`, a short `--stream-timeout` and an
`--api-keys-file` of four keys: two without limits and two with tight ones (`capped-requests`: requests_per_minute;
`capped-tokens`: tokens_per_minute and max_concurrent_requests). `--requests` streamed /v1/completions requests go
out, at most `--concurrency` at a time, each from one kind of client (reliability_clients.py): 20% leave
mid-stream, 10% read slowly (half of those, "stalled", stop reading for 3x the stream timeout and should be
dropped), the rest read normally. Half the requests have high priority (0), half low (10). Normal clients and
leavers spread over the four keys; the slow readers use the unlimited ones (they test the stream timeout, and their
large max_tokens would exceed the tight token limit outright).

The run checks, and the report shows: no 5xx answer and no error event in any stream; 429s only on the two capped
keys (counted by the clients and by the server's /metrics); every KV page free again once the server has settled
(/metrics); no traceback or ERROR line in the server's log. It also gives each kind's outcomes, the server's count
of dropped clients and aborted requests, and TTFT p50/p95 of high- against low-priority requests. The exit code is
1 when a check fails.

    python benchmarks/reliability.py --out reliability.json --plot reliability.png
    python benchmarks/reliability.py --requests 200 --concurrency 64 --output-len 16     # a quicker run
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml
from prometheus_client.parser import text_string_to_metric_families

from reliability_clients import KINDS, ClientResult, ClientSpec, run_client
from serve_overhead import REPO, running_server
from bench_machine import machine_description

HIGH_PRIORITY, LOW_PRIORITY = 0, 10  # lower runs first (vLLM's convention)
UNLIMITED_KEYS = ("steady-a", "steady-b")
CAPPED_KEYS = ("capped-requests", "capped-tokens")
LEAVER_SHARE, SLOW_SHARE = 0.2, 0.1  # of all requests; half the slow ones stall
PROMPT_LEN = 16  # random token ids per prompt
SLOW_LOGPROBS = 20  # top logprobs on every token of a slow reader's stream: ~700 bytes a chunk
SETTLE_TIMEOUT_S = 120.0  # after the clients are done, how long the server may take to free every page
SETTLE_POLL_S = 0.2
TIMEOUT = httpx.Timeout(connect=30.0, read=None, write=30.0, pool=None)  # a queued stream may stay silent long


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "tiny-cpu.yaml", help="engine preset")
    parser.add_argument("--requests", type=int, default=2000, help="requests in the run")
    parser.add_argument("--concurrency", type=int, default=256, help="requests in flight at most")
    parser.add_argument("--output-len", type=int, default=32, help="max_tokens of normal requests")
    parser.add_argument("--leaver-max-tokens", type=int, default=200, help="max_tokens of leavers' requests")
    parser.add_argument("--slow-max-tokens", type=int, default=400, help="max_tokens of slow readers' requests")
    parser.add_argument("--stream-timeout", type=float, default=2.0, help="the server's --stream-timeout (s)")
    parser.add_argument("--seed", type=int, default=0, help="seeds kinds, priorities and prompts")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of TTFT by priority and outcomes")
    args = parser.parse_args()
    if args.requests < 1 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be at least 1")
    return args


# ---- the keys file and the run's requests ----

def key_limits(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    """The two capped keys' limits, scaled to the run so both are over them whatever its size: each key gets a
    quarter of the requests, and its per-minute limit lets through about a tenth of that; capped-tokens may have
    half its share of the clients in flight."""
    per_key_per_minute = max(1, args.requests // 40)
    largest_reservation = PROMPT_LEN + max(args.output_len, args.leaver_max_tokens)
    return {"capped-requests": {"requests_per_minute": per_key_per_minute},
            "capped-tokens": {"tokens_per_minute": max(largest_reservation,
                                                       per_key_per_minute * (PROMPT_LEN + args.output_len)),
                              "max_concurrent_requests": max(1, args.concurrency // 8)}}


def write_keys_file(path: Path, args: argparse.Namespace) -> dict[str, str]:
    """Writes the four keys; returns each name's key."""
    limits = key_limits(args)
    secrets = {name: f"sk-reliability-{name}" for name in (*UNLIMITED_KEYS, *CAPPED_KEYS)}
    path.write_text(yaml.safe_dump({"keys": [{"name": name, "key": key, **limits.get(name, {})}
                                             for name, key in secrets.items()]}))
    return secrets


def build_specs(args: argparse.Namespace, vocab_size: int) -> list[ClientSpec]:
    """Exact shares of kinds and priorities, shuffled; keys round-robin (slow readers on the unlimited keys)."""
    rng = np.random.default_rng(args.seed)
    num_leavers = round(args.requests * LEAVER_SHARE)
    num_slow = round(args.requests * SLOW_SHARE)
    kinds = (["leaver"] * num_leavers + ["stalled"] * (num_slow // 2) + ["sluggish"] * (num_slow - num_slow // 2))
    kinds += ["normal"] * (args.requests - len(kinds))
    rng.shuffle(kinds)
    priorities = [HIGH_PRIORITY, LOW_PRIORITY] * (args.requests // 2 + 1)
    rng.shuffle(priorities)
    all_keys = (*UNLIMITED_KEYS, *CAPPED_KEYS)
    return [_spec(index, kind, priorities[index], all_keys[index % 4] if kind in ("normal", "leaver")
                  else UNLIMITED_KEYS[index % 2], args, vocab_size, rng) for index, kind in enumerate(kinds)]


def _spec(index: int, kind: str, priority: int, key_name: str, args: argparse.Namespace, vocab_size: int,
          rng: np.random.Generator) -> ClientSpec:
    max_tokens = {"normal": args.output_len, "leaver": args.leaver_max_tokens}.get(kind, args.slow_max_tokens)
    body = {"prompt": rng.integers(0, vocab_size, PROMPT_LEN).tolist(), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "priority": priority}
    if kind in ("sluggish", "stalled"):
        body["logprobs"] = SLOW_LOGPROBS
    return ClientSpec(index, kind, key_name, priority, body, leave_after=int(rng.integers(1, 4)),
                      stall_s=3 * args.stream_timeout)


# ---- the run ----

async def drive(base_url: str, specs: list[ClientSpec], secrets: dict[str, str],
                concurrency: int) -> tuple[list[ClientResult], float]:
    """Every client, at most `concurrency` at once; their results and the run's wall time."""
    limit = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=base_url, timeout=TIMEOUT, limits=limits) as http:
        async def one(spec: ClientSpec) -> ClientResult:
            async with limit:
                return await run_client(spec, http, base_url, secrets[spec.key_name])

        start = time.perf_counter()
        results = await asyncio.gather(*(one(spec) for spec in specs))
        return list(results), time.perf_counter() - start


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def settled_metrics(base_url: str) -> tuple[dict[tuple[str, tuple], float], float]:
    """/metrics once no request runs, waits or holds a page (or at the timeout), and the seconds that took."""
    start = time.perf_counter()
    while True:
        samples = scrape(base_url)
        idle = all(samples.get((name, ()), 0) == 0 for name in ("jaxserve:num_requests_running",
                                                                 "jaxserve:num_requests_waiting",
                                                                 "jaxserve:kv_pages_used"))
        waited = time.perf_counter() - start
        if idle or waited > SETTLE_TIMEOUT_S:
            return samples, waited
        time.sleep(SETTLE_POLL_S)


# ---- the report ----

def percentiles_ms(values_s: list[float]) -> dict[str, Any]:
    if not values_s:
        return {"count": 0, "p50": None, "p95": None}
    p50, p95 = np.percentile(np.array(values_s) * 1000, [50, 95]).tolist()
    return {"count": len(values_s), "p50": round(p50, 1), "p95": round(p95, 1)}


def counted(samples: dict, name: str, label: str) -> dict[str, float]:
    """A labelled counter's samples, by the value of `label` (summed over any other label)."""
    totals: dict[str, float] = collections.Counter()
    for (sample, labels), value in samples.items():
        if sample == name:
            totals[dict(labels)[label]] += value
    return dict(totals)


def rate_limited_by_limit(samples: dict) -> dict[str, float]:
    """The server's 429s as "key name / limit", the ones that happened."""
    return {f"{labels['key_name']} / {labels['limit']}": value
            for (name, label_items), value in samples.items()
            if name == "jaxserve:api_key_rate_limited_total" and value
            for labels in [dict(label_items)]}


def summarize(specs: list[ClientSpec], results: list[ClientResult], samples: dict, settle_s: float,
              log: str) -> dict[str, Any]:
    outcomes = {kind: dict(collections.Counter(r.outcome for s, r in zip(specs, results) if s.kind == kind))
                for kind in KINDS}
    rate_limited = collections.Counter(s.key_name for s, r in zip(specs, results) if r.status == 429)
    ttft = {name: percentiles_ms([r.ttft_s for s, r in zip(specs, results)
                                  if s.priority == priority and r.ttft_s is not None])
            for name, priority in (("high", HIGH_PRIORITY), ("low", LOW_PRIORITY))}
    kv_after = {name: samples.get((f"jaxserve:{name}", ()), None)
                for name in ("kv_pages_used", "kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")}
    report = {
        "requests": len(results),
        "outcomes": outcomes,
        "http_5xx": sum(1 for r in results if r.status is not None and r.status >= 500),
        "stream_errors": sum(1 for r in results if r.outcome == "stream_error"),
        "transport_errors": sum(1 for r in results if r.outcome == "transport_error"),
        "rate_limited_by_key": {name: rate_limited.get(name, 0) for name in (*UNLIMITED_KEYS, *CAPPED_KEYS)},
        "server_rate_limited_by_key": counted(samples, "jaxserve:api_key_rate_limited_total", "key_name"),
        "server_rate_limited_by_limit": rate_limited_by_limit(samples),
        "server_admitted_by_key": counted(samples, "jaxserve:api_key_requests_total", "key_name"),
        "server_finished_by_reason": counted(samples, "jaxserve:request_success_total", "finished_reason"),
        "kv_after": {**kv_after, "settle_s": round(settle_s, 2)},
        "ttft_ms_by_priority": ttft,
        "server_log": {"dropped_clients": log.count("(--stream-timeout); its request was aborted"),
                       "tracebacks": log.count("Traceback"), "error_lines": log.count(" ERROR ")},
        "failures": [r.detail for r in results if r.outcome in ("stream_error", "transport_error")
                     or (r.status or 0) >= 500][:10],
    }
    report["checks"] = checks(report)
    return report


def checks(report: dict[str, Any]) -> dict[str, bool]:
    limited = report["rate_limited_by_key"]
    return {
        "no_5xx": report["http_5xx"] == 0,
        "no_stream_or_transport_errors": report["stream_errors"] == report["transport_errors"] == 0,
        "429_only_on_capped_keys": all(limited[name] == 0 for name in UNLIMITED_KEYS)
        and any(limited[name] > 0 for name in CAPPED_KEYS),
        "kv_pages_free_after": report["kv_after"]["kv_pages_used"] == 0,
        "clean_server_log": report["server_log"]["tracebacks"] == report["server_log"]["error_lines"] == 0,
    }


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{'kind':<9} outcomes"]
    for kind, outcomes in report["outcomes"].items():
        lines.append(f"{kind:<9} " + ", ".join(f"{name} {count}" for name, count in sorted(outcomes.items())))
    lines.append("429 by key: " + ", ".join(f"{k} {v}" for k, v in report["rate_limited_by_key"].items()))
    ttft = report["ttft_ms_by_priority"]
    lines.append(f"TTFT ms p50/p95: high {ttft['high']['p50']}/{ttft['high']['p95']}, "
                 f"low {ttft['low']['p50']}/{ttft['low']['p95']}")
    lines.append(f"5xx {report['http_5xx']}, stream errors {report['stream_errors']}, KV pages used after "
                 f"{report['kv_after']['kv_pages_used']} (usage {report['kv_after']['kv_cache_usage_perc']}), "
                 f"dropped clients {report['server_log']['dropped_clients']}")
    lines.append("checks: " + ", ".join(f"{name} {'ok' if ok else 'FAILED'}" for name, ok in report["checks"].items()))
    return "\n".join(lines)


def plot(report: dict[str, Any], specs: list[ClientSpec], results: list[ClientResult], path: Path) -> None:
    """TTFT distributions of high- and low-priority requests, and every kind's outcomes."""
    import matplotlib  # here, not at the top: only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, priority in (("high (0)", HIGH_PRIORITY), ("low (10)", LOW_PRIORITY)):
        ttfts = np.sort([r.ttft_s for s, r in zip(specs, results) if s.priority == priority and r.ttft_s])
        left.plot(ttfts, np.arange(1, len(ttfts) + 1) / max(1, len(ttfts)), label=f"priority {name}")
    left.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT by priority")
    left.grid(alpha=0.3)
    left.legend()
    names = sorted({name for outcomes in report["outcomes"].values() for name in outcomes})
    bottoms = np.zeros(len(KINDS))
    for name in names:
        counts = np.array([report["outcomes"][kind].get(name, 0) for kind in KINDS])
        right.bar(KINDS, counts, bottom=bottoms, label=name)
        bottoms += counts
    right.set(ylabel="requests", title="outcome by client kind")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="reliability-") as tmp:
        keys_path = Path(tmp) / "keys.yaml"
        secrets = write_keys_file(keys_path, args)
        flags = ["--scheduling-policy", "priority", "--api-keys-file", str(keys_path),
                 "--stream-timeout", str(args.stream_timeout),
                 # Room for every client and the few whose departure the server has not seen yet: a 503 would
                 # mean admissions leaked.
                 "--max-waiting-requests", str(2 * args.concurrency)]
        with running_server(args.config, Path(tmp), *flags) as (base_url, startup_s):
            print(f"server ready in {startup_s:.1f} s", flush=True)
            vocab_size = httpx.get(base_url + "/tokenizer_info", timeout=30,
                                   headers={"Authorization": f"Bearer {secrets['steady-a']}"}).json()["vocab_size"]
            specs = build_specs(args, vocab_size)
            results, wall_s = asyncio.run(drive(base_url, specs, secrets, args.concurrency))
            samples, settle_s = settled_metrics(base_url)
        log = (Path(tmp) / "server.log").read_text(errors="replace")
    report = {"machine": machine_description(),
              "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
              "server": {"flags": [flag if flag != str(keys_path) else "KEYS.yaml" for flag in flags],
                         "startup_s": round(startup_s, 1), "key_limits": key_limits(args)},
              "wall_s": round(wall_s, 1), **summarize(specs, results, samples, settle_s, log)}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2, allow_nan=False))
    if args.plot:
        plot(report, specs, results, args.plot)
    print(f"{args.requests} requests, {args.concurrency} at once, in {wall_s:.1f} s on {report['machine']['device']} "
          f"({report['machine']['cpu_count']} cores)")
    print(format_table(report))
    if not all(report["checks"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
