"""`jaxserve compile --out DIR`: a program store filled on any machine, for a GPU target without its GPU (or for
this host's CPU), which `jaxserve serve --compiled DIR` then loads on the serving hosts without compiling.

The engine is built as the GPU program audit builds it (build.py: the preset's model with abstract weights over the
target's devices, a compile-only runner, the pool start-up would size), and its programs are made ready by the
runner's own warm-up path (StepPrograms.compile_all with a ProgramStore), so each is compiled with the options and
stored under the key a start on the target computes. A pool sized from memory is stored with its workspace: a start
on the target takes that pool size where its memory fits it (engine/startup.py).

What cannot be checked without the GPU: that XLA:GPU's deviceless executables load and run on one (serialization is
checked here; a program that does not load is compiled there, and the store rewritten).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from jaxserve.config import EngineConfig
from jaxserve.gpu_programs.build import build_engine
from jaxserve.gpu_programs.model_shapes import model_shape
from jaxserve.gpu_programs.target import load_target
from jaxserve.runner.program_store import ProgramStore, StoredPool
from jaxserve.runner.step_programs import ProgramSources

CPU_TARGET = "cpu"  # --target cpu: this host's CPU devices


@dataclasses.dataclass(frozen=True)
class StoreFill:
    """What filling a program store did."""

    folder: Path  # the scope's folder inside the store
    programs: int  # programs the engine starts with
    sources: ProgramSources  # store: already there; compiled: compiled now (and written, unless XLA refused)
    missing: int  # programs not in the store (XLA would not serialize them; logged): a start compiles those
    num_kv_pages: int  # the pool size they were built for
    seconds: float  # building, compiling and writing


def fill_store(config: EngineConfig, preset: Path | None, target: str, out_dir: Path, model_shape_name: str | None,
               progress=print) -> StoreFill:
    """Builds the engine's programs for `target` ("cpu", "h100", "h200" or a description's path) and writes every one
    the store lacks to `out_dir`."""
    started = time.perf_counter()
    name, hf_config = model_shape(model_shape_name, preset, config.model)
    engine = build_engine(name, hf_config, config, None if target == CPU_TARGET else load_target(target),
                          for_store=True)
    runner, pages = engine.runner, engine.config.require("num_kv_pages")
    store = ProgramStore(out_dir, runner.store_scope(), list(runner.mesh.devices.flat), compile_afresh=True)
    device = runner.mesh.devices.flat[0].device_kind
    progress(f"building {runner.programs.count} programs of {name} for {device} x {config.tensor_parallel_size} "
             f"({pages} KV pages) into {store.folder}")
    runner.programs.compile_all(pages, progress=True, store=store)
    stats = runner.programs.stats
    if stats.all_in_store:  # a start sizing its pool from memory may take this size only if none is missing
        store.record_pool(StoredPool(pages, engine.workspace_bytes))
    fill = StoreFill(store.folder, stats.programs, stats.sources, stats.programs - stats.sources.store - stats.stored,
                     pages, time.perf_counter() - started)
    progress(f"{fill.programs} programs in {fill.folder} ({fill.sources.text()}"
             f"{f'; {fill.missing} not stored' if fill.missing else ''}) in {fill.seconds:.1f} s; serve them with "
             f"--compiled {out_dir}")
    return fill
