"""The properties every step program must keep, checked on its audit: each check returns the violations in words
(empty: it holds). The tests hold the engine's programs to them; the report shows which ones a program breaks.

- No copies: a decode or mixed step reads each weight and the KV pool in place. A copy of a layer's weight costs
  that weight's bytes twice more per step (written, then read back) in a step bound by reading the weights once.
- Bounded temp: a program's temporary memory stays within a small multiple of its activations (plus library
  workspace): more is a sign of a materialized copy, and memory the KV pool does not get.
- No widening: a quantized weight (int8, fp8) is widened where it is read, inside the GEMM; a widened copy of a
  whole weight in memory reads and writes more bytes than the unquantized weight would have.
- FP8 GEMMs: in a W8A8 program (fp8 prefill and mixed steps), every GEMM that reads a float8 weight multiplies two
  float8 operands, the tensor cores' FP8 rate; one that widens either operand runs at the bf16 rate.
"""

from __future__ import annotations

from jaxserve.gpu_programs.audit import Copy, Gemm, ProgramAudit

# Temporary memory a program may hold per byte of its activations: a layer's intermediates in flight and their
# copies for fusions that cannot share buffers.
TEMP_ACTIVATION_MULTIPLE = 4
# Temporary memory beside that: cuBLAS workspaces (32 MiB each on Hopper) and sort scratch.
TEMP_ALLOWANCE_BYTES = 64 * 2**20
STEP_KINDS = ("decode", "mixed", "scoring", "verify")
FLOAT8 = "f8e4m3fn"


def copy_violations(audit: ProgramAudit) -> list[str]:
    """Copies of a weight or of the pool in a step program."""
    if audit.kind not in STEP_KINDS:
        return []
    return [_describe(copy) for copy in audit.copies]


def temp_violations(audit: ProgramAudit) -> list[str]:
    limit = TEMP_ACTIVATION_MULTIPLE * audit.activation_bytes + TEMP_ALLOWANCE_BYTES
    if audit.temp_bytes <= limit:
        return []
    return [f"temp {audit.temp_bytes / 2**20:.1f} MiB exceeds {TEMP_ACTIVATION_MULTIPLE} x its activations "
            f"({audit.activation_bytes / 2**20:.1f} MiB) + {TEMP_ALLOWANCE_BYTES >> 20} MiB"]


def widening_violations(audit: ProgramAudit) -> list[str]:
    """Weights converted whole in memory (a widened or re-typed copy), in any program."""
    return [_describe(copy) for copy in audit.copies if copy.kind in ("widen", "convert")]


def fp8_gemm_violations(audit: ProgramAudit) -> list[str]:
    """GEMMs of float8 weights that do not multiply float8 by float8 (for a W8A8 program)."""
    return [f"{gemm.instruction} ({gemm.backend}) multiplies {' x '.join(gemm.operand_dtypes) or 'unknown types'}, "
            f"x {gemm.per_run} per run" for gemm in fp8_weight_gemms(audit)
            if gemm.operand_dtypes != (FLOAT8, FLOAT8)]


def fp8_weight_gemms(audit: ProgramAudit) -> list[Gemm]:
    """The GEMMs that read a float8 weight."""
    return [gemm for gemm in audit.gemms if any(dtype == FLOAT8 for _, dtype, _ in gemm.reads)]


def _describe(copy: Copy) -> str:
    return (f"{copy.kind} of {', '.join(copy.sources)} by {copy.instruction} ({copy.computation}): {copy.shape}, "
            f"{copy.bytes / 2**20:.1f} MiB x {copy.per_run} per run")
