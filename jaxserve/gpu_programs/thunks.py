"""What a GPU program launches, read from the thunk sequence XLA:GPU writes when asked to dump
(`<module>.thunk_sequence_after_thunk_passes.txt`): kernels, memory copies, library calls, and the CUDA graphs
(command buffers) that group them. The optimized HLO does not show command buffers: XLA forms them over thunks,
after HLO, so only this file says which launches a graph replaces.

A line of that file is `NNN: kKind [edges] details`, nested by indentation: a while loop's `condition:` and
`body:`, a command buffer's or an async start's thunks, indented under them.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

THUNK_FILE_SUFFIX = ".thunk_sequence_after_thunk_passes.txt"
_THUNK = re.compile(r"^(\s*)\d+:\s+(k\w+)\s*(?:\[[^\]]*\])?\s*(.*)$")
_SECTION = re.compile(r"^(\s*)(condition|body|branch[^:]*):\s*$")
# Thunks that only order or group other thunks: everything else is one launch on the device (a kernel, a memcpy or
# memset, a library call, a collective).
_STRUCTURE = {"kWhile", "kConditional", "kSequential", "kCommandBuffer", "kAsyncStart", "kAsyncDone",
              "kWaitForStreams", "kDynamicSliceFusion", "kHostExecuteStart", "kHostExecuteDone"}
_COPIES = {"kCopy", "kDeviceToDeviceCopy", "kMemcpy", "kDynamicMemcpy"}


@dataclasses.dataclass(frozen=True)
class Thunk:
    """One entry of the sequence, with the thunks nested under it."""

    kind: str  # "kCustomKernel", "kCopy", "kWhile", "kCommandBuffer", ...
    detail: str  # the rest of its line (a kernel's name, grid and threads)
    children: tuple[Thunk, ...]  # a while loop's condition and body thunks, a command buffer's, an async start's
    section: str = ""  # under a while: "condition" or "body"; else ""

    @property
    def launches(self) -> bool:
        return self.kind not in _STRUCTURE

    def walk(self):
        yield self
        for child in self.children:
            yield from child.walk()


@dataclasses.dataclass(frozen=True)
class LaunchCounts:
    """Launches of a thunk sequence, each counted once (a loop body's once, not per iteration)."""

    launches: int  # kernels, copies, library and collective calls
    copies: int  # of which device memory copies (a dynamic-slice copied out of a stacked array is one)
    in_command_buffers: int  # of the launches, those a CUDA graph replays instead of the host launching each
    command_buffers: int  # CUDA graphs
    loop_bodies: tuple[int, ...]  # launches per while-loop body, in order (a loop nested in a body counted there too)


def read_thunks(dump_dir: Path) -> list[Thunk] | None:
    """The top-level thunks of the one program dumped in `dump_dir`; None where XLA wrote no thunk sequence."""
    files = sorted(Path(dump_dir).glob(f"*{THUNK_FILE_SUFFIX}"))
    return parse_thunks(files[-1].read_text()) if files else None


def parse_thunks(text: str) -> list[Thunk]:
    """The thunk tree of a thunk sequence file."""
    root: list = []
    stack: list[tuple[int, list, str]] = [(-1, root, "")]  # (indent, children list, section) per open level
    section = ""
    for line in text.splitlines():
        if not line.strip():
            continue
        labelled = _SECTION.match(line)
        if labelled:
            section = "body" if labelled.group(2) == "body" else labelled.group(2)
            continue
        found = _THUNK.match(line)
        if found is None:
            continue
        indent = len(found.group(1))
        while stack[-1][0] >= indent:
            stack.pop()
        node = {"kind": found.group(2), "detail": found.group(3).strip(), "children": [], "section": section}
        stack[-1][1].append(node)
        stack.append((indent, node["children"], section))
    return [_frozen(node) for node in root]


def _frozen(node: dict) -> Thunk:
    return Thunk(node["kind"], node["detail"], tuple(_frozen(c) for c in node["children"]), node["section"])


def count_launches(thunks: list[Thunk]) -> LaunchCounts:
    everything = [t for top in thunks for t in top.walk()]
    launches = [t for t in everything if t.launches]
    graphed = [t for buffer in everything if buffer.kind == "kCommandBuffer"
               for t in buffer.walk() if t.launches]
    bodies = tuple(sum(1 for child in loop.children if child.section == "body" for t in child.walk() if t.launches)
                   for loop in everything if loop.kind == "kWhile")
    return LaunchCounts(launches=len(launches), copies=sum(1 for t in launches if t.kind in _COPIES),
                        in_command_buffers=len(graphed),
                        command_buffers=sum(1 for t in everything if t.kind == "kCommandBuffer"),
                        loop_bodies=bodies)
