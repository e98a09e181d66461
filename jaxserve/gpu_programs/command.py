"""`jaxserve compile`: an engine's GPU programs built for a target, audited, reported as JSON and a table.

Imports JAX: the command line calls `target.prepare_compile_environment()` before importing this module.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

from jaxserve.config import EngineConfig
from jaxserve.errors import ConfigError
from jaxserve.gpu_programs.audit import audit_program
from jaxserve.gpu_programs.build import (AbstractEngine, build_engine, compile_programs, engine_programs, file_stem,
                                         program_name)
from jaxserve.gpu_programs.model_shapes import model_shape
from jaxserve.gpu_programs.report import AuditedProgram, AuditReport, report_table, write_json
from jaxserve.gpu_programs.target import load_target


@dataclasses.dataclass(frozen=True)
class CompileRequest:
    """What `jaxserve compile` was asked."""

    config: EngineConfig  # the preset with the command line's settings
    preset: Path | None  # the preset's file, which may name the model's shapes
    target: str  # "h100", "h200" or a target description's path
    model_shape: str | None  # model_shapes.MODEL_SHAPES key; None: from the preset's name
    audit_path: Path | None  # where the JSON goes; None: printed table only
    dump_dir: Path | None  # each program's optimized HLO (and XLA's dumps) go here; None: kept nowhere
    context_tokens: int  # each sequence's context the roofline assumes
    program_filter: str | None  # a regular expression over program names ("decode S=1", ...); None: all
    compiler_options: dict  # XLA options for every program (e.g. {"xla_gpu_enable_triton_gemm": False})
    jobs: int  # programs compiled at once
    on_device: bool = False  # built for this host's GPUs (autotuned there) rather than the target's described ones


def run_compile(request: CompileRequest, progress=print) -> AuditReport:
    """Builds, compiles and audits the programs asked for; writes the JSON and the HLO dumps, prints the table."""
    started = time.perf_counter()
    name, hf_config = model_shape(request.model_shape, request.preset, request.config.model)
    engine = build_engine(name, hf_config, request.config, load_target(request.target), request.context_tokens,
                          request.on_device)
    programs = [p for p in engine_programs(engine)
                if request.program_filter is None or re.search(request.program_filter, program_name(p))]
    if not programs:
        raise ConfigError(f"no program's name matches {request.program_filter!r}")
    progress(f"compiling {len(programs)} programs of {name} for {engine.target.device_kind} x "
             f"{request.config.tensor_parallel_size} ({engine.config.num_kv_pages} KV pages)")
    audited = {}
    for compiled in compile_programs(engine, programs, request.compiler_options, _xla_dumps(request), request.jobs):
        audit = audit_program(compiled.hlo_text, compiled.facts, compiled.memory, compiled.thunks)
        audited[audit.name] = AuditedProgram(audit, compiled.lower_seconds, compiled.compile_seconds)
        if request.dump_dir is not None:
            (request.dump_dir / f"{file_stem(audit.name)}.hlo.txt").write_text(compiled.hlo_text)
        progress(f"  {audit.name}: compiled in {compiled.compile_seconds:.1f} s")
    report = AuditReport(_setup(engine, request), tuple(audited[program_name(p)] for p in programs),
                         time.perf_counter() - started)
    progress(report_table(report))
    if request.audit_path is not None:
        write_json(report, request.audit_path)
    return report


def _xla_dumps(request: CompileRequest) -> Path | None:
    if request.dump_dir is None:
        return None
    request.dump_dir.mkdir(parents=True, exist_ok=True)
    return request.dump_dir / "xla"


def _setup(engine: AbstractEngine, request: CompileRequest) -> dict:
    config = engine.config
    return {"target": engine.target.name, "device_kind": engine.target.device_kind,
            "memory_bandwidth": engine.target.memory_bandwidth, "model": engine.model_name,
            "num_hidden_layers": engine.model_config.num_hidden_layers, "dtype": engine.dtype.name,
            "tensor_parallel_size": config.tensor_parallel_size, "quantization": config.quantization,
            "kv_cache_dtype": config.kv_cache_dtype, "attention_backend": engine.runner.attention_backend,
            "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_model_len": config.max_model_len, "num_kv_pages": config.num_kv_pages,
            "enable_lora": config.enable_lora, "speculative": config.speculative_config is not None,
            "context_tokens": engine.context_tokens, "compiler_options": request.compiler_options,
            "on_device": request.on_device}


def parse_compiler_options(entries: list[str]) -> dict:
    """KEY=VALUE entries as XLA options: true/false as booleans, numbers as numbers, anything else as text."""
    options = {}
    for entry in entries:
        key, separator, value = entry.partition("=")
        if not separator or not key:
            raise ConfigError(f"--xla-option takes KEY=VALUE, got {entry!r}")
        options[key.removeprefix("--")] = _option_value(value)
    return options


def _option_value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
