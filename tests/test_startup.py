"""Start-up compiles against abstract weights while the real ones are read, and benchmarks/startup.py reports it."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve.checkpoint import plan_model
from jaxserve.config import EngineConfig
from jaxserve.engine.startup import start_runner
from jaxserve.runner.model_runner import ModelRunner

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import startup as startup_benchmark  # noqa: E402

SMALL = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, block_size=8, compilation_cache_dir=None)


def test_weights_are_read_while_the_programs_compile(monkeypatch):
    """The weights cannot finish loading until compiling has begun: start-up overlaps the two, or it stalls here."""
    plan = plan_model(None, "float32")
    compiling = threading.Event()
    warm_up = ModelRunner.warm_up

    def warm_up_signalling(self, *args, **kwargs):
        compiling.set()
        return warm_up(self, *args, **kwargs)

    def read_params_after_compiling_starts(progress):
        assert compiling.wait(timeout=60), "the weights were read before any program compiled"
        return plan.read_params(progress)

    monkeypatch.setattr(ModelRunner, "warm_up", warm_up_signalling)
    overlapped = dataclasses.replace(plan, read_params=read_params_after_compiling_starts)
    config = EngineConfig(**SMALL).with_model_limit(plan.config.max_position_embeddings)
    runner, config, stats, _ = start_runner(overlapped, config, progress=False)
    assert stats.programs == runner.programs.count > len(runner.buckets.all_buckets()) and stats.load_seconds > 0
    assert config.num_kv_pages is not None and runner.pool.num_pages == config.num_kv_pages
    loaded = plan.load(progress=False)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(runner.params), jax.tree.leaves(loaded.params)))


def test_weights_that_differ_from_the_compiled_layout_are_refused():
    plan = plan_model(None, "float32")
    runner = ModelRunner(plan.config, plan.graphdef, plan.abstract_params, plan.dtype,
                         EngineConfig(**SMALL).with_model_limit(plan.config.max_position_embeddings))
    other_dtype = plan_model(None, "bfloat16").load(progress=False).params
    with pytest.raises(ValueError, match="differ in shape, dtype or sharding"):
        runner.load_params(other_dtype)


def test_weight_bytes_per_device_count_every_parameter():
    plan = plan_model(None, "float32")
    expected = sum(int(np.prod(leaf.shape)) * 4 for leaf in jax.tree.leaves(plan.abstract_params))
    assert plan.weight_bytes_per_device() == expected


def test_the_startup_benchmark_reports_phases_and_the_depth_ratio(tmp_path):
    report = startup_benchmark.main(["--model", "builtin", "--layers", "1", "2", "--max-num-seqs", "1",
                                     "--max-num-batched-tokens", "16", "--max-model-len", "64", "--dtype", "float32",
                                     "--out", str(tmp_path / "startup.json")])
    assert json.loads((tmp_path / "startup.json").read_text()) == json.loads(json.dumps(report))
    assert [(r["layers"], r["cache"]) for r in report["results"]] == [(1, "cold"), (1, "warm"), (2, "cold"),
                                                                     (2, "warm")]
    for result in report["results"]:
        assert result["programs"] > 0 and result["weights"] == "abstract"
        assert result["ready_seconds"] >= result["compile_seconds"] > 0
    assert report["depth_ratio"] > 0


def test_a_start_from_the_program_store_compiles_nothing_and_is_timed_against_the_warm_cache(tmp_path):
    report = startup_benchmark.main(["--model", "builtin", "--layers", "1", "--max-num-seqs", "1",
                                     "--max-num-batched-tokens", "16", "--max-model-len", "64", "--dtype", "float32",
                                     "--store"])
    states = {r["cache"]: r for r in report["results"]}
    assert list(states) == ["cold", "warm", "store fill", "store"]
    programs = states["cold"]["programs"]
    assert states["store fill"]["sources"]["compiled"] == programs  # filling compiles afresh, cache off
    assert states["store"]["sources"] == {"store": programs, "cache": 0, "compiled": 0}
    assert states["store"]["lower_seconds"] == 0 and states["store"]["store_seconds"] > 0
    assert set(report["store_ratio"]) == {1} and report["store_ratio"][1] > 0
