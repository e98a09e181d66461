"""benchmarks/speculative.py: its workload repeats itself, its replayed drafts have the quality asked for, and a tiny
run reports every mode with the invariants speculation must keep (no token changes; perfect drafts take fewer target
steps per token, wrong ones are never accepted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import speculative as spec_benchmark  # noqa: E402
from jaxserve.engine.ngram_proposer import NgramProposer  # noqa: E402
from jaxserve.speculative_config import SpeculativeConfig  # noqa: E402

SMOKE_TIMEOUT_S = 300  # about 15 s with a warm compilation cache, a few minutes cold on a busy 2-core machine
VOCAB = 512


def test_prompts_copy_themselves_so_prompt_lookup_finds_drafts():
    args = spec_benchmark.parse_args(["--smoke"])
    prompts = spec_benchmark.make_workload(args, index=1, batch=4, vocab_size=VOCAB)
    assert len(prompts) == args.waves * 4
    assert max(map(len, prompts)) <= spec_benchmark.longest_prompt(args)
    assert args.max_model_len >= spec_benchmark.longest_prompt(args) + args.output_len
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=1))
    assert all(proposer.propose(prompt, 3) for prompt in prompts)
    assert spec_benchmark.make_workload(args, 1, 4, VOCAB) == prompts  # seeded
    assert spec_benchmark.make_workload(args, 2, 4, VOCAB) != prompts  # fresh each round


def test_replayed_drafts_are_right_with_the_chance_asked_for():
    prompt, continuation = tuple(range(20, 30)), tuple(range(100, 140))
    runs = [prompt + continuation]
    perfect = spec_benchmark.ReplayProposer(runs, 1.0, VOCAB, seed=(0,))
    assert perfect.propose(prompt + continuation[:5], 4) == continuation[5:9]
    assert perfect.propose(prompt + continuation[:38], 4) == continuation[38:]  # no further than the run
    assert perfect.propose(tuple(range(300, 310)), 4) == ()  # a prompt it does not know
    wrong = spec_benchmark.ReplayProposer(runs, 0.0, VOCAB, seed=(0,))
    drafts = [wrong.propose(prompt + continuation[:i], 4) for i in range(30)]
    assert all(d != t for drafted, i in zip(drafts, range(30)) for d, t in zip(drafted, continuation[i:]))
    assert all(0 <= d < VOCAB for drafted in drafts for d in drafted)
    half = spec_benchmark.ReplayProposer(runs, 0.5, VOCAB, seed=(1,))
    right = [d == t for i in range(36) for d, t in zip(half.propose(prompt + continuation[:i], 4), continuation[i:])]
    assert 0.3 < np.mean(right) < 0.7
    assert spec_benchmark.iid_expected_accepted(0.5, 3) == 0.5 + 0.25 + 0.125


@pytest.mark.slow
def test_a_tiny_run_reports_every_mode_and_keeps_speculations_invariants(tmp_path):
    out = tmp_path / "speculative.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "speculative.py"), "--smoke", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    modes = ["plain", "no-drafts", "ngram", "replay@0", "replay@1"]
    assert report["modes"] == modes and set(report["results"]) == {"1", "4"}
    assert report["outputs_identical"] and report["compiles_after_warmup"] == {"plain": 0, "speculative": 0}
    for batch, by_mode in report["results"].items():
        assert list(by_mode) == modes
        assert all(row["outputs_identical"] and row["tokens_per_s"] > 0 for row in by_mode.values())
        assert len(report["runs"][batch]["plain"]) == report["settings"]["rounds"]
        plain, perfect, hopeless = by_mode["plain"], by_mode["replay@1"], by_mode["replay@0"]
        assert plain["draft_tokens"] == by_mode["no-drafts"]["draft_tokens"] == 0
        assert perfect["draft_tokens"] > 0 and perfect["accepted_tokens"] == perfect["draft_tokens"]
        assert perfect["acceptance_rate"] == 1.0 and perfect["steps_per_token"] < plain["steps_per_token"]
        assert perfect["steps_vs_plain"] < 1
        assert hopeless["draft_tokens"] > 0 and hopeless["accepted_tokens"] == 0
        assert hopeless["steps_per_token"] == pytest.approx(plain["steps_per_token"], rel=0.1)
    assert (tmp_path / "speculative.png").read_bytes().startswith(b"\x89PNG")
