"""The model families split over 2 and 4 simulated CPU devices give HF's greedy tokens and logprobs, as one device
does (tests/test_model_families.py): Qwen2's biases split with their projections' outputs (KV biases repeated with
their heads at TP 4), Qwen3's q/k norms replicated, and Mistral's windowed layers masked inside shard_map by the
Pallas kernel (the XLA backend's window under shard_map is the same wrapper's; tests/model_families_probe.py's RUNS
says which family runs at which size).

The engines run in one subprocess (tests/model_families_probe.py), since the device count must be set before JAX
starts; the checkpoints and HF's answers are made here.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.hf_models import save_tiny_hf_model  # noqa: E402
from tests.model_families_probe import RUNS, prompts  # noqa: E402
from tests.test_model_families import ENGINE_STYLES, LOGPROB_ATOL, VOCAB, hf_greedy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROBE = "tests.model_families_probe"  # run as a module from ROOT, so that it can import the tests' helpers

pytestmark = [pytest.mark.slow, pytest.mark.parity]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """(probe report, HF's (tokens, logprobs) per style and prompt)."""
    work = tmp_path_factory.mktemp("families_tp")
    expected = {}
    for style in ENGINE_STYLES:
        model = save_tiny_hf_model(work / style, style, vocab_size=VOCAB)
        expected[style] = [hf_greedy(model, p, new_tokens=12) for p in prompts()]
    done = subprocess.run([sys.executable, "-m", PROBE, str(work), *ENGINE_STYLES], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), expected


def assert_same_run(run: dict, expected: list[tuple[list[int], np.ndarray]]):
    assert run["tokens"] == [tokens for tokens, _ in expected]
    for got, (_, logprobs) in zip(run["logprobs"], expected, strict=True):
        np.testing.assert_allclose(got, logprobs, atol=LOGPROB_ATOL)
    assert run["compiles_after_warmup"] == 0


@pytest.mark.parametrize("style, run", [(style, name) for style in ENGINE_STYLES for name, _, _ in RUNS[style]])
def test_each_tensor_parallel_run_gives_hf_greedy_tokens_and_logprobs(families, style, run):
    report, expected = families
    assert_same_run(report[style][run], expected[style])



def test_importing_the_probe_leaves_this_processs_devices_alone():
    """The probe asks XLA for 8 host devices only when run: imported (for RUNS), it must not put that into the test
    process's environment, which every process the suite starts inherits."""
    assert "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
