"""Tensor parallelism: decode step time and the step program's collectives at TP 1/2/4/8, and a memory plan for
Llama-3.1-70B on 2, 4 and 8 H100s.

Part 1, timing (CPU, 8 simulated devices: XLA_FLAGS=--xla_force_host_platform_device_count=8 is set before any
engine starts). For each TP size one engine runs in a process of its own (on the CPU backend every loaded program
holds hundreds of memory mappings, and several engines in one process pass Linux's vm.max_map_count) on a small
random Llama (default 4 layers, hidden 256, 8 query heads, 8 KV heads; `--kv-heads 2` makes TP 4 and 8 repeat KV
heads at load time). Each engine decodes `--batch` sequences in steady state: prompts of 32 tokens, greedy,
`--decode-warm-steps` untimed steps after admission, then `--decode-steps` timed engine steps (wall time of
`LLMEngine.step`, async scheduling on, as the engine serves). The TP sizes alternate over `--rounds` rounds (the
starting size rotates) after one untimed run each; the figure per size is the median over rounds of the median step,
and the ratio to TP 1 is taken within each round. From the same engine's compiled decode program (the bucket that
`--batch` greedy decode rows select) the script counts all-reduces and all-gathers in the partitioned HLO and compares
them with what the sharding rules predict: two all-reduces per layer (after o_proj and down_proj), one for the
vocabulary-split embedding lookup, one all-gather of the sampled rows' logits f32[S, vocab].

On the CPU the 8 "devices" are XLA's threads on the same cores, and a collective is a memory copy plus a rendezvous,
so the step times say little about a GPU (where they need a GPU run); what this part shows is that the communication
is the rules' prediction, and that the sharded engine runs at every size.

Part 2, `--memory-plan` (arithmetic only, no device): for Llama-3.1-70B with weights in bf16 and in FP8 (KV cache in
bf16 and in FP8) over 2, 4 and 8 H100 80GB, each device's weight bytes (from the model's own parameter shapes and the
sharding rules' shard shapes), KV bytes per token, KV pages and the most concurrent 4k-token sequences, through the
engine's own pool sizing (`resolve_num_pages`, given the memory statistics the device would report with the weights
loaded) at gpu_memory_utilization 0.9 and an activation workspace of `--workspace-gib` per device (an estimate: the
engine measures its largest step's workspace from XLA's memory analysis at start-up). FP8 weights mean the decoder
layers' projection matrices in float8_e4m3fn, embeddings, lm_head and norms in bf16, as common FP8 checkpoints of
Llama 3.1 store them. jaxserve runs neither FP8 weights nor an FP8 KV cache yet (the pool takes the model's dtype):
those rows state what FP8 would give.

    python benchmarks/tensor_parallel.py --out tp.json
    python benchmarks/tensor_parallel.py --memory-plan --out plan.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import re
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxserve.checkpoint import BUILTIN_MODEL_DIR, LoadedModel
from jaxserve.checkpoint.builtin import BUILTIN_INIT_STD, sharded_random_params
from jaxserve.checkpoint.param_tree import abstract_params
from jaxserve.config import EngineConfig
from jaxserve.engine.kv_sizing import (STEP_IO_MARGIN_SHARE, XLA_SCHEDULER_MEMORY_SHARE, bytes_per_page,
                                       resolve_num_pages)
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.errors import ConfigError
from jaxserve.model.config import LlamaConfig
from jaxserve.parallel import plan_tensor_parallel
from jaxserve.parallel.collectives import all_gather_shapes, count_collectives, predicted_step_collectives
from jaxserve.parallel.sharding_rules import running_config, shard_shape
from jaxserve.runner.buckets import MIN_TOKEN_BUCKET
from jaxserve.tokenizer import load_tokenizer
from bench_machine import machine_description
from host_overhead import timed_decode_run

TP_SIZES = (1, 2, 4, 8)
SIMULATED_DEVICES = 8
BUILTIN_VOCAB_SIZE = 512  # the built-in tokenizer's vocabulary, which detokenizes the benchmark's outputs

# Llama-3.1-70B's config.json.
LLAMA_31_70B = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                           num_attention_heads=64, num_key_value_heads=8, head_dim=128)
PLAN_TP_SIZES = (2, 4, 8)
# Total memory CUDA reports for an H100 80GB (nvidia-smi: 81559 MiB); the allocator's limit is a fraction of it.
H100_80GB_BYTES = 81559 * 2**20
PLAN_SEQ_LEN = 4096
PLAN_PAGE_SIZE = 16
PLAN_GPU_MEMORY_UTILIZATION = 0.9
# (weights, KV cache) dtypes of the plan's rows.
PLAN_DTYPES = (("bfloat16", "bfloat16"), ("float8_e4m3fn", "bfloat16"), ("float8_e4m3fn", "float8_e4m3fn"))
# The tensors an FP8 checkpoint stores in FP8: the decoder layers' projection matrices (not embeddings, lm_head, norms).
_FP8_QUANTIZED = re.compile(r"^model\.layers\.(self_attn|mlp)\.\w+_proj\.weight$")  # stacked: every layer
SEEDS_2XH100_FP8_KV_GB = 90.0  # the seeds' sizing: 2 x 80 GB minus ~70 GB of FP8 weights


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory-plan", action="store_true", help="print the 70B memory plan only (no timing)")
    parser.add_argument("--workspace-gib", type=float, default=2.0,
                        help="activation workspace per device assumed by the memory plan")
    parser.add_argument("--allocator-fraction", type=float, default=1.0,
                        help="share of the H100's memory its allocator reports as bytes_limit "
                             "(XLA_CLIENT_MEM_FRACTION, formerly XLA_PYTHON_CLIENT_MEM_FRACTION; JAX's default "
                             "is 0.75)")
    parser.add_argument("--tp-sizes", type=int, nargs="+", default=list(TP_SIZES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=None, help="default: 3 x --hidden")
    parser.add_argument("--batch", type=int, default=8, help="decode sequences per step")
    parser.add_argument("--decode-warm-steps", type=int, default=8, help="untimed decode steps before timing")
    parser.add_argument("--decode-steps", type=int, default=48, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="timed runs per TP size, alternated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.intermediate is None:
        args.intermediate = 3 * args.hidden
    if any(tp not in TP_SIZES for tp in args.tp_sizes):
        parser.error(f"--tp-sizes must be among {TP_SIZES}")
    return args


# Part 2: the memory plan (pure arithmetic on the engine's own sizing).

@dataclasses.dataclass(frozen=True)
class MemoryPlanRow:
    """One (weights dtype, KV dtype, TP size) of the plan; bytes are per device unless named total."""

    weights_dtype: str
    kv_dtype: str
    tensor_parallel_size: int
    weight_bytes: int  # this device's weight shards
    kv_bytes_per_token: int  # K and V of one token over all layers, this device's KV heads
    kv_pages: int  # pages of PLAN_PAGE_SIZE tokens the engine would allocate, the null page not counted; 0: no fit
    max_seqs: int  # concurrent PLAN_SEQ_LEN-token sequences those pages hold

    @property
    def kv_bytes(self) -> int:
        return self.kv_pages * self.kv_bytes_per_token * PLAN_PAGE_SIZE

    @property
    def total_kv_bytes(self) -> int:
        return self.kv_bytes * self.tensor_parallel_size


def weight_dtype_of(name: str, weights_dtype: str) -> str:
    """The dtype tensor `name` is stored in: FP8 checkpoints quantize only the decoder layers' projections."""
    if weights_dtype == "float8_e4m3fn" and not _FP8_QUANTIZED.match(name):
        return "bfloat16"
    return weights_dtype


def weight_bytes_per_device(cfg: LlamaConfig, tensor_parallel_size: int, weights_dtype: str) -> int:
    """Bytes of one device's weight shards: the model's parameter shapes (as it runs over that many devices) cut by
    the sharding rules, each tensor in the dtype its checkpoint stores it in."""
    shapes = param_shapes(running_config(cfg, tensor_parallel_size))
    return sum(math.prod(shard_shape(name, shape, tensor_parallel_size))
               * jnp.dtype(weight_dtype_of(name, weights_dtype)).itemsize
               for name, shape in shapes.items())


@functools.cache
def param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every parameter of `cfg`, from the model's own abstract construction (cached: tracing
    80 layers takes seconds, and the plan asks for the same config at every dtype and size)."""
    specs = abstract_params(cfg, jnp.dtype(jnp.bfloat16), lambda name, shape: None).specs
    return {name: spec.shape for name, spec in specs.items()}


def plan_row(cfg: LlamaConfig, tensor_parallel_size: int, weights_dtype: str, kv_dtype: str,
             device_bytes: int, workspace_bytes: int, weight_bytes: int,
             allocator_share: float = 1.0) -> MemoryPlanRow:
    """What the engine's automatic sizing gives on devices whose allocator limit is `device_bytes`, each holding
    `weight_bytes` of weights."""
    model_config = running_config(cfg, tensor_parallel_size)
    stats = {"bytes_limit": device_bytes, "bytes_in_use": weight_bytes}
    try:
        pages = resolve_num_pages(model_config, kv_dtype, page_size=PLAN_PAGE_SIZE, max_num_seqs=1,
                                  max_model_len=PLAN_SEQ_LEN, num_kv_pages=None, kv_cache_memory_gb=None,
                                  gpu_memory_utilization=PLAN_GPU_MEMORY_UTILIZATION, memory_stats=stats,
                                  workspace_bytes=workspace_bytes, tensor_parallel_size=tensor_parallel_size,
                                  allocator_share=allocator_share) - 1
    except ConfigError:  # the weights and workspace leave less than one page
        pages = 0
    return MemoryPlanRow(weights_dtype=weights_dtype, kv_dtype=kv_dtype, tensor_parallel_size=tensor_parallel_size,
                         weight_bytes=weight_bytes,
                         kv_bytes_per_token=bytes_per_page(model_config, 1, kv_dtype, tensor_parallel_size),
                         kv_pages=pages, max_seqs=pages // -(-PLAN_SEQ_LEN // PLAN_PAGE_SIZE))


def memory_plan(cfg: LlamaConfig = LLAMA_31_70B, tp_sizes: tuple[int, ...] = PLAN_TP_SIZES,
                device_bytes: int = H100_80GB_BYTES, workspace_bytes: int = 2 * 2**30,
                allocator_share: float = 1.0) -> list[MemoryPlanRow]:
    """Every (weights dtype, KV dtype) of PLAN_DTYPES at every TP size; `device_bytes` is the allocator's limit,
    `allocator_share` the share of the device it stands for."""
    weights = {(dtype, tp): weight_bytes_per_device(cfg, tp, dtype)
               for dtype in {w for w, _ in PLAN_DTYPES} for tp in tp_sizes}
    return [plan_row(cfg, tp, weights_dtype, kv_dtype, device_bytes, workspace_bytes, weights[weights_dtype, tp],
                     allocator_share) for weights_dtype, kv_dtype in PLAN_DTYPES for tp in tp_sizes]


def format_memory_plan(rows: list[MemoryPlanRow]) -> str:
    lines = [f"{'weights':<8} {'KV':<5} {'TP':>2} {'weights GB/dev':>14} {'KV B/token/dev':>14} "
             f"{'KV GB/dev':>9} {'KV GB total':>11} {'KV pages':>9} {'4k seqs':>7}"]
    for row in rows:
        lines.append(f"{_short(row.weights_dtype):<8} {_short(row.kv_dtype):<5} {row.tensor_parallel_size:>2} "
                     f"{row.weight_bytes / 1e9:>14.2f} {row.kv_bytes_per_token:>14,} {row.kv_bytes / 1e9:>9.2f} "
                     f"{row.total_kv_bytes / 1e9:>11.2f} {row.kv_pages:>9,} {row.max_seqs:>7}")
    return "\n".join(lines)


def seeds_comparison(rows: list[MemoryPlanRow], device_bytes: int, workspace_bytes: int) -> str:
    """Where the plan's 2 x H100 FP8 KV total departs from the seeds' ~90 GB (= 2 x 80 GB - ~70 GB of weights)."""
    row = next(r for r in rows if r.weights_dtype == "float8_e4m3fn" and r.kv_dtype == "bfloat16"
               and r.tensor_parallel_size == 2)
    tp = row.tensor_parallel_size
    used_share = min(PLAN_GPU_MEMORY_UTILIZATION, XLA_SCHEDULER_MEMORY_SHARE - STEP_IO_MARGIN_SHARE)
    held_back = (1 - used_share) * device_bytes * tp
    return (f"2 x H100, FP8 weights: the plan leaves {row.total_kv_bytes / 1e9:.1f} GB for KV against the seeds' "
            f"~{SEEDS_2XH100_FP8_KV_GB:.0f} GB. Allocator limit {tp} x {device_bytes / 1e9:.1f} GB (not 2 x 80); "
            f"weights {row.weight_bytes * tp / 1e9:.1f} GB in all (embeddings and lm_head stay bf16); "
            f"{held_back / 1e9:.1f} GB held back (gpu_memory_utilization {PLAN_GPU_MEMORY_UTILIZATION}, capped at "
            f"{used_share:.2f} of the device for XLA's scheduler); "
            f"{workspace_bytes * tp / 1e9:.1f} GB of activation workspace; the rest is under one page.")


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float8_e4m3fn": "fp8"}.get(dtype, dtype)


def run_memory_plan(args: argparse.Namespace) -> dict[str, Any]:
    device_bytes = int(H100_80GB_BYTES * args.allocator_fraction)
    workspace_bytes = int(args.workspace_gib * 2**30)
    rows = memory_plan(device_bytes=device_bytes, workspace_bytes=workspace_bytes,
                       allocator_share=args.allocator_fraction)
    print(seeds_comparison(rows, device_bytes, workspace_bytes))
    print(format_memory_plan(rows))
    return {"model": "Llama-3.1-70B", "device_bytes": device_bytes, "workspace_bytes": workspace_bytes,
            "gpu_memory_utilization": PLAN_GPU_MEMORY_UTILIZATION, "seq_len": PLAN_SEQ_LEN,
            "page_size": PLAN_PAGE_SIZE,
            "rows": [dataclasses.asdict(row) | {"kv_bytes": row.kv_bytes, "total_kv_bytes": row.total_kv_bytes}
                     for row in rows]}


# Part 1: step time and collectives, one engine per process.

def bench_model_config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(vocab_size=BUILTIN_VOCAB_SIZE, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads)


def timing_engine_config(args: argparse.Namespace) -> EngineConfig:
    """Shapes just large enough for `batch` decoding sequences, so start-up compiles few programs (one token bucket;
    prompts are admitted in chunks)."""
    return EngineConfig(max_model_len=512, max_num_seqs=args.batch,
                        max_num_batched_tokens=max(MIN_TOKEN_BUCKET, args.batch), block_size=16,
                        num_kv_pages=args.batch * 32 + 1, seed=args.seed)


def build_engine(args: argparse.Namespace, tensor_parallel_size: int) -> LLMEngine:
    """An engine over a random model of the benchmark's shape, its weights drawn already sharded."""
    layout = plan_tensor_parallel(bench_model_config(args), tensor_parallel_size)
    dtype = np.dtype(np.float32)
    graphdef, params = sharded_random_params(layout, dtype, args.seed, BUILTIN_INIT_STD)
    model = LoadedModel(layout.model_config, graphdef, params, dtype, BUILTIN_MODEL_DIR, "random", layout.mesh)
    return LLMEngine(model, load_tokenizer(BUILTIN_MODEL_DIR), timing_engine_config(args), progress=False)


def decode_program_report(engine: LLMEngine, args: argparse.Namespace, tensor_parallel_size: int) -> dict[str, Any]:
    """Collectives of the program a step of `batch` greedy decode rows runs, against the rules' prediction."""
    runner = engine.runner
    hlo = runner.programs.step(runner.buckets.select(args.batch, args.batch)).as_text()
    return {"collectives": count_collectives(hlo), "all_gather_shapes": all_gather_shapes(hlo),
            "predicted": predicted_step_collectives(engine.runner.model_config, tensor_parallel_size),
            "num_layers": engine.runner.model_config.num_hidden_layers,
            "kv_heads": engine.runner.model_config.num_key_value_heads}


_engine: LLMEngine | None = None  # the engine of this worker process's TP size
_engine_startup_s = 0.0


def start_engine(args: argparse.Namespace, tensor_parallel_size: int) -> None:
    """The worker process's initializer: builds the engine every later call there uses."""
    global _engine, _engine_startup_s
    start = time.perf_counter()
    _engine = build_engine(args, tensor_parallel_size)
    _engine_startup_s = time.perf_counter() - start


def engine_report(args: argparse.Namespace, tensor_parallel_size: int) -> dict[str, Any]:
    return (decode_program_report(_engine, args, tensor_parallel_size)
            | {"startup_s": _engine_startup_s, "machine": machine_description()})


def decode_round(args: argparse.Namespace, tag: str) -> list[float]:
    """Seconds per timed decode step of one round."""
    return timed_decode_run(_engine, args, tag, BUILTIN_VOCAB_SIZE)


class TimingProcess:
    """One TP size's engine in a worker process of its own; `run` blocks until its round has run there."""

    def __init__(self, args: argparse.Namespace, tensor_parallel_size: int):
        self._args = args
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=start_engine, initargs=(args, tensor_parallel_size))
        self.ready = self._pool.submit(engine_report, args, tensor_parallel_size).result()

    def run(self, tag: str) -> list[float]:
        return self._pool.submit(decode_round, self._args, tag).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def alternated(tp_sizes: list[int], round_index: int) -> list[int]:
    """The sizes, starting one further each round, so no size always runs first."""
    shift = round_index % len(tp_sizes)
    return tp_sizes[shift:] + tp_sizes[:shift]


def run_timing(args: argparse.Namespace) -> dict[str, Any]:
    """Starts one engine per TP size, one after another, then alternates their timed rounds."""
    # Before any engine process starts: the children inherit it, and JAX reads it when its backend starts.
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                               f"--xla_force_host_platform_device_count={SIMULATED_DEVICES}").strip()
    engines: dict[int, TimingProcess] = {}
    try:
        for tp in args.tp_sizes:
            engines[tp] = TimingProcess(args, tp)
            print(f"TP {tp} engine ready in {engines[tp].ready['startup_s']:.1f} s", flush=True)
        for tp, engine in engines.items():
            engine.run(f"warm-tp{tp}")
        step_ms: dict[int, list[float]] = {tp: [] for tp in args.tp_sizes}
        for round_index in range(args.rounds):
            for tp in alternated(args.tp_sizes, round_index):
                step_ms[tp].append(statistics.median(engines[tp].run(f"round{round_index}-tp{tp}")) * 1e3)
                print(f"round {round_index} TP {tp}: median step {step_ms[tp][-1]:.2f} ms", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    return timing_report(args, engines, step_ms)


def timing_report(args: argparse.Namespace, engines: dict[int, TimingProcess],
                  step_ms: dict[int, list[float]]) -> dict[str, Any]:
    baseline = args.tp_sizes[0]
    sizes = {}
    for tp, engine in engines.items():
        ratios = [ms / base for ms, base in zip(step_ms[tp], step_ms[baseline])]
        ready = {key: value for key, value in engine.ready.items() if key != "machine"}
        sizes[tp] = ready | {"median_step_ms_per_round": step_ms[tp], "median_step_ms": statistics.median(step_ms[tp]),
                             f"ratio_vs_tp{baseline}_per_round": ratios,
                             f"ratio_vs_tp{baseline}": statistics.median(ratios),
                             "collectives_as_predicted": ready["collectives"] == ready["predicted"]}
    return {"machine": engines[baseline].ready["machine"], "baseline_tp": baseline,
            "model": dataclasses.asdict(bench_model_config(args)), "tensor_parallel": sizes}


def format_timing_table(report: dict[str, Any]) -> str:
    baseline = report["baseline_tp"]
    lines = [f"{'TP':>2} {'KV heads':>8} {'step ms':>8} {f'vs TP{baseline}':>8} {'all-reduce':>10} "
             f"{'all-gather':>10} {'predicted':>20} {'as predicted':>12} {'all-gather result':>18}"]
    for tp, size in report["tensor_parallel"].items():
        counts, predicted = size["collectives"], size["predicted"]
        predicted_text = f"{predicted.get('all-reduce', 0)} AR + {predicted.get('all-gather', 0)} AG"
        gathered = ", ".join(shape.split("{")[0] for shape in size["all_gather_shapes"]) or "-"
        lines.append(f"{tp:>2} {size['kv_heads']:>8} {size['median_step_ms']:>8.2f} "
                     f"{size[f'ratio_vs_tp{baseline}']:>7.2f}x {counts.get('all-reduce', 0):>10} "
                     f"{counts.get('all-gather', 0):>10} {predicted_text:>20} "
                     f"{'yes' if size['collectives_as_predicted'] else 'NO':>12} {gathered:>18}")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.memory_plan:
        report = run_memory_plan(args)
    else:
        report = run_timing(args)
        model = report["model"]
        print(f"random model: {model['num_hidden_layers']} layers, hidden {model['hidden_size']}, "
              f"{model['num_attention_heads']} heads, {model['num_key_value_heads']} KV heads, float32; batch "
              f"{args.batch} decode rows, {args.decode_steps} timed steps x {args.rounds} rounds on "
              f"{SIMULATED_DEVICES} simulated {report['machine']['device']} devices, {report['machine']['cpu_count']} "
              f"cores")
        print(format_timing_table(report))
    if args.out:
        args.out.write_text(json.dumps(report | {"settings": {k: str(v) if isinstance(v, Path) else v
                                                              for k, v in vars(args).items()}}, indent=2))


if __name__ == "__main__":
    main()
