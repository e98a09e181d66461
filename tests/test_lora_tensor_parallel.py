"""LoRA adapters under tensor parallelism, on 8 simulated CPU devices: the adapter slots split as their projections'
weights do, and a batch mixing the base model and two adapters gives TP 1's greedy tokens at TP 2 and 4.

The checks run in one subprocess (tests/lora_tensor_parallel_probe.py), since the device count must be set before JAX
starts. The built-in model has 4 attention heads and 2 KV heads, so TP 4 runs with its KV heads repeated, and an
adapter's k_proj and v_proj B rows repeated with them.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxserve.parallel.collectives import predicted_step_collectives
from tests.test_lora_engine import builtin_config

ROOT = Path(__file__).resolve().parent.parent
PROBE = "tests.lora_tensor_parallel_probe"  # run as a module from ROOT, so that it can import the tests' helpers
SPLIT_TP_SIZES = (2, 4)
# The projections' A f[layers, slots, r, in] and B f[layers, slots, out, r] partitions: a column-parallel projection
# (weight split over out) splits B's out axis, a row-parallel one (split over in) splits A's in axis.
COLUMN = dict(a=[None, None, None, None], b=[None, None, "tp", None])
ROW = dict(a=[None, None, None, "tp"], b=[None, None, None, None])
EXPECTED_SPECS = {"q_proj": COLUMN, "k_proj": COLUMN, "v_proj": COLUMN, "o_proj": ROW, "gate_proj": COLUMN,
                  "up_proj": COLUMN, "down_proj": ROW}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict[int, dict]:
    work = tmp_path_factory.mktemp("lora_tensor_parallel")
    done = subprocess.run([sys.executable, "-m", PROBE, str(work)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return {int(tp): engine for tp, engine in json.loads(done.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("tp", SPLIT_TP_SIZES)
def test_a_mixed_adapter_batch_gives_the_single_device_greedy_tokens(report, tp):
    for names, batch in report[tp]["batches"].items():
        reference = report[1]["batches"][names]
        assert batch["tokens"] == reference["tokens"], f"TP={tp}, adapters {names}"
        for got, expected in zip(batch["logprobs"], reference["logprobs"]):
            np.testing.assert_allclose(got, expected, atol=1e-4)


def test_every_adapter_changes_the_output(report):
    """Else equal tokens would prove little: a batch's thirds are the base model's, the first and the second
    adapter's continuations of the same prompts."""
    for names, batch in report[1]["batches"].items():
        base, first, second = (batch["tokens"][i * 2:(i + 1) * 2] for i in range(3))
        assert base != first and base != second and first != second, f"adapters {names}"


@pytest.mark.parametrize("tp", SPLIT_TP_SIZES)
def test_each_projections_slots_are_split_as_its_weight(report, tp):
    stack = report[tp]["stack"]
    for leaf in ("a", "b"):
        for projection, expected in EXPECTED_SPECS.items():
            got = stack[leaf][projection]
            assert got["spec"] == expected[leaf], f"TP={tp} {projection}.{leaf}"
            split_axis = expected[leaf].index("tp") if "tp" in expected[leaf] else None
            shard = [size // tp if axis == split_axis else size for axis, size in enumerate(got["shape"])]
            assert got["shard_shape"] == shard, f"TP={tp} {projection}.{leaf}"


def test_the_single_device_stack_is_whole(report):
    stack = report[1]["stack"]
    assert all(entry["shard_shape"] == entry["shape"] for leaf in stack.values() for entry in leaf.values())


@pytest.mark.parametrize("tp", (1, *SPLIT_TP_SIZES))
def test_slot_writes_keep_the_shardings_so_nothing_recompiles(report, tp):
    # Each engine's batches rewrite its two slots (two or three adapters): a write that changed a sharding would
    # make the compiled step programs refuse the stack, or recompile.
    assert report[tp]["compiles_after_warmup"] == 0


@pytest.mark.parametrize("tp", SPLIT_TP_SIZES)
def test_the_adapters_add_no_collective_of_their_own(report, tp):
    """A row-parallel projection's partial A @ x is reduced in the same all-reduce as the base matmul's partial sums
    (XLA combines them: a tuple all-reduce), a column-parallel one needs none: still two all-reduces per layer, one
    for the embedding, and one all-gather (the sampled rows' logits); no adapter weight is ever gathered."""
    collectives, predicted = report[tp]["collectives"], predicted_step_collectives(builtin_config(), tp)
    assert collectives["counted"].get("all-reduce", 0) == predicted["all-reduce"], collectives
    assert collectives["counted"].get("all-gather", 0) == predicted["all-gather"] == 1, collectives
    assert set(collectives["counted"]) <= {"all-reduce", "all-gather"}, collectives
