"""benchmarks/lora_kernels.py's smoke run: every form of the LoRA delta timed against the projection, agreeing with
the gather form, and the JSON and plot written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SMOKE_TIMEOUT_S = 300


@pytest.mark.slow
def test_a_smoke_run_times_every_form_and_they_agree(tmp_path):
    out = tmp_path / "lora_kernels.json"
    done = subprocess.run([sys.executable, "lora_kernels.py", "--smoke", "--out", str(out)], cwd=REPO / "benchmarks",
                          capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["copy_bytes_per_s"] > 0 and set(report["projections"]) == {"q_proj", "gate_proj"}
    for points in report["projections"].values():
        assert [p["tokens"] for p in points] == [1, 8]
        for point in points:
            assert set(point["median_s"]) == {"base", "onehot", "gather", "pallas"}
            assert all(seconds > 0 for seconds in point["median_s"].values())
            assert all(error < 1e-4 for error in point["max_abs_error_vs_gather"].values()), point
            assert point["adapter_bytes"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
