"""One part in a process of its own, under its budget: the orchestrator's side (start, time out, end the part's
whole process group) and the part process's side (run the part, write its outcome). Imports no JAX."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpu_parts import PARTS_BY_NAME
from gpu_parts.context import BENCHMARKS, REPO, PartContext

GRACE_S = 5  # between SIGTERM and SIGKILL of a timed-out part: time to exit cleanly, not to finish work
FAULTS = ("raise", "hang")  # what a test can make a part do instead of running (reported like a real failure)


@dataclasses.dataclass(frozen=True)
class PartJob:
    """What a part's process is told: which part, with which arguments, where to write."""

    part: str  # its name in the registry
    args: dict[str, Any]  # keyword arguments of its run function
    out_dir: str  # PartContext.out_dir
    work_dir: str  # PartContext.work_dir
    smoke: bool  # PartContext.smoke
    result_path: str  # where the process writes the PartOutcome as JSON
    fault: str | None = None  # one of FAULTS, or None to run the part


@dataclasses.dataclass(frozen=True)
class Finished:
    """How a part's process ended."""

    status: str  # "exited" or "timeout"
    returncode: int | None  # the exit code when it exited
    seconds: float  # wall time


def part_environment(smoke: bool) -> dict[str, str]:
    """The part process's environment: jaxserve and the benchmarks importable, output unbuffered (the log is read
    live), and JAX held to the CPU for --smoke or to CUDA otherwise, so that a GPU run whose JAX cannot reach the
    GPU fails at once instead of crawling through 8B-sized work on the CPU. A JAX_PLATFORMS already set wins."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("JAX_PLATFORMS", "cpu" if smoke else "cuda")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(BENCHMARKS), *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_in_own_process(job: PartJob, budget_s: float, log_path: Path) -> Finished:
    """Runs the job in a new process group, its output into log_path; past budget_s the group gets SIGTERM, then
    SIGKILL. Whatever the outcome, every process left in the group (a server, an engine process) is ended after."""
    command = [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--child", json.dumps(dataclasses.asdict(job))]
    start = time.monotonic()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                   env=part_environment(job.smoke))
        try:
            returncode = process.wait(timeout=budget_s)
            status = "exited"
        except subprocess.TimeoutExpired:
            returncode, status = None, "timeout"
            _signal_group(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                pass  # SIGKILL below
    _signal_group(process.pid, signal.SIGKILL)
    process.wait()
    return Finished(status, returncode, time.monotonic() - start)


def _signal_group(group_id: int, signum: int) -> None:
    """Signals the part's process group (its id is the part process's pid); a group already gone is fine."""
    try:
        os.killpg(group_id, signum)
    except ProcessLookupError:
        pass


def run_job(job: PartJob) -> None:
    """The part process: runs the part (or the fault a test asked for) and writes its outcome."""
    part = PARTS_BY_NAME[job.part]
    if job.fault == "raise":
        raise RuntimeError(f"fault injected into part {job.part}")
    if job.fault == "hang":
        threading.Event().wait()  # until the orchestrator ends the process at the budget
    module_name, function_name = part.run.split(":")
    run = getattr(importlib.import_module(module_name), function_name)
    out_dir = Path(job.out_dir)
    context = PartContext(out_dir, Path(job.work_dir), job.smoke, out_dir / part.plot if part.plot else None,
                          out_dir / part.artifact if part.artifact else None)
    outcome = run(context, **job.args)
    Path(job.result_path).write_text(json.dumps(dataclasses.asdict(outcome), indent=1, default=str))
