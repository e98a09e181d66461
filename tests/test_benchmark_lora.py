"""benchmarks/lora.py: requests spread round-robin over the adapters, ratios taken within each round, and a tiny run
that reports every variant with positive throughputs, adapters that change the outputs and a base model that gives
the same tokens with LoRA on and off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import lora as lora_benchmark  # noqa: E402
from jaxserve import LoRARequest  # noqa: E402

SMOKE_TIMEOUT_S = 400  # about 20 s with a warm compilation cache, a few minutes cold on a busy 2-core machine
# The limits of tests/test_lora_engine.py's engines (2 slots of rank 8; max_num_seqs 4, max_num_batched_tokens 64,
# max_model_len 128): the run finds their programs in the persistent compilation cache.
TINY = ["--num-requests", "4", "--prompt-len", "8", "--max-tokens", "4", "--rounds", "1", "--num-adapters", "2",
        "--rank", "8", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--max-model-len", "128"]


def fake_runs(speeds: list[float], outputs: tuple = ((1, 2), (3, 4))) -> list[lora_benchmark.RunResult]:
    """One run per round, each of 4 generated tokens at the round's tokens/s."""
    return [lora_benchmark.RunResult(wall_s=4 / speed, generated_tokens=4, steps=2, outputs=outputs)
            for speed in speeds]


def test_requests_spread_round_robin_and_prompts_are_fresh_each_round():
    adapters = [LoRARequest(f"a{i}", i + 1, f"folder{i}") for i in range(3)]
    assert [a.lora_int_id for a in lora_benchmark.round_robin(adapters, 7)] == [1, 2, 3, 1, 2, 3, 1]
    args = lora_benchmark.parse_args(["--num-requests", "5", "--prompt-len", "6", "--max-tokens", "3"])
    assert args.max_model_len == 9 and args.lora_off
    prompts = lora_benchmark.make_prompts(args, 1, vocab_size=50)
    assert len(prompts) == 5 and all(len(p["prompt_token_ids"]) == 6 for p in prompts)
    assert all(0 <= t < 50 for p in prompts for t in p["prompt_token_ids"])
    assert lora_benchmark.make_prompts(args, 1, 50) == prompts and lora_benchmark.make_prompts(args, 2, 50) != prompts
    with pytest.raises(SystemExit):
        lora_benchmark.parse_args(["--prompt-len", "60", "--max-tokens", "10", "--max-model-len", "64"])


def test_ratios_are_taken_within_each_round_and_the_outputs_compared():
    results = {"base": fake_runs([100.0, 50.0]), "adapters": fake_runs([90.0, 30.0], outputs=((1, 2), (3, 5))),
               "lora-off": fake_runs([200.0, 100.0])}
    summary = lora_benchmark.summarize(results)
    adapters_vs_base = summary["ratios"]["adapters / base"]
    assert adapters_vs_base["per_round"] == pytest.approx([0.9, 0.6])
    assert adapters_vs_base["median"] == pytest.approx(0.75) and not summary["meets_target"]
    assert summary["ratios"]["base / lora-off"]["per_round"] == pytest.approx([0.5, 0.5])
    assert summary["variants"]["base"]["tokens_per_s"] == pytest.approx(75.0)
    assert summary["checks"] == {"adapters_change_outputs": 0.5, "base_same_as_lora_off": True}
    assert "adapters / base: 0.75x (target >= 0.8x: NOT met)" in lora_benchmark.format_table(summary)
    del results["lora-off"]
    assert list(lora_benchmark.summarize(results)["ratios"]) == ["adapters / base"]


@pytest.mark.slow
def test_a_tiny_run_reports_every_variant(tmp_path):
    out = tmp_path / "lora.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "lora.py"), *TINY, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["jax_backend"] and report["settings"]["num_requests"] == 4
    assert list(report["variants"]) == ["base", "adapters", "lora-off"]
    assert report["compiles_after_warmup"] == {"lora-on": 0, "lora-off": 0}
    for variant, row in report["variants"].items():
        assert row["tokens_per_s"] > 0 and row["generated_tokens"] == 4 * 4
        assert len(report["runs"][variant]) == 1 == len(row["tokens_per_s_per_round"])
    speeds = {variant: row["tokens_per_s"] for variant, row in report["variants"].items()}
    ratio = report["ratios"]["adapters / base"]
    assert ratio["median"] == pytest.approx(speeds["adapters"] / speeds["base"]) == ratio["per_round"][0]
    assert report["ratios"]["base / lora-off"]["median"] == pytest.approx(speeds["base"] / speeds["lora-off"])
    assert report["meets_target"] == (ratio["median"] >= report["target_adapters_vs_base"])
    assert report["checks"]["adapters_change_outputs"] > 0 and report["checks"]["base_same_as_lora_off"]
    assert "adapters / base" in done.stdout
    assert (tmp_path / "lora.png").read_bytes().startswith(b"\x89PNG")
