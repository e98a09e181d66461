"""Prometheus metrics of one app, named like vLLM's (`jaxserve:` for `vllm:`) so its dashboards carry over.

`--metrics-prefix vllm` serves them as vLLM does: `vllm:` names, vLLM's `model_name` and `engine` labels on every
series, vLLM's histogram buckets, and two of vLLM's older names beside their successors, so vLLM's dashboards,
alerts, autoscalers and inference-gateway endpoint pickers read this server unchanged. The instruments are kept
once, under `jaxserve:`; each scrape renders them under the configured prefix (`_Exposition`).

Engine gauges are read from the engine thread's latest snapshot at scrape time. Request timings and token counts come
from one `RequestObserver` per engine request, fed by `streams.merged_events`, the path every request takes. Timings
are per continuation (each of a request's n choices), as vLLM times its child requests.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from jaxserve.engine.async_engine import EngineEvent
from jaxserve.engine.scheduler_stats import SchedulerStats, SpecDecodeStats
from jaxserve.engine.startup import StartupStats
from jaxserve.outputs import CompletionDelta
from jaxserve.server.api_keys_file import LIMIT_FIELDS


OWN_PREFIX = "jaxserve:"  # the instruments' names; a scrape under another prefix renames them
VLLM_ENGINE = "0"  # vLLM's `engine` label, the engine core's index: this server runs one engine
# vLLM's former names of two series (gpu_cache_usage_perc, renamed in 0.9; time_per_output_token_seconds, renamed
# in 0.11), which older dashboards and endpoint pickers still read: the vllm prefix serves both names of each.
VLLM_FORMER_NAMES = {"kv_cache_usage_perc": "gpu_cache_usage_perc",
                     "inter_token_latency_seconds": "time_per_output_token_seconds"}


def _ladder(low_exponent: int, high_exponent: int) -> list[float]:
    """1-2.5-5 steps per decade, 10**low_exponent .. 10**high_exponent: fine at GPU speeds and wide enough for a CPU."""
    steps = [float(f"{m}e{e}") for e in range(low_exponent, high_exponent) for m in (1, 2.5, 5)]
    return steps + [float(f"1e{high_exponent}")]


# Each histogram's bucket bounds under each prefix: ours, and vLLM's own (vllm/v1/metrics/loggers.py), so that an
# alert on one of vLLM's bounds (`le="0.75"`) finds it. The instrument counts at the bounds of both; a scrape keeps
# its prefix's, which is exact because buckets are cumulative.
TTFT_BUCKETS = {"jaxserve": _ladder(-3, 2),
                "vllm": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                         20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]}
ITL_BUCKETS = {"jaxserve": _ladder(-4, 1),
               "vllm": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                        40.0, 80.0]}
E2E_BUCKETS = {"jaxserve": _ladder(-2, 3),
               "vllm": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                        480.0, 960.0, 1920.0, 7680.0]}


class ServerMetrics:
    """The app's registry and the instruments the request path updates; one per app, never the global registry."""

    def __init__(self, engine_stats: Callable[[], SchedulerStats], startup: StartupStats | None = None):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(engine_stats))
        if startup is not None:
            self.registry.register(_StartupCollector(startup))
        # Histogram name (after the prefix) -> prefix -> the bucket bounds a scrape under that prefix shows
        self._bucket_bounds: dict[str, Mapping[str, list[float]]] = {}
        self.time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "From submission to a continuation's first token.", TTFT_BUCKETS)
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "Gap between consecutive tokens of a continuation.", ITL_BUCKETS)
        self.e2e_request_latency = self._histogram(
            "e2e_request_latency_seconds", "From submission to a continuation's last token.", E2E_BUCKETS)
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

    def _histogram(self, name: str, documentation: str, bounds: Mapping[str, list[float]]) -> Histogram:
        """A histogram counting at the bounds of every prefix; a scrape shows its own prefix's (`_Exposition`)."""
        self._bucket_bounds[name] = bounds
        every_bound = sorted(set().union(*bounds.values()))
        return Histogram(OWN_PREFIX + name, documentation, buckets=every_bound, registry=self.registry)

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

    def exposition(self, prefix: str = "jaxserve", model_name: str = "") -> tuple[bytes, str]:
        """The registry in Prometheus' text format under `prefix` ("jaxserve" or "vllm"; for vllm, `model_name` is
        the served model's name vLLM labels every series with), and that format's content type."""
        view = _Exposition(self.registry, prefix, model_name, self._bucket_bounds)
        return generate_latest(view), CONTENT_TYPE_LATEST


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


class _Exposition(Collector):
    """The registry's series as a scrape under one prefix shows them: renamed, with that prefix's histogram buckets,
    and under vllm with vLLM's labels and its former names too."""

    def __init__(self, registry: CollectorRegistry, prefix: str, model_name: str,
                 bucket_bounds: Mapping[str, Mapping[str, list[float]]]):
        self._registry = registry
        self._prefix = prefix
        # vLLM labels every series with the served model's name and the engine's index; ours adds none
        self._labels = {"model_name": model_name, "engine": VLLM_ENGINE} if prefix == "vllm" else {}
        self._bucket_bounds = bucket_bounds

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            name = family.name.removeprefix(OWN_PREFIX)
            bounds = self._bucket_bounds.get(name, {}).get(self._prefix)
            samples = [s for s in family.samples if bounds is None or _bucket_shown(s, bounds)]
            yield self._renamed(family, name, samples)
            if self._prefix == "vllm" and name in VLLM_FORMER_NAMES:
                yield self._renamed(family, VLLM_FORMER_NAMES[name], samples)

    def _renamed(self, family: Metric, name: str, samples: list[Sample]) -> Metric:
        renamed = Metric(f"{self._prefix}:{name}", family.documentation, family.type, family.unit)
        # A sample is named by its family plus a suffix (_total, _bucket, _sum, _created ...), which it keeps
        renamed.samples = [s._replace(name=renamed.name + s.name.removeprefix(family.name),
                                      labels={**self._labels, **s.labels}) for s in samples]
        return renamed


def _bucket_shown(sample: Sample, bounds: list[float]) -> bool:
    """Whether a histogram's sample is shown when its buckets are `bounds`: every sample but the other buckets."""
    upper = sample.labels.get("le") if sample.name.endswith("_bucket") else None
    return upper is None or upper == "+Inf" or float(upper) in bounds


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


class _StartupCollector(Collector):
    """How the engine started: its time to ready, and where its step programs came from."""

    def __init__(self, startup: StartupStats):
        self._startup = startup

    def collect(self) -> Iterator[Metric]:
        yield _gauge("jaxserve:startup_ready_seconds", "Seconds from the engine's start to ready to step.",
                     self._startup.ready_seconds)
        programs = GaugeMetricFamily("jaxserve:startup_programs", "Step programs at start-up by source: store "
                                     "(loaded whole), cache (JAX's compilation cache), compiled.", labels=["source"])
        for source, count in dataclasses.asdict(self._startup.sources).items():
            programs.add_metric([source], count)
        yield programs


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
