"""The whole engine end to end against the HBM roofline, each engine in a process of its own.

What is measured: the whole engine on a Llama-3-8B-shaped random bf16 model (with --smoke, the built-in model's
shapes), one engine per process (pallas and xla attention, alive together and alternated): batch-1 decode
inter-token time against the HBM roofline (weights + KV bytes read per step / the copy bandwidth measured in that
process, as benchmarks/kernels.py measures it), and steady decode throughput at batch 64, pallas against xla.
Each step is also set against the card's spec bandwidth (configs/gpu-targets/*.pbtxt by device kind, else
SPEC_BANDWIDTH), and the copy rate is cross-checked by a device memcpy and a read-only reduction of the same buffer.
--engine-variants picks other engines from ENGINE_VARIANTS (int8 / fp8 weights, an fp8 KV cache, the layer loop in
one CUDA graph); ratios are to the first. --engine-profile-steps traces that many decode steps of the first engine
per --engine-profile-batches with jax.profiler, after the timed runs, into --engine-profile-dir (one folder per
batch: the trace and the HLO text of the programs the steps run).

Method. Each engine runs in a process of its own, started one after the other (so that their compiles do not
compete) and alive together (so that their runs alternate round by round); this process never touches the GPU
before they start, since JAX would claim most of its memory. A run prefills fresh random prompts, steps untimed,
then times --engine-steps decode steps; its requests are aborted after. A profiled run steps the same way, with the
profiler on around its steps only. A run's or an engine's failure is recorded in the JSON with its message and the
rest goes on; the JSON is rewritten after every run.

    python benchmarks/engine_bench.py --out engine.json                  # pallas against xla (GPU)
    python benchmarks/engine_bench.py --engine-variants pallas pallas-int8 pallas-fp8 --engine-grow-memory \\
        --engine-mem-fraction 0.9 --out quantized.json                   # quantized weights against bf16
    python benchmarks/engine_bench.py --engine-variants pallas --engine-profile-steps 20 \\
        --engine-profile-batches 1 64 --engine-profile-dir traces --out profiled.json  # 20 steps traced at 1 and 64
    python benchmarks/engine_bench.py --smoke --out smoke.json           # CPU: the built-in model, kernel interpreted
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import multiprocessing
import os
import shutil
import statistics
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.checkpoint import BUILTIN_MODEL_DIR, LoadedModel
from jaxserve.checkpoint.builtin import random_params
from jaxserve.checkpoint.param_tree import abstract_params, fill_params, flat_arrays
from jaxserve.checkpoint.quantize import quantized_arrays
from jaxserve.config import PALLAS_BACKEND, XLA_BACKEND, EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.model.config import LlamaConfig
from jaxserve.model.dtypes import parse_dtype
from jaxserve.model.quantization import int4_format
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import load_tokenizer
from jaxserve.gpu_programs.target import TARGETS_DIR, load_target
from bench_machine import machine_description
from kernels import AttentionShape, describe, json_settings, kv_bytes_read, measure_stream_rates
from model_shapes import LLAMA3_8B_CONFIG

GOALS = {"engine_batch1_fraction_of_roofline": 0.85}
# The HBM bandwidth NVIDIA specifies (bytes/s) for cards that have no target description in configs/gpu-targets/
# (those give it as memory_bandwidth), by the device kind JAX reports.
SPEC_BANDWIDTH = {
    "NVIDIA A100-SXM4-40GB": 1.555e12, "NVIDIA A100-SXM4-80GB": 2.039e12, "NVIDIA A100 80GB PCIe": 1.935e12,
    "NVIDIA H100 PCIe": 2.0e12, "NVIDIA H100 NVL": 3.9e12, "NVIDIA GH200 480GB": 4.0e12, "NVIDIA B200": 8.0e12,
}
# The host annotation around a profiled run's steps: it marks their window in the trace.
PROFILE_WINDOW = "jaxserve_profiled_decode_steps"
ENGINE_BACKENDS = (PALLAS_BACKEND, XLA_BACKEND)  # the default engine variants, named after their attention


@dataclasses.dataclass(frozen=True)
class EngineVariant:
    """One engine process of this benchmark: its attention and how it stores weights and KV."""

    backend: str  # --attention-backend
    quantization: str | None = None  # --quantization of the random weights (quantized on the device)
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype
    xla_flags: str = ""  # added to XLA_FLAGS in this engine's process (XLA:GPU settings under test)
    gemm_backend: str = "auto"  # --gemm-backend
    # The random weights as a 4-bit (W4A16) checkpoint stores them: packed, with a scale and zero point per group of
    # this many input features; None: as `quantization` says
    int4_group: int | None = None


# XLA:GPU runs the scanned layers' loop as one launch of the body per layer (its trip count is known, so no host
# sync), and by default captures each body, not the loop, as a CUDA graph; this variant asks for the whole loop in
# one graph (CUDA 12.3+), to measure what the per-layer launches cost a batch-1 step.
GRAPHED_LOOP_FLAGS = "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_command_buffer_unroll_loops=true"

ENGINE_VARIANTS = {
    PALLAS_BACKEND: EngineVariant(PALLAS_BACKEND),
    XLA_BACKEND: EngineVariant(XLA_BACKEND),
    "pallas-int8": EngineVariant(PALLAS_BACKEND, "int8"),
    "pallas-fp8": EngineVariant(PALLAS_BACKEND, "fp8"),
    # int8 / fp8 decode through the Pallas W8A16 kernel reading the stacked weights in place (--gemm-backend pallas)
    "pallas-int8-gemm-pallas": EngineVariant(PALLAS_BACKEND, "int8", gemm_backend="pallas"),
    "pallas-fp8-gemm-pallas": EngineVariant(PALLAS_BACKEND, "fp8", gemm_backend="pallas"),
    # 4-bit weights as a W4A16 checkpoint (group 128, zero points) stores them: every step through the Pallas W4A16
    # kernel (--gemm-backend auto on one GPU)
    "pallas-int4": EngineVariant(PALLAS_BACKEND, int4_group=128),
    "pallas-kv-fp8": EngineVariant(PALLAS_BACKEND, kv_cache_dtype="fp8"),
    "pallas-fp8-kv-fp8": EngineVariant(PALLAS_BACKEND, "fp8", "fp8"),
    "pallas-graphed-loop": EngineVariant(PALLAS_BACKEND, xla_flags=GRAPHED_LOOP_FLAGS),
}
ENGINE_INIT_STD = 0.02  # a trained model's scale: keeps activations finite through 32 bf16 layers


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU check: the built-in model, few steps, the Pallas "
                                                             "kernel in interpret mode")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here (after every run)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--engine-batches", type=int, nargs="+", default=None, help="default 1 64 (smoke 1 4)")
    parser.add_argument("--engine-prompt-len", type=int, default=None, help="default 512 (smoke 24)")
    parser.add_argument("--engine-steps", type=int, default=None, help="timed decode steps per run (default 64)")
    parser.add_argument("--engine-warm-steps", type=int, default=None, help="untimed steps before timing (default 8)")
    parser.add_argument("--engine-rounds", type=int, default=None, help="runs per backend, alternated (default 3)")
    parser.add_argument("--engine-batched-tokens", type=int, default=None,
                        help="max_num_batched_tokens (default 256; each power of two up to it is a compiled bucket)")
    parser.add_argument("--engine-mem-fraction", type=float, default=0.45,
                        help="XLA_PYTHON_CLIENT_MEM_FRACTION of each engine process (two live at once)")
    parser.add_argument("--engine-variants", nargs="+", choices=list(ENGINE_VARIANTS), default=list(ENGINE_BACKENDS),
                        help="engine processes, alive together, their runs alternated; ratios are to the first "
                             "(default: pallas xla)")
    parser.add_argument("--engine-grow-memory", action="store_true",
                        help="each engine process claims memory as it needs it, up to --engine-mem-fraction "
                             "(XLA_PYTHON_CLIENT_PREALLOCATE=false): for more than two engines of unlike sizes")
    parser.add_argument("--engine-profile-steps", type=int, default=0,
                        help="after the timed runs, trace this many decode steps of the first engine per profiled "
                             "batch with jax.profiler (default 0: none)")
    parser.add_argument("--engine-profile-batches", type=int, nargs="+", default=None,
                        help="the batches profiled (default: every --engine-batches)")
    parser.add_argument("--engine-profile-dir", type=Path, default=None,
                        help="where the traces go, a folder per batch (needed with --engine-profile-steps)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    hf_config: dict[str, Any]  # the model's config.json; its weights are random
    dtype: str
    batches: tuple[int, ...]
    prompt_len: int
    warm_steps: int
    steps: int
    rounds: int
    max_num_batched_tokens: int
    page_size: int
    interpret: bool  # the Pallas kernel through Pallas' interpreter (CPU)
    variants: tuple[str, ...]  # ENGINE_VARIANTS names, one engine process each; ratios are to the first
    copy_bytes: int
    reps: int
    seed: int
    profile_steps: int = 0  # decode steps traced per profiled batch, on the first variant's engine; 0: no profile
    profile_batches: tuple[int, ...] = ()

    @property
    def max_batch(self) -> int:
        return max(self.batches)

    @property
    def max_new_tokens(self) -> int:
        """Tokens a request may generate: while the largest batch's other prompts are prefilled (each step
        decodes every running request first, then prefills with what is left of the token budget), then the warm
        and timed steps, plus slack for the steps admission takes. Nobody finishes inside the timed window."""
        prefill_steps = -(-self.max_batch * self.prompt_len // (self.max_num_batched_tokens - self.max_batch))
        return prefill_steps + self.warm_steps + self.steps + 32

    @property
    def max_model_len(self) -> int:
        return self.prompt_len + self.max_new_tokens


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    config = (json.loads((BUILTIN_MODEL_DIR / "config.json").read_text()) if args.smoke else LLAMA3_8B_CONFIG)
    settings = EngineSettings(
        hf_config=config, dtype="bfloat16",
        batches=tuple(args.engine_batches or ((1, 4) if args.smoke else (1, 64))),
        prompt_len=args.engine_prompt_len or (24 if args.smoke else 512),
        warm_steps=args.engine_warm_steps or (2 if args.smoke else 8),
        steps=args.engine_steps or (4 if args.smoke else 64),
        rounds=args.engine_rounds or (1 if args.smoke else 3),
        max_num_batched_tokens=args.engine_batched_tokens or (32 if args.smoke else 256),
        page_size=args.page_size, interpret=args.smoke, variants=tuple(args.engine_variants),
        copy_bytes=16 * 2**20 if args.smoke else 2**30, reps=3 if args.smoke else 10, seed=args.seed,
    )
    if settings.max_num_batched_tokens <= settings.max_batch:
        raise SystemExit("--engine-batched-tokens must exceed the largest engine batch (room to prefill)")
    if args.engine_profile_steps:
        settings = dataclasses.replace(settings, profile_steps=args.engine_profile_steps,
                                       profile_batches=tuple(args.engine_profile_batches or settings.batches))
        check_profile(settings, args.engine_profile_dir)
    return settings


def check_profile(settings: EngineSettings, profile_dir: Path | None) -> None:
    """A profiled run fits the requests' token budget (sized for the timed runs) and the engine's batch."""
    if profile_dir is None:
        raise SystemExit("--engine-profile-steps needs --engine-profile-dir")
    if settings.profile_steps > settings.steps:
        raise SystemExit("--engine-profile-steps may not exceed --engine-steps (the requests are sized for those)")
    if max(settings.profile_batches) > settings.max_batch:
        raise SystemExit("--engine-profile-batches may not exceed the largest --engine-batches")


def engine_config(settings: EngineSettings, variant: EngineVariant) -> EngineConfig:
    """Shapes sized for the largest batch, with exactly the pages it needs (nothing is sized from free memory,
    which the other engine processes share)."""
    pages = settings.max_batch * -(-settings.max_model_len // settings.page_size) + 1
    return EngineConfig(max_model_len=settings.max_model_len, max_num_seqs=settings.max_batch,
                        max_num_batched_tokens=settings.max_num_batched_tokens, block_size=settings.page_size,
                        num_kv_pages=pages, attention_backend=variant.backend, quantization=variant.quantization,
                        kv_cache_dtype=variant.kv_cache_dtype, gemm_backend=variant.gemm_backend,
                        # The interpreter applies to the kernel only.
                        pallas_interpret=settings.interpret and variant.backend != XLA_BACKEND, seed=settings.seed)


def random_model(settings: EngineSettings, quantization: str | None = None,
                 int4_group: int | None = None) -> LoadedModel:
    """The config's model with random weights, built straight on the device (no checkpoint on disk), its
    projections quantized there when asked (as loading quantizes a checkpoint's), or drawn as packed 4-bit weights
    with group scales and zero points (`int4_group`); the built-in tokenizer serves, since out-of-vocabulary ids
    decode to nothing and prompts are token ids."""
    config = LlamaConfig.from_hf_dict(settings.hf_config)
    dtype = parse_dtype(settings.dtype)
    if int4_group is not None:
        graphdef, params = _random_int4(config, dtype, settings.seed, int4_group)
        return LoadedModel(config, graphdef, params, dtype, BUILTIN_MODEL_DIR, "random")
    graphdef, params = random_params(config, dtype, settings.seed, ENGINE_INIT_STD)
    if quantization is not None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        placed = abstract_params(config, dtype, lambda name, shape: device, quantization)
        graphdef, params = placed.graphdef, fill_params(placed, quantized_arrays(flat_arrays(params), placed.specs,
                                                                                 quantization))
    return LoadedModel(config, graphdef, params, dtype, BUILTIN_MODEL_DIR, "random")


def _random_int4(config: LlamaConfig, dtype, seed: int, group_size: int) -> tuple[Any, Any]:
    """Random parameters with the projections as packed 4-bit weights whose dequantized values have about
    ENGINE_INIT_STD's spread (uniform 4-bit values, zero points of 0), drawn straight into that layout (no bf16
    projections ever exist, which other engine processes' memory could not spare); norms of 1."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    placed = abstract_params(config, dtype, lambda name, shape: device, int4_format(group_size, zero_points=True))
    key = jax.random.key(seed)
    filled = {}
    for name, spec in placed.specs.items():
        key, draw = jax.random.split(key)
        if spec.dtype == np.uint8:
            filled[name] = jax.random.randint(draw, spec.shape, 0, 256, jnp.int32).astype(jnp.uint8)
        elif name.endswith("weight_scale"):
            filled[name] = jnp.full(spec.shape, ENGINE_INIT_STD / 4.6, jnp.float32)  # 4-bit values' spread: ~4.6
        elif name.endswith("weight_zero_point"):
            filled[name] = jnp.zeros(spec.shape, jnp.int8)
        elif name.endswith("norm.weight"):
            filled[name] = jnp.ones(spec.shape, spec.dtype)
        else:
            filled[name] = (ENGINE_INIT_STD * jax.random.normal(draw, spec.shape, jnp.float32)).astype(spec.dtype)
    return placed.graphdef, fill_params(placed, filled)


def spec_bandwidth(device_kind: str) -> dict[str, Any] | None:
    """The HBM bandwidth the card is specified at, from the target description of its device kind in
    configs/gpu-targets/ or else from SPEC_BANDWIDTH, with where it came from; None for a device neither knows."""
    for path in sorted(TARGETS_DIR.glob("*.pbtxt")):
        target = load_target(str(path))
        if target.device_kind == device_kind:
            return {"bytes_per_s": target.memory_bandwidth, "source": f"configs/gpu-targets/{path.name}"}
    if device_kind in SPEC_BANDWIDTH:
        return {"bytes_per_s": SPEC_BANDWIDTH[device_kind], "source": "engine_bench.SPEC_BANDWIDTH"}
    return None


def weight_bytes_per_step(model: LoadedModel) -> int:
    """Weight bytes a decode step reads: all of them but the embedding table, of which it gathers a row per token
    (negligible; a tied table is read whole as the LM head)."""
    arrays = flat_arrays(model.params)
    total = sum(array.nbytes for array in arrays.values())
    return total if model.config.tie_word_embeddings else total - arrays["model.embed_tokens.weight"].nbytes


_ENGINE: dict[str, Any] = {}  # this engine process's engine and settings


def start_engine(settings: EngineSettings, name: str) -> dict[str, Any]:
    """Runs in the engine's process: measures the stream rates (the copy the roofline uses, and its cross-checks)
    while the device is still empty, then builds the random model and the engine of variant `name` (compiling every
    bucket)."""
    variant = ENGINE_VARIANTS[name]
    streams = measure_stream_rates(settings.copy_bytes, settings.dtype, settings.reps, warmup=2, seed=settings.seed)
    if "error" in streams["copy"]:
        raise RuntimeError(f"the copy bandwidth, which the roofline needs, failed: {streams['copy']['error']}")
    model = random_model(settings, variant.quantization, variant.int4_group)
    start = time.perf_counter()
    engine = LLMEngine(model, load_tokenizer(BUILTIN_MODEL_DIR), engine_config(settings, variant), progress=False)
    _ENGINE.update(engine=engine, settings=settings)
    config = model.config
    machine = machine_description()
    return {
        "backend": engine.runner.attention_backend, "startup_s": time.perf_counter() - start, **streams,
        "spec_bandwidth": spec_bandwidth(machine["device"]),
        "machine": machine, "weight_bytes_per_step": weight_bytes_per_step(model),
        "layers": config.num_hidden_layers, "model_shape": dataclasses.asdict(AttentionShape(
            config.num_attention_heads, config.num_key_value_heads, config.head_dim, settings.page_size,
            engine.runner.kv_dtype.name)),  # the pool's dtype: a float8 pool reads half the KV bytes
    }


def request_lengths(engine: LLMEngine, ids: list[str]) -> list[tuple[int, int]]:
    """(tokens in the sequence, output tokens) of each request, as the host knows them."""
    requests = [request for request_id in ids for request in engine.scheduler_requests(request_id)]
    if len(requests) < len(ids) or any(request.is_finished for request in requests):
        raise RuntimeError("a request finished inside the timed window; raise EngineSettings.max_new_tokens")
    return [(request.num_tokens, request.num_output_tokens) for request in requests]


def step_until_decoding(engine: LLMEngine, ids: list[str], settings: EngineSettings) -> None:
    """Steps until every prompt is prefilled (each request has sampled a token)."""
    for _ in range(settings.max_new_tokens):
        if all(outputs >= 1 for _, outputs in request_lengths(engine, ids)):
            return
        engine.step()
    raise RuntimeError("prompts were still being prefilled after max_new_tokens steps")


def engine_decode_run(batch: int, tag: str) -> dict[str, Any]:
    """Runs in the engine's process: `batch` fresh random prompts, prefilled, then `warm_steps` untimed and `steps`
    timed decode steps; the requests are aborted afterwards. Step time is wall time between engine.step() calls in
    steady state (with async scheduling: the device step, unless the host is slower). A run that fails leaves the
    engine as the server does after a failed step (every request and the step in flight dropped), so the next
    batch still runs."""
    engine: LLMEngine = _ENGINE["engine"]
    try:
        return _timed_decode(engine, batch, tag)
    except Exception:
        engine.abort_all_requests()
        raise


def _timed_decode(engine: LLMEngine, batch: int, tag: str) -> dict[str, Any]:
    settings: EngineSettings = _ENGINE["settings"]
    ids = start_decoding(engine, batch, tag, settings)
    before = request_lengths(engine, ids)
    phases_before = dataclasses.replace(engine.phase_times)
    start = time.perf_counter()
    for _ in range(settings.steps):
        engine.step()
    seconds = time.perf_counter() - start
    phases = engine.phase_times.since(phases_before).per_step_ms()
    after = request_lengths(engine, ids)
    end_requests(engine, ids)
    generated = sum(a[1] - b[1] for a, b in zip(after, before))
    return {"batch": batch, "steps": settings.steps, "seconds": seconds, "generated_tokens": generated,
            "step_s": seconds / settings.steps, "tokens_per_s": generated / seconds,
            "host_phase_ms": phases,  # per step: schedule, dispatch, wait (device time not hidden), outputs
            # Mid-window lengths stand for the window's mean KV read.
            "mid_window_seq_lens": [(a[0] + b[0]) // 2 for a, b in zip(after, before)]}


def start_decoding(engine: LLMEngine, batch: int, tag: str, settings: EngineSettings) -> list[str]:
    """Adds `batch` fresh random prompts (no prefix-cache hits), prefills them and runs the untimed warm steps:
    the engine is then in steady decode. Returns the requests' ids."""
    rng = np.random.default_rng([settings.seed, zlib.crc32(tag.encode())])
    ids = [f"{tag}-{i}" for i in range(batch)]
    params = SamplingParams(max_tokens=settings.max_new_tokens, temperature=0.0, ignore_eos=True)
    for request_id in ids:
        engine.add_request(request_id, [int(t) for t in rng.integers(0, engine.vocab_size, settings.prompt_len)],
                           params)
    step_until_decoding(engine, ids, settings)
    for _ in range(settings.warm_steps):
        engine.step()
    return ids


def end_requests(engine: LLMEngine, ids: list[str]) -> None:
    """Aborts the run's requests and steps until the engine is idle (the step in flight included)."""
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def engine_profile_run(batch: int, tag: str, trace_dir: str) -> dict[str, Any]:
    """Runs in the engine's process: a run like engine_decode_run's whose `profile_steps` steps are traced by
    jax.profiler into `trace_dir`, inside a PROFILE_WINDOW annotation, beside the HLO text of the programs they
    run. While a trace runs XLA executes its CUDA graphs op by op (so that each kernel is named): a profiled step is
    slower than a timed one, and the report gives both."""
    engine: LLMEngine = _ENGINE["engine"]
    try:
        return _profiled_decode(engine, batch, tag, Path(trace_dir))
    except Exception:
        engine.abort_all_requests()
        raise


def _profiled_decode(engine: LLMEngine, batch: int, tag: str, trace_dir: Path) -> dict[str, Any]:
    settings: EngineSettings = _ENGINE["settings"]
    ids = start_decoding(engine, batch, tag, settings)
    programs = write_step_programs(engine, batch, trace_dir / "hlo")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # tracing every Python call would slow the host's side of each step
    with jax.profiler.trace(str(trace_dir), profiler_options=options), jax.profiler.TraceAnnotation(PROFILE_WINDOW):
        start = time.perf_counter()
        for _ in range(settings.profile_steps):
            engine.step()
        seconds = time.perf_counter() - start
    end_requests(engine, ids)
    return {"batch": batch, "steps": settings.profile_steps, "seconds": seconds,
            "step_s": seconds / settings.profile_steps, "trace_dir": str(trace_dir), "hlo_files": programs,
            "window_annotation": PROFILE_WINDOW}


def write_step_programs(engine: LLMEngine, batch: int, folder: Path) -> list[str]:
    """Writes the optimized HLO of the programs a decode step of `batch` sequences runs (its bucket's program and,
    where the step is split, its sampler), one file each, and returns their paths: a trace names each kernel by
    its HLO instruction, whose metadata gives the named scope it came from."""
    runner = engine.runner
    bucket = runner.buckets.select(batch, batch)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, program in enumerate(runner.programs.of_bucket(bucket)):
        path = folder / f"program-{index}.hlo.txt"
        path.write_text(program.as_text())
        paths.append(str(path))
    return paths


def variant_environment(variant: EngineVariant) -> dict[str, str]:
    """The environment variables an engine variant's process adds: its XLA flags after any already set."""
    if not variant.xla_flags:
        return {}
    return {"XLA_FLAGS": " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), variant.xla_flags]))}


@contextlib.contextmanager
def environment(**variables: str) -> Iterator[None]:
    """Sets environment variables for processes started inside, and restores them after."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def roofline(ready: dict[str, Any], run: dict[str, Any]) -> dict[str, float]:
    """The HBM floor of one decode step: weight bytes plus every layer's KV pages read, over the copy bandwidth
    measured in the engine's own process, and over the card's spec bandwidth where it is known; and the measured
    step's share of each."""
    shape = AttentionShape(**ready["model_shape"])
    step_bytes = ready["weight_bytes_per_step"] + ready["layers"] * kv_bytes_read(run["mid_window_seq_lens"], shape)
    floor_s = step_bytes / ready["copy"]["bytes_per_s"]
    figures = {"step_bytes": step_bytes, "roofline_step_s": floor_s, "fraction_of_roofline": floor_s / run["step_s"]}
    spec = ready.get("spec_bandwidth")
    if spec is not None:  # the same bytes at the card's spec bandwidth: the floor no measured kernel can lower
        spec_s = step_bytes / spec["bytes_per_s"]
        figures.update(spec_roofline_step_s=spec_s, fraction_of_spec_roofline=spec_s / run["step_s"])
    return figures


# The stream rates each engine process measures: "copy" (x * s) sets the measured roofline, "memcpy" (a device
# memcpy, read + written) and "read" (a read-only reduction) check it.
STREAM_KINDS = ("copy", "memcpy", "read")
# roofline()'s figures a summary row keeps (their medians over the rounds); the spec ones only where the spec is known.
ROOFLINE_KEYS = ("fraction_of_roofline", "roofline_step_s", "fraction_of_spec_roofline", "spec_roofline_step_s")


def engine_rounds(executors: dict[str, concurrent.futures.Executor], settings: EngineSettings,
                  runs: dict[str, dict[int, list[dict[str, Any]]]], save: Callable[[], None]) -> None:
    """Every round, each batch on each engine, the engines' order flipping every round; failures are recorded."""
    for round_index in range(settings.rounds):
        for batch in settings.batches:
            order = list(executors) if round_index % 2 == 0 else list(executors)[::-1]
            for backend in order:
                try:
                    run = executors[backend].submit(engine_decode_run, batch, f"r{round_index}-b{batch}").result()
                except Exception as error:
                    run = {"batch": batch, "error": describe(error)}
                runs[backend][batch].append(run)
                save()
                print(engine_line(backend, run), flush=True)


def summarize_engine(ready: dict[str, dict[str, Any]], runs: dict[str, dict[int, list[dict[str, Any]]]],
                     settings: EngineSettings) -> dict[str, Any]:
    """Per batch and variant: median step time, tokens/s and roofline share; each variant's tokens/s over the
    first's per round, then the median (pallas/xla under its old name)."""
    summary: dict[str, Any] = {}
    for batch in settings.batches:
        row: dict[str, Any] = {}
        for backend, by_batch in runs.items():
            good = [run for run in by_batch[batch] if "error" not in run]
            if good:
                shares = [roofline(ready[backend], run) for run in good]
                row[backend] = {"step_s": statistics.median(r["step_s"] for r in good),
                                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in good),
                                **{key: statistics.median(s[key] for s in shares) for key in ROOFLINE_KEYS
                                   if key in shares[0]},
                                "host_phase_ms": {phase: statistics.median(r["host_phase_ms"][phase] for r in good)
                                                  for phase in good[0]["host_phase_ms"]}}
        first, *others = settings.variants
        for other in others:
            pairs = [(o, f) for o, f in zip(runs[other][batch], runs[first][batch]) if "error" not in o and "error"
                     not in f]
            if pairs:
                row[f"{other}_vs_{first}"] = statistics.median(o["tokens_per_s"] / f["tokens_per_s"] for o, f in pairs)
        if f"{XLA_BACKEND}_vs_{PALLAS_BACKEND}" in row:
            row["pallas_vs_xla"] = 1 / row[f"{XLA_BACKEND}_vs_{PALLAS_BACKEND}"]
        summary[str(batch)] = row
    return summary


def run_engine_part(settings: EngineSettings, mem_fraction: float, report: dict[str, Any],
                    save: Callable[[], None], grow_memory: bool = False, profile_dir: Path | None = None) -> None:
    """Fills report with one engine process's figures per variant (by default pallas and xla attention), started
    one after the other so that their compiles do not compete, and alive together so that their runs alternate.
    This process must not have touched the GPU yet: JAX would have claimed most of its memory. With
    settings.profile_steps, the first variant's engine is then profiled into profile_dir."""
    report.update(settings={**dataclasses.asdict(settings), "max_model_len": settings.max_model_len}, ready={},
                  runs={name: {batch: [] for batch in settings.batches} for name in settings.variants})
    spawn = multiprocessing.get_context("spawn")
    memory = {"XLA_PYTHON_CLIENT_MEM_FRACTION": str(mem_fraction)}
    if grow_memory:
        memory["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    with environment(**memory), contextlib.ExitStack() as stack:
        executors = {}
        for backend in settings.variants:
            executor = stack.enter_context(concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn))
            try:
                with environment(**variant_environment(ENGINE_VARIANTS[backend])):  # the process starts here
                    report["ready"][backend] = executor.submit(start_engine, settings, backend).result()
                executors[backend] = executor
                print(f"{backend} engine ready in {report['ready'][backend]['startup_s']:.1f} s", flush=True)
            except Exception as error:
                report["ready"][backend] = {"error": describe(error)}
                print(f"{backend} engine failed: {report['ready'][backend]['error'][:300]}", flush=True)
            save()
        engine_rounds(executors, settings, report["runs"], save)
        first = settings.variants[0]
        if settings.profile_steps and first in executors:
            report["profiles"] = {}
            engine_profiles(executors[first], settings, profile_dir, report["profiles"], save)
    report["summary"] = summarize_engine(report["ready"], report["runs"], settings)


def engine_profiles(executor: concurrent.futures.Executor, settings: EngineSettings, profile_dir: Path,
                    profiles: dict[str, Any], save: Callable[[], None]) -> None:
    """A profiled run per profiled batch on one engine, each into a fresh folder of profile_dir; failures are
    recorded."""
    for batch in settings.profile_batches:
        trace_dir = profile_dir / f"batch-{batch}"
        shutil.rmtree(trace_dir, ignore_errors=True)  # a rerun's trace would be read as this one's
        try:
            profiles[str(batch)] = executor.submit(engine_profile_run, batch, f"profile-b{batch}",
                                                   str(trace_dir)).result()
            print(f"engine {settings.variants[0]} batch {batch}: {settings.profile_steps} steps traced into "
                  f"{trace_dir}", flush=True)
        except Exception as error:
            profiles[str(batch)] = {"batch": batch, "error": describe(error)}
            print(f"engine {settings.variants[0]} batch {batch}: profile failed: {describe(error)[:300]}", flush=True)
        save()


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def engine_line(backend: str, run: dict[str, Any]) -> str:
    if "error" in run:
        return f"engine {backend:<17} batch {run['batch']:>3}: failed: {run['error'][:200]}"
    return (f"engine {backend:<17} batch {run['batch']:>3}: {run['step_s'] * 1e3:8.2f} ms/step "
            f"{run['tokens_per_s']:9.1f} tok/s")


def format_engine_table(engine: dict[str, Any]) -> str:
    variants = engine["settings"]["variants"]
    lines = [f"{'engine batch':>12} {'variant':>17} {'ms/step':>9} {'tok/s':>9} {'roofline ms':>11} "
             f"{'%roofline':>9} {'spec ms':>8} {'%spec':>6}"]
    for batch, row in engine["summary"].items():
        for backend in variants:
            if backend in row:
                r = row[backend]
                spec = (f"{r['spec_roofline_step_s'] * 1e3:>8.2f} {r['fraction_of_spec_roofline']:>6.0%}"
                        if "spec_roofline_step_s" in r else f"{'-':>8} {'-':>6}")
                lines.append(f"{batch:>12} {backend:>17} {r['step_s'] * 1e3:>9.2f} {r['tokens_per_s']:>9.1f} "
                             f"{r['roofline_step_s'] * 1e3:>11.2f} {r['fraction_of_roofline']:>9.0%} {spec}")
        for other in variants[1:]:
            if f"{other}_vs_{variants[0]}" in row:
                lines.append(f"{batch:>12} {f'{other}/{variants[0]}':>17} {row[f'{other}_vs_{variants[0]}']:>9.2f}x")
    batch_one = engine["summary"].get("1", {})
    shares = [f"{b} {batch_one[b]['fraction_of_roofline']:.0%}" for b in variants if b in batch_one]
    if shares:
        lines.append(f"goal: batch-1 decode >= {GOALS['engine_batch1_fraction_of_roofline']:.0%} of the HBM roofline; "
                     f"measured {', '.join(shares)}")
    lines += [stream_line(backend, ready) for backend, ready in engine["ready"].items() if "error" not in ready]
    for backend, ready in engine["ready"].items():
        if "error" in ready:
            lines.append(f"{backend} engine failed to start: {ready['error'][:300]}")
    for batch, profile in engine.get("profiles", {}).items():
        lines.append(f"profile batch {batch}: " + (f"failed: {profile['error'][:300]}" if "error" in profile else
                                                   f"{profile['steps']} steps at {profile['step_s'] * 1e3:.2f} "
                                                   f"ms/step traced into {profile['trace_dir']}"))
    return "\n".join(lines)


def stream_line(backend: str, ready: dict[str, Any]) -> str:
    """An engine process's stream rates (the roofline's copy and its two cross-checks) and the spec bandwidth."""
    rates = ", ".join(f"{name} {ready[name]['bytes_per_s'] / 1e9:.0f} GB/s" if "bytes_per_s" in ready.get(name, {})
                      else f"{name} failed" for name in STREAM_KINDS)
    spec = ready.get("spec_bandwidth")
    return (f"{backend} process: {rates}; spec "
            + (f"{spec['bytes_per_s'] / 1e9:.0f} GB/s ({spec['source']})" if spec else "unknown for this device"))


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    report: dict[str, Any] = {"settings": json_settings(args), "goals": GOALS, "complete": False}

    def save() -> None:
        report["elapsed_s"] = time.perf_counter() - start
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))

    # First: this process has not claimed GPU memory yet.
    run_engine_part(engine_settings(args), args.engine_mem_fraction, report.setdefault("engine", {}), save,
                    args.engine_grow_memory, args.engine_profile_dir)
    report["machine"] = machine_description()
    report["complete"] = True
    save()
    print(f"\nfinished in {report['elapsed_s']:.0f} s")
    print(f"{report['machine']['device']} ({report['machine']['jax_backend']})")
    print(format_engine_table(report["engine"]))


if __name__ == "__main__":
    main()
