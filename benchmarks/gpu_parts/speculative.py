"""Speculative decoding on the GPU, by benchmarks/speculative.py: a Llama-3.1-8B-shaped random bf16 model in two
engine processes (without and with speculation), n-gram drafts on a repetitive workload and replayed drafts of set
quality (acceptance 0 to 1), at batch 1 and a larger batch: target steps per token, the cost of a verifying step
against a decode step, and the wall speed-up over no speculation, measured in one run. On a memory-bound GPU the
verifying step should cost about a decode step, so the speed-up should follow the saved steps; on a CPU it does not.

Greedy outputs with drafts must equal those without wherever a near tie cannot flip: on the CPU smoke run. On the
8B-shaped random bf16 model they cannot be required: its next-token distribution is close to uniform, its top-two
gaps are a few hundredths, and a verifying step (several query tokens per sequence) rounds differently from a
decode step, which flips such ties within a few tokens (measured on an H200; the engine_parity part shows the
same between attention backends). There the check is the verifying program run without drafts, which must
reproduce the plain engine's tokens exactly, and no compiles after warm-up.
"""

from __future__ import annotations

from typing import Any

from gpu_parts.context import PartContext, PartOutcome, markdown_table, run_benchmark_script

NO_DRAFTS = "no-drafts"  # benchmarks/speculative.py's mode: the verifying program with no draft in any step


def run(context: PartContext, args: list[str]) -> PartOutcome:
    plot_args = ["--plot", str(context.plot)] if context.plot is not None else []
    report = run_benchmark_script("speculative.py", [*args, *plot_args], context.work_dir / "speculative.json")
    rows = speedup_rows(report)
    figures = {"rows": rows, "outputs_identical": report["outputs_identical"],
               "compiles_after_warmup": report["compiles_after_warmup"], "report": report}
    identical = report["outputs_identical"] if context.smoke else all(
        row["outputs_identical"] for row in rows if row["mode"] == NO_DRAFTS)
    passed = identical and not any(report["compiles_after_warmup"].values())
    return PartOutcome(figures, summary(figures, report), passed)


def speedup_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per batch size and mode: acceptance, steps and step time against plain, tokens/s and the speed-up."""
    keys = ("acceptance_rate", "mean_accepted_per_draft_step", "steps_per_token", "steps_vs_plain", "step_ms",
            "step_time_vs_plain", "tokens_per_s", "speedup_vs_plain", "outputs_identical")
    return [{"batch": int(batch), "mode": mode, **{key: row[key] for key in keys}}
            for batch, by_mode in report["results"].items() for mode, row in by_mode.items()]


def summary(figures: dict[str, Any], report: dict[str, Any]) -> str:
    settings = report["settings"]
    lines = [f"- {report['model']}, k = {settings['num_speculative_tokens']}, prompt lookup "
             f"{settings['prompt_lookup_max']}..{settings['prompt_lookup_min']}; {settings['rounds']} rounds, modes "
             f"alternated; greedy outputs identical to no speculation: {figures['outputs_identical']}; compiles "
             f"after warm-up: {figures['compiles_after_warmup']}"]
    table = [[r["batch"], r["mode"], _percent(r["acceptance_rate"]), _number(r["mean_accepted_per_draft_step"]),
              f"{r['steps_vs_plain']:.2f}x", f"{r['step_ms']:.2f}", f"{r['step_time_vs_plain']:.2f}x",
              f"{r['tokens_per_s']:.1f}", f"{r['speedup_vs_plain']:.2f}x", r["outputs_identical"]]
             for r in figures["rows"]]
    return "\n".join(lines) + "\n\n" + markdown_table(
        ["batch", "mode", "acceptance", "accepted / draft step", "steps / token vs plain", "ms / step",
         "step time vs plain", "tok/s", "speed-up", "identical"], table)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
