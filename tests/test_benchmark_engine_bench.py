"""benchmarks/engine_bench.py: its rooflines (measured copy and spec) and request-length counting on hand-computed
cases, the spec bandwidth by device kind, the copy rate's cross-checks, the GPU check's argument lists (the profiled
part compiles what engine_speed compiles), and imports that run one way (engine_bench uses kernels, never the
reverse)."""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import engine_bench  # noqa: E402
from gpu_parts import PARTS, engine_speed  # noqa: E402
from kernels import AttentionShape  # noqa: E402

# 4 query heads over 2 KV heads of 8, pages of 16 tokens, bf16: one token slot's K and V are 2 * 2 * 8 * 2 = 64 B.
SHAPE = AttentionShape(heads=4, kv_heads=2, head_dim=8, page_size=16, dtype="bfloat16")


def test_roofline_counts_weights_and_every_layers_kv_pages():
    ready = {"model_shape": dataclasses.asdict(SHAPE), "weight_bytes_per_step": 1000, "layers": 2,
             "copy": {"bytes_per_s": 1e6}}
    run = {"mid_window_seq_lens": [17], "step_s": 0.01}
    figures = engine_bench.roofline(ready, run)
    # 17 tokens fill 2 pages: 2 * 16 * 64 B per layer, 2 layers, plus 1000 B of weights.
    assert figures["step_bytes"] == 1000 + 2 * 2048
    assert figures["roofline_step_s"] == pytest.approx(5.096e-3)
    assert figures["fraction_of_roofline"] == pytest.approx(0.5096)


def test_engine_requests_outlast_prefill_warm_up_and_timed_steps():
    settings = engine_bench.EngineSettings(
        hf_config={}, dtype="bfloat16", batches=(1, 64), prompt_len=512, warm_steps=8, steps=64, rounds=3,
        max_num_batched_tokens=256, page_size=16, interpret=False, variants=("pallas", "xla"), copy_bytes=1, reps=1,
        seed=0)
    # 64 prompts of 512 tokens, 192 prefill tokens a step beside 64 decodes: 171 steps; then 8 + 64, plus 32.
    assert settings.max_new_tokens == 171 + 8 + 64 + 32
    assert settings.max_model_len == 512 + settings.max_new_tokens


ENGINE_BENCH_PARTS = ("gpu_parts.engine_speed:run", "gpu_parts.decode_profile:run")


@pytest.mark.parametrize("part", [p for p in PARTS if p.run in ENGINE_BENCH_PARTS], ids=lambda p: p.name)
def test_the_gpu_checks_engine_arguments_parse(part):
    for args in (part.gpu_args["args"], part.smoke_args["args"]):
        settings = engine_bench.engine_settings(engine_bench.parse_args(args))
        assert settings.variants and all(name in engine_bench.ENGINE_VARIANTS for name in settings.variants)


def test_kernels_imports_nothing_of_the_engine():
    tree = ast.parse((BENCHMARKS / "kernels.py").read_text())
    modules = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    modules += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    assert not [m for m in modules if m == "engine_bench" or m.startswith(("jaxserve.engine", "jaxserve.checkpoint"))]


def test_roofline_at_the_spec_bandwidth_counts_the_same_bytes_as_at_the_measured_copy():
    ready = {"model_shape": dataclasses.asdict(SHAPE), "weight_bytes_per_step": 1000, "layers": 2,
             "copy": {"bytes_per_s": 1e6}, "spec_bandwidth": {"bytes_per_s": 2e6, "source": "test"}}
    figures = engine_bench.roofline(ready, {"mid_window_seq_lens": [17], "step_s": 0.01})
    assert figures["spec_roofline_step_s"] == pytest.approx(5.096e-3 / 2)
    assert figures["fraction_of_spec_roofline"] == pytest.approx(0.2548)
    assert "spec_roofline_step_s" not in engine_bench.roofline({**ready, "spec_bandwidth": None},
                                                               {"mid_window_seq_lens": [17], "step_s": 0.01})


def test_spec_bandwidth_comes_from_the_target_description_of_the_device_kind_else_the_table():
    h100, h200 = engine_bench.spec_bandwidth("NVIDIA H100 80GB HBM3"), engine_bench.spec_bandwidth("NVIDIA H200")
    assert h100 == {"bytes_per_s": 3.35232e12, "source": "configs/gpu-targets/h100.pbtxt"}
    assert h200 == {"bytes_per_s": 4.8e12, "source": "configs/gpu-targets/h200.pbtxt"}
    assert engine_bench.spec_bandwidth("NVIDIA H100 PCIe")["bytes_per_s"] == 2.0e12
    assert engine_bench.spec_bandwidth("cpu") is None


def test_the_copy_rate_is_cross_checked_by_a_real_memcpy_and_a_read_that_count_their_bytes():
    rates = engine_bench.measure_stream_rates(2**20, "bfloat16", reps=2, warmup=1)
    assert [rates[name]["bytes_moved"] for name in engine_bench.STREAM_KINDS] == [2 * 2**20, 2 * 2**20, 2**20]
    assert rates["memcpy"]["copies_in_program"] == 1  # a donated copy would have compiled to nothing
    assert all(rates[name]["bytes_per_s"] > 0 for name in engine_bench.STREAM_KINDS)
    assert engine_speed.STREAM_KINDS == engine_bench.STREAM_KINDS  # the part names them without importing JAX


def part_settings(name: str) -> engine_bench.EngineSettings:
    part = next(p for p in PARTS if p.name == name)
    args = part.gpu_args["args"]
    if name == "decode_profile":
        args = [*args, "--engine-profile-steps", str(part.gpu_args["profile_steps"]), "--engine-profile-batches",
                *map(str, part.gpu_args["profile_batches"]), "--engine-profile-dir", "traces"]
    return engine_bench.engine_settings(engine_bench.parse_args(args))


def test_decode_profile_profiles_20_steps_of_the_programs_engine_speed_compiles():
    """decode_profile runs first on a GPU: engine_speed then finds its pallas programs in the compilation cache."""
    profiled, speed = part_settings("decode_profile"), part_settings("engine_speed")
    assert profiled.profile_steps == 20 and profiled.profile_batches == (1, 64) and profiled.variants == ("pallas",)
    variant = engine_bench.ENGINE_VARIANTS["pallas"]
    assert engine_bench.engine_config(profiled, variant) == engine_bench.engine_config(speed, variant)


def test_a_profile_longer_than_the_timed_steps_or_without_a_folder_is_refused():
    with pytest.raises(SystemExit, match="may not exceed --engine-steps"):
        engine_bench.engine_settings(engine_bench.parse_args(["--engine-profile-steps", "65",
                                                              "--engine-profile-dir", "traces"]))
    with pytest.raises(SystemExit, match="needs --engine-profile-dir"):
        engine_bench.engine_settings(engine_bench.parse_args(["--engine-profile-steps", "20"]))
    with pytest.raises(SystemExit, match="largest --engine-batches"):
        engine_bench.engine_settings(engine_bench.parse_args(["--engine-profile-steps", "20", "--engine-profile-dir",
                                                              "t", "--engine-profile-batches", "128"]))
