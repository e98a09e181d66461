"""A jax.profiler trace of an engine's decode steps, read into what the device did: kernels per step, how busy it
was over the steps' wall time, and which kernels took the time, grouped by the named scope each came from.

The trace is the Chrome-trace JSON the profiler writes beside its xplane (`plugins/profile/<run>/<host>.trace.json.gz`).
On a GPU the device's work is the events of the stream lines ("Stream #N...") of a "/device:GPU:N" process: kernels,
and the runtime's memcpy/memset, each kernel naming the HLO instruction that launched it (args hlo_op and
hlo_module). On the CPU backend (the smoke check) XLA:CPU's thunks carry the same args on host threads and stand in
for them when asked (host_thunks). A kernel's named scope comes from its instruction's op_name metadata in the
optimized HLO of the programs the steps ran: `jax.named_scope` paths such as
`jit(run_packed_forward)/layers/while/body/decoder_layer/dot_general`.

While a trace runs, XLA:GPU executes its CUDA graphs op by op (so that each kernel is named): the kernels are those
an unprofiled step runs, but the gaps between them include the launches the graphs would have saved. Imports no JAX.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import re
from pathlib import Path
from typing import Any

GPU_PROCESS = re.compile(r"/device:GPU:\d+")
STREAM_LINE = "Stream"  # how the device's kernel lines are named ("Stream #13(Compute)")
COPY_NAME = re.compile(r"memcpy|memset", re.IGNORECASE)  # the runtime's copies (the HLO's own copies run as kernels)
MODULE = re.compile(r"^HloModule\s+([^\s,]+)", re.MULTILINE)
COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")  # "%fused_add (p: f32[2]) -> f32[2] {"
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s")
OP_NAME = re.compile(r'\bop_name="([^"]*)"')
CALLED = re.compile(r"\b(?:calls|to_apply|body)=%?([\w.\-]+)")
# The step's named scopes (runner/step.py, model/llama.py), most specific first: a kernel belongs to the first on its
# op_name path.
SCOPES = ("decoder_layer", "layers", "logits", "sample", "verify_drafts", "prompt_scores")
OUTSIDE_SCOPES = "outside the named scopes"  # the embedding lookup, unpacking the step's inputs
UNATTRIBUTED = "no op_name"  # an instruction XLA made with no source op (a copy it inserted), or the runtime's work
TOP_KERNELS = 15


@dataclasses.dataclass(frozen=True)
class DeviceEvent:
    """A kernel or copy the device ran, as the trace gives it."""

    name: str  # the kernel's name (an XLA fusion's is its instruction's, '.' written '_'), or the copy's
    start_us: float
    end_us: float
    hlo_op: str | None  # the instruction that launched it; None for the runtime's own work
    hlo_module: str | None  # the program it belongs to ("jit_run_packed_forward")
    raw: dict[str, Any] = dataclasses.field(compare=False, repr=False)  # the trace's event, for the excerpt

    @property
    def is_copy(self) -> bool:
        return bool(COPY_NAME.search(self.name))

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


def load_trace(trace_dir: Path) -> dict[str, Any]:
    """The newest trace the profiler wrote under trace_dir (its own file, not the Perfetto copy of it)."""
    files = list(Path(trace_dir).glob("plugins/profile/*/*.trace.json.gz"))  # not perfetto_trace.json.gz
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}/plugins/profile")
    with gzip.open(max(files, key=lambda path: path.stat().st_mtime), "rt") as stream:
        return json.load(stream)


def complete_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The trace's complete events (phase X: a start and a duration)."""
    return [event for event in trace["traceEvents"] if event.get("ph") == "X" and "dur" in event]


def metadata_names(trace: dict[str, Any], kind: str) -> dict[Any, str]:
    """process_name by pid, or thread_name by (pid, tid)."""
    names = {}
    for event in trace["traceEvents"]:
        if event.get("ph") == "M" and event.get("name") == kind:
            key = event["pid"] if kind == "process_name" else (event["pid"], event.get("tid"))
            names[key] = event.get("args", {}).get("name", "")
    return names


def device_events(trace: dict[str, Any], host_thunks: bool = False) -> list[DeviceEvent]:
    """What the device ran: the events of the GPU processes' stream lines; with `host_thunks` (JAX on the CPU
    backend) every event naming an HLO instruction instead, XLA:CPU's thunks. Not the default: on a GPU host the
    host's thunk annotations name instructions too, and would pass for kernels where the trace has none (no CUPTI).
    Only innermost events count (XLA:CPU nests a loop's thunks in the loop's)."""
    events = complete_events(trace)
    if host_thunks:
        chosen = [e for e in events if "hlo_op" in e.get("args", {})]
    else:
        processes, threads = metadata_names(trace, "process_name"), metadata_names(trace, "thread_name")
        gpus = {pid for pid, name in processes.items() if GPU_PROCESS.search(name)}
        chosen = [e for e in events if e["pid"] in gpus
                  and threads.get((e["pid"], e.get("tid")), "").startswith(STREAM_LINE)]
    return [DeviceEvent(e.get("name", ""), float(e["ts"]), float(e["ts"]) + float(e["dur"]),
                        e.get("args", {}).get("hlo_op") or None, e.get("args", {}).get("hlo_module") or None, e)
            for e in innermost(chosen)]


def innermost(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events that contain no other event of their line (pid, tid). Containing, not overlapping: consecutive
    kernels of a stream may overlap by a rounding of their timestamps."""
    lines = collections.defaultdict(list)
    for event in events:
        lines[(event["pid"], event.get("tid"))].append(event)
    kept = []
    for line in lines.values():
        line.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))  # a parent first, then the children inside it
        for event, following in zip(line, line[1:] + [None]):
            end = float(event["ts"]) + float(event["dur"])
            if following is None or float(following["ts"]) + float(following["dur"]) > end:
                kept.append(event)
    return kept


def step_window(trace: dict[str, Any], annotation: str, events: list[DeviceEvent]) -> tuple[float, float]:
    """(start, end) in µs of the profiled steps: the host annotation around them, else the device events' span."""
    marks = [e for e in complete_events(trace) if e.get("name") == annotation]
    if marks:
        mark = max(marks, key=lambda e: float(e["dur"]))
        return float(mark["ts"]), float(mark["ts"]) + float(mark["dur"])
    if not events:
        raise ValueError("the trace holds neither the steps' annotation nor any device event")
    return min(e.start_us for e in events), max(e.end_us for e in events)


@dataclasses.dataclass(frozen=True)
class OpNames:
    """The op_name metadata (the named-scope path) of every instruction of some programs' optimized HLO, by program
    and instruction, and by instruction alone (the first program's where several share a name)."""

    in_module: dict[tuple[str, str], str]  # (module, instruction) -> op_name
    anywhere: dict[str, str]  # instruction -> op_name

    @classmethod
    def of(cls, hlo_texts: list[str]) -> OpNames:
        in_module: dict[tuple[str, str], str] = {}
        anywhere: dict[str, str] = {}
        for text in hlo_texts:
            found = MODULE.search(text)
            module = found.group(1) if found is not None else None
            for instruction, path in module_op_names(text).items():
                for name in (instruction, kernel_name(instruction)):  # a kernel is named the second way
                    in_module[(module, name)] = path
                    anywhere.setdefault(name, path)
        return cls(in_module, anywhere)

    def path_of(self, event: DeviceEvent) -> str | None:
        """The event's op_name: by the instruction the trace names, else by its kernel's name; in its own program
        where the trace says which, else in any."""
        for name in filter(None, (event.hlo_op, kernel_name(event.name))):
            if (event.hlo_module, name) in self.in_module:
                return self.in_module[(event.hlo_module, name)]
            if name in self.anywhere:
                return self.anywhere[name]
        return None


def module_op_names(text: str) -> dict[str, str]:
    """Instruction -> op_name of one module's HLO text. An instruction without metadata of its own (a fusion XLA
    wrapped around one op, a reduce) takes what the ops of the computation it calls share, as XLA's kernel
    annotations do; HLO text prints a computation before those calling it, so one pass sees callees first."""
    paths: dict[str, str] = {}
    computations: dict[str, list[str]] = collections.defaultdict(list)  # computation -> its instructions' op_names
    current = None
    for line in text.splitlines():
        instruction = INSTRUCTION.match(line)
        if instruction is None:
            header = COMPUTATION.match(line)
            current = header.group(1) if header is not None else current
            continue
        own, callee = OP_NAME.search(line), CALLED.search(line)
        path = own.group(1) if own is not None else common_path(computations.get(callee.group(1), [])) if callee else ""
        if path:
            paths[instruction.group(1)] = path
            computations[current].append(path)
    return paths


def common_path(paths: list[str]) -> str:
    """The longest run of leading '/'-separated components all paths share."""
    if not paths:
        return ""
    split = [path.split("/") for path in paths]
    shared = []
    for parts in zip(*split):
        if len(set(parts)) > 1:
            break
        shared.append(parts[0])
    return "/".join(shared)


def kernel_name(instruction: str) -> str:
    """An instruction's name as XLA:GPU names the kernel it emits for it ("loop_add_fusion.3" -> "..._3")."""
    return re.sub(r"[.\-]", "_", instruction)


def scope_of(path: str | None) -> str:
    """The named scope of an op_name path: "layers/decoder_layer", "layers" (the loop around the layer body),
    "logits", "sample", ...; OUTSIDE_SCOPES where the path has none, UNATTRIBUTED without a path."""
    if path is None:
        return UNATTRIBUTED
    parts = path.split("/")
    scope = next((name for name in SCOPES if name in parts), None)
    if scope == "decoder_layer":
        return "layers/decoder_layer"
    return scope or OUTSIDE_SCOPES


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of a union of intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def summarize(events: list[DeviceEvent], window: tuple[float, float], steps: int, names: OpNames) -> dict[str, Any]:
    """Per step: kernels and copies started in the window, the device's busy time (the union of every event's
    interval within the window) against the window, kernel time; then that time by named scope and by kernel."""
    start, end = window
    inside = [e for e in events if start <= e.start_us < end]
    wall_us = end - start
    busy_us = union_us([(max(e.start_us, start), min(e.end_us, end)) for e in events
                        if e.end_us > start and e.start_us < end])
    scoped = [(scope_of(names.path_of(e)), e) for e in inside]
    device_us = sum(e.duration_us for e in inside)
    return {
        "steps": steps, "window_ms": wall_us / 1e3, "ms_per_step": wall_us / 1e3 / steps,
        "kernels_per_step": sum(1 for e in inside if not e.is_copy) / steps,
        "copies_per_step": sum(1 for e in inside if e.is_copy) / steps,
        "busy_fraction": busy_us / wall_us if wall_us > 0 else 0.0,
        "busy_ms_per_step": busy_us / 1e3 / steps, "device_ms_per_step": device_us / 1e3 / steps,
        "attributed_fraction": (sum(e.duration_us for scope, e in scoped if scope != UNATTRIBUTED) / device_us
                                if device_us else 0.0),
        "scopes": scope_rows(scoped, steps, device_us), "top_kernels": kernel_rows(scoped, steps, device_us),
    }


def scope_rows(scoped: list[tuple[str, DeviceEvent]], steps: int, device_us: float) -> list[dict[str, Any]]:
    """Per named scope, most time first: launches and device ms per step, share of the device time."""
    launches, time_us = collections.Counter(), collections.Counter()
    for scope, event in scoped:
        launches[scope] += 1
        time_us[scope] += event.duration_us
    return [{"scope": scope, "launches_per_step": launches[scope] / steps, "ms_per_step": us / 1e3 / steps,
             "share": us / device_us if device_us else 0.0} for scope, us in time_us.most_common()]


def kernel_rows(scoped: list[tuple[str, DeviceEvent]], steps: int, device_us: float) -> list[dict[str, Any]]:
    """The TOP_KERNELS (scope, instruction, kernel) groups by device time: a layer-loop kernel runs once per layer,
    so its calls per step count the layers."""
    calls, time_us = collections.Counter(), collections.Counter()
    for scope, event in scoped:
        key = (scope, event.hlo_op or "-", event.name)
        calls[key] += 1
        time_us[key] += event.duration_us
    return [{"scope": scope, "hlo_op": hlo_op, "kernel": kernel, "calls_per_step": calls[key] / steps,
             "us_per_call": us / calls[key], "ms_per_step": us / 1e3 / steps,
             "share": us / device_us if device_us else 0.0}
            for key, us in time_us.most_common(TOP_KERNELS) for scope, hlo_op, kernel in [key]]


def read_profile(trace_dir: Path, annotation: str, steps: int, hlo_files: list[str],
                 host_thunks: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One profiled run's summary, and the trace's events within its window (for an excerpt); `host_thunks` as
    device_events takes it."""
    trace = load_trace(trace_dir)
    events = device_events(trace, host_thunks)
    if not events:
        lines = sorted(set(metadata_names(trace, "process_name").values())
                       | set(metadata_names(trace, "thread_name").values()))
        raise ValueError(f"the trace in {trace_dir} holds no device events (no CUPTI on this host?); its processes "
                         f"and lines: {lines[:20]}")
    window = step_window(trace, annotation, events)
    names = OpNames.of([Path(path).read_text() for path in hlo_files])
    return summarize(events, window, steps, names), excerpt(trace, events, window, annotation)


def excerpt(trace: dict[str, Any], events: list[DeviceEvent], window: tuple[float, float],
            annotation: str) -> list[dict[str, Any]]:
    """The device events overlapping the window, the window's annotation and the metadata naming their lines: a
    trace Perfetto opens, a small part of the whole."""
    start, end = window
    kept = [e.raw for e in events if e.end_us > start and e.start_us < end]
    kept += [e for e in complete_events(trace) if e.get("name") == annotation]
    lines = {(e["pid"], e.get("tid")) for e in kept}
    return [e for e in trace["traceEvents"] if e.get("ph") == "M" and (
        e["pid"] in {pid for pid, _ in lines} if e.get("name") == "process_name" else (e["pid"], e.get("tid")) in lines)
    ] + kept


def combined_trace(excerpts: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Several excerpts in one trace, each run's processes renumbered and their names prefixed with its label."""
    events = []
    for index, (label, part) in enumerate(excerpts.items()):
        pids = {pid: (index + 1) * 1000 + number for number, pid in enumerate(sorted({e["pid"] for e in part}))}
        for event in part:
            event = {**event, "pid": pids[event["pid"]]}
            if event.get("ph") == "M" and event.get("name") == "process_name":
                event["args"] = {**event.get("args", {}), "name": f"{label}: {event.get('args', {}).get('name', '')}"}
            events.append(event)
    return {"displayTimeUnit": "ns", "traceEvents": events}
