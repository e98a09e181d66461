"""Serving-benchmark statistics: pure functions from per-request timings to the figures `serve.py` reports.

The definitions are vLLM's (`benchmarks/benchmark_serving.py`), so figures compare with theirs:

    TTFT        first output chunk − request sent
    E2E         last output chunk − request sent
    TPOT        (E2E − TTFT) / (output tokens − 1), one value per request; undefined for a 1-token output, which
                is then left out of the TPOT figures and counts as meeting the TPOT SLO
    ITL         every gap between consecutive output chunks, pooled over all requests
    throughput  completed requests, output tokens, prompt + output tokens, each per second of the scenario
    goodput     completed requests that meet every SLO, per second

Failed requests are counted (with their error messages) and left out of every latency figure and throughput.
Times are seconds in, milliseconds out.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one streamed request."""

    start_s: float  # when the request was sent (time.perf_counter seconds)
    chunk_times_s: tuple[float, ...] = ()  # arrival of every chunk that carried output text, in order
    output_tokens: int = 0  # the server's usage.completion_tokens, else the number of output chunks
    prompt_tokens: int = 0  # the server's usage.prompt_tokens, else the prompt length the client built
    error: str | None = None  # why the request failed; None when it succeeded
    status: int | None = None  # HTTP status; None when no response came

    @property
    def succeeded(self) -> bool:
        return self.error is None


@dataclasses.dataclass(frozen=True)
class SLOs:
    """Service-level objectives a request must meet (inclusive bounds) to count towards goodput."""

    ttft_ms: float
    tpot_ms: float


def ttft_s(record: RequestRecord) -> float:
    return record.chunk_times_s[0] - record.start_s


def e2e_latency_s(record: RequestRecord) -> float:
    return record.chunk_times_s[-1] - record.start_s


def tpot_s(record: RequestRecord) -> float | None:
    """Mean time per output token after the first; None when there is no second token to time."""
    if record.output_tokens < 2:
        return None
    return (e2e_latency_s(record) - ttft_s(record)) / (record.output_tokens - 1)


def inter_chunk_gaps_s(record: RequestRecord) -> list[float]:
    times = record.chunk_times_s
    return [later - earlier for earlier, later in zip(times, times[1:])]


def meets_slos(record: RequestRecord, slos: SLOs) -> bool:
    tpot = tpot_s(record)
    return ttft_s(record) * 1e3 <= slos.ttft_ms and (tpot is None or tpot * 1e3 <= slos.tpot_ms)


def distribution_ms(values_s: Sequence[float],
                    percentiles: Sequence[float] = PERCENTILES) -> dict[str, float | None]:
    """Mean and percentiles (linear interpolation, as numpy and vLLM) in milliseconds; None where there is no value."""
    keys = ["mean", *(f"p{p:g}" for p in percentiles)]
    if not values_s:
        return dict.fromkeys(keys)
    values_ms = np.asarray(values_s, dtype=np.float64) * 1e3
    figures = [values_ms.mean(), *np.percentile(values_ms, percentiles)]
    return {key: float(value) for key, value in zip(keys, figures)}


def error_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    """How many requests failed with each message, most frequent first."""
    counts = collections.Counter(r.error for r in records if not r.succeeded)
    return dict(counts.most_common())


def summarize(records: Sequence[RequestRecord], duration_s: float, slos: SLOs,
              percentiles: Sequence[float] = PERCENTILES) -> dict[str, Any]:
    """Every figure of one scenario, from its request records and its wall time; latencies at `percentiles`."""
    done = [r for r in records if r.succeeded]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [t for t in map(tpot_s, done) if t is not None]
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": error_counts(records),
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_token_throughput": output_tokens / duration_s,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration_s,
        "goodput": sum(meets_slos(r, slos) for r in done) / duration_s,
        "slos": dataclasses.asdict(slos),
        "ttft_ms": distribution_ms([ttft_s(r) for r in done], percentiles),
        "tpot_ms": distribution_ms(tpots, percentiles),
        "itl_ms": distribution_ms([gap for r in done for gap in inter_chunk_gaps_s(r)], percentiles),
        "e2e_latency_ms": distribution_ms([e2e_latency_s(r) for r in done], percentiles),
    }
