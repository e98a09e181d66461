"""The XLA compiler options each GPU step program is compiled with, chosen from what XLA:GPU makes of it.

The decoder is one `jax.lax.scan` over layer-stacked weights, so each layer's projections read a dynamic slice of a
stacked weight. The GPU program audit (jaxserve/gpu_programs, `jaxserve compile --audit`) shows what XLA:GPU does
with those slices, on H100/H200 targets and on an H100 itself:

- By default XLA gives the projections to its Triton GEMM fusion, which cannot read a dynamic slice in place: every
  step copies each layer's q, o, gate, up and down slices (and from two rows on k and v) into a buffer of their own
  first, so a decode step moves about 2.8x the bytes it must read.
- With Triton GEMM fusion off, cuBLAS reads each slice in place (a dynamic-slice fusion around the library call).
  Its dot merger would then concatenate q, k and v weights into one GEMM every layer (48 MiB written and read per
  layer at 8B): off too, each projection stays one GEMM over its own slice.
- int8 and fp8 weights are different: Triton widens them inside its GEMM fusion (the slices are copied, at one byte
  a weight), while cuBLAS would widen every slice to bf16 in memory first. So quantized weights keep XLA's default.
- Except in W8A8 programs (fp8 prefill and mixed steps: model/quantization.py), where both operands are float8:
  there cuBLAS runs cuBLASLt's FP8 GEMM (`__cublas$lt$matmul$f8`), the tensor cores' float8 rate, as vLLM's
  cutlass FP8 kernels do, and nothing is widened.

Samplers have no GEMMs and keep XLA's defaults. Off a GPU the options would mean nothing: none are given.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.model.quantization import WeightFormat, quantizes_activations

CUBLAS, TRITON = "cublas", "triton"
# cuBLAS for every projection, each over its own weight slice, read in place.
IN_PLACE_GEMMS = {"xla_gpu_enable_triton_gemm": False, "xla_gpu_dot_merger_threshold_mb": 0}


@dataclasses.dataclass(frozen=True)
class StepCompilerOptions:
    """What decides the XLA options of an engine's step programs (forward, whole step, scoring, verifying)."""

    platform: str  # a JAX device's platform: "gpu", "cpu", ...
    gemm_backend: str  # as configured: "auto", "cublas", "triton", or "pallas" (auto for the GEMMs its kernel skips)
    quantized_weights: bool  # some weight is stored in one byte (int8 or float8)
    weight_format: WeightFormat | None = None  # the projections' quantized format; None: unquantized or unknown

    def of(self, num_tokens: int) -> dict[str, Any]:
        """The options of the step program of `num_tokens` tokens."""
        if self.platform != "gpu":
            return {}
        if self.gemm_backend in (CUBLAS, TRITON):
            chosen = self.gemm_backend
        elif quantizes_activations(self.weight_format, num_tokens):
            chosen = CUBLAS
        else:
            chosen = TRITON if self.quantized_weights else CUBLAS
        return dict(IN_PLACE_GEMMS) if chosen == CUBLAS else {}
