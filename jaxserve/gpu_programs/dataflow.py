"""A compiled program walked from its entry: every operation that launches work on the device (a kernel, a library
call, a copy, a collective), how often one run executes it, and which program argument each of its operands
carries, if any.

Arguments are followed through the plumbing XLA adds between them and the kernels: tuples and their elements,
bitcasts, a while loop's state (a weight enters the layer loop as one element of its state tuple), async starts,
calls and conditional branches. An in-place update (the KV write into the pool) returns the buffer it updates. An
operation that only moves data (a slice, concatenate, convert, copy, all-gather) and writes a layer or more of an
argument passes the argument on, marked as derived: a kernel reading that result reads a copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxserve.gpu_programs.arguments import ProgramArgument
from jaxserve.gpu_programs.hlo import Computation, HloModule, Instruction, Shape

# Operations that launch nothing: they name, group or alias buffers, or end an async operation started earlier.
FREE_OPCODES = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
                "replica-id", "opt-barrier", "add-dependency", "domain", "fusion-done", "copy-done", "async-done",
                "all-gather-done", "all-reduce-done", "collective-permute-done", "send-done", "recv-done"}
# Operations (alone, or inside a fusion) that only move, slice, join or re-type data; collectives that gather
# shards into a whole array among them (a weight gathered from its shards is a copy of it on every device).
MOVEMENT_OPCODES = {"copy", "copy-start", "dynamic-slice", "slice", "concatenate", "convert", "transpose", "reshape",
                    "bitcast", "bitcast-convert", "pad", "reverse", "all-gather", "all-gather-start", "all-to-all",
                    "collective-permute", "collective-permute-start"}
# Operations that update their first operand in place, writing only their update.
IN_PLACE_OPCODES = {"scatter", "dynamic-update-slice"}
# Operations inside a fusion that make it compute rather than move data, or update a buffer in place.
COMPUTING_OPCODES = {"dot", "convolution", "reduce", "reduce-window", "scatter", "sort", "custom-call", "gather",
                     "fft", "select-and-scatter", "dynamic-update-slice", "rng", "rng-bit-generator", "cholesky",
                     "triangular-solve", "all-reduce", "reduce-scatter"}


@dataclasses.dataclass(frozen=True)
class Origin:
    """Which program argument a value holds."""

    argument: int  # its index in ProgramFacts.arguments
    derived: bool  # a slice, copy or conversion made from the argument, not the argument's own buffer


@dataclasses.dataclass(frozen=True)
class Unit:
    """One operation that launches device work, where it sits, and what it reads."""

    instruction: Instruction
    computation: str  # the computation it sits in (the entry, a loop body, a branch)
    fused: str | None  # the computation a fusion runs; None for other operations
    executions: int  # times one run of the program executes it (the trip counts of its enclosing loops multiplied)
    loop: str | None  # the innermost while loop around it; None at the top level
    operand_origins: tuple[Origin | None, ...]  # per operand: the argument it carries, if any
    # Not the heaviest branch of its conditional: left out of per-run totals, which count one branch
    alternative: bool = False


@dataclasses.dataclass(frozen=True)
class Loop:
    """A while loop of the program."""

    name: str  # its instruction
    trip_count: int | None  # as XLA knows it; None: decided at run time (each iteration then syncs with the host)
    body: str  # its body computation
    executions: int  # times one run enters it


@dataclasses.dataclass(frozen=True)
class Dataflow:
    """A program walked: its launching operations and loops."""

    units: tuple[Unit, ...]
    loops: tuple[Loop, ...]


def walk_program(module: HloModule, arguments: Sequence[ProgramArgument]) -> Dataflow:
    """Every launching operation of the program, from its entry, with each operand's origin; `arguments`: the
    program's, in the order of its entry parameters."""
    walker = _Walker(module, arguments)
    entry = module.entry_computation
    walker.walk(entry, _entry_origins(entry, arguments), executions=1, loop=None)
    return Dataflow(tuple(walker.units), tuple(walker.loops))


def _entry_origins(entry: Computation, arguments: Sequence[ProgramArgument]) -> list[Origin | None]:
    """Each entry parameter's argument: the next one, in order, of its shape and type (XLA leaves out arguments a
    program does not use, so parameters and arguments need not pair one to one)."""
    origins, position = [], 0
    for parameter in entry.parameters():
        wanted = (parameter.shape.dtype, parameter.shape.dims)
        match = next((i for i in range(position, len(arguments))
                      if (arguments[i].dtype, arguments[i].shard_dims) == wanted), None)
        origins.append(Origin(match, False) if match is not None else None)
        position = match + 1 if match is not None else position
    return origins


def fused_opcodes(module: HloModule, computation: str) -> set[str]:
    """The opcodes of a fused computation and of every computation it calls (nested fusions), reducers aside."""
    seen, pending, opcodes = set(), [computation], set()
    while pending:
        name = pending.pop()
        if name in seen or name not in module.computations:
            continue
        seen.add(name)
        for instruction in module.computations[name].instructions:
            opcodes.add(instruction.opcode)
            pending += instruction.called_as("calls")
    return opcodes


def moves_data(module: HloModule, unit: Unit) -> bool:
    """The operation only moves, slices, joins or re-types data: a fusion with nothing computing inside, or such an
    operation alone."""
    if unit.fused is not None:
        return not fused_opcodes(module, unit.fused) & COMPUTING_OPCODES
    return unit.instruction.opcode in MOVEMENT_OPCODES


class _Walker:
    def __init__(self, module: HloModule, arguments: Sequence[ProgramArgument]):
        self.module = module
        self.arguments = arguments
        self.units: list[Unit] = []
        self.loops: list[Loop] = []

    def walk(self, computation: Computation, parameter_origins: list, executions: int, loop: str | None,
             alternative: bool = False) -> None:
        origins: dict[str, object] = {}
        for instruction in computation.instructions:
            origins[instruction.name] = self._visit(instruction, computation, origins, parameter_origins, executions,
                                                    loop, alternative)

    def _visit(self, instruction: Instruction, computation: Computation, origins: dict, parameter_origins: list,
               executions: int, loop: str | None, alternative: bool):
        """The instruction's origin (or a tuple of them); launching operations are recorded on the way."""
        opcode, operands = instruction.opcode, instruction.operands
        first = origins.get(operands[0]) if operands else None
        if opcode == "parameter":
            number = instruction.parameter_number
            return parameter_origins[number] if number is not None and number < len(parameter_origins) else None
        if opcode == "get-tuple-element":
            return first[instruction.tuple_index] if isinstance(first, tuple) and \
                instruction.tuple_index < len(first) else None
        if opcode == "tuple":
            return tuple(origins.get(name) for name in operands)
        if opcode in ("bitcast", "copy-done", "opt-barrier"):
            return first
        if opcode == "fusion-done":  # the async fusion's result is element 1 of its start's tuple
            return first[1] if isinstance(first, tuple) and len(first) > 1 else None
        if opcode in FREE_OPCODES:
            return None
        if opcode == "while":
            self._walk_loop(instruction, first, executions)
            return first  # the loop state keeps its arguments (the pool updated in place is still the pool)
        if opcode == "conditional":
            self._walk_branches(instruction, origins, executions, loop, alternative)
            return None
        if opcode == "call":
            for called in instruction.called_as("to_apply"):
                self.walk(self.module.computations[called], [origins.get(name) for name in operands], executions,
                          loop, alternative)
            return None
        fused = (instruction.called_as("calls") or [None])[0] if opcode in ("fusion", "fusion-start") else None
        unit = Unit(instruction, computation.name, fused, executions, loop,
                    tuple(_single(origins.get(name)) for name in operands), alternative)
        self.units.append(unit)
        updated = self._updated_in_place(unit)
        if updated is not None:
            return updated
        derived = self._copied_argument(unit)
        if opcode.endswith("-start"):
            return (None, derived, None)
        return derived

    def _walk_loop(self, instruction: Instruction, state, executions: int) -> None:
        trip_count = instruction.known_trip_count
        inner = executions * (trip_count or 1)
        body = instruction.called_as("body")[0]
        self.loops.append(Loop(instruction.name, trip_count, body, executions))
        for name in instruction.called_as("condition") + [body]:
            self.walk(self.module.computations[name], [state], inner, instruction.name)

    def _walk_branches(self, instruction: Instruction, origins: dict, executions: int, loop: str | None,
                       alternative: bool) -> None:
        """Each branch walked; all but the one launching the most are marked alternative."""
        weights = []
        for index, branch in enumerate(instruction.called_as("branch")):
            start = len(self.units)
            operand = instruction.operands[index + 1] if index + 1 < len(instruction.operands) else None
            self.walk(self.module.computations[branch], [origins.get(operand)], executions, loop, alternative)
            weights.append((sum(u.instruction.shape.bytes for u in self.units[start:]), start, len(self.units)))
        if len(weights) > 1:
            heaviest = max(weights)
            for _, start, end in weights:
                if (start, end) != heaviest[1:]:
                    self.units[start:end] = [dataclasses.replace(u, alternative=True) for u in self.units[start:end]]

    def _updated_in_place(self, unit: Unit) -> Origin | None:
        """An in-place update (a scatter or dynamic-update-slice, alone or at a fusion's root) returns the buffer it
        updates: the pool after the step's KV writes is still the pool."""
        if unit.fused is None:
            return unit.operand_origins[0] if unit.instruction.opcode in IN_PLACE_OPCODES else None
        update = in_place_update(self.module, unit.fused)
        if update is None or update.target is None or update.target >= len(unit.operand_origins):
            return None
        return unit.operand_origins[update.target]

    def _copied_argument(self, unit: Unit) -> Origin | None:
        """What a data-moving operation's result holds, when it is a copy of (a layer or more of) an argument's
        matrix: that argument, derived."""
        if not moves_data(self.module, unit):
            return None
        copied = copied_arguments(unit, self.arguments)
        return Origin(copied[0], derived=True) if copied else None


def copied_arguments(unit: Unit, arguments) -> list[int]:
    """The arguments (indices) an operation's result holds a layer or more of: those of its operands that are
    matrices per layer (weights, adapters, pool pages; not norm vectors or scales), no larger than its result."""
    result = largest_result(unit.instruction)
    return [origin.argument for origin in unit.operand_origins
            if origin is not None and arguments[origin.argument].is_layer_matrix
            and result.num_elements >= arguments[origin.argument].layer_elements]


@dataclasses.dataclass(frozen=True)
class InPlaceUpdate:
    """A fusion whose result is one of its operands updated in place."""

    target: int | None  # the fusion operand (its computation's parameter number) updated; None: not a parameter
    update: Shape  # what it writes into it


def in_place_update(module: HloModule, fused: str) -> InPlaceUpdate | None:
    """The in-place update at a fused computation's root (through bitcasts), if that is what it ends in."""
    computation = module.computations[fused]
    by_name = computation.by_name()
    root = _through_bitcasts(by_name, by_name[computation.root])
    if root.opcode not in IN_PLACE_OPCODES:
        return None
    target = _through_bitcasts(by_name, by_name[root.operands[0]]).parameter_number
    return InPlaceUpdate(target, by_name[root.operands[2 if root.opcode == "scatter" else 1]].shape)


def written_arguments(module: HloModule, unit: Unit, arguments) -> list[int]:
    """The arguments (indices) an in-place update writes a layer or more of into its buffer: a dynamic-update-slice
    or scatter fusion whose update comes from another operand that is a matrix per layer (a weight, the pool)."""
    update = in_place_update(module, unit.fused) if unit.fused is not None else None
    if update is None:
        return []
    return [origin.argument for position, origin in enumerate(unit.operand_origins)
            if position != update.target and origin is not None and arguments[origin.argument].is_layer_matrix
            and update.update.num_elements >= arguments[origin.argument].layer_elements]


def largest_result(instruction: Instruction) -> Shape:
    """The largest array an operation writes (an async start's result is element 1 of its tuple)."""
    shape = instruction.shape
    if instruction.opcode.endswith("-start") and shape.is_tuple and len(shape.elements) > 1:
        shape = shape.elements[1]
    return max(shape.arrays(), key=lambda a: a.num_elements)


def _through_bitcasts(by_name: dict[str, Instruction], instruction: Instruction) -> Instruction:
    while instruction.opcode in ("bitcast", "reshape") and instruction.operands:
        instruction = by_name[instruction.operands[0]]
    return instruction


def _single(origin) -> Origin | None:
    return origin if isinstance(origin, Origin) else None
