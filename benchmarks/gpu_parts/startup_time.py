"""Engine start-up, by benchmarks/startup.py: ready time split into weight reading, lowering and compiling, with a
fresh (cold) compilation cache and then the same cache again (warm), each start in a fresh process without a program
store; with --store, then a start that fills a store and one that loads every program from it."""

from __future__ import annotations

from typing import Any

from gpu_parts.context import PartContext, PartOutcome, markdown_table, run_benchmark_script


def run(context: PartContext, args: list[str]) -> PartOutcome:
    plot_args = ["--plot", str(context.plot)] if context.plot is not None else []
    report = run_benchmark_script("startup.py", [*args, *plot_args], context.work_dir / "startup.json")
    return PartOutcome({"report": report}, summary(report))


def summary(report: dict[str, Any]) -> str:
    settings = report["settings"]
    rows = [[r["layers"], r["cache"], r["weights"], r["programs"], program_sources(r.get("sources", {})),
             f"{r['ready_seconds']:.1f}", f"{r['load_seconds']:.1f}", f"{r['lower_seconds']:.1f}",
             f"{r['compile_seconds']:.1f}"]
            for r in report["results"]]
    ratios = "".join(f"\n\nstart from the store over the warm-cache start, {layers} layers: {ratio:.2f}"
                     for layers, ratio in report.get("store_ratio", {}).items())
    return (f"{settings['model']} shapes, {settings['max_num_seqs']} seqs, {settings['max_num_batched_tokens']} "
            f"tokens per step, max_model_len {settings['max_model_len']}, {settings['dtype']}:\n\n"
            + markdown_table(["layers", "cache", "weights", "programs", "from store / cache / compiled", "ready s",
                              "load s", "lower s", "compile s"], rows) + ratios)


def program_sources(sources: dict[str, int]) -> str:
    """"store / cache / compiled" program counts of one start ("-" where the report has none)."""
    if not sources:
        return "-"
    return " / ".join(str(sources.get(name, 0)) for name in ("store", "cache", "compiled"))
