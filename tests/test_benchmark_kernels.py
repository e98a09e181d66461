"""benchmarks/kernels.py: its byte and FLOP counting on hand-computed cases, and a whole --smoke run."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import kernels as kernel_benchmark  # noqa: E402
from kernels import AttentionShape, Batch, decode_batch, prefill_batch  # noqa: E402
from tests.cuda_lowering import CUDNN_ATTENTION_TARGET, export_for_h100, triton_calls  # noqa: E402

# 4 query heads over 2 KV heads of 8, pages of 16 tokens, bf16: one token slot's K and V are 2 * 2 * 8 * 2 = 64 B.
SHAPE = AttentionShape(heads=4, kv_heads=2, head_dim=8, page_size=16, dtype="bfloat16")
SMOKE_TIMEOUT_S = 600  # about 25 s of CPU on an idle 2-core machine; generous for a loaded one


def test_kv_bytes_count_whole_pages():
    # Lengths 1, 16 and 17 fill 1, 1 and 2 pages: 4 pages of 16 slots of 64 B.
    assert kernel_benchmark.kv_bytes_read([1, 16, 17], SHAPE) == 4 * 16 * 64


def test_decode_bytes_add_query_and_output():
    batch = Batch(seq_lens=(1, 16, 17), query_lens=(1, 1, 1))
    # KV pages, then 3 tokens' q read and output written: 2 * 3 * 4 heads * 8 * 2 B.
    assert kernel_benchmark.attention_bytes(batch, SHAPE) == 4096 + 384


def test_causal_flops_of_a_chunk_after_prior_context():
    # A chunk of 3 tokens after 4 cached ones sees 5, 6 and 7 slots; two such sequences see 36.
    batch = prefill_batch(num_seqs=2, chunk=3, prior=4)
    assert kernel_benchmark.visible_slots(batch) == 36
    assert kernel_benchmark.attention_flops(batch, SHAPE) == 4 * 4 * 8 * 36


def test_decode_query_sees_its_whole_sequence():
    assert kernel_benchmark.visible_slots(decode_batch(num_seqs=3, context=10)) == 30


def test_batch_tokens_are_each_sequences_last_positions():
    batch = prefill_batch(num_seqs=2, chunk=3, prior=4)
    assert batch.token_seq().tolist() == [0, 0, 0, 1, 1, 1]
    assert batch.positions().tolist() == [4, 5, 6, 4, 5, 6]
    assert decode_batch(num_seqs=2, context=5).positions().tolist() == [4, 4]


def test_block_tables_are_disjoint_random_pages_padded_with_the_null_page():
    tables = kernel_benchmark.random_block_tables(np.random.default_rng(0), [2, 3], sets=4)
    assert tables.shape == (4, 2, 3)
    assert (tables[:, 0, 2] == kernel_benchmark.NULL_PAGE).all()
    used = np.concatenate([tables[:, 0, :2].ravel(), tables[:, 1, :].ravel()])
    assert sorted(used.tolist()) == list(range(1, 21))


def test_small_points_rotate_through_page_sets_and_large_ones_do_not():
    batch = decode_batch(num_seqs=1, context=16)  # one page: 1 KiB of K and V
    assert kernel_benchmark.rotation_sets(batch, SHAPE, rotate_bytes=10 * 1024) == 10
    assert kernel_benchmark.pool_pages(batch, SHAPE, rotate_bytes=10 * 1024) == 11
    assert kernel_benchmark.rotation_sets(batch, SHAPE, rotate_bytes=512) == 1


@pytest.mark.parametrize("width, k_splits, padded", [(8, 16, 16), (512, 16, 512), (40, 4, 64), (13, 16, 16)])
def test_shipped_op_table_width_meets_its_asserts(width, k_splits, padded):
    tables = np.arange(1, 2 * width + 1, dtype=np.int32).reshape(2, width)
    result = np.asarray(kernel_benchmark.shipped_block_tables(tables, k_splits))
    assert result.shape == (2, padded)
    per_split = padded // k_splits
    block = min(per_split, kernel_benchmark.SHIPPED_PAGES_PER_COMPUTE_BLOCK)
    assert padded % k_splits == 0 and per_split % block == 0
    assert (result[:, :width] == tables).all() and (result[:, width:] == kernel_benchmark.NULL_PAGE).all()


def test_sweep_tunings_start_with_the_default_and_do_not_repeat():
    default = kernel_benchmark.DecodeTuning(pages_per_block=8, k_splits=1)
    tunings = kernel_benchmark.decode_tunings(default, sweep=True)
    assert tunings[0] == default and len(set(tunings)) == len(tunings) > 1
    assert kernel_benchmark.decode_tunings(default, sweep=False) == [default]


def _finite_timed(variant: dict) -> bool:
    seconds = variant["median_s"]
    return variant["error"] is None and seconds is not None and math.isfinite(seconds) and seconds > 0


@pytest.mark.slow
def test_smoke_run_measures_every_implementation_correctly(tmp_path):
    out = tmp_path / "smoke.json"
    completed = subprocess.run([sys.executable, str(BENCHMARKS / "kernels.py"), "--smoke", "--out", str(out)],
                               cwd=REPO, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    assert completed.returncode == 0, completed.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["complete"]
    ceilings = report["ceilings"]
    for name, figure in (("copy", "bytes_per_s"), ("matmul", "flops_per_s"), ("dispatch", "median_s")):
        assert math.isfinite(ceilings[name][figure]) and ceilings[name][figure] > 0, ceilings[name]
    for grid, implementations in (("decode", {"pallas", "shipped", "pallas_mixed", "xla"}),
                                  ("prefill", {"pallas", "xla"})):
        assert report[grid], f"no {grid} point"
        for point in report[grid]:
            assert {v["implementation"] for v in point["variants"]} == implementations
            for variant in point["variants"]:
                assert _finite_timed(variant), variant
                assert variant["rel_error"] < kernel_benchmark.CORRECT_REL_ERROR, variant
                assert variant["max_abs_error"] < 0.1, variant
            assert set(point["best"]) == implementations
            assert point["best"]["pallas"]["fraction_of_copy" if grid == "decode" else "fraction_of_matmul"] > 0


@pytest.mark.parametrize("grid, batch", [
    ("decode", decode_batch(num_seqs=1, context=128)),
    ("decode", decode_batch(num_seqs=8, context=512)),
    ("decode", decode_batch(num_seqs=256, context=32768)),
    ("prefill", prefill_batch(num_seqs=1, chunk=2048, prior=4096)),
    ("prefill", prefill_batch(num_seqs=16, chunk=128, prior=0)),
], ids=["decode-1x128", "decode-8x512", "decode-256x32k", "prefill-1x2048-after-4k", "prefill-16x128"])
def test_every_swept_variant_lowers_for_an_h100(grid, batch):
    """Each implementation and tuning of full-grid points (Llama-3-8B heads) passes the Pallas-to-Triton lowering
    for CUDA, so a GPU run does not spend its time on variants that cannot even lower."""
    settings = kernel_benchmark.grid_settings(kernel_benchmark.parse_args(["--sweep"]))
    variants_for = kernel_benchmark.decode_variants if grid == "decode" else kernel_benchmark.prefill_variants
    # The first rotation set's shapes, as the benchmark would build them, without allocating the pool.
    inputs = jax.eval_shape(lambda: kernel_benchmark.build_inputs(batch, settings.shape, settings.rotate_bytes, 0)[0])
    for variant in variants_for(batch, settings):
        arguments = jax.eval_shape(variant.arguments, inputs)
        exported = export_for_h100(variant.run, *arguments)
        if variant.implementation == "cudnn":
            assert triton_calls(exported, CUDNN_ATTENTION_TARGET) == 1, variant.label
        else:
            assert triton_calls(exported) >= (0 if variant.implementation == "xla" else 1), variant.label
    if grid == "prefill":  # cuDNN joins where no prompt has a cached prefix
        implementations = {variant.implementation for variant in variants_for(batch, settings)}
        assert ("cudnn" in implementations) == (batch.seq_lens == batch.query_lens), implementations


def _tiny_settings(**changes):
    settings = kernel_benchmark.grid_settings(kernel_benchmark.parse_args(["--smoke"]))
    return dataclasses.replace(settings, reps=2, warmup=0, rotate_bytes=0, **changes)


def test_a_failing_variant_is_recorded_and_the_others_still_measured():
    def broken(q, *_):
        raise RuntimeError("Triton says no")

    def variants_for(batch, settings):
        return [kernel_benchmark.Variant("pallas", {}, broken, kernel_benchmark.decode_arguments),
                kernel_benchmark.xla_variant(settings.shape.scale)]

    point = kernel_benchmark.measure_point({}, decode_batch(num_seqs=2, context=20), variants_for, _tiny_settings())
    failed, xla = point["variants"]
    assert failed["error"] == "RuntimeError: Triton says no" and not failed["correct"]
    assert xla["error"] is None and xla["correct"] and len(xla["times_s"]) == 2
    kernel_benchmark.add_figures(point, point["bytes"], 1e9, "bytes_per_s", "fraction_of_copy")
    assert set(point["best"]) == {"xla"} and "speedup_vs_xla" not in point


def test_a_failing_point_is_recorded_and_an_oversized_one_skipped():
    def variants_for(batch, settings):
        raise MemoryError("out of memory")

    settings = _tiny_settings()
    point = kernel_benchmark.measure_point({}, decode_batch(1, 20), variants_for, settings)
    assert point["error"] == "MemoryError: out of memory"
    small = dataclasses.replace(settings, max_pool_bytes=1024)
    assert "exceeds --max-pool-gib" in kernel_benchmark.measure_point({}, decode_batch(1, 20), variants_for,
                                                                      small)["skipped"]
