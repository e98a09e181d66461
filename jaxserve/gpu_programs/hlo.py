"""XLA's optimized HLO text (`Compiled.as_text()`) read into computations and instructions: just enough structure
for the audit to follow data from a program's arguments into its kernels.

Only the fields the audit reads are kept: each instruction's name, result shape, opcode, operands, the computations
it calls, and a few attributes (custom-call target, fusion backend kind, a while loop's known trip count). The text
format is XLA's own and unversioned, so everything else on a line is kept as raw text, never interpreted.
"""

from __future__ import annotations

import dataclasses
import math
import re

# Bytes per element of XLA's element types (sub-byte types rounded up: they only occur in small arrays here).
ELEMENT_BYTES = {
    "pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 1,
    "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
    "f32": 4, "s32": 4, "u32": 4,
    "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16,
    "token": 0, "opaque": 0,
}
_ASSIGNMENT = re.compile(r"^\s*(ROOT\s+)?(%[\w.\-]+)\s*=\s*")
_COMMENT = re.compile(r"/\*.*?\*/")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition)=(%[\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_CUSTOM_CALL_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_FUSION_KIND = re.compile(r"\bkind=(k\w+)")
_BACKEND_KIND = re.compile(r'"kind":"(__[^"]+)"')  # a fusion backend's kind; its key order varies
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_PARAMETER_NUMBER = re.compile(r"^(\d+)")
_INDEX = re.compile(r"\bindex=(\d+)")


@dataclasses.dataclass(frozen=True)
class Shape:
    """An array shape, or a tuple of shapes (then `dtype` is "tuple" and `dims` is empty)."""

    dtype: str  # XLA element type ("bf16", "f32", ...) or "tuple"
    dims: tuple[int, ...]  # the array's dimensions
    elements: tuple[Shape, ...] = ()  # a tuple's element shapes

    @property
    def is_tuple(self) -> bool:
        return self.dtype == "tuple"

    @property
    def num_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        """Bytes of the array, or of every array of the tuple."""
        if self.is_tuple:
            return sum(element.bytes for element in self.elements)
        return self.num_elements * ELEMENT_BYTES.get(self.dtype, 4)

    def arrays(self) -> list[Shape]:
        """The arrays the shape holds, depth first."""
        return [a for e in self.elements for a in e.arrays()] if self.is_tuple else [self]

    def __str__(self) -> str:
        if self.is_tuple:
            return "(" + ", ".join(str(e) for e in self.elements) + ")"
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One line of a computation."""

    name: str  # without the leading %
    shape: Shape  # its result
    opcode: str  # "fusion", "custom-call", "while", ...
    operands: tuple[str, ...]  # the names of the instructions it reads, in order
    # (how, computation) for each computation it calls: ("calls", a fusion's), ("body", ...) and ("condition", ...)
    # of a while loop, ("to_apply", a reducer's or a call's), ("branch", each of a conditional's)
    called: tuple[tuple[str, str], ...]
    attributes: str  # the rest of the line, raw

    def called_as(self, how: str) -> list[str]:
        """The computations it calls in the role `how` ("calls", "body", "condition", "to_apply", "branch")."""
        return [name for role, name in self.called if role == how]

    @property
    def custom_call_target(self) -> str | None:
        found = _CUSTOM_CALL_TARGET.search(self.attributes)
        return found.group(1) if found else None

    @property
    def fusion_kind(self) -> str | None:
        """kLoop, kInput, kOutput or kCustom, for a fusion (or fusion-start)."""
        found = _FUSION_KIND.search(self.attributes)
        return found.group(1) if found else None

    @property
    def backend_kind(self) -> str | None:
        """A custom fusion's kind as its backend config names it ("__triton_gemm", "__cub$sort", ...)."""
        found = _BACKEND_KIND.search(self.attributes)
        return found.group(1) if found else None

    @property
    def known_trip_count(self) -> int | None:
        """A while loop's trip count where XLA knows it; None otherwise (or for other instructions)."""
        found = _TRIP_COUNT.search(self.attributes)
        return int(found.group(1)) if found else None

    @property
    def op_name(self) -> str:
        """The JAX operation it came from (metadata), "" where none is recorded."""
        found = _OP_NAME.search(self.attributes)
        return found.group(1) if found else ""

    @property
    def parameter_number(self) -> int | None:
        """A parameter's position in its computation's signature."""
        if self.opcode != "parameter":
            return None
        found = _PARAMETER_NUMBER.match(self.attributes)
        return int(found.group(1)) if found else None

    @property
    def tuple_index(self) -> int | None:
        """A get-tuple-element's index."""
        found = _INDEX.search(self.attributes)
        return int(found.group(1)) if found and self.opcode == "get-tuple-element" else None


@dataclasses.dataclass(frozen=True)
class Computation:
    """A named list of instructions; the last one marked ROOT is its result."""

    name: str
    instructions: tuple[Instruction, ...]
    root: str  # the ROOT instruction's name

    def by_name(self) -> dict[str, Instruction]:
        return {i.name: i for i in self.instructions}

    def parameters(self) -> list[Instruction]:
        """Its parameters, by position."""
        return sorted((i for i in self.instructions if i.opcode == "parameter"), key=lambda i: i.parameter_number)


@dataclasses.dataclass(frozen=True)
class HloModule:
    """Every computation of a program, and which one is the entry."""

    computations: dict[str, Computation]  # by name
    entry: str  # the ENTRY computation's name

    @property
    def entry_computation(self) -> Computation:
        return self.computations[self.entry]


def parse_module(text: str) -> HloModule:
    """An HloModule from `Compiled.as_text()` (or any `HloModule ...` text dump)."""
    computations, entry = {}, None
    header, lines, root = None, [], None
    for line in text.splitlines():
        if header is None:
            if line.endswith("{") and not line.startswith((" ", "HloModule")):
                header, lines, root = line, [], None
            continue
        if line == "}":
            name = _computation_name(header)
            computations[name] = Computation(name, tuple(lines), root)
            if header.startswith("ENTRY"):
                entry = name
            header = None
            continue
        instruction = parse_instruction(line)
        if instruction is not None:
            lines.append(instruction)
            if line.lstrip().startswith("ROOT"):
                root = instruction.name
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return HloModule(computations, entry)


def _computation_name(header: str) -> str:
    return header.removeprefix("ENTRY").split()[0].lstrip("%")


def parse_instruction(line: str) -> Instruction | None:
    """One instruction line; None for a line that is not one."""
    assigned = _ASSIGNMENT.match(line)
    if assigned is None:
        return None
    position = assigned.end()
    shape, position = parse_shape(line, position)
    opcode_end = line.index("(", position)
    opcode = line[position:opcode_end].strip()
    operands_end = _matching(line, opcode_end, "(", ")")
    operand_text = _COMMENT.sub("", line[opcode_end + 1:operands_end])
    attributes = line[operands_end + 1:].lstrip(", ")
    operands = tuple(name.lstrip("%") for name in re.findall(r"%[\w.\-]+", operand_text))
    if opcode == "parameter":  # its number is the operand text
        attributes = operand_text + " " + attributes
    called = [(how, name.lstrip("%")) for how, name in _CALLED.findall(attributes)]
    for branches in _BRANCHES.findall(attributes):
        called += [("branch", name.strip().lstrip("%")) for name in branches.split(",") if name.strip()]
    return Instruction(assigned.group(2).lstrip("%"), shape, opcode, operands, tuple(called), attributes)


def parse_shape(text: str, position: int = 0) -> tuple[Shape, int]:
    """The shape starting at `position` (an array with optional layout, or a tuple), and where it ends."""
    while text.startswith("/*", position):
        position = text.index("*/", position) + 2
        position = _skip_spaces(text, position)
    if text[position] == "(":
        elements, position = [], _skip_spaces(text, position + 1)
        while text[position] != ")":
            element, position = parse_shape(text, position)
            elements.append(element)
            position = _skip_spaces(text, position)
            if text[position] == ",":
                position = _skip_spaces(text, position + 1)
        return Shape("tuple", (), tuple(elements)), position + 1
    found = re.compile(r"(\w+)\[([^\]]*)\]").match(text, position)
    if found is None:
        raise ValueError(f"no shape at {text[position:position + 40]!r}")
    dims = tuple(int(d.lstrip("<=")) for d in found.group(2).split(",") if d)
    position = found.end()
    if position < len(text) and text[position] == "{":  # the layout
        position = _matching(text, position, "{", "}") + 1
    return Shape(found.group(1), dims), position


def _skip_spaces(text: str, position: int) -> int:
    while position < len(text) and text[position] == " ":
        position += 1
    return position


def _matching(text: str, start: int, opening: str, closing: str) -> int:
    """The index of the bracket closing the one at `start`, skipping quoted strings."""
    depth, position, quoted = 0, start, False
    while position < len(text):
        char = text[position]
        if quoted:
            if char == "\\":
                position += 1
            elif char == '"':
                quoted = False
        elif char == '"':
            quoted = True
        elif char == opening:
            depth += 1
        elif char == closing:
            depth -= 1
            if depth == 0:
                return position
        position += 1
    raise ValueError(f"unbalanced {opening}{closing} in {text[start:start + 60]!r}")
