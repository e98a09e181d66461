"""LoRA adapters on the GPU, by benchmarks/lora.py: a Llama-3.1-8B-shaped random bf16 model (one copy of the weights,
run by two engines in one process), one batch on the base model against the same batch spread over 4 adapters of
rank 16 on every projection, on the engine with adapter slots, and the base-only batch on an engine without them:
generated tokens/s per variant and the ratios within each round (the target: adapters / base >= 0.8x; base /
lora-off is what enabling LoRA costs requests that use no adapter). On a GPU the step's device work decides the
ratios, where on the CPU host work does.

The adapters must change the outputs, and neither engine may compile after warm-up. The base model's greedy tokens
with LoRA on and off must agree on the CPU smoke run; on the 8B-shaped random bf16 model they are reported, not
required: the two engines' programs differ (the adapter path adds a masked delta to every projection), so XLA may
pick other matmul algorithms, and the model's near-uniform next-token distribution (top-two gaps of a few
hundredths, see the speculative and engine_parity parts) flips such ties within a few tokens.
"""

from __future__ import annotations

from typing import Any

from gpu_parts.context import PartContext, PartOutcome, markdown_table, run_benchmark_script

BASE = "base"  # benchmarks/lora.py's variant that the table's last column compares with


def run(context: PartContext, args: list[str]) -> PartOutcome:
    plot_args = ["--plot", str(context.plot)] if context.plot is not None else []
    report = run_benchmark_script("lora.py", [*args, *plot_args], context.work_dir / "lora.json")
    figures = {"rows": variant_rows(report), "ratios": report["ratios"], "meets_target": report["meets_target"],
               "checks": report["checks"], "compiles_after_warmup": report["compiles_after_warmup"],
               "engine_startup_s": report["engine_startup_s"], "report": report}
    checks = report["checks"]
    same_base = checks.get("base_same_as_lora_off", True) if context.smoke else True
    passed = checks["adapters_change_outputs"] > 0 and same_base and not any(report["compiles_after_warmup"].values())
    return PartOutcome(figures, summary(figures, report), passed)


def variant_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per variant: its engine, tokens/s (median and per round), steps and step time, and tokens/s over base's."""
    base = report["variants"][BASE]["tokens_per_s"]
    keys = ("engine", "tokens_per_s", "tokens_per_s_per_round", "steps", "step_ms")
    return [{"variant": variant, **{key: row[key] for key in keys}, "vs_base": row["tokens_per_s"] / base}
            for variant, row in report["variants"].items()]


def summary(figures: dict[str, Any], report: dict[str, Any]) -> str:
    settings, checks = report["settings"], figures["checks"]
    startup = ", ".join(f"{name} {seconds:.0f} s ({report['engine_programs'][name]} programs)"
                        for name, seconds in figures["engine_startup_s"].items())
    lines = [f"- {report['model']} ({report['dtype']}): {settings['num_requests']} requests x {settings['max_tokens']} "
             f"tokens after {settings['prompt_len']}-token prompts, {settings['num_adapters']} adapters of rank "
             f"{settings['rank']} on every projection; max_num_seqs {settings['max_num_seqs']}, "
             f"max_num_batched_tokens {settings['max_num_batched_tokens']}; {settings['rounds']} rounds, variants "
             f"alternated",
             f"- engine start-up: {startup}; compiles after warm-up: {figures['compiles_after_warmup']}",
             f"- adapters change {checks['adapters_change_outputs']:.0%} of the outputs"
             + (f"; base outputs same with LoRA on and off: {checks['base_same_as_lora_off']}"
                if "base_same_as_lora_off" in checks else "")]
    table = [[r["variant"], r["engine"], f"{r['tokens_per_s']:.1f}", _numbers(r["tokens_per_s_per_round"], 1),
              f"{r['steps']:.0f}", f"{r['step_ms']:.2f}", f"{r['vs_base']:.2f}x"] for r in figures["rows"]]
    ratios = [[name, f"{ratio['median']:.2f}x", _numbers(ratio["per_round"], 2)]
              for name, ratio in figures["ratios"].items()]
    target = (f"adapters / base, against the target of {report['target_adapters_vs_base']}x: "
              f"{'met' if figures['meets_target'] else 'NOT met'}")
    variants = markdown_table(["variant", "engine", "tok/s", "tok/s per round", "steps", "ms / step", "vs base"], table)
    return "\n\n".join(["\n".join(lines), variants, markdown_table(["ratio", "median", "per round"], ratios), target])


def _numbers(values: list[float], digits: int) -> str:
    return " ".join(f"{value:.{digits}f}" for value in values)
