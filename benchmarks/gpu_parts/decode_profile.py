"""Decode against its rooflines, and what a decode step does on the device: benchmarks/engine_bench.py with the
8B-shaped pallas engine alone, batch 1, 64 and 256 against the roofline (weights + KV read per step) at the card's
spec bandwidth and at the copy rate measured in the engine's process (which a device memcpy and a read-only
reduction of the same buffer cross-check); then, in the same engine, decode steps at batch 1 and 64 traced with
jax.profiler and read by step_trace.py: kernels per step, the device's busy fraction over the steps' wall time, and
the kernels that took the time, by named scope. The traces' device events within the steps' windows go into the
output folder as one Chrome trace (ui.perfetto.dev opens it); the whole traces stay in the work folder.

The engine's settings are engine_speed's (the same programs, so one part finds the other's in JAX's compilation
cache)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from gpu_parts.context import PartContext, PartOutcome, markdown_table, run_benchmark_script
from gpu_parts.engine_speed import HOST_PHASES, ROOFLINE_HEADER, bandwidth_text, roofline_cells, speed_rows
from gpu_parts.step_trace import combined_trace, read_profile

# Issue 34's targets: a step's share of the spec-bandwidth roofline, by batch.
SPEC_TARGETS = {1: 0.75, 64: 0.65}
MAX_TRACE_BYTES = 12 * 2**20  # the excerpt stays under the 16 MiB a results file may have


def run(context: PartContext, args: list[str], profile_batches: list[int], profile_steps: int) -> PartOutcome:
    profile_dir = context.work_dir / "decode_profile"
    report = run_benchmark_script(
        "engine_bench.py", [*args, "--engine-profile-steps", str(profile_steps), "--engine-profile-batches",
                            *map(str, profile_batches), "--engine-profile-dir", str(profile_dir)],
        context.work_dir / "decode_profile.json")
    engine = report["engine"]
    profiles, excerpts = read_profiles(engine.get("profiles", {}), host_thunks=context.smoke)
    figures = {"rows": speed_rows(engine), "profiles": profiles, "targets": spec_targets(engine),
               "trace": write_trace(excerpts, context.artifact), "report": report}
    passed = (bool(figures["rows"]) and len(profiles) == len(profile_batches)
              and all("error" not in p and p["kernels_per_step"] > 0 for p in profiles.values()))
    return PartOutcome(figures, summary(figures, engine), passed)


def read_profiles(runs: dict[str, Any], host_thunks: bool) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Each profiled batch's summary (or why there is none), and its trace excerpt. `host_thunks`: JAX ran on the
    CPU, whose thunks stand in for device events."""
    profiles, excerpts = {}, {}
    for batch, run in runs.items():
        if "error" in run:
            profiles[batch] = {"error": run["error"]}
            continue
        try:
            summary_, excerpts[f"batch {batch}"] = read_profile(Path(run["trace_dir"]), run["window_annotation"],
                                                                run["steps"], run["hlo_files"], host_thunks)
        except (OSError, ValueError, KeyError) as error:  # an unreadable trace leaves the timed figures
            profiles[batch] = {"error": f"{type(error).__name__}: {error}"}
            continue
        profiles[batch] = {**summary_, "host_step_ms": run["step_s"] * 1e3, "trace_dir": run["trace_dir"]}
    return profiles, excerpts


def write_trace(excerpts: dict[str, list[dict[str, Any]]], path: Path | None) -> dict[str, Any]:
    """The excerpts as one gzipped trace at `path`, unless there are none or it would be too large to bring back."""
    if path is None or not excerpts:
        return {"written": False, "why": "no trace excerpt"}
    data = gzip.compress(json.dumps(combined_trace(excerpts)).encode())
    if len(data) > MAX_TRACE_BYTES:
        return {"written": False, "why": f"{len(data) / 2**20:.1f} MiB compressed, over {MAX_TRACE_BYTES / 2**20:.0f}"}
    path.write_bytes(data)
    return {"written": True, "file": path.name, "bytes": len(data)}


def spec_targets(engine: dict[str, Any]) -> dict[str, Any]:
    """Per batch with a target: the pallas step's share of the spec roofline against it (met or not)."""
    targets = {}
    for batch, target in SPEC_TARGETS.items():
        row = engine.get("summary", {}).get(str(batch), {}).get(engine["settings"]["variants"][0], {})
        if "fraction_of_spec_roofline" in row:
            targets[str(batch)] = {"target": target, "measured": row["fraction_of_spec_roofline"],
                                   "met": row["fraction_of_spec_roofline"] >= target}
    return targets


def summary(figures: dict[str, Any], engine: dict[str, Any]) -> str:
    lines = [f"- {backend} process: {bandwidth_text(ready)}" for backend, ready in engine["ready"].items()
             if "error" not in ready]
    lines += [f"- {backend} engine failed to start: {ready['error'][:300]}" for backend, ready in
              engine["ready"].items() if "error" in ready]
    lines += [f"- batch {batch}: {t['measured']:.0%} of the spec roofline, target {t['target']:.0%}: "
              + ("met" if t["met"] else "**not met**") for batch, t in figures["targets"].items()]
    speed = markdown_table(
        ["batch", "engine", "ms/step", "tok/s", *ROOFLINE_HEADER, "host ms/step: " + " / ".join(HOST_PHASES)],
        [[r["batch"], r["backend"], f"{r['step_s'] * 1e3:.2f}", f"{r['tokens_per_s']:.1f}", *roofline_cells(r),
          " / ".join(f"{r['host_phase_ms'][phase]:.2f}" for phase in HOST_PHASES)] for r in figures["rows"]])
    return "\n\n".join(["\n".join(lines), speed, profile_text(figures, engine)])


def profile_text(figures: dict[str, Any], engine: dict[str, Any]) -> str:
    """The profiles: one row per batch, then each batch's time by named scope and its top kernels."""
    profiles = figures["profiles"]
    timed = {str(r["batch"]): r["step_s"] * 1e3 for r in figures["rows"] if r["backend"] ==
             engine["settings"]["variants"][0]}
    ok = {batch: p for batch, p in profiles.items() if "error" not in p}
    parts = [f"Profile of {next(iter(ok.values()))['steps'] if ok else '?'} decode steps per batch (jax.profiler; "
             "CUDA graphs run op by op while it traces, so a profiled step is slower than a timed one):"]
    parts += [f"- batch {batch}: profile failed: {p['error'][:300]}" for batch, p in profiles.items() if "error" in p]
    if ok:
        parts.append(markdown_table(
            ["batch", "timed ms/step", "profiled ms/step", "kernels/step", "copies/step", "GPU busy",
             "busy ms/step", "device ms/step", "attributed to a scope"],
            [[batch, f"{timed[batch]:.2f}" if batch in timed else "-", f"{p['ms_per_step']:.2f}",
              f"{p['kernels_per_step']:.0f}", f"{p['copies_per_step']:.0f}", f"{p['busy_fraction']:.0%}",
              f"{p['busy_ms_per_step']:.2f}", f"{p['device_ms_per_step']:.2f}", f"{p['attributed_fraction']:.0%}"]
             for batch, p in ok.items()]))
    for batch, p in ok.items():
        parts.append(f"Batch {batch}, device time by named scope:")
        parts.append(markdown_table(["scope", "launches/step", "ms/step", "share"],
                                    [[s["scope"], f"{s['launches_per_step']:.0f}", f"{s['ms_per_step']:.3f}",
                                      f"{s['share']:.0%}"] for s in p["scopes"]]))
        parts.append(f"Batch {batch}, top kernels by device time:")
        parts.append(markdown_table(
            ["scope", "HLO op", "kernel", "calls/step", "µs/call", "ms/step", "share"],
            [[k["scope"], k["hlo_op"], k["kernel"][:60], f"{k['calls_per_step']:.0f}", f"{k['us_per_call']:.1f}",
              f"{k['ms_per_step']:.3f}", f"{k['share']:.0%}"] for k in p["top_kernels"]]))
    trace = figures["trace"]
    parts.append(f"Trace of the profiled steps: {trace['file']} ({trace['bytes'] / 2**20:.2f} MiB)" if
                 trace["written"] else f"Trace of the profiled steps not written: {trace['why']}")
    return "\n\n".join(parts)
