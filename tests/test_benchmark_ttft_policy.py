"""benchmarks/ttft_policy.py: its burst is seeded and mixed as asked, the two policies differ only in the partial-
prefill limits, and a tiny run reports TTFT per policy and class with the invariants scheduling must keep (no token
changes, no compile after warm-up, the same work for both policies)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import ttft_policy  # noqa: E402

SMOKE_TIMEOUT_S = 300  # about 7 s with a warm compilation cache, a minute or two cold on a busy 2-core machine
VOCAB = 512


def test_the_burst_mixes_long_and_short_prompts_fresh_each_round():
    args = ttft_policy.parse_args(["--smoke"])
    burst = ttft_policy.make_burst(args, 1, VOCAB)
    kinds = [kind for kind, _ in burst]
    assert kinds.count("long") == args.num_long and kinds.count("short") == args.num_short
    assert {len(p) for kind, p in burst if kind == "long"} == {args.long_len}
    assert {len(p) for kind, p in burst if kind == "short"} == {args.short_len}
    assert all(ttft_policy.FIRST_TOKEN_ID <= t < VOCAB for _, p in burst for t in p)
    assert ttft_policy.make_burst(args, 1, VOCAB) == burst  # seeded
    assert ttft_policy.make_burst(args, 2, VOCAB) != burst  # fresh each round


def test_the_policies_differ_only_in_the_partial_prefill_limits():
    args = ttft_policy.parse_args(["--max-num-partial-prefills", "3", "--max-long-partial-prefills", "2"])
    assert ttft_policy.policies(args) == {
        "before": {"max_num_partial_prefills": 1},
        "after": {"max_num_partial_prefills": 3, "max_long_partial_prefills": 2, "long_prefill_token_threshold": 0}}
    with pytest.raises(SystemExit):
        ttft_policy.parse_args(["--long-len", "2040"])  # no room for the outputs within max_model_len


@pytest.mark.slow
def test_a_tiny_run_reports_ttft_per_policy_and_class(tmp_path):
    out = tmp_path / "ttft.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "ttft_policy.py"), "--smoke", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    settings = report["settings"]
    assert report["outputs_identical"] and report["compiles_after_warmup"] == {"before": 0, "after": 0}
    assert report["long_prefill_tokens"] == settings["long_prefill_token_threshold"]
    assert len(report["rounds"]) == settings["rounds"]
    requests = settings["num_long"] + settings["num_short"]
    for record in report["rounds"]:
        assert sorted(record["order"]) == ["after", "before"]
        for policy in ("before", "after"):
            assert len(record[f"{policy}_ttft_s"]) == requests and min(record[f"{policy}_ttft_s"]) > 0
            assert record[policy]["steps"] > 0 and record[policy]["makespan_s"] >= max(record[f"{policy}_ttft_s"])
    summary = report["summary"]
    for policy in ("before", "after"):
        for name in ("all", "short", "long"):
            for unit in ("ttft_s", "ttft_steps"):
                p50, p95 = summary[policy][name][unit]["p50"], summary[policy][name][unit]["p95"]
                assert 0 < p50 <= p95
    ratios = {f"{name}_ttft_{q}" for name in ("all", "short", "long") for q in ("p50", "p95")} | {"makespan"}
    assert set(summary["ratio"]) == ratios
    assert all(ratio > 0 for ratio in summary["ratio"].values())
    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    assert "after/before" in done.stdout.splitlines()[-8]  # the table is printed last
