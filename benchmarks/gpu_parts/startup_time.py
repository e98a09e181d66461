"""Engine start-up, by benchmarks/startup.py: ready time split into weight reading, lowering and compiling, with a
fresh (cold) compilation cache and then the same cache again (warm), each start in a fresh process."""

from __future__ import annotations

from typing import Any

from gpu_parts.context import PartContext, PartOutcome, markdown_table, run_benchmark_script


def run(context: PartContext, args: list[str]) -> PartOutcome:
    plot_args = ["--plot", str(context.plot)] if context.plot is not None else []
    report = run_benchmark_script("startup.py", [*args, *plot_args], context.work_dir / "startup.json")
    return PartOutcome({"report": report}, summary(report))


def summary(report: dict[str, Any]) -> str:
    settings = report["settings"]
    rows = [[r["layers"], r["cache"], r["weights"], r["programs"], f"{r['ready_seconds']:.1f}",
             f"{r['load_seconds']:.1f}", f"{r['lower_seconds']:.1f}", f"{r['compile_seconds']:.1f}"]
            for r in report["results"]]
    return (f"{settings['model']} shapes, {settings['max_num_seqs']} seqs, {settings['max_num_batched_tokens']} "
            f"tokens per step, max_model_len {settings['max_model_len']}, {settings['dtype']}:\n\n"
            + markdown_table(["layers", "cache", "weights", "programs", "ready s", "load s", "lower s", "compile s"],
                             rows))
