"""What a part of the GPU check is given (PartContext) and gives back (PartOutcome), and how it runs a benchmark
script of this folder. Imports no JAX: the orchestrating process uses these too."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent.parent
REPO = BENCHMARKS.parent


@dataclasses.dataclass(frozen=True)
class PartContext:
    """Where a part writes, and how big it runs."""

    out_dir: Path  # the report's folder: flat, a few files; a part writes there only the files its Part names
    work_dir: Path  # scratch that outlives the run (sub-benchmark JSON, logs, the random checkpoint), reused by reruns
    smoke: bool  # the CPU check: tiny shapes, kernels interpreted
    plot: Path | None  # where the part's plot goes (in out_dir), None for a part without one
    artifact: Path | None = None  # where the part's other file (a trace) goes (in out_dir), None for none


@dataclasses.dataclass(frozen=True)
class PartOutcome:
    """A part's result, as the report keeps it."""

    figures: dict[str, Any]  # everything measured, JSON-ready (sub-benchmarks' own reports included)
    summary: str  # markdown for the report: a few lines or a table
    passed: bool = True  # False when a check the part makes did not hold (it still ran to the end)


def run_benchmark_script(script: str, args: list[str], json_out: Path) -> dict[str, Any]:
    """Runs benchmarks/SCRIPT with ARGS plus `--out JSON_OUT` in a process of its own (its output goes to the part's
    log) and returns the JSON it wrote; a non-zero exit raises."""
    json_out.unlink(missing_ok=True)
    subprocess.run([sys.executable, str(BENCHMARKS / script), *args, "--out", str(json_out)], check=True, cwd=REPO)
    return json.loads(json_out.read_text())


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
