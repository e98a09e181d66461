"""benchmarks/tensor_parallel.py: the 70B memory plan against hand-computed numbers, and a tiny timing run whose
step programs hold exactly the collectives the sharding rules predict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.engine.kv_sizing import STEP_IO_MARGIN_SHARE, XLA_SCHEDULER_MEMORY_SHARE

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import tensor_parallel as tp_benchmark  # noqa: E402

GB = 10**9
# Llama-3.1-70B's parameters by hand: per layer q (8192x8192), k and v (1024x8192 each), o (8192x8192), gate, up and
# down (28672x8192 each), two norms (8192 each); the embedding and lm_head (128256x8192 each); the final norm.
LAYER_PROJECTIONS = 8192 * 8192 * 2 + 1024 * 8192 * 2 + 28672 * 8192 * 3
VOCAB_TABLE = 128256 * 8192
PARAMS_70B = 80 * (LAYER_PROJECTIONS + 2 * 8192) + 2 * VOCAB_TABLE + 8192


def row(rows, weights: str, kv: str, tp: int) -> tp_benchmark.MemoryPlanRow:
    return next(r for r in rows if (r.weights_dtype, r.kv_dtype, r.tensor_parallel_size) == (weights, kv, tp))


@pytest.fixture(scope="module")
def plan():
    return tp_benchmark.memory_plan()


def test_70b_bf16_weights_are_141_gb_split_evenly(plan):
    assert PARAMS_70B == 70_553_706_496
    for tp in (2, 4, 8):
        # Every tensor but the norms is split; the norms (161 x 8192) are replicated on each device.
        replicated_norms = (2 * 80 + 1) * 8192 * 2
        expected = (PARAMS_70B * 2 - replicated_norms) // tp + replicated_norms
        assert row(plan, "bfloat16", "bfloat16", tp).weight_bytes == expected
    assert row(plan, "bfloat16", "bfloat16", 2).weight_bytes * 2 == pytest.approx(141.1 * GB, rel=1e-3)


def test_fp8_weights_quantize_the_layer_projections_only(plan):
    # Projections at 1 byte; embedding, lm_head and norms stay at 2 bytes.
    total = 80 * LAYER_PROJECTIONS + 2 * (2 * VOCAB_TABLE + (2 * 80 + 1) * 8192)
    replicated_norms = (2 * 80 + 1) * 8192 * 2
    assert row(plan, "float8_e4m3fn", "bfloat16", 2).weight_bytes == (total - replicated_norms) // 2 + replicated_norms


def test_kv_bytes_per_token_are_split_over_the_kv_heads(plan):
    whole = 2 * 80 * 8 * 128 * 2  # K and V, layers, KV heads, head_dim, bf16 bytes
    assert whole == 327_680
    for tp in (2, 4, 8):
        assert row(plan, "bfloat16", "bfloat16", tp).kv_bytes_per_token == whole // tp
        assert row(plan, "float8_e4m3fn", "float8_e4m3fn", tp).kv_bytes_per_token == whole // tp // 2


def test_pages_are_what_is_left_after_utilization_weights_and_workspace(plan):
    r = row(plan, "float8_e4m3fn", "bfloat16", 2)
    # gpu_memory_utilization 0.9, capped at the share XLA:GPU's scheduler plans within (engine/kv_sizing.py)
    share = min(0.9, XLA_SCHEDULER_MEMORY_SHARE - STEP_IO_MARGIN_SHARE)
    assert share == pytest.approx(0.79)
    budget = tp_benchmark.H100_80GB_BYTES * share - r.weight_bytes - 2 * 2**30
    assert r.kv_pages == int(budget // (r.kv_bytes_per_token * 16))
    assert r.max_seqs == r.kv_pages // 256  # 4096-token sequences of 16-token pages


def test_weights_that_do_not_fit_leave_no_pages():
    rows = tp_benchmark.memory_plan(tp_sizes=(2,), device_bytes=int(tp_benchmark.H100_80GB_BYTES * 0.75))
    assert row(rows, "bfloat16", "bfloat16", 2).kv_pages == 0
    assert row(rows, "bfloat16", "bfloat16", 2).max_seqs == 0


@pytest.mark.slow
def test_tiny_timing_run_reports_the_predicted_collectives(tmp_path):
    # One layer and one decode row: 5 step programs per engine to compile.
    out = tmp_path / "tp.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "tensor_parallel.py"), "--tp-sizes", "1", "2", "--layers", "1", "--hidden",
         "64", "--heads", "4", "--kv-heads", "2", "--batch", "1", "--decode-warm-steps", "2", "--decode-steps", "4",
         "--rounds", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    sizes = json.loads(out.read_text())["tensor_parallel"]
    assert sizes["1"]["collectives"] == {}
    # One layer: two all-reduces, one for the vocabulary-split embedding lookup, one gather of the sampled logits.
    assert sizes["2"]["collectives"] == sizes["2"]["predicted"] == {"all-reduce": 3, "all-gather": 1}
    # One row's logits are computed as two (runner/step.py: XLA would copy the lm_head for a one-row product).
    assert [shape.split("{")[0] for shape in sizes["2"]["all_gather_shapes"]] == ["f32[2,512]"]
    assert len(sizes["2"]["median_step_ms_per_round"]) == 1


def test_the_rules_predict_one_embedding_all_reduce_and_one_gather_only_for_a_split_vocabulary():
    from jaxserve.model.config import LlamaConfig
    from jaxserve.parallel.collectives import predicted_step_collectives

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    assert predicted_step_collectives(cfg, 1) == {}
    assert predicted_step_collectives(cfg, 8) == {"all-reduce": 3, "all-gather": 1}
    # An odd vocabulary leaves embedding and lm_head whole: only the layers' all-reduces remain.
    assert predicted_step_collectives(LlamaConfig(**{**cfg.__dict__, "vocab_size": 511}), 2) == {"all-reduce": 2}
