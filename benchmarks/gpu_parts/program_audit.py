"""The engine's step programs compiled on the GPU against the same programs compiled without it: `jaxserve compile
--audit` once per build, by default deviceless (XLA's heuristic choices for the target description) and
--on-device (built for this GPU, so XLA autotunes there), and per program what differs between the builds: temp
memory, GEMM backends, other library calls, weight and pool copies, launches per layer, CUDA graphs, bytes moved
against bytes the step must read, rematerialized operations. Decisions made before autotuning (fusions, copies)
carry over from a deviceless build to the device; a GEMM's backend or a sort's library may not, which is what this
part shows. The target is the description of this GPU (by nvidia-smi's name; configs/gpu-targets/), so that both
builds size the same pool and compile the same programs.

Each build runs in a process of its own (the deviceless one must start JAX with its CUDA plugin beside the CPU
backend); a build that fails is reported with the end of its output and the others still run. Imports no JAX.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_parts.context import REPO, PartContext, PartOutcome, markdown_table
from jaxserve.gpu_programs.target import TARGETS_DIR, load_target

MIB = 2**20
DEFAULT_TARGET = "h100"  # where nvidia-smi names no GPU with a description
OUTPUT_TAIL_CHARS = 3000  # of a failed build's output, kept in the figures
NVIDIA_SMI_TIMEOUT_S = 30


def run(context: PartContext, config: str, target: str, programs: str, builds: dict[str, list[str]]) -> PartOutcome:
    target = this_gpus_target() if target == "auto" else target
    audits = {label: compile_and_audit(config, target, programs, flags,
                                       context.work_dir / f"program_audit-{file_label(label)}.json")
              for label, flags in builds.items()}
    reports = {label: audit["report"] for label, audit in audits.items() if "report" in audit}
    figures = {"target": target, "config": config, "programs": programs, "builds": builds,
               "comparison": compare(reports), "audits": audits}
    return PartOutcome(figures, summary(figures), passed=len(reports) == len(builds))


def this_gpus_target() -> str:
    """The target description (configs/gpu-targets/NAME.pbtxt) whose device kind is nvidia-smi's name of GPU 0,
    else DEFAULT_TARGET. Asked of nvidia-smi, not JAX: JAX here would claim the GPU's memory the builds need."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return DEFAULT_TARGET
    try:
        name = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=NVIDIA_SMI_TIMEOUT_S, check=True).stdout.splitlines()[0].strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        return DEFAULT_TARGET
    return next((path.stem for path in sorted(TARGETS_DIR.glob("*.pbtxt"))
                 if load_target(str(path)).device_kind == name), DEFAULT_TARGET)


def file_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-")


def compile_and_audit(config: str, target: str, programs: str, flags: list[str], audit_path: Path) -> dict[str, Any]:
    """One `jaxserve compile --audit` in a process of its own (its output echoed into the part's log): its report,
    or the error and the end of its output."""
    audit_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "jaxserve.cli", "compile", "--config", config, "--target", target, "--programs",
               programs, "--audit", str(audit_path), *flags]
    print("$ " + " ".join(command), flush=True)
    started = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    print(done.stdout + done.stderr, flush=True)
    if done.returncode != 0 or not audit_path.exists():
        return {"command": command, "seconds": seconds, "error": f"exit code {done.returncode}",
                "output_tail": (done.stdout + done.stderr)[-OUTPUT_TAIL_CHARS:]}
    return {"command": command, "seconds": seconds, "report": json.loads(audit_path.read_text())}


def _gemms(program: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for gemm in program["gemms"]:
        counts[short_call(gemm["backend"])] = counts.get(short_call(gemm["backend"]), 0) + gemm["per_run"]
    return " ".join(f"{n} {name}" for name, n in counts.items()) or "-"


def _library_calls(program: dict[str, Any]) -> str:
    """Custom calls that are not GEMMs: Pallas (Triton) kernels, CUB sorts."""
    calls = {short_call(t): n for t, n in program["custom_calls"].items() if not t.startswith("__cublas")}
    return " ".join(f"{n} {name}" for name, n in calls.items()) or "-"


def _copies(program: dict[str, Any], pool: bool) -> str:
    copies = [c for c in program["copies"] if (c["role"] == "pool") == pool]
    if not copies:
        return "0"
    return f"{sum(c['per_run'] for c in copies)} = {sum(c['bytes'] * c['per_run'] for c in copies) / MIB:.0f} MiB"


def _graphs(program: dict[str, Any]) -> str:
    thunks = program["launches"]["thunks"]
    if thunks is None:
        return "?"
    return f"{thunks['command_buffers']} ({thunks['in_command_buffers']}/{thunks['launches']} launches)"


# What the comparison shows of each program: (column, how an audit's program entry reads in it).
COLUMNS = (
    ("temp MiB", lambda p: f"{p['temp_bytes'] / MIB:.0f}"),
    ("GEMMs", _gemms),
    ("other library calls", _library_calls),
    ("weight copies/run", lambda p: _copies(p, pool=False)),
    ("pool copies/run", lambda p: _copies(p, pool=True)),
    ("launches/layer", lambda p: str(p["launches"]["per_layer"])),
    ("CUDA graphs", _graphs),
    ("moved/must-read", lambda p: f"{p['roofline']['ratio']:.2f}"),
    ("remat", lambda p: str(p["rematerialized"])),
)


def short_call(target: str) -> str:
    """A library call's or GEMM backend's short name: "__cublas$lt$matmul" -> "cublasLt"."""
    names = {"__cublas$lt$matmul$f8": "cublasLt-f8", "__cublas$lt$matmul": "cublasLt", "__cublas$gemm": "cublas",
             "__gpu$xla.gpu.triton": "triton", "__triton_nested_gemm_fusion": "tritonN", "__triton_gemm": "triton",
             "xla fusion": "xla"}
    return names.get(target, target.removeprefix("xla.gpu.ext.").removeprefix("__"))


def compare(reports: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per program (in the first build's order, then any only later builds have): each column's cell per build,
    and the columns whose cells differ."""
    names = list(dict.fromkeys(p["name"] for report in reports.values() for p in report["programs"]))
    by_build = {label: {p["name"]: p for p in report["programs"]} for label, report in reports.items()}
    rows = []
    for name in names:
        cells = {column: {label: read(programs[name]) if name in programs else "missing"
                          for label, programs in by_build.items()} for column, read in COLUMNS}
        rows.append({"program": name, "cells": cells,
                     "differs": [column for column, values in cells.items() if len(set(values.values())) > 1]})
    return rows


def summary(figures: dict[str, Any]) -> str:
    audits = figures["audits"]
    lines = [f"`jaxserve compile --config {figures['config']} --target {figures['target']} --programs "
             f"'{figures['programs']}' --audit OUT` per build:"]
    for label, audit in audits.items():
        flags = " ".join(figures["builds"][label]) or "no flags"
        if "report" in audit:
            report = audit["report"]
            lines.append(f"- {label} ({flags}): {len(report['programs'])} programs on "
                         f"{report['setup']['device_kind']}, {report['setup']['num_kv_pages']} KV pages, "
                         f"{audit['seconds']:.0f} s")
        else:
            lines.append(f"- {label} ({flags}): **failed**, {audit['error']}: {audit['output_tail'][-600:]}")
    labels = [label for label in audits if "report" in audits[label]]
    if not figures["comparison"]:
        return "\n".join(lines)
    header = ["program", *[column for column, _ in COLUMNS]]
    rows = [[row["program"], *[cell_text(row["cells"][column], labels, column in row["differs"])
                               for column, _ in COLUMNS]] for row in figures["comparison"]]
    differing = sum(1 for row in figures["comparison"] if row["differs"])
    lines.append(f"- cells read {' -> '.join(labels)} where the builds differ (in bold); {differing} of "
                 f"{len(rows)} programs differ somewhere")
    return "\n".join(lines) + "\n\n" + markdown_table(header, rows)


def cell_text(values: dict[str, str], labels: list[str], differs: bool) -> str:
    if not differs:
        return values[labels[0]]
    return "**" + " -> ".join(values[label] for label in labels) + "**"
