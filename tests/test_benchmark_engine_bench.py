"""benchmarks/engine_bench.py: its roofline and request-length counting on hand-computed cases, the GPU check's
argument lists, and imports that run one way (engine_bench uses kernels, never the reverse)."""

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
from gpu_parts import PARTS  # noqa: E402
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


@pytest.mark.parametrize("part", [p for p in PARTS if p.run == "gpu_parts.engine_speed:run"], ids=lambda p: p.name)
def test_the_gpu_checks_engine_arguments_parse(part):
    for args in (part.gpu_args["args"], part.smoke_args["args"]):
        settings = engine_bench.engine_settings(engine_bench.parse_args(args))
        assert settings.variants and all(name in engine_bench.ENGINE_VARIANTS for name in settings.variants)


def test_kernels_imports_nothing_of_the_engine():
    tree = ast.parse((BENCHMARKS / "kernels.py").read_text())
    modules = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    modules += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module]
    assert not [m for m in modules if m == "engine_bench" or m.startswith(("jaxserve.engine", "jaxserve.checkpoint"))]
