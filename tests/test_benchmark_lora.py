"""benchmarks/lora.py: requests spread round-robin over the adapters, ratios taken within each round, engines of the
8B shape that fit one 80 GB GPU together, random weights of a named shape, and a tiny run that reports every variant
with positive throughputs, adapters that change the outputs and a base model that gives the same tokens with LoRA on
and off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import lora as lora_benchmark  # noqa: E402
from gpu_parts import PARTS_BY_NAME  # noqa: E402
from model_shapes import model_config, random_model  # noqa: E402
from jaxserve import LoRARequest  # noqa: E402
from jaxserve.checkpoint import BUILTIN_MODEL_DIR, load_model  # noqa: E402
from jaxserve.checkpoint.lora_adapter import projection_shape  # noqa: E402
from jaxserve.checkpoint.lora_config import PROJECTIONS  # noqa: E402
from jaxserve.checkpoint.param_tree import abstract_params, flat_arrays  # noqa: E402
from jaxserve.engine.kv_sizing import bytes_per_page  # noqa: E402
from jaxserve.model.config import LlamaConfig  # noqa: E402

SMOKE_TIMEOUT_S = 400  # about 20 s with a warm compilation cache, a few minutes cold on a busy 2-core machine
# The limits of tests/test_lora_engine.py's engines (2 slots of rank 8; max_num_seqs 4, max_num_batched_tokens 64,
# max_model_len 128): the run finds their programs in the persistent compilation cache.
TINY = ["--model-shape", "builtin", "--num-requests", "4", "--prompt-len", "8", "--max-tokens", "4", "--rounds", "1",
        "--num-adapters", "2", "--rank", "8", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
        "--max-model-len", "128"]
GPU_GIB = 80  # an H100's memory
XLA_PREALLOCATED = 0.75  # the share of it JAX's allocator takes by default


def fake_runs(speeds: list[float], outputs: tuple = ((1, 2), (3, 4))) -> list[lora_benchmark.RunResult]:
    """One run per round, each of 4 generated tokens at the round's tokens/s."""
    return [lora_benchmark.RunResult(wall_s=4 / speed, generated_tokens=4, steps=2, outputs=outputs)
            for speed in speeds]


def test_requests_spread_round_robin_and_prompts_are_fresh_each_round():
    adapters = [LoRARequest(f"a{i}", i + 1, f"folder{i}") for i in range(3)]
    assert [a.lora_int_id for a in lora_benchmark.round_robin(adapters, 7)] == [1, 2, 3, 1, 2, 3, 1]
    args = lora_benchmark.parse_args(["--num-requests", "5", "--prompt-len", "6", "--max-tokens", "3"])
    assert args.max_model_len == 9 and args.lora_off
    prompts = lora_benchmark.make_prompts(args, 1, vocab_size=50)
    assert len(prompts) == 5 and all(len(p) == 6 for p in prompts)
    assert all(0 <= t < 50 for p in prompts for t in p)
    assert lora_benchmark.make_prompts(args, 1, 50) == prompts and lora_benchmark.make_prompts(args, 2, 50) != prompts
    with pytest.raises(SystemExit):
        lora_benchmark.parse_args(["--prompt-len", "60", "--max-tokens", "10", "--max-model-len", "64"])
    with pytest.raises(SystemExit):
        lora_benchmark.parse_args(["--model", "folder", "--model-shape", "llama-3.1-8b"])


def test_the_gpu_checks_two_8b_engines_fit_one_80_gb_gpu_beside_one_copy_of_the_weights():
    """The gpu_check part's settings: each pool holds max_num_seqs whole sequences, and both pools, the adapter
    slots and the weights (read once, run by both engines) take well under what JAX's allocator holds by default,
    leaving the rest for the steps' workspace."""
    args = lora_benchmark.parse_args(PARTS_BY_NAME["lora"].gpu_args["args"])
    assert args.model_shape == "llama-3.1-8b" and args.lora_off and args.dtype == "bfloat16"
    config = LlamaConfig.from_hf_dict(model_config(args.model_shape))
    shaped = type("Shaped", (), {"config": config})  # what engine_config reads of a model
    engines = {lora: lora_benchmark.engine_config(args, shaped, enable_lora=lora) for lora in (True, False)}
    assert engines[True].enable_lora and engines[True].max_loras == 4 and not engines[False].enable_lora
    pages = engines[True].num_kv_pages
    assert pages == engines[False].num_kv_pages == args.max_num_seqs * -(-args.max_model_len // 16) + 1
    specs = abstract_params(config, jnp.bfloat16, lambda name, shape: None).specs.values()
    weights = sum(np.prod(spec.shape) * spec.dtype.itemsize for spec in specs)
    pools = 2 * pages * bytes_per_page(config, 16, jnp.bfloat16)
    widths = sum(sum(projection_shape(config, projection)) for projection in PROJECTIONS)  # A's in, B's out
    slots = (args.num_adapters + 1) * args.rank * config.num_hidden_layers * widths * 2  # bf16
    assert 14 * 2**30 < weights < 16 * 2**30
    assert weights + pools + slots < 0.4 * XLA_PREALLOCATED * GPU_GIB * 2**30


def test_random_weights_of_a_shape_are_drawn_in_the_dtype_asked_for():
    config = model_config("builtin")
    model = random_model(config, "auto", seed=1)
    assert model.config == LlamaConfig.from_hf_dict(config) and model.model_dir == BUILTIN_MODEL_DIR
    assert model.dtype == jnp.float32 and model.source == "random"  # auto: float32 on the CPU
    drawn, builtin = flat_arrays(model.params), flat_arrays(load_model(None, "float32", progress=False).params)
    assert {name: a.shape for name, a in drawn.items()} == {name: a.shape for name, a in builtin.items()}
    assert not np.array_equal(drawn["model.embed_tokens.weight"], builtin["model.embed_tokens.weight"])
    assert random_model(config, "bfloat16", seed=1).dtype == jnp.bfloat16


def test_ratios_are_taken_within_each_round_and_the_outputs_compared():
    results = {"base": fake_runs([100.0, 50.0]), "adapters": fake_runs([90.0, 30.0], outputs=((1, 2), (3, 5))),
               "lora-off": fake_runs([200.0, 100.0])}
    summary = lora_benchmark.summarize(results)
    adapters_vs_base = summary["ratios"]["adapters / base"]
    assert adapters_vs_base["per_round"] == pytest.approx([0.9, 0.6])
    assert adapters_vs_base["median"] == pytest.approx(0.75) and not summary["meets_target"]
    assert summary["ratios"]["base / lora-off"]["per_round"] == pytest.approx([0.5, 0.5])
    assert summary["variants"]["base"]["tokens_per_s"] == pytest.approx(75.0)
    assert summary["checks"] == {"adapters_change_outputs": 0.5, "base_same_as_lora_off": True}
    assert "adapters / base: 0.75x (target >= 0.8x: NOT met)" in lora_benchmark.format_table(summary)
    del results["lora-off"]
    assert list(lora_benchmark.summarize(results)["ratios"]) == ["adapters / base"]


@pytest.mark.slow
def test_a_tiny_run_reports_every_variant(tmp_path):
    out = tmp_path / "lora.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "lora.py"), *TINY, "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["jax_backend"] and report["settings"]["num_requests"] == 4
    assert report["model"] == "built-in tiny random model" and report["dtype"] == "float32"
    assert report["num_kv_pages"] == {"lora-on": 4 * 8 + 1, "lora-off": 4 * 8 + 1}  # 4 sequences of 128 tokens
    assert report["engine_programs"]["lora-on"] == report["engine_programs"]["lora-off"] > 0
    assert list(report["variants"]) == ["base", "adapters", "lora-off"]
    assert report["compiles_after_warmup"] == {"lora-on": 0, "lora-off": 0}
    for variant, row in report["variants"].items():
        assert row["tokens_per_s"] > 0 and row["generated_tokens"] == 4 * 4
        assert len(report["runs"][variant]) == 1 == len(row["tokens_per_s_per_round"])
    speeds = {variant: row["tokens_per_s"] for variant, row in report["variants"].items()}
    ratio = report["ratios"]["adapters / base"]
    assert ratio["median"] == pytest.approx(speeds["adapters"] / speeds["base"]) == ratio["per_round"][0]
    assert report["ratios"]["base / lora-off"]["median"] == pytest.approx(speeds["base"] / speeds["lora-off"])
    assert report["meets_target"] == (ratio["median"] >= report["target_adapters_vs_base"])
    assert report["checks"]["adapters_change_outputs"] > 0 and report["checks"]["base_same_as_lora_off"]
    assert "adapters / base" in done.stdout
    assert (tmp_path / "lora.png").read_bytes().startswith(b"\x89PNG")
