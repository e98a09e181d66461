"""The audit's results as JSON (everything found, per program) and as a table (one line per program)."""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path

from jaxserve.gpu_programs.audit import ProgramAudit

MIB = 2**20


@dataclasses.dataclass(frozen=True)
class AuditedProgram:
    """One program's findings and what building it cost."""

    audit: ProgramAudit
    lower_seconds: float
    compile_seconds: float  # on its compile thread, beside the other compiles running


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """Every audited program of one engine set-up on one GPU target."""

    setup: dict  # target, model, engine settings and the roofline's assumptions, for the reader
    programs: tuple[AuditedProgram, ...]  # in warm-up order
    wall_seconds: float  # building, compiling (in parallel) and auditing all of them


def report_json(report: AuditReport) -> dict:
    """The report as JSON-ready data: each audit's fields, plus each roofline's ratio."""
    programs = []
    for program in report.programs:
        entry = _plain(dataclasses.asdict(program.audit))
        entry["roofline"]["ratio"] = round(program.audit.roofline.ratio, 3)
        entry["lower_seconds"], entry["compile_seconds"] = program.lower_seconds, program.compile_seconds
        programs.append(entry)
    return {"setup": report.setup, "wall_seconds": report.wall_seconds, "programs": programs,
            "totals": _totals(report)}


def write_json(report: AuditReport, path: Path) -> None:
    Path(path).write_text(json.dumps(report_json(report), indent=1) + "\n")


def _totals(report: AuditReport) -> dict:
    audits = [p.audit for p in report.programs]
    return {"programs": len(audits),
            "programs_copying_weights": sum(1 for a in audits if a.weight_copies),
            "programs_copying_the_pool": sum(1 for a in audits if a.pool_copies),
            "largest_temp_bytes": max((a.temp_bytes for a in audits), default=0),
            "compile_seconds": sum(p.compile_seconds for p in report.programs),
            "lower_seconds": sum(p.lower_seconds for p in report.programs)}


def _plain(value):
    """dataclasses.asdict's output with enums as their values and tuples as lists."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value.value if isinstance(value, enum.Enum) else value


_COLUMNS = (("program", 28), ("temp MiB", 9), ("x act", 7), ("launch/run", 10), ("/layer", 6), ("graphs", 6),
            ("GEMMs", 22), ("weight copies/run", 17), ("pool", 4), ("moved/must", 10), ("remat", 5),
            ("compile s", 9))


def report_table(report: AuditReport) -> str:
    """One line per program: temp memory (and its multiple of the activations), launches per run and per layer,
    CUDA graphs, GEMM backends, weight and pool copies per run, the roofline ratio and the compile time."""
    lines = ["  ".join(f"{title:>{width}}" if i else f"{title:<{width}}" for i, (title, width) in enumerate(_COLUMNS))]
    for program in report.programs:
        lines.append("  ".join(f"{cell:>{width}}" if i else f"{cell:<{width}}"
                               for i, (cell, (_, width)) in enumerate(zip(_row(program), _COLUMNS))))
    return "\n".join(lines)


def _row(program: AuditedProgram) -> tuple[str, ...]:
    audit = program.audit
    thunks = audit.launches.thunks
    copies = audit.weight_copies
    copied = sum(c.bytes * c.per_run for c in copies)
    return (audit.name, f"{audit.temp_bytes / MIB:.0f}",
            f"{audit.temp_bytes / audit.activation_bytes:.1f}" if audit.activation_bytes else "-",
            str(audit.launches.per_run), str(audit.launches.per_layer),
            str(thunks.command_buffers) if thunks is not None else "?", _gemm_summary(audit),
            f"{sum(c.per_run for c in copies)} = {copied / MIB:.0f} MiB" if copies else "0",
            str(sum(c.per_run for c in audit.pool_copies)), f"{audit.roofline.ratio:.2f}",
            str(audit.rematerialized), f"{program.compile_seconds:.1f}")


def _gemm_summary(audit: ProgramAudit) -> str:
    """GEMMs per run by backend, short: "160 tritonN 1 cublasLt" ("-f8" where both operands are float8)."""
    counts: dict[str, int] = {}
    for gemm in audit.gemms:
        short = (gemm.backend.replace("__triton_nested_gemm_fusion", "tritonN").replace("__triton_gemm", "triton")
                 .replace("__cublas$lt$matmul$f8", "cublasLt-f8").replace("__cublas$lt$matmul", "cublasLt")
                 .replace("__cublas$gemm", "cublas").replace("xla fusion", "xla"))
        if set(gemm.operand_dtypes) == {"f8e4m3fn"} and not short.endswith("-f8"):
            short += "-f8"  # a Triton FP8 GEMM
        counts[short] = counts.get(short, 0) + gemm.per_run
    return " ".join(f"{n} {name}" for name, n in counts.items()) or "-"
