"""The bucket grid: few programs at GPU limits, and every batch the scheduler can form fits the bucket chosen."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from jaxserve.runner.buckets import MIN_TOKEN_BUCKET, BucketSet, StepBucket, decode_sizes, token_sizes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import padding_waste  # noqa: E402


def test_gpu_limits_compile_few_programs():
    assert len(BucketSet.for_limits(max_num_batched_tokens=8192, max_num_seqs=64).all_buckets()) <= 64
    assert len(BucketSet.for_limits(max_num_batched_tokens=8192, max_num_seqs=256).all_buckets()) <= 64
    assert len(BucketSet.for_limits(max_num_batched_tokens=64, max_num_seqs=4).all_buckets()) <= 16


def test_mixed_token_sizes_add_midpoints_where_tokens_cost_most():
    assert token_sizes(8192) == (16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
    assert token_sizes(64) == (16, 32, 64) and token_sizes(1000) == (16, 32, 64, 128, 256, 512, 1024)
    assert all(size % 128 == 0 for size in token_sizes(1 << 15) if size >= 128)  # the prompt scorer's tile


def test_decode_sizes_follow_the_cuda_graph_grid_and_end_at_the_limit():
    assert decode_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert decode_sizes(256)[-6:] == (96, 128, 160, 192, 224, 256)
    assert decode_sizes(100)[-2:] == (96, 100) and decode_sizes(3) == (1, 2, 3) and decode_sizes(1) == (1,)


@pytest.mark.parametrize("max_tokens, max_seqs", [(64, 4), (512, 16), (256, 64), (8192, 64)])
def test_every_batch_fits_a_compiled_bucket(max_tokens, max_seqs):
    buckets = BucketSet.for_limits(max_tokens, max_seqs)
    compiled = set(buckets.all_buckets())
    for tokens in range(1, max_tokens + 1, max(1, max_tokens // 300)):
        for seqs in range(1, min(tokens, max_seqs) + 1):
            for prompt_logits, penalties in itertools.product((False, True), (False, True)):
                bucket = buckets.select(tokens, seqs, prompt_logits, penalties)
                assert bucket in compiled and bucket.prompt_logits == prompt_logits
                # Context-long token histories are shipped only where a row needs them (or a prompt is scored).
                assert bucket.penalties == (penalties or prompt_logits)
                assert bucket.num_tokens >= tokens and bucket.num_seqs >= seqs


def test_decode_batches_take_decode_buckets_and_prefill_the_mixed_ones():
    buckets = BucketSet.for_limits(max_num_batched_tokens=8192, max_num_seqs=64)
    assert buckets.select(33, 33) == StepBucket(40, 40)
    assert buckets.select(1, 1) == StepBucket(1, 1)
    assert buckets.select(300, 33) == StepBucket(512, 64)
    assert buckets.select(5000, 10) == StepBucket(6144, 64)
    assert buckets.select(5, 2) == StepBucket(MIN_TOKEN_BUCKET, MIN_TOKEN_BUCKET)
    assert buckets.select(5, 5, prompt_logits=True) == StepBucket(16, 16, prompt_logits=True, penalties=True)
    assert buckets.select(33, 33, penalties=True) == StepBucket(40, 40, penalties=True)


def test_the_padding_benchmark_compares_both_grids(tmp_path):
    report = padding_waste.main(["--max-num-seqs", "8", "--max-num-batched-tokens", "2048", "--max-model-len", "1024",
                                 "--num-kv-pages", "600", "--requests", "40", "--prompt-median", "200",
                                 "--output-median", "20", "--out", str(tmp_path / "padding.json")])
    assert json.loads((tmp_path / "padding.json").read_text())["steps"] == report["steps"] > 40
    assert report["programs"]["buckets"] < report["programs"]["product"]
    for grid in ("buckets", "product"):
        assert report[grid]["all"]["token_ratio"] >= 1.0 and report[grid]["decode"]["row_ratio"] >= 1.0
    assert report["buckets"]["decode"]["token_ratio"] <= report["product"]["decode"]["token_ratio"]
