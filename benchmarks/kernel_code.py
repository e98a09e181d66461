"""The machine code of the Pallas kernels at Llama-3.1-8B's shapes (attention heads; the quantized GEMMs at the
gate projection), compiled for an H100 or H200 target on any machine (no GPU): registers, spills, tensor-core
instructions, and what each attention loop pass issues against the tensor-core time it feeds.

XLA:GPU compiles each point as the engine's pallas backend calls it (the engine's default tuning for the shape),
ptxas included; jaxserve/gpu_programs/machine_code.py reads the binaries with NVIDIA's cuobjdump and nvdisasm.

Static figures, not timings. For each loop that runs tensor-core instructions:

    issue / MMA    instruction issue clocks of one pass (instructions x warps / 4 schedulers per SM) over the
                   tensor-core clocks of its matmuls at the dense bf16 rate (4,096 FLOP per clock per SM: H100 SXM,
                   989 TFLOP/s at 1,830 MHz on 132 SMs). Above 1 the loop cannot keep the tensor cores busy even if
                   every instruction overlapped a matmul; FlashAttention-3 keeps its softmax well below it.

    python benchmarks/kernel_code.py --target h100 --out kernel_code.json

Needs the gpu-audit extra (JAX's CUDA plugin, cuobjdump, nvdisasm).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from jaxserve.gpu_programs.target import prepare_compile_environment

FLOPS_PER_SM_CLOCK = 4096  # dense bf16 tensor-core rate of one H100/H200 SM
SCHEDULERS_PER_SM = 4  # warp schedulers: each issues one instruction per clock
HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16  # Llama-3.1-8B
MAX_MODEL_LEN = 8192  # the 8B presets' context: block tables of 512 pages


@dataclasses.dataclass(frozen=True)
class Point:
    """One kernel call: a ragged batch of `seqs` rows, each bringing `tokens` query tokens after `prior` cached."""

    name: str
    kernel: str  # "prefill" (the mixed kernel), "decode", or a GEMM over stacked weights: "int8" (W8A16), "int4"
    seqs: int  # attention: sequence rows; GEMMs: 1
    tokens: int  # attention: query tokens per row this call; GEMMs: rows of x
    prior: int  # attention: tokens each row has cached before the call; GEMMs: 0


# The tuning follows tokens per row (T / S): one long prompt, then the engine's mixed buckets of 64 rows from
# prefill-heavy to decode-heavy (the kernel is the same for any prompt split of one T / S), and the decode kernel.
POINTS = (
    Point("prefill 1x2048", "prefill", 1, 2048, 0),
    Point("mixed T=2048 S=64", "prefill", 64, 32, 2048),
    Point("mixed T=1024 S=64", "prefill", 64, 16, 2048),
    Point("mixed T=256 S=64", "prefill", 64, 4, 2048),
    Point("decode 64x2048", "decode", 64, 1, 2047),
    Point("W8A16 gate_proj T=1", "int8", 1, 1, 0),
    Point("W8A16 gate_proj T=64", "int8", 1, 64, 0),
    Point("W4A16 g128 gate_proj T=1", "int4", 1, 1, 0),
    Point("W4A16 g128 gate_proj T=64", "int4", 1, 64, 0),
)
HIDDEN, INTERMEDIATE, LAYERS, GROUP_SIZE = 4096, 14336, 32, 128  # Llama-3.1-8B's MLP, a 4-bit checkpoint's groups


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="h100", help="GPU target description (configs/gpu-targets/)")
    parser.add_argument("--points", nargs="+", default=None, help="names of POINTS to compile (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    prepare_compile_environment()
    points = [p for p in POINTS if args.points is None or p.name in args.points]
    report = {"target": args.target, "points": [compile_point(point, args.target) for point in points]}
    print(table(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


def compile_point(point: Point, target_name: str) -> dict[str, Any]:
    """The point's kernel compiled for the target: its tuning, resources, instruction mix and loops."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxserve.gpu_programs.machine_code import compiled_kernels
    from jaxserve.gpu_programs.target import load_target, target_devices

    mesh = Mesh(target_devices(load_target(target_name), 1), ("x",))
    function, avals, tuning, rows, flops_per_pass = _call(point, NamedSharding(mesh, PartitionSpec()))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        lowered = jax.jit(function).lower(*avals)
    [kernel] = [k for k in compiled_kernels(lowered) if k.name == _kernel_name(tuning, point, rows)]
    loops = []
    for loop in kernel.loops:
        if not loop.count("HGMMA", "HMMA"):
            continue
        figures = {"instructions": loop.instructions, "hgmma": loop.count("HGMMA"), "hmma": loop.count("HMMA"),
                   "mufu": loop.count("MUFU")}
        if flops_per_pass:  # attention: one pass folds one key block (GEMMs are bound by reading their weights)
            issue_clocks = loop.instructions * tuning.num_warps / SCHEDULERS_PER_SM
            figures["issue_per_mma"] = round(issue_clocks / (flops_per_pass / FLOPS_PER_SM_CLOCK), 3)
        loops.append(figures)
    return {"point": point.name, "tuning": dataclasses.asdict(tuning), "rows": rows, **kernel.summary(),
            "loops": loops}


def _kernel_name(tuning, point: Point, rows: int) -> str:
    """The pallas_call's name: the tuning's, or int4_matmul's (rows x output channels of its program)."""
    if point.kernel == "int4":
        return f"int4_matmul_{tuning.block_t}x{tuning.block_out}"
    return tuning.kernel_name


def _call(point: Point, sharding):
    """(function, abstract arguments, tuning, query rows per program, FLOPs of one key-block pass) of the engine's
    call at `point`."""
    import functools

    import jax
    import jax.numpy as jnp

    from kernels_pallas import (default_decode_tuning, default_prefill_tuning, paged_decode_attention,
                                paged_prefill_attention)
    from kernels_pallas.common import padded_rows

    def aval(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    if point.kernel in ("int8", "int4"):
        return _gemm_call(point, aval)

    max_pages = MAX_MODEL_LEN // PAGE_SIZE
    num_pages = point.seqs * -(-(point.prior + point.tokens) // PAGE_SIZE) + 1
    pool = aval((KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM), jnp.bfloat16)
    tables, lengths = aval((point.seqs, max_pages), jnp.int32), aval((point.seqs,), jnp.int32)
    scale = HEAD_DIM ** -0.5
    group = HEADS // KV_HEADS
    if point.kernel == "decode":
        tuning = default_decode_tuning(point.seqs, KV_HEADS, max_pages, PAGE_SIZE, HEAD_DIM, jnp.bfloat16)
        function = functools.partial(paged_decode_attention, sm_scale=scale, tuning=tuning)
        rows = padded_rows(group)
        avals = (aval((point.seqs, HEADS, HEAD_DIM), jnp.bfloat16), pool, pool, tables, lengths)
    else:
        tokens = point.seqs * point.tokens
        tuning = default_prefill_tuning(tokens, point.seqs, group, max_pages, PAGE_SIZE, HEAD_DIM, jnp.bfloat16)
        function = functools.partial(paged_prefill_attention, sm_scale=scale, tuning=tuning)
        rows = padded_rows(tuning.block_q * group)
        ints = aval((tokens,), jnp.int32)
        avals = (aval((tokens, HEADS, HEAD_DIM), jnp.bfloat16), pool, pool, tables, lengths, ints, ints)
    slots = tuning.pages_per_block * PAGE_SIZE
    return function, avals, tuning, rows, 2 * 2 * rows * slots * HEAD_DIM  # q·kᵀ and p·v


def _gemm_call(point: Point, aval):
    """The engine's gate projection through the W8A16 or W4A16 kernel, reading layer 0 of the stacked weights."""
    import functools

    import jax.numpy as jnp

    from kernels_pallas.int4_matmul import int4_matmul
    from kernels_pallas.quantized_matmul import default_tuning, quantized_matmul

    x, layer = aval((point.tokens, HIDDEN), jnp.bfloat16), aval((), jnp.int32)
    tuning = default_tuning(point.tokens, HIDDEN, INTERMEDIATE)
    if point.kernel == "int8":
        weights = (aval((LAYERS, INTERMEDIATE, HIDDEN), jnp.int8), aval((LAYERS, INTERMEDIATE), jnp.float32))
        function = functools.partial(quantized_matmul, tuning=tuning)
    else:
        weights = (aval((LAYERS, INTERMEDIATE, HIDDEN // 2), jnp.uint8),
                   aval((LAYERS, INTERMEDIATE, HIDDEN // GROUP_SIZE), jnp.float32))

        def function(x, q, scale, layer):  # symmetric: no zero points
            return int4_matmul(x, q, scale, None, layer, group_size=GROUP_SIZE, tuning=tuning)
    return function, (x, *weights, layer), tuning, tuning.block_t, 0


def table(report: dict[str, Any]) -> str:
    lines = [f"Pallas kernels compiled for {report['target']} (Llama-3.1-8B: heads {HEADS}/{KV_HEADS}, head_dim "
             f"{HEAD_DIM}, bf16; GEMMs at the gate projection {HIDDEN} -> {INTERMEDIATE})",
             "| point | kernel | registers | local bytes | HGMMA / HMMA | loops: instructions, issue / MMA |",
             "|---|---|---|---|---|---|"]
    for p in report["points"]:
        loops = "; ".join(f"{loop['instructions']}" + (f", {loop['issue_per_mma']:.2f}" if "issue_per_mma" in loop
                                                        else "") for loop in p["loops"])
        lines.append(f"| {p['point']} | {p['kernel']} | {p['registers']} | {p['local_bytes']} | "
                     f"{p['hgmma']} / {p['hmma']} | {loops} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
