"""A compiled GPU program's optimized HLO (and, where dumped, its thunks) read into findings: temp memory, the
libraries and kernels it calls, its loops, every materialized copy of a weight or of the KV pool, and a static
roofline (the bytes it moves against the bytes it must read).

A copy is an operation that writes at least one layer's worth of an argument's elements (a weight's, an adapter's,
the pool's) into a buffer of its own: a slice, concatenate, conversion or elementwise result of it, alone or as the
whole of a fusion; an all-gather of its shards; an in-place update of another buffer with it. A weight read in place
by its GEMM (a dynamic slice inside the GEMM's fusion, or a dynamic-slice fusion around a library call) is not one;
a layer's slice copied out before the GEMM is.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxserve.gpu_programs.arguments import ProgramFacts, Role
from jaxserve.gpu_programs.dataflow import (Dataflow, Unit, copied_arguments, fused_opcodes, largest_result, moves_data,
                                            walk_program, written_arguments)
from jaxserve.gpu_programs.hlo import ELEMENT_BYTES, HloModule, Shape, parse_module
from jaxserve.gpu_programs.thunks import LaunchCounts, Thunk, count_launches
from jaxserve.gpu_programs.traffic import unit_traffic

_COPIED_ROLES = (Role.WEIGHT, Role.POOL, Role.ADAPTER)
_GEMM_LIBRARY_PREFIXES = ("__cublas", "__cudnn")


@dataclasses.dataclass(frozen=True)
class Copy:
    """A materialized copy of (at least a layer of) a weight, an adapter or the pool."""

    instruction: str  # the operation making it, e.g. "fusion-start.3"
    computation: str  # what it runs: its fused computation (e.g. "fused_dynamic_slice.clone"), or its opcode
    # "slice", "concatenate", "widen" (to a wider dtype), "convert", "copy", "all-gather", "all-to-all", "permute",
    # or "elementwise OPCODE" (an elementwise result of it, as large)
    kind: str
    sources: tuple[str, ...]  # the arguments copied, e.g. ("model.layers.self_attn.q_proj.weight",)
    role: str  # "weight", "adapter" or "pool"
    shape: str  # the copy's shape, e.g. "bf16[1,4096,4096]"
    bytes: int  # of one copy
    per_run: int  # copies one run of the program makes
    in_loop: bool  # made inside a loop (the layer loop: once per layer)


@dataclasses.dataclass(frozen=True)
class Gemm:
    """A matrix product: which backend runs it and what it reads of the weights."""

    instruction: str  # the fusion or library call
    backend: str  # a library call's target ("__cublas$lt$matmul"), a fusion's ("__triton_gemm"), or "xla fusion"
    # (argument, dtype as read, read from a copy) for each weight or adapter operand
    reads: tuple[tuple[str, str, bool], ...]
    per_run: int  # executions per run
    # The element types the product itself multiplies (the dot's or library call's two operands, after any
    # widening fused before it): ("f8e4m3fn", "f8e4m3fn") for an FP8 GEMM, ("bf16", "bf16") for a widened one
    operand_dtypes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class LoopFinding:
    """A while loop: the layer scan, a prompt-scoring map over logits tiles, an attention loop over pages."""

    name: str  # its while instruction
    trip_count: int | None  # None: decided on the device, each iteration synced with the host
    per_run: int  # times one run enters it
    launches: int  # operations its body launches per iteration (HLO)


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Device memory traffic of one run, from the HLO (traffic.py) against what the program must read."""

    must_read_bytes: int  # ProgramFacts.must_read_bytes
    moved_bytes: int  # every operation's reads and writes
    copy_bytes: int  # of which the copies' own reads and writes (their readers' reads are counted apart)
    collective_bytes: int  # written by collectives (tensor parallelism)
    unknown_trip_counts: int  # loops counted once for lack of a trip count: moved_bytes is then a lower bound

    @property
    def ratio(self) -> float:
        return self.moved_bytes / self.must_read_bytes if self.must_read_bytes else 0.0


@dataclasses.dataclass(frozen=True)
class Launches:
    """What the device is asked to run per program run."""

    per_run: int  # operations launched (HLO), loop bodies once per iteration
    static: int  # operations in the program text
    per_layer: int  # in the layer loop's body (the loop with the most iterations); 0 without a loop
    # From the thunks XLA built (None where not dumped): launches counted once, CUDA graphs, launches they replay
    thunks: LaunchCounts | None


@dataclasses.dataclass(frozen=True)
class ProgramAudit:
    """Everything the audit found in one program."""

    name: str
    kind: str
    temp_bytes: int  # XLA's temporary allocation for one run (memory_analysis)
    argument_bytes: int
    output_bytes: int
    activation_bytes: int  # ProgramFacts.activation_bytes: the temp is judged against it
    custom_calls: dict[str, int]  # target -> calls per run
    fusion_backends: dict[str, int]  # custom fusion kind ("__triton_gemm", ...) -> launches per run
    gemms: tuple[Gemm, ...]
    copies: tuple[Copy, ...]
    loops: tuple[LoopFinding, ...]
    launches: Launches
    roofline: Roofline
    # Operations XLA recomputed to fit its memory limit (named "*.remat*"): it believed the program would not fit
    rematerialized: int

    @property
    def weight_copies(self) -> tuple[Copy, ...]:
        return tuple(c for c in self.copies if c.role != Role.POOL.value)

    @property
    def pool_copies(self) -> tuple[Copy, ...]:
        return tuple(c for c in self.copies if c.role == Role.POOL.value)


def audit_program(hlo_text: str, facts: ProgramFacts, memory: dict[str, int],
                  thunks: list[Thunk] | None = None) -> ProgramAudit:
    """The findings of one compiled program: its optimized HLO text, what it is for, its memory analysis
    ({"temp", "argument", "output"} bytes) and, where dumped, its thunks."""
    module = parse_module(hlo_text)
    flow = walk_program(module, facts.arguments)
    shapes = {i.name: i.shape for c in module.computations.values() for i in c.instructions}
    counted = [u for u in flow.units if not u.alternative]
    copies = tuple(_copies(module, flow, facts))
    return ProgramAudit(
        name=facts.name, kind=facts.kind, temp_bytes=memory["temp"], argument_bytes=memory["argument"],
        output_bytes=memory["output"], activation_bytes=facts.activation_bytes,
        custom_calls=_per_run_counts(counted, lambda u: library_calls(module, u)),
        fusion_backends=_per_run_counts(counted, lambda u: u.instruction.backend_kind if u.fused else None),
        gemms=tuple(_gemms(module, flow, facts, shapes)), copies=copies,
        loops=tuple(LoopFinding(loop.name, loop.trip_count, loop.executions,
                                sum(1 for u in flow.units if u.loop == loop.name)) for loop in flow.loops),
        launches=_launches(flow, facts, thunks), roofline=_roofline(module, flow, facts, shapes, copies),
        rematerialized=sum(1 for u in flow.units if ".remat" in u.instruction.name))


def _per_run_counts(units: list[Unit], key) -> dict[str, int]:
    """Executions per run by key (a key function giving a name, a list of names, or None)."""
    counts = collections.Counter()
    for unit in units:
        names = key(unit)
        for name in [names] if isinstance(names, str) else names or []:
            counts[name] += unit.executions
    return dict(counts)


def library_calls(module: HloModule, unit: Unit) -> list[str]:
    """The custom-call targets an operation runs: its own, or those inside its fusion (a dynamic-slice fusion
    around a cuBLAS call reads the slice in place)."""
    if unit.fused is None:
        target = unit.instruction.custom_call_target
        return [target] if target else []
    return [i.custom_call_target for name in _nested(module, unit.fused)
            for i in module.computations[name].instructions if i.opcode == "custom-call"]


def _nested(module: HloModule, computation: str) -> list[str]:
    names, pending = [], [computation]
    while pending:
        name = pending.pop()
        if name not in names and name in module.computations:
            names.append(name)
            pending += [c for i in module.computations[name].instructions for c in i.called_as("calls")]
    return names


def _copies(module: HloModule, flow: Dataflow, facts: ProgramFacts):
    for unit in flow.units:
        moved = (copied_arguments(unit, facts.arguments) if moves_data(module, unit)
                 else written_arguments(module, unit, facts.arguments))
        copied = [facts.arguments[i] for i in moved if facts.arguments[i].role in _COPIED_ROLES]
        if not copied:
            continue
        result = largest_result(unit.instruction)
        yield Copy(instruction=unit.instruction.name, computation=unit.fused or unit.instruction.opcode,
                   kind=_copy_kind(module, unit, copied[0].dtype, result),
                   sources=tuple(dict.fromkeys(a.name for a in copied)), role=copied[0].role.value,
                   shape=str(result), bytes=result.bytes, per_run=0 if unit.alternative else unit.executions,
                   in_loop=unit.loop is not None)


def _copy_kind(module: HloModule, unit: Unit, source_dtype: str, result: Shape) -> str:
    """What the copy does, by the operation producing its result."""
    opcode = unit.instruction.opcode
    if unit.fused is not None:
        computation = module.computations[unit.fused]
        by_name = computation.by_name()
        root = by_name[computation.root]
        while root.opcode in ("bitcast", "reshape", "tuple") and root.operands:
            root = by_name[root.operands[0]]
        opcode = root.opcode
    if opcode == "convert" or result.dtype != source_dtype:
        return "widen" if _element_bytes(result.dtype) > _element_bytes(source_dtype) else "convert"
    return {"dynamic-slice": "slice", "slice": "slice", "concatenate": "concatenate", "copy": "copy",
            "copy-start": "copy", "transpose": "copy", "dynamic-update-slice": "copy", "scatter": "copy",
            "all-gather": "all-gather", "all-gather-start": "all-gather", "all-to-all": "all-to-all",
            "collective-permute": "permute", "collective-permute-start": "permute"}.get(opcode, f"elementwise {opcode}")


def _element_bytes(dtype: str) -> int:
    return ELEMENT_BYTES.get(dtype, 4)


def _gemms(module: HloModule, flow: Dataflow, facts: ProgramFacts, shapes: dict[str, Shape]):
    for unit in flow.units:
        libraries = [t for t in library_calls(module, unit) if t.startswith(_GEMM_LIBRARY_PREFIXES)]
        if libraries:
            backend = libraries[0]
        elif unit.fused is not None and "dot" in fused_opcodes(module, unit.fused):
            backend = unit.instruction.backend_kind or "xla fusion"
        else:
            continue
        reads = tuple((facts.arguments[origin.argument].name, shapes[unit.instruction.operands[i]].dtype,
                       origin.derived)
                      for i, origin in enumerate(unit.operand_origins)
                      if origin is not None and facts.arguments[origin.argument].role in (Role.WEIGHT, Role.ADAPTER))
        yield Gemm(unit.instruction.name, backend, reads, 0 if unit.alternative else unit.executions,
                   _multiplied_dtypes(module, unit, shapes))


def _multiplied_dtypes(module: HloModule, unit: Unit, shapes: dict[str, Shape]) -> tuple[str, ...]:
    """The element types of the first product's two operands: the library call's own, or the dot's (or library
    call's) inside the fusion."""
    if unit.fused is None:
        return tuple(shapes[name].dtype for name in unit.instruction.operands[:2])
    for name in _nested(module, unit.fused):
        computation = module.computations[name]
        by_name = computation.by_name()
        for instruction in computation.instructions:
            library = (instruction.custom_call_target or "").startswith(_GEMM_LIBRARY_PREFIXES)
            if instruction.opcode == "dot" or library:
                return tuple(by_name[operand].shape.dtype for operand in instruction.operands[:2])
    return ()


def _roofline(module: HloModule, flow: Dataflow, facts: ProgramFacts, shapes: dict[str, Shape],
              copies: tuple[Copy, ...]) -> Roofline:
    moved = copied = collective = 0
    copy_names = {c.instruction for c in copies}
    for unit in flow.units:
        if unit.alternative:
            continue
        traffic = unit_traffic(module, unit, facts, shapes)
        moved += traffic.bytes * unit.executions
        if unit.instruction.name in copy_names:
            copied += traffic.bytes * unit.executions
        if unit.instruction.opcode.startswith(("all-", "reduce-scatter", "collective-permute")):
            collective += traffic.written_bytes * unit.executions
    unknown = sum(1 for loop in flow.loops if loop.trip_count is None)
    return Roofline(facts.must_read_bytes, moved, copied, collective, unknown)


def _launches(flow: Dataflow, facts: ProgramFacts, thunks: list[Thunk] | None) -> Launches:
    counted = [u for u in flow.units if not u.alternative]
    layer_loop = _layer_loop(flow, facts)
    per_layer = sum(1 for u in counted if layer_loop is not None and u.loop == layer_loop)
    return Launches(per_run=sum(u.executions for u in counted), static=len(flow.units), per_layer=per_layer,
                    thunks=count_launches(thunks) if thunks is not None else None)


def _layer_loop(flow: Dataflow, facts: ProgramFacts) -> str | None:
    """The loop over decoder layers: the one whose body reads the most layer-stacked weights (a prompt-scoring loop
    over logits tiles may run more iterations, but reads none)."""
    stacked = collections.Counter(u.loop for u in flow.units for origin in u.operand_origins
                                  if origin is not None and u.loop is not None
                                  and facts.arguments[origin.argument].layer_axis is not None)
    return stacked.most_common(1)[0][0] if stacked else None
