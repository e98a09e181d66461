"""Prometheus metrics of one app, named like vLLM's (`jaxserve:` for `vllm:`) so its dashboards carry over.

Engine gauges are read from the engine thread's latest snapshot at scrape time. Request timings and token counts come
from one `RequestObserver` per engine request, fed by `streams.merged_events`, the path every request takes. Timings
are per continuation (each of a request's n choices), as vLLM times its child requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxserve.engine.async_engine import EngineEvent
from jaxserve.engine.scheduler_stats import SchedulerStats, SpecDecodeStats
from jaxserve.outputs import CompletionDelta
from jaxserve.server.api_keys_file import LIMIT_FIELDS


def _ladder(low_exponent: int, high_exponent: int) -> list[float]:
    """1-2.5-5 steps per decade, 10**low_exponent .. 10**high_exponent: fine at GPU speeds and wide enough for a CPU."""
    steps = [float(f"{m}e{e}") for e in range(low_exponent, high_exponent) for m in (1, 2.5, 5)]
    return steps + [float(f"1e{high_exponent}")]


class ServerMetrics:
    """The app's registry and the instruments the request path updates; one per app, never the global registry."""

    def __init__(self, engine_stats: Callable[[], SchedulerStats]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(engine_stats))
        self.time_to_first_token = Histogram(
            "jaxserve:time_to_first_token_seconds", "From submission to a continuation's first token.",
            buckets=_ladder(-3, 2), registry=self.registry)
        self.inter_token_latency = Histogram(
            "jaxserve:inter_token_latency_seconds", "Gap between consecutive tokens of a continuation.",
            buckets=_ladder(-4, 1), registry=self.registry)
        self.e2e_request_latency = Histogram(
            "jaxserve:e2e_request_latency_seconds", "From submission to a continuation's last token.",
            buckets=_ladder(-2, 3), registry=self.registry)
        self.prompt_tokens = Counter("jaxserve:prompt_tokens", "Prompt tokens of requests that produced a token.",
                                     registry=self.registry)
        self.generation_tokens = Counter("jaxserve:generation_tokens", "Generated tokens, aborted requests' included.",
                                         registry=self.registry)
        self.request_success = Counter(
            "jaxserve:request_success", "Continuations ended, by why: stop, length, abort (the client left) or error "
            "(the engine failed).", ["finished_reason"], registry=self.registry)
        self.requests_rejected = Counter(
            "jaxserve:num_requests_rejected", "Requests answered 503 by admission: overloaded or draining.",
            ["reason"], registry=self.registry)
        # Per API key, labelled by the key's name from --api-keys-file ("default" for --api-key), never the key.
        self.api_key_requests = Counter(
            "jaxserve:api_key_requests", "Generation requests admitted, by API key name.", ["key_name"],
            registry=self.registry)
        self.api_key_rate_limited = Counter(
            "jaxserve:api_key_rate_limited", "Requests answered 429, by API key name and the limit they were over.",
            ["key_name", "limit"], registry=self.registry)
        self.api_key_prompt_tokens = Counter(
            "jaxserve:api_key_prompt_tokens", "Prompt tokens of ended requests, by API key name.", ["key_name"],
            registry=self.registry)
        self.api_key_generation_tokens = Counter(
            "jaxserve:api_key_generation_tokens", "Generated tokens of ended requests (aborted ones' included), by "
            "API key name.", ["key_name"], registry=self.registry)

    def request_observer(self, num_prompt_tokens: int, n: int) -> RequestObserver:
        return RequestObserver(self, num_prompt_tokens, n)

    def count_rejected(self, reason: str) -> None:
        self.requests_rejected.labels(reason).inc()

    def declare_api_keys(self, names: Iterable[str]) -> None:
        """Every key's series, at 0 until it moves: a scraper sees each key from the start (rates need a first
        sample). Names dropped by a reload keep their series, as counters do."""
        for name in names:
            for counter in (self.api_key_requests, self.api_key_prompt_tokens, self.api_key_generation_tokens):
                counter.labels(name)
            for limit in LIMIT_FIELDS:
                self.api_key_rate_limited.labels(name, limit)

    def count_key_admitted(self, name: str) -> None:
        self.api_key_requests.labels(name).inc()

    def count_key_rate_limited(self, name: str, limit: str) -> None:
        self.api_key_rate_limited.labels(name, limit).inc()

    def count_key_tokens(self, name: str, prompt: int, generated: int) -> None:
        self.api_key_prompt_tokens.labels(name).inc(prompt)
        self.api_key_generation_tokens.labels(name).inc(generated)

    def exposition(self) -> tuple[bytes, str]:
        """The registry in Prometheus' text format, and that format's content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestObserver:
    """Times one engine request (a prompt and its n continuations) from submission and counts its tokens and end."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, n: int):
        self._metrics = metrics
        self._num_prompt_tokens = num_prompt_tokens
        self._n = n  # continuations that will each end once
        self._submitted = time.perf_counter()
        self._last_token: dict[int, float] = {}  # continuation index -> when its latest token arrived
        self._ended: set[int] = set()  # continuations whose last token arrived

    def observe(self, event: EngineEvent) -> None:
        """Every event of the request, as it is handed on; the final RequestOutput adds nothing the deltas lacked."""
        if isinstance(event, CompletionDelta):
            self._on_delta(event, time.perf_counter())

    def close(self, reason: str | None) -> None:
        """The request's stream ended: continuations still unfinished are counted under `reason` (None: not at all,
        for a request the engine refused, which never ran)."""
        unfinished = self._n - len(self._ended)
        if unfinished and reason is not None:
            self._metrics.request_success.labels(reason).inc(unfinished)

    def _on_delta(self, delta: CompletionDelta, now: float) -> None:
        metrics = self._metrics
        if not self._last_token:  # the prompt has been computed
            metrics.prompt_tokens.inc(self._num_prompt_tokens)
        previous = self._last_token.get(delta.index)
        if previous is None:
            metrics.time_to_first_token.observe(now - self._submitted)
        else:
            metrics.inter_token_latency.observe(now - previous)
        self._last_token[delta.index] = now
        metrics.generation_tokens.inc(len(delta.token_ids))
        if delta.finish_reason is not None:
            self._ended.add(delta.index)
            metrics.e2e_request_latency.observe(now - self._submitted)
            metrics.request_success.labels(delta.finish_reason).inc()


class _EngineStatsCollector(Collector):
    """Queue and KV-pool gauges, read from the snapshot the engine thread refreshes after every step."""

    def __init__(self, engine_stats: Callable[[], SchedulerStats]):
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._engine_stats()
        total_pages = stats.num_pages_used + stats.num_pages_free + stats.num_pages_cached
        yield _gauge("jaxserve:num_requests_running", "Sequences holding KV pages (each continuation counts).",
                     stats.num_running)
        yield _gauge("jaxserve:num_requests_waiting", "Sequences queued for pages, preempted ones included.",
                     stats.num_waiting)
        yield _gauge("jaxserve:kv_pages_used", "KV pages held by running sequences.", stats.num_pages_used)
        yield _gauge("jaxserve:kv_pages_cached", "Unheld KV pages whose content a later prompt may reuse.",
                     stats.num_pages_cached)
        yield _gauge("jaxserve:kv_pages_free", "Unheld KV pages with no reusable content.", stats.num_pages_free)
        yield _gauge("jaxserve:kv_cache_usage_perc", "Fraction of KV pages held (cached ones count as free).",
                     stats.num_pages_used / total_pages if total_pages else 0.0)
        yield _gauge("jaxserve:prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / tokens looked up.",
                     stats.prefix_hit_rate)
        yield _counter("jaxserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                       stats.prefix_queried_tokens)
        yield _counter("jaxserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                       stats.prefix_hit_tokens)
        yield _counter("jaxserve:num_preemptions", "Sequences preempted (pages taken back, recomputed later).",
                       stats.num_preemptions)
        yield _counter("jaxserve:num_engine_steps", "Batches the engine has run.", stats.num_steps)
        yield from _spec_decode_counters(stats.spec_decode)


def _spec_decode_counters(spec: SpecDecodeStats) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters (all 0 when speculation is off)."""
    yield _counter("jaxserve:spec_decode_num_drafts", "Sequence steps that brought drafts.", spec.num_drafts)
    yield _counter("jaxserve:spec_decode_num_draft_tokens", "Draft tokens proposed.", spec.num_draft_tokens)
    yield _counter("jaxserve:spec_decode_num_accepted_tokens", "Draft tokens the target accepted.",
                   spec.num_accepted_tokens)
    per_position = CounterMetricFamily("jaxserve:spec_decode_num_accepted_tokens_per_pos",
                                       "Draft tokens accepted, by their position in the draft run (from 0).",
                                       labels=["position"])
    for position, count in enumerate(spec.accepted_per_position):
        per_position.add_metric([str(position)], count)
    yield per_position


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)
