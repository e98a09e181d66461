"""Bytes a launching operation reads and writes in device memory, estimated from its HLO alone.

A fusion reads each operand whole, except where its computation only slices or gathers from it (then what it
slices), or updates it in place (a scatter or dynamic-update-slice target: only the updated part is touched); it
writes its result, or only the updated part of an in-place result. A library call reads its operands whole, except
an attention kernel's pages, which are data dependent: each pool operand is counted as the KV touched by one layer
(ProgramFacts.kv_read_per_call_bytes); and a layer-stacked weight handed whole to a kernel (with the layer index, as
kernels_pallas/quantized_matmul.py takes it), counted as one layer of it: such a kernel reads that layer's rows. Caches are ignored: this is the traffic to and from device memory if nothing
stayed in L2, the figure a memory-bound step is measured by.
"""

from __future__ import annotations

import dataclasses

from jaxserve.gpu_programs.arguments import ProgramFacts, Role
from jaxserve.gpu_programs.dataflow import Unit
from jaxserve.gpu_programs.hlo import Computation, HloModule, Instruction, Shape

_SLICING = {"dynamic-slice", "slice", "gather"}  # read only their result's worth of operand 0
_IN_PLACE = {"scatter", "dynamic-update-slice"}  # touch only the update's worth of operand 0
_PASS_THROUGH = {"bitcast", "reshape", "get-tuple-element"}
_WORKSPACE_TYPES = {"s8", "u8"}


@dataclasses.dataclass(frozen=True)
class Traffic:
    """One execution of an operation's device memory traffic."""

    read_bytes: int
    written_bytes: int

    @property
    def bytes(self) -> int:
        return self.read_bytes + self.written_bytes


def unit_traffic(module: HloModule, unit: Unit, facts: ProgramFacts, shapes: dict[str, Shape]) -> Traffic:
    """One execution's traffic; `shapes`: every instruction's result shape by name (its operands' among them)."""
    instruction = unit.instruction
    operand_shapes = [shapes[name] for name in instruction.operands]
    if unit.fused is not None:
        fused = module.computations[unit.fused]
        parameters = fused.parameters()
        read = sum(_parameter_read(module, fused, p.name, shape.bytes)
                   for p, shape in zip(parameters, operand_shapes))
        return Traffic(read, _root_written(module, fused, _result(instruction)))
    if instruction.opcode == "custom-call":
        read = sum(facts.kv_read_per_call_bytes if _is_pool(origin, facts) else _library_read(origin, shape, facts)
                   for origin, shape in zip(unit.operand_origins, operand_shapes))
        return Traffic(read, library_result_bytes(instruction.shape))
    if instruction.opcode in _SLICING:
        return Traffic(instruction.shape.bytes, instruction.shape.bytes)
    if instruction.opcode in _IN_PLACE:
        update = _update_operand(instruction, operand_shapes)
        return Traffic(update.bytes, update.bytes)
    return Traffic(sum(shape.bytes for shape in operand_shapes), _result(instruction).bytes)


def _library_read(origin, shape: Shape, facts: ProgramFacts) -> int:
    """A library call's read of one operand: whole, but one layer's share of a whole layer-stacked weight."""
    argument = facts.arguments[origin.argument] if origin is not None else None
    if (argument is None or argument.role is not Role.WEIGHT or argument.layer_axis is None
            or shape.bytes != argument.bytes):
        return shape.bytes
    return shape.bytes // argument.shard_dims[argument.layer_axis]


def _is_pool(origin, facts: ProgramFacts) -> bool:
    return origin is not None and facts.arguments[origin.argument].role is Role.POOL


def _result(instruction: Instruction) -> Shape:
    """What an operation writes: an async start's result is element 1 of its tuple (element 0 holds its operands)."""
    shape = instruction.shape
    if instruction.opcode.endswith("-start") and shape.is_tuple and len(shape.elements) > 1:
        return shape.elements[1]
    return shape


def _parameter_read(module: HloModule, computation: Computation, parameter: str, whole: int) -> int:
    """Bytes a fused computation reads of one parameter (at most all of it)."""
    users = _users(computation, parameter)
    total = 0
    for user, position in users:
        if user.opcode in _SLICING and position == 0:
            total += user.shape.bytes
        elif user.opcode in _IN_PLACE and position == 0:
            continue
        elif user.opcode in ("fusion", "call") and user.called_as("calls") + user.called_as("to_apply"):
            nested = module.computations[(user.called_as("calls") + user.called_as("to_apply"))[0]]
            nested_parameter = nested.parameters()[position].name
            total += _parameter_read(module, nested, nested_parameter, whole)
        else:
            return whole
    return min(total, whole)


def _users(computation: Computation, name: str) -> list[tuple[Instruction, int]]:
    """The instructions reading `name` (through bitcasts and reshapes), with the operand position they read it at."""
    found, pending = [], [name]
    while pending:
        current = pending.pop()
        for instruction in computation.instructions:
            for position, operand in enumerate(instruction.operands):
                if operand != current:
                    continue
                if instruction.opcode in _PASS_THROUGH:
                    pending.append(instruction.name)
                else:
                    found.append((instruction, position))
    return found


def _root_written(module: HloModule, computation: Computation, result: Shape) -> int:
    """Bytes a fused computation writes: its result, but only the updated part of an in-place update."""
    by_name = computation.by_name()
    root = by_name[computation.root]
    while root.opcode in _PASS_THROUGH and root.operands:
        root = by_name[root.operands[0]]
    if root.opcode == "tuple":
        return sum(_written_by(by_name, by_name[name]) for name in root.operands)
    if root.opcode == "custom-call":
        return library_result_bytes(root.shape)
    return _written_by(by_name, root) if root.opcode in _IN_PLACE else result.bytes


def _written_by(by_name: dict[str, Instruction], instruction: Instruction) -> int:
    while instruction.opcode in _PASS_THROUGH and instruction.operands:
        instruction = by_name[instruction.operands[0]]
    if instruction.opcode in _IN_PLACE:
        return _update_operand(instruction, [by_name[name].shape for name in instruction.operands]).bytes
    return instruction.shape.bytes


def library_result_bytes(shape: Shape) -> int:
    """What a library call writes: its results, less the scratch workspace a cuBLAS or cuDNN call returns last
    (an s8/u8 array: 32 MiB for cuBLASLt on Hopper), which is not traffic of the step."""
    arrays = shape.arrays()
    if shape.is_tuple and len(arrays) > 1 and arrays[-1].dtype in _WORKSPACE_TYPES:
        arrays = arrays[:-1]
    return sum(a.bytes for a in arrays)


def _update_operand(instruction: Instruction, operand_shapes: list[Shape]) -> Shape:
    """The update a scatter (operand, indices, updates) or dynamic-update-slice (operand, update, indices...)
    writes."""
    index = 2 if instruction.opcode == "scatter" else 1
    return operand_shapes[index] if len(operand_shapes) > index else instruction.shape
