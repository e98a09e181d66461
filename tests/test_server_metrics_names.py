"""/metrics under `--metrics-prefix vllm` against vLLM's own names, types, labels and buckets for the metrics both
servers have; and the default `jaxserve:` exposition as it was."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.engine.scheduler_stats import SchedulerStats, SpecDecodeStats
from jaxserve.engine.startup import StartupStats
from jaxserve.errors import ConfigError
from jaxserve.outputs import CompletionDelta
from jaxserve.server.config import ServerConfig
from jaxserve.runner.step_programs import ProgramSources
from jaxserve.server.metrics import ServerMetrics
from tests.live_server import running_server

# --- the oracle: vLLM's metrics that jaxserve has too, written from vLLM's source (vllm-project/vllm) -------------
# vllm/v1/metrics/loggers.py, PrometheusStatLogger.__init__, the v0.12 line (the revision whose comment reads "With
#   0.12.x you can enable with --show-hidden-metrics-for-version=0.11"): every series is labelled
#   ["model_name", "engine"] (the served model name, the engine index); request_success adds "finished_reason".
# The same file at commit 005a810bc40faa25b8870fbc8559c3462581eee3 (the v0.10 line): vllm:gpu_cache_usage_perc
#   (deprecated in 0.9 for kv_cache_usage_perc) and vllm:time_per_output_token_seconds (which 0.11 renamed
#   inter_token_latency_seconds), both still read by older dashboards and endpoint pickers.
# vllm/v1/spec_decode/metrics.py, SpecDecodingProm, commit 016a8587edb04ae53c913a1da9355a07dc0ca4ae: the four
#   spec_decode counters, the per-position one labelled "position" too.
# Family names as prometheus_client reports them: a counter's samples add `_total`.
VLLM_LABELS = frozenset({"model_name", "engine"})
VLLM_SHARED = {
    "vllm:num_requests_running": ("gauge", VLLM_LABELS),
    "vllm:num_requests_waiting": ("gauge", VLLM_LABELS),
    "vllm:kv_cache_usage_perc": ("gauge", VLLM_LABELS),
    "vllm:gpu_cache_usage_perc": ("gauge", VLLM_LABELS),
    "vllm:prefix_cache_queries": ("counter", VLLM_LABELS),
    "vllm:prefix_cache_hits": ("counter", VLLM_LABELS),
    "vllm:num_preemptions": ("counter", VLLM_LABELS),
    "vllm:prompt_tokens": ("counter", VLLM_LABELS),
    "vllm:generation_tokens": ("counter", VLLM_LABELS),
    "vllm:request_success": ("counter", VLLM_LABELS | {"finished_reason"}),
    "vllm:time_to_first_token_seconds": ("histogram", VLLM_LABELS),
    "vllm:inter_token_latency_seconds": ("histogram", VLLM_LABELS),
    "vllm:time_per_output_token_seconds": ("histogram", VLLM_LABELS),
    "vllm:e2e_request_latency_seconds": ("histogram", VLLM_LABELS),
    "vllm:spec_decode_num_drafts": ("counter", VLLM_LABELS),
    "vllm:spec_decode_num_draft_tokens": ("counter", VLLM_LABELS),
    "vllm:spec_decode_num_accepted_tokens": ("counter", VLLM_LABELS),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("counter", VLLM_LABELS | {"position"}),
}
# The bucket bounds vLLM gives its latency histograms (same file and revision)
_VLLM_ITL_BOUNDS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0]
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": _VLLM_ITL_BOUNDS,
    "vllm:time_per_output_token_seconds": _VLLM_ITL_BOUNDS,
    "vllm:e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                         60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
}
# Ours that vLLM lacks: served under the chosen prefix, with vLLM's labels added under vllm
OURS_ONLY = ["kv_pages_used", "kv_pages_cached", "kv_pages_free", "prefix_cache_hit_rate", "num_engine_steps",
             "num_requests_rejected", "api_key_requests", "api_key_rate_limited", "api_key_prompt_tokens",
             "api_key_generation_tokens", "startup_ready_seconds", "startup_programs"]

# The default exposition as it was before the prefix existed: these families, unlabelled but for their own labels
JAXSERVE_FAMILIES = {
    "jaxserve:num_requests_running": "gauge", "jaxserve:num_requests_waiting": "gauge",
    "jaxserve:kv_pages_used": "gauge", "jaxserve:kv_pages_cached": "gauge", "jaxserve:kv_pages_free": "gauge",
    "jaxserve:kv_cache_usage_perc": "gauge", "jaxserve:prefix_cache_hit_rate": "gauge",
    "jaxserve:prefix_cache_queries": "counter", "jaxserve:prefix_cache_hits": "counter",
    "jaxserve:num_preemptions": "counter", "jaxserve:num_engine_steps": "counter",
    "jaxserve:spec_decode_num_drafts": "counter", "jaxserve:spec_decode_num_draft_tokens": "counter",
    "jaxserve:spec_decode_num_accepted_tokens": "counter",
    "jaxserve:spec_decode_num_accepted_tokens_per_pos": "counter",
    "jaxserve:time_to_first_token_seconds": "histogram", "jaxserve:inter_token_latency_seconds": "histogram",
    "jaxserve:e2e_request_latency_seconds": "histogram", "jaxserve:prompt_tokens": "counter",
    "jaxserve:generation_tokens": "counter", "jaxserve:request_success": "counter",
    "jaxserve:num_requests_rejected": "counter", "jaxserve:api_key_requests": "counter",
    "jaxserve:api_key_rate_limited": "counter", "jaxserve:api_key_prompt_tokens": "counter",
    "jaxserve:api_key_generation_tokens": "counter",
    "jaxserve:startup_ready_seconds": "gauge", "jaxserve:startup_programs": "gauge",
}
# Our 1-2.5-5 ladders, written out: TTFT 1 ms .. 100 s, ITL 0.1 ms .. 10 s, E2E 10 ms .. 1000 s
JAXSERVE_BUCKETS = {
    "jaxserve:time_to_first_token_seconds": [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                             10.0, 25.0, 50.0, 100.0],
    "jaxserve:inter_token_latency_seconds": [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                             0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
    "jaxserve:e2e_request_latency_seconds": [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0,
                                             100.0, 250.0, 500.0, 1000.0],
}

MODEL = "my-model"
STATS = SchedulerStats(num_running=2, num_waiting=3, num_pages_used=5, num_pages_free=10, num_pages_cached=5,
                       num_preemptions=1, prefix_queried_tokens=40, prefix_hit_tokens=16, num_steps=9,
                       spec_decode=SpecDecodeStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=7,
                                                   accepted_per_position=[4, 2, 1]))
STARTUP = StartupStats(programs=6, load_seconds=0.5, lower_seconds=0.0, compile_seconds=0.1, ready_seconds=0.6,
                       sources=ProgramSources(store=5, cache=0, compiled=1))


def exercised_metrics() -> ServerMetrics:
    """Metrics with a sample in every series: a request of two continuations (one ends by length, one is aborted),
    one API key, one admission refusal."""
    metrics = ServerMetrics(lambda: STATS, STARTUP)
    metrics.declare_api_keys(["team-a"])
    metrics.count_rejected("overloaded")
    observer = metrics.request_observer(num_prompt_tokens=11, n=2)
    for index, finish_reason in [(0, None), (1, None), (0, "length"), (1, None)]:
        observer.observe(CompletionDelta("request-0", index, "ab", (1, 2), None, finish_reason, None))
    observer.close("abort")
    return metrics


def families(text: str) -> dict:
    """The exposition's families by name, less the `X_created` gauges prometheus_client writes beside every counter
    and histogram X (vLLM's exposition has them too)."""
    return {family.name: family for family in text_string_to_metric_families(text)
            if not family.name.endswith("_created")}


def scraped(metrics: ServerMetrics, *prefix_and_model: str) -> dict:
    return families(metrics.exposition(*prefix_and_model)[0].decode())


def label_names(family) -> set[frozenset]:
    """The label sets of a family's samples, a histogram's `le` aside."""
    return {frozenset(sample.labels) - {"le"} for sample in family.samples}


def bucket_bounds(family) -> list[float]:
    return [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]


def check_vllm_families(exposed: dict, model_name: str) -> None:
    """Every shared metric is there with vLLM's type, labels and buckets; every series carries model and engine."""
    for name, (kind, labels) in VLLM_SHARED.items():
        assert name in exposed, f"{name} missing"
        assert exposed[name].type == kind, name
        assert label_names(exposed[name]) <= {labels}, name  # none: a series not yet seen (per_pos, no drafts)
        if kind == "counter":  # the sample names queries use
            assert {s.name for s in exposed[name].samples} <= {name + "_total"}, name
    for name, bounds in VLLM_BUCKETS.items():
        assert bucket_bounds(exposed[name]) == bounds, name
    for name, family in exposed.items():
        assert name.startswith("vllm:"), name
        for sample in family.samples:
            assert sample.labels["model_name"] == model_name and sample.labels["engine"] == "0", sample


def test_vllm_prefix_serves_vllms_names_types_labels_and_buckets():
    exposed = scraped(exercised_metrics(), "vllm", MODEL)
    check_vllm_families(exposed, MODEL)
    assert all(exposed[name].samples for name in VLLM_SHARED)
    assert set(exposed) == set(VLLM_SHARED) | {"vllm:" + name for name in OURS_ONLY}
    reasons = {s.labels["finished_reason"] for s in exposed["vllm:request_success"].samples}
    assert reasons == {"length", "abort"}


def test_vllm_prefix_carries_the_same_values_under_vllms_names():
    metrics = exercised_metrics()
    ours, theirs = scraped(metrics, "jaxserve", MODEL), scraped(metrics, "vllm", MODEL)
    former = {"vllm:gpu_cache_usage_perc": "kv_cache_usage_perc",
              "vllm:time_per_output_token_seconds": "inter_token_latency_seconds"}
    for name, family in theirs.items():
        own = ours["jaxserve:" + former.get(name, name.removeprefix("vllm:"))]
        own_values = {(s.name.removeprefix(own.name), frozenset(s.labels.items())): s.value for s in own.samples
                      if not s.name.endswith("_bucket")}
        for sample in family.samples:
            if not sample.name.endswith("_bucket"):  # _total, _count, _sum, _created, or the gauge itself
                labels = frozenset((k, v) for k, v in sample.labels.items() if k not in VLLM_LABELS)
                assert own_values[(sample.name.removeprefix(name), labels)] == sample.value, sample
    assert theirs["vllm:kv_cache_usage_perc"].samples[0].value == 5 / 20  # held pages / all pages


def test_each_prefix_counts_exactly_at_its_own_bucket_bounds():
    """The instruments count at both prefixes' bounds; each scrape must show its own, with the right counts."""
    metrics = ServerMetrics(lambda: STATS)
    for seconds in (0.003, 0.03, 0.7, 3.0):
        metrics.time_to_first_token.observe(seconds)

    def counts(prefix):
        family = scraped(metrics, prefix, MODEL)[f"{prefix}:time_to_first_token_seconds"]
        return {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}

    vllm, ours = counts("vllm"), counts("jaxserve")
    assert [vllm[le] for le in ("0.001", "0.005", "0.02", "0.04", "0.5", "0.75", "2.5", "5.0", "+Inf")] == \
        [0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert [ours[le] for le in ("0.001", "0.0025", "0.005", "0.025", "0.05", "0.5", "1.0", "2.5", "5.0", "+Inf")] == \
        [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert "0.75" not in ours and "0.0025" not in vllm


def test_default_prefix_is_unchanged():
    metrics = exercised_metrics()
    default = scraped(metrics)
    assert {name: family.type for name, family in default.items()} == JAXSERVE_FAMILIES
    assert scraped(metrics, "jaxserve", MODEL).keys() == default.keys()
    for name, bounds in JAXSERVE_BUCKETS.items():
        assert bucket_bounds(default[name]) == bounds, name
    for family in default.values():
        for sample in family.samples:
            assert not {"model_name", "engine"} & set(sample.labels), sample
    assert ServerConfig().metrics_prefix == "jaxserve"


def test_the_prefix_is_a_checked_setting_and_a_serve_flag():
    from jaxserve.cli import _build_parser

    assert ServerConfig(metrics_prefix="vllm").metrics_prefix == "vllm"
    with pytest.raises(ConfigError, match="metrics_prefix"):
        ServerConfig(metrics_prefix="sglang")
    assert _build_parser().parse_args(["serve", "--metrics-prefix", "vllm"]).metrics_prefix == "vllm"
    assert _build_parser().parse_args(["serve"]).metrics_prefix == "jaxserve"


@pytest.mark.slow
def test_a_live_server_with_the_vllm_prefix_serves_vllms_metrics(tmp_path):
    """The flag through the real server: a completion moves vLLM's series, labelled with the served model's name."""
    with running_server(tmp_path, "--metrics-prefix", "vllm", "--served-model-name", MODEL, "other-name") as live:
        body = {"model": MODEL, "prompt": "vLLM's names", "max_tokens": 3, "ignore_eos": True, "temperature": 0}
        response = httpx.post(live.base_url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        exposed = families(httpx.get(live.base_url + "/metrics", timeout=120).text)
    check_vllm_families(exposed, MODEL)

    def total(name: str, **labels: str) -> float:
        return sum(s.value for s in exposed[name].samples if s.name == name + "_total"
                   and labels.items() <= s.labels.items())

    assert total("vllm:generation_tokens") == 3
    assert total("vllm:prompt_tokens") == response.json()["usage"]["prompt_tokens"]
    assert total("vllm:request_success", finished_reason="length") == 1
    ttft_count = [s.value for s in exposed["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft_count == [1]
