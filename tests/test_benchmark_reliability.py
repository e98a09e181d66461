"""benchmarks/reliability.py at a tiny size, so that the script keeps working: it starts the real server with an API
keys file, sends every kind of client, and its report holds and passes its own checks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_tiny_reliability_run_passes_its_checks(tmp_path):
    out, plot = tmp_path / "reliability.json", tmp_path / "reliability.png"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "reliability.py"), "--requests", "20",
                           "--concurrency", "8", "--output-len", "4", "--slow-max-tokens", "300", "--stream-timeout",
                           "1", "--out", str(out), "--plot", str(plot)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert all(report["checks"].values()), report["checks"]
    assert report["http_5xx"] == report["stream_errors"] == 0
    assert sum(sum(outcomes.values()) for outcomes in report["outcomes"].values()) == report["requests"] == 20
    assert report["outcomes"]["leaver"].get("left", 0) + report["outcomes"]["leaver"].get("http_429", 0) == 4
    # The clients' 429 counts are the server's own, key by key.
    assert report["rate_limited_by_key"] == {name: int(count)
                                             for name, count in report["server_rate_limited_by_key"].items()}
    assert report["rate_limited_by_key"]["capped-requests"] > 0
    assert report["kv_after"]["kv_pages_used"] == 0 and report["kv_after"]["kv_cache_usage_perc"] == 0
    assert {"high", "low"} == set(report["ttft_ms_by_priority"])
    assert all(figures["count"] > 0 for figures in report["ttft_ms_by_priority"].values())
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert done.stdout.strip().splitlines()[-1].startswith("checks: ")
