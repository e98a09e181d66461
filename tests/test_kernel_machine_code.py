"""The machine code of the Pallas kernels (attention; the W8A16 and W4A16 GEMMs), compiled for an H100 target on this
machine (no GPU): what the GPU would run, read with NVIDIA's cuobjdump and nvdisasm
(jaxserve/gpu_programs/machine_code.py).

Guards: no kernel spills registers to local memory; prefill tiles of 64 rows or more run on Hopper's asynchronous
tensor cores (HGMMA), never the older mma.sync; and the prefill kernel's main loop issues fewer instruction clocks
per pass than its matmuls take on the tensor cores (benchmarks/kernel_code.py's "issue / MMA"). Before the kernel
split off its unmasked blocks and moved its softmax to exp2 and fused multiply-adds, that loop issued 1.65 times
its tensor-core time at the 8B shapes (1,687 instructions a pass); it is 0.58 now.

The parsers are tested on their own on hand-made SASS and protobuf bytes, so they are checked without the tools.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.gpu_programs.machine_code import binary_tools_installed, kernel_binaries, sass_loops, sass_opcodes
from jaxserve.gpu_programs.target import CUDA_PLUGIN_MISSING, cuda_plugin_installed

REPO = Path(__file__).resolve().parents[1]
COMPILE_TIMEOUT_S = 600
# Most issue clocks per tensor-core clock the prefill kernel's main loop may take at the 8B shapes (0.58 today).
MAX_MAIN_LOOP_ISSUE_PER_MMA = 0.75
COMPUTE_BOUND_POINTS = ("prefill 1x2048", "mixed T=2048 S=64")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory) -> dict[str, dict]:
    """benchmarks/kernel_code.py's report for the H100 target, by point name."""
    if not cuda_plugin_installed():
        pytest.skip(CUDA_PLUGIN_MISSING)
    if not binary_tools_installed():
        pytest.skip("cuobjdump and nvdisasm are not installed (the gpu-audit extra)")
    out = tmp_path_factory.mktemp("kernel-code") / "kernel_code.json"
    run = subprocess.run([sys.executable, "benchmarks/kernel_code.py", "--target", "h100", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    assert run.returncode == 0, f"benchmarks/kernel_code.py failed:\n{run.stderr[-4000:]}"
    return {point["point"]: point for point in json.loads(out.read_text())["points"]}


def test_no_kernel_spills_registers(kernels):
    spilled = {name: p["local_bytes"] for name, p in kernels.items() if p["local_bytes"]}
    assert not spilled, spilled
    assert all(p["registers"] <= 255 for p in kernels.values())


def test_prefill_tiles_of_64_rows_or_more_run_on_hoppers_async_tensor_cores(kernels):
    checked = 0
    for name, point in kernels.items():
        if point["kernel"].startswith("paged_prefill") and point["rows"] >= 64:
            assert point["hgmma"] > 0 and point["hmma"] == 0, (name, point)
            checked += 1
    assert checked >= 2


@pytest.mark.parametrize("point", COMPUTE_BOUND_POINTS)
def test_the_prefill_main_loop_issues_less_than_its_tensor_core_time(kernels, point):
    loops = kernels[point]["loops"]
    main = min(loops, key=lambda loop: loop["issue_per_mma"])
    assert main["hgmma"] > 0 and main["issue_per_mma"] <= MAX_MAIN_LOOP_ISSUE_PER_MMA, loops
    # One exp2 per score and one per row, nothing more: 64 rows x 128 slots per warpgroup = 64 scores a thread.
    assert main["mufu"] <= 64 + 4, main


# The parsers, on hand-made input.

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ ;
        /*0020*/                   MUFU.EX2 R3, R3 ;
        /*0030*/               @P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0040*/                   EXIT ;
        /*0050*/                   BRA `(.L_x_2);
"""


def test_sass_opcodes_drop_modifiers_and_predicates():
    assert sass_opcodes(SASS) == {"LDC": 1, "HGMMA": 1, "MUFU": 1, "BRA": 2, "EXIT": 1}


def test_sass_loops_are_backward_branches_with_their_bodies():
    first, second = sass_loops(SASS)
    assert first.instructions == 3 and first.opcodes == {"HGMMA": 1, "MUFU": 1, "BRA": 1}
    assert second.instructions == 2 and second.count("EXIT") == 1


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (lengths below 128 bytes)."""
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def test_kernel_binaries_finds_each_entrys_elf_image():
    elf = b"\x7fELF" + bytes(12)
    body = _field(1, b"fusion text") + bytes([2 << 3 | 0, 5]) + _field(3, elf)  # a varint field between them
    cache = _field(1, _field(1, b"my_kernel") + _field(2, body)) + _field(1, _field(1, b"other") + _field(2, _field(
        4, elf)))
    assert kernel_binaries(cache) == {"my_kernel": elf, "other": elf}


def test_kernel_binaries_rejects_an_entry_without_a_binary():
    with pytest.raises(ValueError, match="'empty' .* holds 0 binaries"):
        kernel_binaries(_field(1, _field(1, b"empty") + _field(2, _field(1, b"no elf"))))
