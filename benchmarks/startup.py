"""Time to ready, split into weight reading, trace+lower and compile, with the step-program count, cold and with a
warm compilation cache, at two depths of the same width.

Each measurement runs in a fresh process (no program in memory) against a compilation-cache folder that is empty
for the cold start and reused for the warm one, with no program store (`--compiled none`). Weights (--weights):
    abstract  shapes only: nothing is read or allocated, the programs compiled are the engine's own (the default on
              a CPU, where an 8B model's step cannot run in useful time, so its compile plan is the proxy);
    random    random weights drawn on the device, read on a thread while the programs compile, as a checkpoint is
              (the default on a GPU).
With the decoder layers scanned, a step program holds one layer, so start-up should barely grow with depth: the
report's `depth_ratio` is ready time at the deepest over the shallowest, cold (target <= 1.3).

With --store, two more starts per depth use a store of compiled programs (runner/program_store.py): one fills it
(`--compiled DIR` on an empty folder compiles every program afresh and writes it), the next loads every program
from it, tracing, lowering and compiling nothing. `store_ratio` is that start's ready time over the warm-cache start
(the persistent compilation cache alone) at each depth.

    python benchmarks/startup.py --model llama-3.1-8b --layers 2 32 --max-num-seqs 64 \
        --max-num-batched-tokens 8192 --max-model-len 8192 --out startup.json --plot startup.png
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS = ("llama-3.1-8b", "llama-3.1-70b", "builtin")
CACHE_STATES = ("cold", "warm")
STORE_STATES = ("store fill", "store")  # with --store, after the cache states: fill the store, then start from it
PHASES = ("load_seconds", "lower_seconds", "compile_seconds", "store_seconds")
ABSTRACT_POOL_PAGES = 4097  # any size compiles the same programs; nothing is allocated


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="llama-3.1-8b", help="whose shapes (random weights)")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 32], help="depths to compare, same width")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--weights", choices=("auto", "abstract", "random"), default="auto",
                        help="auto: random on a GPU, abstract elsewhere")
    parser.add_argument("--store", action="store_true",
                        help="also time a start that fills a program store and one that loads from it")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="draw the phases per depth and cache state (PNG)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one measurement, in its own process
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child is not None:
        print(json.dumps(measure(**json.loads(args.child))))
        return {}
    from jaxserve.engine.startup import NO_STORE  # here: the children time their own import of JAX

    results = []
    for layers in args.layers:
        with tempfile.TemporaryDirectory(prefix="jaxserve-startup-cache-") as cache_dir:
            states = CACHE_STATES + (STORE_STATES if args.store else ())
            for cache_state in states:
                # The cache states start without a store (not even the default one beside the cache): they time
                # the persistent compilation cache alone.
                store_dir = str(Path(cache_dir) / "store") if cache_state in STORE_STATES else NO_STORE
                result = run_child(args, layers, cache_dir, store_dir)
                results.append({"layers": layers, "cache": cache_state, **result})
                print(f"{layers:3d} layers, {cache_state}: ready in {result['ready_seconds']:.1f} s "
                      f"({result['programs']} programs {result.get('sources', {})}; load {result['load_seconds']:.1f} "
                      f"s, lower {result['lower_seconds']:.1f} s, compile {result['compile_seconds']:.1f} s)",
                      flush=True)
    report = {"settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot", "child")},
              "machine": results[0]["machine"], "results": results, "depth_ratio": depth_ratio(results)}
    print(f"depth ratio (cold, {max(args.layers)} over {min(args.layers)} layers): {report['depth_ratio']:.2f}")
    if args.store:
        report["store_ratio"] = store_ratios(results)
        print("store start over warm-cache start: " + ", ".join(
            f"{layers} layers {ratio:.2f}" for layers, ratio in report["store_ratio"].items()))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    if args.plot is not None:
        plot(results, args.plot)
    return report


def run_child(args: argparse.Namespace, layers: int, cache_dir: str, store_dir: str | None = None) -> dict[str, Any]:
    """One start-up in a fresh process; its stats."""
    child = dict(model=args.model, layers=layers, max_num_seqs=args.max_num_seqs,
                 max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                 dtype=args.dtype, weights=args.weights, cache_dir=cache_dir, store_dir=store_dir)
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(child)], check=True, capture_output=True,
                          text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(model: str, layers: int, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, dtype: str,
            weights: str, cache_dir: str, store_dir: str | None = None) -> dict[str, Any]:
    """Runs in the child: builds the engine's runner for the model's shapes at `layers` layers and times it."""
    import dataclasses

    import jax

    from bench_machine import machine_description
    from jaxserve.config import EngineConfig
    from jaxserve.engine.startup import start_runner

    started = time.perf_counter()
    plan = random_model_plan(model, layers, dtype)
    if weights == "auto":
        weights = "random" if jax.default_backend() == "gpu" else "abstract"
    config = EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len, compilation_cache_dir=cache_dir, compiled_dir=store_dir,
                          num_kv_pages=ABSTRACT_POOL_PAGES if weights == "abstract" else None,
                          ).with_model_limit(plan.config.max_position_embeddings)
    if weights == "random":
        _, _, stats, _ = start_runner(plan, config, progress=False)
        stats = dataclasses.asdict(stats)
    else:
        stats = compile_only(plan, config)
    return {**stats, "weights": weights, "process_seconds": time.perf_counter() - started,
            "machine": machine_description()}


def compile_only(plan, config) -> dict[str, Any]:
    """The runner's warm-up alone, against abstract weights and pool: start-up minus reading and allocating (with
    the program store, when the config names one)."""
    import dataclasses

    from jaxserve.engine.startup import enable_compilation_cache, open_program_store
    from jaxserve.runner.model_runner import ModelRunner

    started = time.perf_counter()
    enable_compilation_cache(config)
    runner = ModelRunner(plan.config, plan.graphdef, plan.abstract_params, plan.dtype, config, plan.mesh)
    runner.warm_up(config.num_kv_pages, progress=False, store=open_program_store(config, runner))
    warmup = runner.programs.stats
    return {"programs": warmup.programs, "load_seconds": 0.0, "lower_seconds": warmup.lower_seconds,
            "compile_seconds": warmup.compile_seconds, "store_seconds": warmup.store_seconds,
            "sources": dataclasses.asdict(warmup.sources), "ready_seconds": time.perf_counter() - started}


def random_model_plan(model: str, layers: int, dtype: str):
    """A ModelPlan of the model's shapes at `layers` layers whose weights are random, drawn on the device."""
    from jaxserve.checkpoint import BUILTIN_MODEL_DIR, ModelPlan
    from jaxserve.checkpoint.builtin import sharded_random_params
    from jaxserve.checkpoint.param_tree import abstract_params, fill_params
    from jaxserve.model.config import LlamaConfig
    from jaxserve.model.dtypes import parse_dtype
    from jaxserve.parallel import plan_tensor_parallel
    from model_shapes import model_config

    cfg = LlamaConfig.from_hf_dict({**model_config(model), "num_hidden_layers": layers})
    layout = plan_tensor_parallel(cfg, 1)
    target = parse_dtype(dtype)
    placed = abstract_params(layout.model_config, target, layout.param_sharding)
    return ModelPlan(layout.model_config, placed.graphdef, fill_params(placed, placed.specs), target,
                     BUILTIN_MODEL_DIR, "random", layout.mesh,
                     lambda progress: sharded_random_params(layout, target, seed=0, init_std=0.02)[1])


def store_ratios(results: list[dict[str, Any]]) -> dict[int, float]:
    """Per depth: ready time of the start from the store over that of the start with a warm compilation cache."""
    ready = {(r["layers"], r["cache"]): r["ready_seconds"] for r in results}
    return {layers: ready[layers, "store"] / ready[layers, "warm"]
            for layers in sorted({r["layers"] for r in results}) if (layers, "store") in ready}


def depth_ratio(results: list[dict[str, Any]]) -> float:
    """Cold ready time at the deepest model over the shallowest."""
    cold = {r["layers"]: r["ready_seconds"] for r in results if r["cache"] == "cold"}
    return cold[max(cold)] / cold[min(cold)]


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # here, not at the top: only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['layers']} layers\n{r['cache']}" for r in results]
    figure, axes = plt.subplots(figsize=(1.6 * len(results) + 2, 4))
    bottom = [0.0] * len(results)
    for phase in PHASES:
        heights = [r.get(phase, 0.0) for r in results]
        axes.bar(labels, heights, bottom=bottom, label=phase.removesuffix("_seconds"))
        bottom = [b + h for b, h in zip(bottom, heights)]
    axes.plot(labels, [r["ready_seconds"] for r in results], "k_", markersize=30, label="ready (phases overlap)")
    axes.set_ylabel("seconds")
    axes.set_title(f"start-up, {results[0]['programs']} step programs")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
