"""Structured output on the GPU, by benchmarks/structured_output.py: the host's time to fill the grammar masks of 64
sequences over Llama 3's vocabulary size, and an 8B-shaped random bf16 engine's throughput with every request
constrained by a JSON Schema against the same tokens unconstrained (target >= 0.9x), and constrained with async
overlap off (what filling the masks during the forward pass saves), rounds rotating the three."""

from __future__ import annotations

from typing import Any

from gpu_parts.context import PartContext, PartOutcome, markdown_table, run_benchmark_script

TARGET = 0.9  # constrained over unconstrained tokens/s


def run(context: PartContext, args: list[str]) -> PartOutcome:
    report = run_benchmark_script("structured_output.py", args, context.work_dir / "structured_output.json")
    throughput = report["throughput"]
    figures = {"masks": report["masks"], "throughput": throughput,
               "meets_target": throughput["constrained_over_unconstrained"] >= TARGET}
    passed = throughput["valid_outputs"] == throughput["requests"] and not throughput["compiles_after_warmup"]
    return PartOutcome(figures, summary(report), passed)


def summary(report: dict[str, Any]) -> str:
    masks, throughput = report["masks"], report["throughput"]
    lines = [f"- masks: {masks['seqs']} sequences over a {masks['vocab']}-token vocabulary: "
             f"{masks['mask_ms_per_step_median']:.2f} ms per step (median; {masks['mask_us_per_seq_median']:.0f} us "
             f"per sequence) on {report['machine']['cpu']}",
             f"- engine: {throughput['model']} ({throughput['dtype']}), {throughput['requests']} greedy requests, "
             f"max_num_seqs {throughput['max_num_seqs']}; outputs valid against the schema: "
             f"{throughput['valid_outputs']} / {throughput['requests']}; compiles after warm-up: "
             f"{throughput['compiles_after_warmup']}",
             f"- constrained / unconstrained {throughput['constrained_over_unconstrained']:.2f}x (target {TARGET}x); "
             f"overlap / no overlap {throughput['overlap_over_no_overlap']:.2f}x"]
    rows = [[mode, f"{rate:.0f}", " ".join(f"{r:.0f}" for r in throughput["tokens_per_s"][mode])]
            for mode, rate in throughput["tokens_per_s_median"].items()]
    phases = ", ".join(f"{phase} {ms:.2f}" for phase, ms in throughput["host_ms_per_step"].items())
    return "\n".join(lines) + f"\n- host ms per step, all modes: {phases}\n\n" + markdown_table(
        ["mode", "tokens/s (median)", "per round"], rows)
