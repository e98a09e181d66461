"""Pool sizing: explicit pages, a GiB budget, or device memory minus weights and the largest step's workspace."""

import logging
import os

import jax.numpy as jnp
import pytest

from jaxserve.checkpoint import load_model
from jaxserve.config import EngineConfig
from jaxserve.device_memory import MEM_FRACTION_VARS, claim_device_memory
from jaxserve.engine import startup
from jaxserve.engine.kv_sizing import (STEP_IO_MARGIN_SHARE, WORKSPACE_SLACK_BYTES, XLA_SCHEDULER_MEMORY_SHARE,
                                      bytes_per_page, check_workspace_plan, device_budget_bytes, resolve_num_pages)
from jaxserve.errors import ConfigError
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.step_programs import StepPrograms

SIZES = dict(page_size=16, max_num_seqs=4, max_model_len=256)


@pytest.fixture(scope="module")
def builtin():
    return load_model(None, "float32", progress=False)


def _pages(builtin, **kwargs):
    settings = dict(num_kv_pages=None, kv_cache_memory_gb=None, gpu_memory_utilization=0.9, memory_stats=None)
    return resolve_num_pages(builtin.config, jnp.float32, **SIZES, **{**settings, **kwargs})


def test_bytes_per_page_counts_k_and_v_of_every_layer(builtin):
    cfg = builtin.config  # 2 layers, 2 KV heads of 16
    assert bytes_per_page(cfg, 16, jnp.bfloat16) == 2 * 2 * 2 * 16 * 16 * 2


def test_under_tensor_parallelism_a_page_costs_each_device_its_share_of_kv_heads(builtin):
    cfg = builtin.config
    one_device = bytes_per_page(cfg, 16, jnp.bfloat16)
    assert bytes_per_page(cfg, 16, jnp.bfloat16, tensor_parallel_size=2) == one_device // 2
    # Per-device memory buys twice the pages when each device holds half of every page.
    per_page = one_device // 2
    stats = {"bytes_limit": 1000 * per_page, "bytes_in_use": 100 * per_page}
    pages = resolve_num_pages(cfg, jnp.bfloat16, **SIZES, num_kv_pages=None, kv_cache_memory_gb=None,
                              gpu_memory_utilization=0.5, memory_stats=stats, tensor_parallel_size=2)
    assert pages == 400 + 1


def test_explicit_pages_then_gib_then_cpu_default(builtin):
    per_page = bytes_per_page(builtin.config, 16, jnp.float32)
    assert _pages(builtin, num_kv_pages=77) == 77
    assert _pages(builtin, kv_cache_memory_gb=per_page * 20 / 2**30) == 21
    assert _pages(builtin) == 4 * 16 + 1  # no memory stats: room for max_num_seqs full sequences


def test_device_memory_budget_subtracts_weights_and_workspace(builtin):
    per_page = bytes_per_page(builtin.config, 16, jnp.float32)
    stats = {"bytes_limit": 1000 * per_page, "bytes_in_use": 100 * per_page}
    assert _pages(builtin, memory_stats=stats, gpu_memory_utilization=0.5) == 400 + 1
    assert _pages(builtin, memory_stats=stats, gpu_memory_utilization=0.5, workspace_bytes=50 * per_page) == 351
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="not enough for one page"):
        _pages(builtin, num_kv_pages=1)


def test_memory_that_cannot_fit_the_limits_names_the_limit_to_lower(builtin):
    """Raised while sizing, before any program compiles: which limit to lower, with the GiB figures."""
    per_page = bytes_per_page(builtin.config, 16, jnp.float32)
    stats = {"bytes_limit": 1000 * per_page, "bytes_in_use": 90 * per_page}
    with pytest.raises(ConfigError, match=r"workspace \(0\.\d+ GiB\).*lower max_num_batched_tokens"):
        _pages(builtin, memory_stats=stats, gpu_memory_utilization=0.1, workspace_bytes=20 * per_page)
    # 16 pages make one 256-token sequence: 10 of room are too few.
    with pytest.raises(ConfigError, match=r"fewer than one sequence of max_model_len \(256 tokens"):
        _pages(builtin, memory_stats=stats, gpu_memory_utilization=0.1)
    with pytest.raises(ConfigError, match="--max-model-len"):
        _pages(builtin, kv_cache_memory_gb=per_page * 10 / 2**30)
    assert _pages(builtin, memory_stats=stats, gpu_memory_utilization=0.11) == 21


def test_every_compiled_program_fits_the_workspace_the_sizing_measured(builtin):
    """The sizing measures one program on a two-page pool; after warm-up at the real size every program's own
    workspace (XLA's analysis) is within it."""
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, block_size=8)
    runner = ModelRunner(builtin.config, builtin.graphdef, builtin.params, builtin.dtype, config)
    planned = runner.programs.largest_workspace_bytes()
    runner.warm_up(4096, progress=False)
    workspaces = runner.programs.compiled_workspaces()
    assert len(workspaces) == runner.programs.count and planned > 0
    assert max(workspaces.values()) <= 1.01 * planned  # buffer assignment differs a little between programs
    check_workspace_plan(planned, workspaces)


def test_a_program_needing_more_workspace_than_planned_stops_start_up():
    gib = 2**30
    check_workspace_plan(2 * gib, {"step a": 2 * gib, "sampler b": gib // 2})
    check_workspace_plan(0, {"step a": WORKSPACE_SLACK_BYTES})  # alignment-sized excess is allowed
    with pytest.raises(ConfigError, match=r"the step big program needs 44\.74 GiB .* more than the 2\.00 GiB"):
        check_workspace_plan(2 * gib, {"step a": gib, "step big": int(44.74 * gib)})


def test_utilization_is_a_share_of_the_device_not_of_the_allocator_limit():
    """JAX's allocator holds 0.75 of a GPU by default: 0.5 utilization is 0.5 of the device, never past the limit."""
    stats = {"bytes_limit": 750}
    assert device_budget_bytes(stats, 0.5, mem_fraction=0.75) == pytest.approx(500)
    assert device_budget_bytes(stats, 0.9, mem_fraction=0.75) == 750


def test_a_memory_sized_pool_keeps_weights_and_pool_within_xlas_scheduling_share_of_the_device():
    """At the 8B H100 preset's 0.92 utilization the arguments of every step (weights + pool) would exceed the 80% of
    the device XLA:GPU schedules a program in, and it would recompute projections (reading their weights twice per
    step, as the GPU program audit showed): the budget stops short of that share, less the steps' other inputs."""
    device = 80 * 2**30
    stats = {"bytes_limit": 0.92 * device}
    budget = device_budget_bytes(stats, 0.92, mem_fraction=0.92)
    assert budget == pytest.approx((XLA_SCHEDULER_MEMORY_SHARE - STEP_IO_MARGIN_SHARE) * device)
    assert budget < XLA_SCHEDULER_MEMORY_SHARE * device
    assert device_budget_bytes(stats, 0.5, mem_fraction=0.92) == pytest.approx(0.5 * device)  # below it: unchanged


def test_pool_sizing_reads_the_allocator_limit_as_its_share_of_the_device(builtin):
    per_page = bytes_per_page(builtin.config, 16, jnp.float32)
    stats = {"bytes_limit": 750 * per_page, "bytes_in_use": 100 * per_page}
    assert _pages(builtin, memory_stats=stats, gpu_memory_utilization=0.5, allocator_share=0.75) == 400 + 1


def test_commands_raise_the_allocator_share_to_the_utilization_unless_the_operator_set_it(monkeypatch):
    for name in MEM_FRACTION_VARS:
        monkeypatch.delenv(name, raising=False)
    claim_device_memory(0.9)
    assert float(os.environ[MEM_FRACTION_VARS[0]]) == 0.9
    monkeypatch.setenv(MEM_FRACTION_VARS[0], "0.6")
    claim_device_memory(0.9)
    assert float(os.environ[MEM_FRACTION_VARS[0]]) == 0.6


def _start_sized_from_memory(builtin, monkeypatch, workspaces=None):
    """start_runner as on a GPU: the pool sized from the allocator's statistics (64 MiB, 16 in use)."""
    monkeypatch.setattr(startup, "device_memory_stats", lambda: {"bytes_limit": 64 * 2**20, "bytes_in_use": 2**24})
    if workspaces is not None:
        monkeypatch.setattr(StepPrograms, "compiled_workspaces", lambda programs: workspaces)
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, block_size=8)
    return startup.start_runner(builtin, config.with_model_limit(builtin.config.max_position_embeddings),
                                progress=False)


def test_a_memory_sized_start_checks_its_programs_workspace(builtin, monkeypatch):
    runner, config, _, _ = _start_sized_from_memory(builtin, monkeypatch)
    assert config.num_kv_pages > 2 * 8  # sized from the 48 MiB left, not from max_num_seqs
    check_workspace_plan(runner.programs.largest_workspace_bytes(), runner.programs.compiled_workspaces())
    with pytest.raises(ConfigError, match="the step copy program needs 1.00 GiB of workspace"):
        _start_sized_from_memory(builtin, monkeypatch, {"step copy": 2**30})


def test_start_up_logs_the_largest_programs_workspace(builtin, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=startup.__name__)
    _start_sized_from_memory(builtin, monkeypatch, {"step small": 2**10, "sampler of 8 rows": 3 * 2**19})
    assert "largest workspace of 2 programs: 1.5 MiB (sampler of 8 rows)" in caplog.text
