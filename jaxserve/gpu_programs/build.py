"""The engine's step programs built for a GPU target on any machine: the model laid out with abstract weights (shapes,
dtypes and shardings; nothing read or allocated) over the target's compile-only devices, a compile-only
`ModelRunner`, and every program its warm-up compiles, compiled one by one with what XLA made of each kept.

Building is apart from auditing (audit.py): the same compiled programs can be audited, or kept in a program store
(store_fill.py), for which the engine may also be built for this host's CPU (no target).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np

from jaxserve.checkpoint.int4_layout import Int4Quantization
from jaxserve.checkpoint.loading import quantization_scheme
from jaxserve.checkpoint.param_tree import abstract_params, fill_params
from jaxserve.checkpoint.quantized_checkpoint import check_requested
from jaxserve.config import EngineConfig
from jaxserve.engine.kv_sizing import resolve_num_pages
from jaxserve.engine.startup import check_speculation
from jaxserve.errors import ConfigError
from jaxserve.gpu_programs.arguments import ProgramArgument, ProgramFacts, Role, xla_element_type
from jaxserve.gpu_programs.facts import StepShapes, program_facts
from jaxserve.gpu_programs.target import GpuTarget, target_devices
from jaxserve.gpu_programs.thunks import Thunk, read_thunks
from jaxserve.model.config import LlamaConfig
from jaxserve.model.dtypes import resolve_dtype
from jaxserve.model.kv_quantization import kv_pool_dtype
from jaxserve.model.param_names import is_stacked
from jaxserve.model.quantization import WeightFormat
from jaxserve.parallel import plan_tensor_parallel
from jaxserve.runner.buckets import StepBucket
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.step_programs import ProgramLowering

GPU_PLATFORM = "gpu"  # what JAX calls the platform of CUDA devices, which sets the engine's GPU defaults
CPU_PLATFORM = "cpu"
# A pool sized from a target's memory for a program store leaves this share of the device aside, so that it fits
# the real device, whose allocator reports a little less than the description (a start takes a stored pool size only
# where it fits: engine/startup.py).
STORED_POOL_MARGIN_SHARE = 0.01
# The step programs' leading arguments, as ModelRunner lowers them: the weights, then the pool.
_WEIGHTS_POSITION, _POOL_POSITION = 0, 1


@dataclasses.dataclass(frozen=True)
class AbstractEngine:
    """An engine's runner built for a GPU target without its weights: it lowers and compiles, never runs."""

    runner: ModelRunner  # compile-only, over the target's devices
    model_name: str  # e.g. "llama-3.1-8b"
    model_config: LlamaConfig  # as it runs (KV heads repeated up to the tensor-parallel size)
    config: EngineConfig  # step limits, max_model_len and the pool's size filled in as start-up would
    target: GpuTarget | None  # None: this host's CPU
    dtype: np.dtype  # of the weights and activations
    context_tokens: int  # each sequence's context the programs' expected traffic assumes (KV read per step)
    workspace_bytes: int = 0  # the largest step's workspace, measured for a memory-sized pool (for_store); else 0


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """One program compiled for the target, with what the audit reads of it."""

    facts: ProgramFacts  # what it is and should do
    bucket: StepBucket  # the step shape it serves (a sampler's: the decode bucket of its rows)
    compiled: jax.stages.Compiled
    hlo_text: str  # the optimized HLO the GPU would run
    memory: dict[str, int]  # {"temp", "argument", "output"} bytes on one device (XLA's memory analysis)
    thunks: list[Thunk] | None  # what XLA launches (kernels, copies, CUDA graphs); None where it wrote none
    lower_seconds: float  # tracing and lowering it
    compile_seconds: float  # XLA compiling it


def build_engine(model_name: str, hf_config: dict, config: EngineConfig, target: GpuTarget | None,
                 context_tokens: int = 1024, on_device: bool = False, for_store: bool = False) -> AbstractEngine:
    """The engine `config` describes (preset and flags) for the model of `hf_config` (config.json's contents), on
    `config.tensor_parallel_size` devices of `target` (None: of this host's CPU), with abstract weights in
    `config.quantization`'s format. `on_device`: on this host's own GPUs instead (XLA then autotunes on them), the
    pool still sized from `target`'s memory, so that both builds compile the same programs. `for_store`: a pool
    sized from the target's memory is sized as start-up sizes it (the largest step's workspace measured first), less
    STORED_POOL_MARGIN_SHARE."""
    check_speculation(config)
    if config.speculative_config is not None and config.speculative_config.model is not None:
        raise ConfigError("the GPU program audit builds the target model's programs only; a draft model's are not "
                          "built yet (use the ngram method, or leave speculation out)")
    stored = LlamaConfig.from_hf_dict(hf_config)
    platform = GPU_PLATFORM if target is not None else CPU_PLATFORM
    config = config.with_platform_defaults(platform).with_model_limit(stored.max_position_embeddings)
    devices = _devices(target, config.tensor_parallel_size, on_device)
    layout = plan_tensor_parallel(stored, config.tensor_parallel_size, devices)
    dtype = resolve_dtype(config.dtype, stored.checkpoint_dtype, platform)
    placed = abstract_params(layout.model_config, dtype, layout.param_sharding,
                             weight_format(hf_config, config.quantization))
    params = fill_params(placed, placed.specs)
    runner = ModelRunner(layout.model_config, placed.graphdef, params, dtype, config, layout.mesh, compile_only=True)
    memory_sized = target is not None and config.num_kv_pages is None and config.kv_cache_memory_gb is None
    workspace = runner.programs.largest_workspace_bytes() if for_store and memory_sized else 0
    config = config.with_pool(_pool_pages(layout.model_config, config, dtype, placed.specs.values(), target,
                                          workspace, STORED_POOL_MARGIN_SHARE if for_store else 0.0))
    return AbstractEngine(runner, model_name, layout.model_config, config, target, dtype,
                          min(context_tokens, config.require("max_model_len")), workspace)


def weight_format(hf_config: dict, requested: str | None) -> WeightFormat | str | None:
    """The projections' format: a pre-quantized checkpoint's quantization_config (a GPTQ one with desc_act taken
    as act-order, since its g_idx is not read here), else --quantization's."""
    scheme = quantization_scheme(hf_config.get("quantization_config"))
    check_requested(scheme, requested)
    if scheme is None:
        return requested
    if isinstance(scheme, Int4Quantization) and hf_config["quantization_config"].get("desc_act"):
        scheme = dataclasses.replace(scheme, act_order=True)
    return scheme.weight_format


def _devices(target: GpuTarget | None, count: int, on_device: bool) -> list:
    if target is None:
        cpus = jax.devices(CPU_PLATFORM)
        if len(cpus) < count:
            raise ConfigError(f"building for this host's CPU over {count} devices needs as many; JAX sees {len(cpus)} "
                              "(XLA_FLAGS=--xla_force_host_platform_device_count=N)")
        return cpus[:count]
    return _local_gpus(count) if on_device else target_devices(target, count)


def _local_gpus(count: int) -> list:
    gpus = [d for d in jax.local_devices() if d.platform == GPU_PLATFORM]
    if len(gpus) < count:
        raise ConfigError(f"building on this host's GPUs needs {count}; JAX sees {len(gpus)}")
    return gpus[:count]


def _pool_pages(model: LlamaConfig, config: EngineConfig, dtype, specs, target: GpuTarget | None,
                workspace_bytes: int, margin_share: float) -> int:
    """The pool start-up would make on the target: sized from its memory (less the weight shards, the workspace
    given and `margin_share` of the device), unless the config fixes it; on the CPU (no target), the CPU's rule.
    Without a workspace measured, the pool is that much larger than a real start's; a program's code does not
    depend on the pool's size."""
    weights = max(sum(_shard_bytes(spec) for spec in specs), 1)
    memory = (None if target is None else
              {"bytes_limit": target.memory_bytes, "bytes_in_use": weights + int(margin_share * target.memory_bytes)})
    return resolve_num_pages(model, kv_pool_dtype(config.kv_cache_dtype, dtype), page_size=config.block_size,
                             max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                             num_kv_pages=config.num_kv_pages, kv_cache_memory_gb=config.kv_cache_memory_gb,
                             gpu_memory_utilization=config.gpu_memory_utilization, memory_stats=memory,
                             workspace_bytes=workspace_bytes, tensor_parallel_size=config.tensor_parallel_size)


def _shard_bytes(spec: jax.ShapeDtypeStruct) -> int:
    return int(np.prod(spec.sharding.shard_shape(spec.shape))) * np.dtype(spec.dtype).itemsize


def engine_programs(engine: AbstractEngine) -> list[ProgramLowering]:
    """Every program the engine's warm-up compiles, in its order (step programs, then samplers)."""
    return engine.runner.programs.lowerings(engine.config.require("num_kv_pages"))


def program_name(program: ProgramLowering) -> str:
    """"decode S=1", "mixed T=512 S=64 +penalties", "scoring T=512 S=64", "verify T=16 S=16", "sampler S=8",
    "sampler S=8 untruncated" (the variant for steps where no row truncates)."""
    bucket = program.bucket
    if program.sampler:
        return f"sampler S={bucket.num_seqs}" + ("" if program.truncation else " untruncated")
    kind = program_kind(program)
    shape = f"S={bucket.num_seqs}" if kind == "decode" else f"T={bucket.num_tokens} S={bucket.num_seqs}"
    return f"{kind} {shape}" + (" +penalties" if bucket.penalties and not bucket.prompt_logits else "")


def program_kind(program: ProgramLowering) -> str:
    bucket = program.bucket
    if program.sampler:
        return "sampler"
    if bucket.prompt_logits:
        return "scoring"
    if bucket.drafts:
        return "verify"
    return "decode" if bucket.num_tokens == bucket.num_seqs else "mixed"


def compile_programs(engine: AbstractEngine, programs: list[ProgramLowering], compiler_options: dict | None = None,
                     dump_root: Path | None = None, jobs: int = 1) -> Iterator[CompiledProgram]:
    """Each program lowered here, in order, and compiled on up to `jobs` threads (XLA compiles release the GIL),
    yielded as each is done. XLA's dumps of a program (its thunks among them) go to `dump_root/<its name>`, or to
    a temporary folder kept only while its thunks are read."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(jobs, 1)) as workers:
        compiling = []
        for program in programs:
            started = time.perf_counter()
            lowered = program.lower()
            dump_dir = Path(dump_root) / file_stem(program_name(program)) if dump_root is not None else None
            compiling.append(workers.submit(_compile, engine, program, lowered, time.perf_counter() - started,
                                            compiler_options or {}, dump_dir))
        for done in concurrent.futures.as_completed(compiling):
            yield done.result()


def _compile(engine: AbstractEngine, program: ProgramLowering, lowered: jax.stages.Lowered, lower_seconds: float,
             compiler_options: dict, dump_dir: Path | None) -> CompiledProgram:
    with tempfile.TemporaryDirectory(prefix="xla-dump-") as scratch:
        dumps = dump_dir if dump_dir is not None else Path(scratch)
        started = time.perf_counter()
        # The product's options for the program first (the runner's choice), then those the command adds.
        options = {**program.compiler_options, **compiler_options, "xla_dump_to": str(dumps)}
        compiled = lowered.compile(compiler_options=options)
        compile_seconds = time.perf_counter() - started
        thunks = read_thunks(dumps)
    arguments = program_arguments(lowered, compiled, weights_first=not program.sampler)
    shapes = StepShapes.of(engine.model_config, engine.config, program.bucket, engine.dtype, engine.context_tokens,
                           kv_pool_dtype(engine.config.kv_cache_dtype, engine.dtype))
    facts = program_facts(program_name(program), program_kind(program), arguments, shapes)
    return CompiledProgram(facts, program.bucket, compiled, compiled.as_text(), memory_of(compiled), thunks,
                           lower_seconds, compile_seconds)


def file_stem(name: str) -> str:
    """A program's name as a file name: "decode S=1" -> "decode_S1"."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name.replace("=", "")).strip("_")


def memory_of(compiled: jax.stages.Compiled) -> dict[str, int]:
    """{"temp", "argument", "output"} bytes of one device's share of the program (XLA's memory analysis)."""
    analysis = compiled.memory_analysis()
    return {"temp": int(analysis.temp_size_in_bytes), "argument": int(analysis.argument_size_in_bytes),
            "output": int(analysis.output_size_in_bytes)}


def program_arguments(lowered: jax.stages.Lowered, compiled: jax.stages.Compiled,
                      weights_first: bool) -> tuple[ProgramArgument, ...]:
    """The program's flattened arguments, named by their paths, as one device holds them. `weights_first`: the
    program is a step program, taking the weights then the pool (a sampler takes logits and inputs only)."""
    paths = jax.tree_util.tree_flatten_with_path(lowered.args_info)[0]
    shardings = jax.tree.leaves(compiled.input_shardings)
    arguments = []
    for (path, info), sharding in zip(paths, shardings):
        position = path[1].idx if len(path) > 1 and hasattr(path[1], "idx") else None
        name = _argument_name(path[2:])
        role = _role(name, position, weights_first)
        name = {Role.POOL: f"pool.{name}", Role.ADAPTER: f"lora.{name}"}.get(role, name) or f"input {position}"
        shard = tuple(sharding.shard_shape(info.shape))
        arguments.append(ProgramArgument(name, role, xla_element_type(info.dtype), shard, _layer_axis(name, role)))
    return tuple(arguments)


def _argument_name(path) -> str:
    """"model.layers.mlp.up_proj.weight" from the path of a weight's leaf; "k_pages" from a pool's."""
    parts = [str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", "")))) for key in path]
    return ".".join(part for part in parts if part and part != "value")


def _role(name: str, position: int | None, weights_first: bool) -> Role:
    if not weights_first:
        return Role.INPUT
    if position == _WEIGHTS_POSITION:
        return Role.WEIGHT
    if position == _POOL_POSITION:
        return Role.POOL
    return Role.ADAPTER if name.startswith(("a.", "b.")) else Role.INPUT


def _layer_axis(name: str, role: Role) -> int | None:
    """Stacked weights and adapter slots lead with the layer axis; the pool f[kv_heads, layers, ...] has it second
    (its per-layer scales, f32[layers], first)."""
    if role is Role.WEIGHT:
        return 0 if is_stacked(name) else None
    if role is Role.ADAPTER:
        return 0
    if role is Role.POOL:
        return 1 if name.endswith("_pages") else 0
    return None
