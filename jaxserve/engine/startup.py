"""Start-up: the model runner made ready to serve, compiling its step programs while the weights load.

Compiling needs only the weights' shapes, dtypes and shardings, which a `ModelPlan` has before any weight is read.
So, given a plan, the weights are read on a thread while the pool is sized and every step program is lowered and
compiled; the weights are attached and the pool allocated once both are done. Given a `LoadedModel` (weights
already read), the same happens without the thread.

With a program store (`compiled_dir`, or programs/ in the compilation cache folder; runner/program_store.py) every
program kept there under its key loads whole instead, and every one compiled is added; the weights are then read
before the programs rather than beside them (XLA:CPU is not safe deserializing two executables at once). A pool sized from memory
then takes the largest pool size stored that fits, with the workspace measured when it was stored, so that a store
filled elsewhere (`jaxserve compile --out`) serves without a compile.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from pathlib import Path

import jax

from jaxserve.checkpoint import LoadedModel, ModelPlan
from jaxserve.checkpoint.loading import weight_bytes_per_device
from jaxserve.config import EngineConfig
from jaxserve.device_memory import allocator_fraction
from jaxserve.errors import ConfigError
from jaxserve.engine.kv_sizing import (bytes_per_page, check_workspace_plan, device_memory_stats,
                                      resolve_num_pages, workspace_summary)
from jaxserve.model.kv_quantization import is_float8, kv_pool_dtype
from jaxserve.parallel.process_group import smallest_across_processes
from jaxserve.runner.lockstep import spans_processes
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.program_keys import UnstableKeyError
from jaxserve.runner.program_store import ProgramStore, StoredPool
from jaxserve.runner.step_programs import ProgramSources

log = logging.getLogger(__name__)
PROGRAMS_FOLDER = "programs"  # the program store's folder inside the compilation cache's, when no compiled_dir is set
NO_STORE = "none"  # compiled_dir that turns the program store off


@dataclasses.dataclass(frozen=True)
class StartupStats:
    """Where start-up time went."""

    programs: int  # step programs made ready: loaded from the program store, or compiled (or found cached)
    load_seconds: float  # reading the weights, on their own thread beside the compiles; 0 when read beforehand
    lower_seconds: float  # tracing and lowering every program
    compile_seconds: float  # wall time of the parallel compiles
    ready_seconds: float  # from the start of `start_runner` to a runner ready to step
    sources: ProgramSources = ProgramSources()  # where the programs came from: store, compilation cache, compiled
    store_seconds: float = 0.0  # reading programs from the program store


def start_runner(model: LoadedModel | ModelPlan, config: EngineConfig, progress: bool = True,
                 draft: ModelPlan | None = None) -> tuple[ModelRunner, EngineConfig, StartupStats, ModelRunner | None]:
    """A runner with every program compiled, its weights attached and its pool allocated, and `config` with the
    pool's size filled in. `config` must have max_model_len resolved (EngineConfig.with_model_limit).

    With a `draft` model (speculative decoding) its runner comes too, ready the same way: its programs compile
    after the target's, and its pool has as many pages (sized together from memory)."""
    started = time.perf_counter()
    check_speculation(config)
    enable_compilation_cache(config)
    planned = isinstance(model, ModelPlan)
    runner = ModelRunner(model.config, model.graphdef, model.abstract_params if planned else model.params,
                         model.dtype, config, model.mesh, model.kv_cache_scales)
    if draft is not None and spans_processes(runner.mesh):
        # Followers replay one runner's broadcast steps; a second runner's would interleave with them.
        raise ConfigError("speculative_config: a draft model runs within one process; a model over several processes "
                          "can speculate with the ngram method")
    # Read before the weights start arriving: with them in flight, the allocator's count would be a moving target.
    stats = device_memory_stats() if config.num_kv_pages is None and config.kv_cache_memory_gb is None else None
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as loader:
        loading = loader.submit(_timed_load, model, progress) if planned else None
        pending_bytes = (model.weight_bytes_per_device() if planned else 0) + (
            draft.weight_bytes_per_device() if draft is not None else 0)
        store = open_program_store(config, runner)
        if store is not None and loading is not None:
            # XLA:CPU crashed (a segfault) deserializing a stored program while the loading thread's jitted code
            # deserialized another from JAX's persistent cache: with a store, the weights are read first.
            loading.result()
        pages, workspace = _pool_pages(model, config, runner, stats, pending_bytes, draft, store)
        config = config.with_pool(pages)
        runner.warm_up(config.num_kv_pages, progress, store)
        if store is not None and runner.programs.stats.all_in_store:  # a start may then size its pool to it
            store.record_pool(StoredPool(config.num_kv_pages, workspace))
        workspaces = runner.programs.compiled_workspaces()
        log.info("%s", workspace_summary(workspaces))
        if stats is not None:  # a pool sized from memory leaves the steps only the workspace it measured
            check_workspace_plan(workspace, workspaces)
        draft_runner = _start_draft(draft, config, progress) if draft is not None else None
        load_seconds = 0.0
        if loading is not None:
            loaded, load_seconds = loading.result()
            runner.load_params(loaded.params)
    runner.allocate_pool(config.num_kv_pages)
    warmup = runner.programs.stats
    startup = StartupStats(warmup.programs, load_seconds, warmup.lower_seconds, warmup.compile_seconds,
                           time.perf_counter() - started, warmup.sources, warmup.store_seconds)
    # compile_seconds spans the whole warm-up, store reads included: it is not time spent compiling alone.
    log.info("ready in %.1f s: %d step programs (%s) ready after %.1f s (%.1f s reading the store, %.1f s lowering), "
             "weights read in %.1f s", startup.ready_seconds, startup.programs, startup.sources.text(),
             startup.compile_seconds, startup.store_seconds, startup.lower_seconds, startup.load_seconds)
    log.info("%s", serving_summary(model, config))
    return runner, config, startup, draft_runner


def _start_draft(draft: ModelPlan, config: EngineConfig, progress: bool) -> ModelRunner:
    """The draft model's runner: programs compiled, weights read, a pool of the target's page count."""
    runner = ModelRunner(draft.config, draft.graphdef, draft.abstract_params, draft.dtype, draft_engine_config(config),
                         draft.mesh)
    runner.warm_up(config.num_kv_pages, progress, open_program_store(config, runner))
    runner.load_params(draft.load(progress).params)
    runner.allocate_pool(config.num_kv_pages)
    return runner


def draft_engine_config(config: EngineConfig) -> EngineConfig:
    """The draft runner's settings: the target's limits and pool size, a token budget with room for each row's
    catch-up token (the draft may lag its target by one), and no speculation or quantization of its own."""
    return dataclasses.replace(config, model=config.speculative_config.model, speculative_config=None,
                               quantization=None,
                               max_num_batched_tokens=config.require("max_num_batched_tokens") + config.max_num_seqs)


def check_speculation(config: EngineConfig) -> None:
    """Refuses speculative settings the step limits cannot hold, or a method this engine lacks, before compiling."""
    spec = config.speculative_config
    if spec is None:
        return
    if spec.num_speculative_tokens + 1 > config.require("max_num_batched_tokens"):
        raise ConfigError(f"speculative_config: num_speculative_tokens ({spec.num_speculative_tokens}) plus the "
                          f"sampled token must fit max_num_batched_tokens ({config.max_num_batched_tokens})")


def serving_summary(model: LoadedModel | ModelPlan, config: EngineConfig) -> str:
    """One line of what runs: model, dtype, devices, step limits, weight and KV cache bytes per device."""
    devices = model.mesh.devices.flatten() if model.mesh is not None else jax.local_devices()[:1]
    weights = weight_bytes_per_device(model.abstract_params if isinstance(model, ModelPlan) else model.params)
    pool = config.require("num_kv_pages") - 1  # the null page holds nothing
    kv_dtype = kv_pool_dtype(config.kv_cache_dtype, model.dtype)
    per_page = bytes_per_page(model.config, config.block_size, kv_dtype, len(devices))
    quantized = f" with {model.quantization} weights" if model.quantization is not None else ""
    return (f"serving {model.model_dir.name} ({model.source}) in {jax.numpy.dtype(model.dtype).name}{quantized} on "
            f"{len(devices)} x {devices[0].device_kind}; max_num_seqs {config.max_num_seqs}, max_num_batched_tokens "
            f"{config.max_num_batched_tokens}, max_model_len {config.max_model_len}; weights {_size(weights)} per "
            f"device; KV cache {pool} pages = {pool * config.block_size} tokens ({_size(pool * per_page)} per device, "
            f"{per_page // config.block_size} bytes per token in {kv_dtype.name}{_scales_note(model, kv_dtype)})"
            f"{_speculation_note(config)}")


def _speculation_note(config: EngineConfig) -> str:
    spec = config.speculative_config
    if spec is None:
        return ""
    proposer = (f"draft model {spec.model}" if spec.model is not None
                else f"ngram lookup of {spec.prompt_lookup_max}..{spec.prompt_lookup_min} tokens")
    return f"; speculative decoding: {proposer}, up to {spec.num_speculative_tokens} drafts per sequence and step"


def _scales_note(model: LoadedModel | ModelPlan, kv_dtype) -> str:
    if not is_float8(kv_dtype):
        return ""
    return ", the checkpoint's K/V scales" if model.kv_cache_scales is not None else ", K/V scales 1.0"


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def _timed_load(plan: ModelPlan, progress: bool) -> tuple[LoadedModel, float]:
    """The weights, and the seconds reading them took (its bar, where the format has one, takes its own line)."""
    started = time.perf_counter()
    loaded = plan.load(progress)
    return loaded, time.perf_counter() - started


def _pool_pages(model: LoadedModel | ModelPlan, config: EngineConfig, runner: ModelRunner, stats: dict | None,
                pending_weight_bytes: int, draft: ModelPlan | None,
                store: ProgramStore | None) -> tuple[int, int]:
    """The pool's size and the workspace left beside it; sized from device memory, the pool leaves room for the
    weights (those still loading counted as in use) and for the largest step's activation workspace, and takes the
    largest pool whose programs the store holds if that fits.

    In a multi-process group every process takes the smallest count, so all compile the same programs.
    """
    if stats is not None:
        stats = {**stats, "bytes_in_use": stats.get("bytes_in_use", 0) + pending_weight_bytes}
    workspace = 0
    stored = [pool for pool in store.stored_pools() if pool.workspace_bytes > 0] if store is not None else []
    if stats is not None and stored:
        workspace = stored[0].workspace_bytes  # measured by the start (or `jaxserve compile`) that stored them
    elif stats is not None:
        log.info("sizing the KV cache: compiling the largest step once to measure its workspace")
        workspace = runner.programs.largest_workspace_bytes()
    pages = resolve_num_pages(model.config, kv_pool_dtype(config.kv_cache_dtype, model.dtype),
                              page_size=config.block_size,
                              tensor_parallel_size=model.mesh.size if model.mesh is not None else 1,
                              max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                              num_kv_pages=config.num_kv_pages, kv_cache_memory_gb=config.kv_cache_memory_gb,
                              gpu_memory_utilization=config.gpu_memory_utilization, memory_stats=stats,
                              workspace_bytes=workspace, allocator_share=allocator_fraction(),
                              extra_bytes_per_page=_draft_bytes_per_page(draft, config))
    fitting = [pool.num_pages for pool in stored if pool.num_pages <= pages]
    if stats is not None and fitting:
        log.info("KV cache: %d pages, the largest pool the program store holds programs for (memory fits %d)",
                 fitting[0], pages)
        pages = fitting[0]
    return smallest_across_processes(pages), workspace


def _draft_bytes_per_page(draft: ModelPlan | None, config: EngineConfig) -> int:
    if draft is None:
        return 0
    devices = draft.mesh.size if draft.mesh is not None else 1
    return bytes_per_page(draft.config, config.block_size, kv_pool_dtype(config.kv_cache_dtype, draft.dtype), devices)


def program_store_dir(config: EngineConfig) -> Path | None:
    """Where compiled programs are kept: `compiled_dir`, else programs/ in the compilation cache's folder; None
    when neither is set, or compiled_dir is "none"."""
    if config.compiled_dir == NO_STORE:
        return None
    if config.compiled_dir is not None:
        return Path(config.compiled_dir)
    return Path(config.compilation_cache_dir) / PROGRAMS_FOLDER if config.compilation_cache_dir is not None else None


def open_program_store(config: EngineConfig, runner: ModelRunner) -> ProgramStore | None:
    """The store of the runner's programs (runner/program_store.py), keyed by its scope; None without a folder, and
    for runners whose programs are not stored yet (pooling, a mesh over several processes)."""
    folder = program_store_dir(config)
    if folder is None:
        return None
    if config.pooling or spans_processes(runner.mesh):
        log.info("the program store is not used by %s yet: compiling",
                 "the pooling runner" if config.pooling else "a mesh over several processes")
        return None
    try:
        scope = runner.store_scope()
    except UnstableKeyError as error:
        log.warning("the program store is not used: %s", error)
        return None
    return ProgramStore(folder, scope, list(runner.mesh.devices.flat), compile_afresh=config.compiled_dir is not None)


def enable_compilation_cache(config: EngineConfig) -> None:
    """JAX's persistent cache: a restart (or a second engine of the same shapes) loads programs instead of compiling."""
    if config.compilation_cache_dir is None:
        return
    jax.config.update("jax_compilation_cache_dir", str(config.compilation_cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
