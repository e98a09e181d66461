"""The device's ceilings, measured as benchmarks/kernels.py measures them: HBM copy bandwidth (x * s over 1 GiB, the
rate engine rooflines use) cross-checked by a device memcpy and a read-only reduction of the same buffer, each set
against the card's spec bandwidth; the bf16 matmul rate, the fp8 matmul rate where the device has fp8 tensor cores
(compute capability 8.9 and up), and the dispatch floor."""

from __future__ import annotations

import statistics
from typing import Any

import jax
import jax.numpy as jnp

from engine_bench import spec_bandwidth
from gpu_parts.context import PartContext, PartOutcome
from kernels import (describe, measure_copy_bandwidth, measure_dispatch_floor, measure_matmul_rate,
                     measure_memcpy_bandwidth, measure_read_bandwidth, random_normal, timed_reps)

FP8_DTYPE = "float8_e4m3fn"
FP8_MIN_COMPUTE_CAPABILITY = 8.9  # Ada and Hopper: the first with fp8 tensor cores
# What the compiled program calls when XLA rewrote the pattern below into one cuBLASLt FP8 GEMM, or made the dot a
# Triton GEMM fusion.
CUBLASLT_FP8_TARGET = "__cublas$lt$matmul$f8"
TRITON_GEMM_TARGET = "__triton_gemm"
# XLA:GPU's Triton GEMM fusion claims a dot with converts and scales around it before the cuBLAS rewriter sees it
# (on an H200 the default build of the pattern below was no FP8 GEMM); this program option leaves it to cuBLASLt.
CUBLAS_ONLY = {"xla_gpu_enable_triton_gemm": False}


def run(context: PartContext, copy_mib: int, matmul_size: int, reps: int, warmup: int) -> PartOutcome:
    measures = {
        "copy": lambda: measure_copy_bandwidth(copy_mib * 2**20, "bfloat16", reps, warmup),
        "memcpy": lambda: measure_memcpy_bandwidth(copy_mib * 2**20, "bfloat16", reps, warmup),
        "read": lambda: measure_read_bandwidth(copy_mib * 2**20, "bfloat16", reps, warmup),
        "matmul_bf16": lambda: measure_matmul_rate(matmul_size, "bfloat16", reps, warmup),
        "matmul_fp8": lambda: measure_fp8_matmul_rate(matmul_size, reps, warmup),
        "matmul_fp8_cublas": lambda: measure_fp8_matmul_rate(matmul_size, reps, warmup, CUBLAS_ONLY),
        "dispatch": lambda: measure_dispatch_floor("bfloat16", reps, warmup),
    }
    figures: dict[str, Any] = {}
    for name, measure in measures.items():
        skipped = fp8_unsupported() if name.startswith("matmul_fp8") else None
        try:
            figures[name] = {"skipped": skipped} if skipped else measure()
        except Exception as error:  # one failed ceiling leaves the others measured
            figures[name] = {"error": describe(error)}
    figures["spec_bandwidth"] = spec_bandwidth(jax.devices()[0].device_kind)
    passed = all("error" not in figures[name] for name in ("copy", "matmul_bf16"))
    return PartOutcome(figures, summary(figures), passed)


def fp8_unsupported() -> str | None:
    """Why fp8 is not measured here, or None. The CPU runs it (emulated) so that the code cannot rot."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if capability is not None and float(capability) < FP8_MIN_COMPUTE_CAPABILITY:
        return f"compute capability {capability} has no fp8 tensor cores"
    return None


def fp8_matmul(a: jax.Array, b: jax.Array, a_scale: jax.Array, b_scale: jax.Array) -> jax.Array:  # bf16[n, n]
    """a, b: f8e4m3[n, n]; scales: f32[]. The pattern XLA:GPU turns into one cuBLASLt FP8 GEMM (fp8 operands
    widened, multiplied by scalar scales, then the dot); any other spelling runs as a bf16 matmul after a convert."""
    a_wide = a.astype(jnp.bfloat16) * a_scale.astype(jnp.bfloat16)  # bf16[n, n]
    b_wide = b.astype(jnp.bfloat16) * b_scale.astype(jnp.bfloat16)  # bf16[n, n]
    return jnp.dot(a_wide, b_wide, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def measure_fp8_matmul_rate(size: int, reps: int, warmup: int, compiler_options: dict[str, Any] | None = None,
                            seed: int = 0) -> dict[str, Any]:
    """FLOP/s of an n x n x n fp8 matmul compiled with these XLA options, and whether the program is the cuBLASLt
    FP8 GEMM (if not, the figure says nothing of fp8 tensor cores) or a Triton GEMM fusion."""
    a = random_normal(jax.random.key(seed), (size, size), "bfloat16").astype(FP8_DTYPE)  # f8[n, n]
    b = random_normal(jax.random.key(seed + 1), (size, size), "bfloat16").astype(FP8_DTYPE)  # f8[n, n]
    scales = (jnp.float32(1.0), jnp.float32(1.0))
    compiled = jax.jit(fp8_matmul).lower(a, b, *scales).compile(compiler_options=compiler_options)
    times = timed_reps(compiled, [(a, b, *scales)], reps, warmup)
    flops = 2 * size**3
    return {"size": size, "flops": flops, "median_s": statistics.median(times), "times_s": times,
            "flops_per_s": flops / statistics.median(times),
            "compiler_options": compiler_options or {}, "cublaslt_fp8_gemm": CUBLASLT_FP8_TARGET in compiled.as_text(),
            "triton_gemm": TRITON_GEMM_TARGET in compiled.as_text()}


def figure(entry: dict[str, Any], key: str, scale: float, unit: str) -> str:
    if key in entry:
        return f"{entry[key] / scale:.1f} {unit}"
    return entry.get("skipped") or f"failed: {entry.get('error', '?')[:200]}"


def summary(figures: dict[str, Any]) -> str:
    spec = figures["spec_bandwidth"]
    return "\n".join([
        f"- HBM copy bandwidth (x * s, read + written): {stream_text(figures['copy'], spec)}",
        f"- HBM memcpy bandwidth (device-to-device, read + written): {stream_text(figures['memcpy'], spec)}",
        f"- HBM read bandwidth (a sum, read only): {stream_text(figures['read'], spec)}",
        "- spec bandwidth: " + (f"{spec['bytes_per_s'] / 1e9:.0f} GB/s ({spec['source']})" if spec
                                else "unknown for this device"),
        f"- bf16 matmul: {figure(figures['matmul_bf16'], 'flops_per_s', 1e12, 'TFLOP/s')}",
        f"- fp8 (e4m3) matmul: {fp8_line(figures['matmul_fp8'])}",
        f"- fp8 (e4m3) matmul, Triton GEMM fusion off: {fp8_line(figures['matmul_fp8_cublas'])}",
        f"- dispatch floor per call: {figure(figures['dispatch'], 'median_s', 1e-6, 'us')}",
    ])


def stream_text(entry: dict[str, Any], spec: dict[str, Any] | None) -> str:
    """A stream rate, with its share of the spec bandwidth where that is known."""
    text = figure(entry, "bytes_per_s", 1e9, "GB/s")
    if spec is None or "bytes_per_s" not in entry:
        return text
    return f"{text} ({entry['bytes_per_s'] / spec['bytes_per_s']:.0%} of spec)"


def fp8_line(entry: dict[str, Any]) -> str:
    if "flops_per_s" not in entry:
        return figure(entry, "flops_per_s", 1e12, "TFLOP/s")
    program = ("cuBLASLt FP8 GEMM" if entry["cublaslt_fp8_gemm"] else
               "**not** an FP8 GEMM: a Triton GEMM fusion" if entry["triton_gemm"] else "**not** an FP8 GEMM")
    return f"{figure(entry, 'flops_per_s', 1e12, 'TFLOP/s')} ({program})"
