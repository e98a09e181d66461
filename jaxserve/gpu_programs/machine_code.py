"""The machine code of a program compiled for a described GPU: every kernel XLA:GPU built (its own fusions and Pallas
kernels alike), as the GPU would load it, with its registers, spills and instruction mix.

XLA writes each kernel's binary (a cubin: the SASS the GPU runs) to the file `xla_gpu_kernel_cache_file` names, a
per-compile option, so a deviceless compile yields the very binaries a GPU would run, ptxas included. NVIDIA's
cuobjdump and nvdisasm (the `nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` wheels, in the gpu-audit extra)
read them: resource use and the SASS. That answers, without a GPU, what timings alone cannot say about a kernel: whether its matmuls
run on Hopper's asynchronous tensor cores (HGMMA, wgmma) or the older synchronous ones (HMMA), whether its
registers spilled to local memory, and whether its loads are asynchronous copies into shared memory (LDGSTS, TMA).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.util
import re
import subprocess
import tempfile
from pathlib import Path

from jaxserve.errors import ConfigError

TOOLS_MISSING = ("NVIDIA's {tool} is not installed: reading compiled kernels needs the gpu-audit extra "
                 "(pip install -e '.[gpu-audit]', which installs nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm)")
_ELF_MAGIC = b"\x7fELF"
# Hopper's warpgroup matmul (wgmma) and the older per-warp one (mma.sync), as SASS names them.
ASYNC_TENSOR_CORE = "HGMMA"
SYNC_TENSOR_CORE = "HMMA"
# Asynchronous global-to-shared copies: cp.async (Ampere on) and the Tensor Memory Accelerator (Hopper).
ASYNC_COPIES = ("LDGSTS", "UTMALDG")


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop of the SASS: the instructions from a label to the branch that jumps back to it."""

    instructions: int  # instructions in one pass of the body (every warp issues each)
    opcodes: dict[str, int]  # SASS opcode -> count in the body

    def count(self, *opcodes: str) -> int:
        return sum(self.opcodes.get(opcode, 0) for opcode in opcodes)


@dataclasses.dataclass(frozen=True)
class KernelCode:
    """One compiled kernel as cuobjdump reads it."""

    name: str  # the kernel's symbol: a pallas_call's name, or an XLA fusion's
    registers: int  # registers per thread (255 is the most a thread may hold)
    local_bytes: int  # local memory per thread: above 0, registers spilled (or an array was put on the stack)
    shared_bytes: int  # static shared memory; Triton's pipeline buffers are dynamic and not counted here
    opcodes: dict[str, int]  # SASS opcode, modifiers dropped -> how many times it appears in the code
    loops: tuple[Loop, ...] = ()  # the code's loops (backward branches), in code order

    def count(self, *opcodes: str) -> int:
        """Instructions of the code with any of these opcodes."""
        return sum(self.opcodes.get(opcode, 0) for opcode in opcodes)

    @property
    def spills(self) -> bool:
        return self.local_bytes > 0

    def summary(self) -> dict:
        """The figures a report shows: resources and the instructions that decide a kernel's speed."""
        return {"kernel": self.name, "registers": self.registers, "local_bytes": self.local_bytes,
                "shared_bytes": self.shared_bytes, "hgmma": self.count(ASYNC_TENSOR_CORE),
                "hmma": self.count(SYNC_TENSOR_CORE), "async_copies": self.count(*ASYNC_COPIES),
                "instructions": sum(self.opcodes.values())}


@dataclasses.dataclass(frozen=True)
class BinaryTools:
    """NVIDIA's binary utilities, from their wheels."""

    cuobjdump: Path  # resource use of a cubin
    nvdisasm: Path  # its SASS

    @classmethod
    def find(cls) -> BinaryTools:
        """Both tools; ConfigError naming the extra when one is not installed."""
        return cls(cuobjdump=_find_tool("cuobjdump"), nvdisasm=_find_tool("nvdisasm"))


def binary_tools_installed() -> bool:
    try:
        BinaryTools.find()
    except ConfigError:
        return False
    return True


def _find_tool(tool: str) -> Path:
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for found in sorted(Path(root).glob(f"*/bin/{tool}")):
            return found
    raise ConfigError(TOOLS_MISSING.format(tool=tool))


def compiled_kernels(lowered, compiler_options: dict | None = None) -> list[KernelCode]:
    """Compiles `lowered` (a jax `Lowered` for a GPU target) and reads every kernel of the result, sorted by name.

    JAX's persistent compilation cache is bypassed for this compile: a cache hit would skip the compile that writes
    the binaries."""
    tools = BinaryTools.find()
    with tempfile.TemporaryDirectory(prefix="jaxserve-kernels-") as folder:
        cache_file = Path(folder) / "kernels.pb"
        with _persistent_cache_off():
            lowered.compile({**(compiler_options or {}), "xla_gpu_kernel_cache_file": str(cache_file)})
        binaries = kernel_binaries(cache_file.read_bytes())
        return sorted((describe(binary, tools, Path(folder)) for binary in binaries.values()),
                      key=lambda kernel: kernel.name)


@contextlib.contextmanager
def _persistent_cache_off():
    import jax

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


def kernel_binaries(cache: bytes) -> dict[str, bytes]:
    """Kernel name -> cubin, from XLA's kernel cache file (a protobuf: repeated entries of a name and a message
    holding the binary among other fields; the binary is the one length-delimited field that is an ELF image)."""
    binaries = {}
    for number, entry in _fields(cache):
        if number != 1 or not isinstance(entry, bytes):
            continue
        parts = dict(_fields(entry))
        name, body = parts.get(1), parts.get(2)
        if not isinstance(name, bytes) or not isinstance(body, bytes):
            raise ValueError("XLA's kernel cache file has an entry without a name and a body")
        elf = [value for _, value in _fields(body) if isinstance(value, bytes) and value.startswith(_ELF_MAGIC)]
        if len(elf) != 1:
            raise ValueError(f"kernel {name.decode()!r} in XLA's kernel cache file holds {len(elf)} binaries, not 1")
        binaries[name.decode()] = elf[0]
    return binaries


def _fields(message: bytes):
    """(field number, value) of a protobuf message: ints for varints and fixed fields, bytes for length-delimited."""
    position = 0
    while position < len(message):
        key, position = _varint(message, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, position = _varint(message, position)
        elif wire_type == 2:
            length, position = _varint(message, position)
            value, position = message[position:position + length], position + length
        elif wire_type in (1, 5):
            size = 8 if wire_type == 1 else 4
            value, position = int.from_bytes(message[position:position + size], "little"), position + size
        else:
            raise ValueError(f"unexpected protobuf wire type {wire_type} in XLA's kernel cache file")
        yield number, value


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[position]
        value |= (byte & 0x7F) << shift
        position, shift = position + 1, shift + 7
        if not byte & 0x80:
            return value, position


def describe(cubin: bytes, tools: BinaryTools, folder: Path) -> KernelCode:
    """One cubin's resource use and SASS opcode counts (one function per XLA kernel binary)."""
    path = folder / "kernel.cubin"
    path.write_bytes(cubin)
    resources = _run(tools.cuobjdump, "-res-usage", path)
    sass = _run(tools.nvdisasm, "-c", path)
    found = re.search(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", resources)
    if found is None:
        raise ValueError(f"cuobjdump reported no function resources:\n{resources}")
    name, registers, _, shared, local = found.groups()
    return KernelCode(name=name, registers=int(registers), local_bytes=int(local), shared_bytes=int(shared),
                      opcodes=sass_opcodes(sass), loops=sass_loops(sass))


_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH_TARGET = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")


def sass_opcodes(sass: str) -> dict[str, int]:
    """Opcode counts of nvdisasm's SASS listing ("/*0010*/  @P0 HGMMA.64x128x16.F32.BF16 R24, ... ;")."""
    return dict(collections.Counter(opcode for opcode, _ in _instructions(sass)))


def sass_loops(sass: str) -> tuple[Loop, ...]:
    """Every backward branch of the listing as a Loop (label ".L_x_1:" ... "@P0 BRA `(.L_x_1)" after it)."""
    labels, body, loops = {}, [], []
    for line in sass.splitlines():
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(body)
            continue
        found = _INSTRUCTION.match(line)
        if not found:
            continue
        body.append(found.group(1))
        target = _BRANCH_TARGET.search(line)
        if target and target.group(1) in labels:
            opcodes = body[labels[target.group(1)]:]
            loops.append(Loop(instructions=len(opcodes), opcodes=dict(collections.Counter(opcodes))))
    return tuple(loops)


def _instructions(sass: str):
    for line in sass.splitlines():
        found = _INSTRUCTION.match(line)
        if found:
            yield found.group(1), line


def _run(tool: Path, flag: str, path: Path) -> str:
    result = subprocess.run([str(tool), flag, str(path)], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ValueError(f"{tool.name} {flag} failed: {result.stderr.strip()}")
    return result.stdout
