"""The LoRA delta's three forms on the GPU, by benchmarks/lora_kernels.py: the engine's one-hot einsum (reads every
slot), the gather form and the Pallas kernels (read only the adapters in use), per Llama-3.1-8B projection and
token count, each against the projection itself. The check: every form agrees with the gather form."""

from __future__ import annotations

from typing import Any

from gpu_parts.context import PartContext, PartOutcome, markdown_table, run_benchmark_script

AGREEMENT = 5e-2  # max abs difference from the gather form (bf16 outputs of deltas of order 1)


def run(context: PartContext, args: list[str]) -> PartOutcome:
    plot_args = ["--plot", str(context.plot)] if context.plot is not None else []
    report = run_benchmark_script("lora_kernels.py", [*args, *plot_args], context.work_dir / "lora_kernels.json")
    rows = [{"projection": name, "tokens": p["tokens"], **{f"{form}_us": s * 1e6 for form, s in p["median_s"].items()},
             **{f"{form}_vs_base": r for form, r in p["vs_base"].items()},
             "worst_error": max(p["max_abs_error_vs_gather"].values())}
            for name, points in report["projections"].items() for p in points]
    passed = all(row["worst_error"] <= AGREEMENT for row in rows)
    return PartOutcome({"rows": rows, "report": report}, summary(rows, report), passed)


def summary(rows: list[dict[str, Any]], report: dict[str, Any]) -> str:
    forms = [key[:-3] for key in rows[0] if key.endswith("_us")]
    table = [[r["projection"], r["tokens"], *(f"{r[f'{form}_us']:.1f}" for form in forms),
              *(f"{r[f'{form}_vs_base']:.2f}x" for form in forms if form != "base"), f"{r['worst_error']:.1e}"]
             for r in rows]
    header = ["projection", "tokens", *(f"{form} us" for form in forms),
              *(f"{form} / base" for form in forms if form != "base"), "max error vs gather"]
    settings = report["settings"]
    return (f"- {settings['adapters']} adapters of rank {settings['rank']}, {settings['dtype']}; copy bandwidth "
            f"{report['copy_bytes_per_s'] / 1e9:.0f} GB/s\n\n" + markdown_table(header, table))
