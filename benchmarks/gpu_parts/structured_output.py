"""Structured output on the GPU, by benchmarks/structured_output.py: the host's time to fill the grammar masks of 64
sequences over Llama 3's vocabulary size (on llguidance's thread pool over the host's cores, against one thread row
after row), and an 8B-shaped random bf16 engine's throughput with every request constrained by a JSON Schema against
the same tokens unconstrained (target >= 0.9x), constrained with the masks filled on one thread (the engine before
the parallel fill), and constrained with async overlap off (what filling the masks during the forward pass saves),
rounds rotating the four."""

from __future__ import annotations

from typing import Any

from gpu_parts.context import PartContext, PartOutcome, markdown_table, run_benchmark_script

TARGET = 0.9  # constrained over unconstrained tokens/s
# The engine's KV pool on a GPU, GiB. Its 64 sequences of at most 256 tokens hold 2 GiB at the 8B shapes (bf16): 8
# leaves them room to spare and the device allocator room too. Sized from device memory (the benchmark's default),
# each of the pool's K and V arrays is one 22 GiB block, which JAX's BFC arena could not find contiguous on an H100
# once the weights and the compiles' buffers had left holes ("Out of memory while trying to allocate 22.00GiB").
KV_POOL_GB = 8.0
POOL_FLAG = "--kv-cache-memory-gb"


def run(context: PartContext, args: list[str]) -> PartOutcome:
    report = run_benchmark_script("structured_output.py", script_args(context, args),
                                  context.work_dir / "structured_output.json")
    throughput, masks = report["throughput"], report["masks"]
    figures = {"masks": masks, "throughput": throughput,
               "meets_target": throughput["constrained_over_unconstrained"] >= TARGET}
    passed = (throughput["valid_outputs"] == throughput["requests"] and not throughput["compiles_after_warmup"]
              and masks["identical_masks"])
    return PartOutcome(figures, summary(report), passed)


def script_args(context: PartContext, args: list[str]) -> list[str]:
    """The benchmark's arguments: on a GPU with the pool of KV_POOL_GB unless they size it themselves (on the CPU
    the pool is sized by the benchmark's engine defaults)."""
    return args if context.smoke or POOL_FLAG in args else [*args, POOL_FLAG, str(KV_POOL_GB)]


def summary(report: dict[str, Any]) -> str:
    masks, throughput = report["masks"], report["throughput"]
    ms, worst = masks["ms_per_step_median"], masks["ms_per_step_max"]
    pool = f"{masks['threads']} threads" if masks["pooled"] else "the calling thread (too few to pool)"
    lines = [f"- masks: {masks['seqs']} sequences over a {masks['vocab']}-token vocabulary, ms per step (median / "
             f"worst): {ms['parallel']:.2f} / {worst['parallel']:.1f} on {pool}, {ms['sequential']:.2f} / "
             f"{worst['sequential']:.1f} on one ({masks['speedup_median']:.1f}x, totals "
             f"{masks['speedup_of_totals']:.1f}x; every step's masks identical: {masks['identical_masks']}) on "
             f"{report['machine']['cpu']}",
             f"- engine: {throughput['model']} ({throughput['dtype']}), {throughput['requests']} greedy requests, "
             f"max_num_seqs {throughput['max_num_seqs']}; outputs valid against the schema: "
             f"{throughput['valid_outputs']} / {throughput['requests']}; compiles after warm-up: "
             f"{throughput['compiles_after_warmup']}",
             f"- constrained / unconstrained {throughput['constrained_over_unconstrained']:.2f}x (target {TARGET}x; "
             f"masks on one thread {throughput['sequential_masks_over_unconstrained']:.2f}x); parallel / one-thread "
             f"masks {throughput['parallel_over_sequential_masks']:.2f}x; overlap / no overlap "
             f"{throughput['overlap_over_no_overlap']:.2f}x"]
    memory = throughput.get("device_memory")
    if memory:
        lines.append(f"- device memory, GB: peak {memory['peak_bytes_in_use'] / 1e9:.2f} of "
                     f"{memory['bytes_limit'] / 1e9:.2f}; pool {memory['pool_bytes'] / 1e9:.2f}, weights "
                     f"{memory['weight_bytes'] / 1e9:.2f}, largest workspace "
                     f"{memory['largest_workspace_bytes'] / 1e9:.2f}")
    rows = [[mode, f"{rate:.0f}", " ".join(f"{r:.0f}" for r in throughput["tokens_per_s"][mode])]
            for mode, rate in throughput["tokens_per_s_median"].items()]
    phases = ", ".join(f"{phase} {ms:.2f}" for phase, ms in throughput["host_ms_per_step"].items())
    return "\n".join(lines) + f"\n- host ms per step, all modes: {phases}\n\n" + markdown_table(
        ["mode", "tokens/s (median)", "per round"], rows)
