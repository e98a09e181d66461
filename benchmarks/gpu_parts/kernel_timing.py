"""Kernel speed, by benchmarks/kernels.py on a few chosen points (one run per attention shape): decode as a fraction of
the copy bandwidth measured in the same run, prefill as a fraction of the matmul rate, each against JAX's shipped
Pallas paged-attention op (decode), cuDNN's fused flash attention (prompts with no cached prefix) and the XLA paged
attention. The runs' whole reports are kept in the figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpu_parts.context import PartContext, PartOutcome, markdown_table, run_benchmark_script

# ours (decode / mixed kernel), JAX's op, cuDNN's flash attention, XLA
IMPLEMENTATIONS = ("pallas", "pallas_mixed", "shipped", "cudnn", "xla")


def run(context: PartContext, runs: dict[str, list[str]]) -> PartOutcome:
    reports = {}
    for index, (label, args) in enumerate(runs.items()):
        reports[label] = run_benchmark_script("kernels.py", args, context.work_dir / f"kernels-{index}.json")
    rows = point_rows(reports)
    if context.plot is not None:
        plot(rows, context.plot)
    figures = {"points": rows, "reports": reports}
    measured = [row for row in rows if row["pallas_fraction"] is not None]
    return PartOutcome(figures, summary(reports, rows), passed=bool(measured))


def point_rows(reports: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per measured point: its best time per implementation and the fraction of the ceiling each reached."""
    rows = []
    for label, report in reports.items():
        for grid, fraction in (("decode", "fraction_of_copy"), ("prefill", "fraction_of_matmul")):
            for point in report.get(grid, []):
                best = point.get("best", {})
                rows.append({
                    "run": label, "grid": grid, "point": point_label(grid, point),
                    "seconds": {name: best[name]["median_s"] for name in IMPLEMENTATIONS if name in best},
                    "fractions": {name: best[name][fraction] for name in IMPLEMENTATIONS if name in best},
                    "pallas_fraction": best.get("pallas", {}).get(fraction),
                    "pallas_best": best.get("pallas", {}).get("label"),
                    "speedup_vs_shipped": point.get("speedup_vs_shipped"),
                    "speedup_vs_xla": point.get("speedup_vs_xla"),
                    "failed": point.get("error") or point.get("skipped"),
                })
    return rows


def point_label(grid: str, point: dict[str, Any]) -> str:
    if grid == "decode":
        return f"decode {point['batch']} seqs x {point['context']}"
    return f"prefill {point['sequences']}x{point['chunk']} after {point['prior_context']}"


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def microseconds(row: dict[str, Any], name: str) -> str:
    seconds = row["seconds"].get(name)
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


TABLE_HEADER = ["run", "point", "pallas us", "of ceiling", "fastest pallas tuning", "mixed us", "shipped us",
                "cudnn us", "cudnn of ceiling", "xla us", "vs shipped", "vs xla", "not measured"]


def table_row(row: dict[str, Any]) -> list[str]:
    return [row["run"], row["point"], microseconds(row, "pallas"), percent(row["pallas_fraction"]),
            row.get("pallas_best") or "-", microseconds(row, "pallas_mixed"), microseconds(row, "shipped"),
            microseconds(row, "cudnn"), percent(row["fractions"].get("cudnn")), microseconds(row, "xla"),
            ratio(row["speedup_vs_shipped"]), ratio(row["speedup_vs_xla"]), (row["failed"] or "")[:80]]


def summary(reports: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> str:
    ceilings = [f"{label}: copy {report['ceilings']['copy'].get('bytes_per_s', 0) / 1e9:.0f} GB/s, matmul "
                f"{report['ceilings']['matmul'].get('flops_per_s', 0) / 1e12:.1f} TFLOP/s"
                for label, report in reports.items() if "ceilings" in report]
    return ("Ceilings measured in each run: " + "; ".join(ceilings) + ". Decode's ceiling is the copy bandwidth, "
            "prefill's the matmul rate; \"mixed\" is the engine's kernel on the same decode call.\n\n"
            + markdown_table(TABLE_HEADER, [table_row(row) for row in rows]))


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Each point's fraction of its ceiling, one bar per implementation."""
    import matplotlib  # here: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(max(6.0, 2.2 * len(rows)), 4.5))
    width = 0.8 / len(IMPLEMENTATIONS)
    for offset, name in enumerate(IMPLEMENTATIONS):
        heights = [row["fractions"].get(name) or 0.0 for row in rows]
        axes.bar([i + offset * width for i in range(len(rows))], heights, width, label=name)
    axes.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))],
                    [f"{row['run']}\n{row['point']}" for row in rows], fontsize=8)
    axes.set_ylabel("fraction of ceiling (decode: copy BW, prefill: matmul)")
    axes.set_title("attention kernels against the device's ceilings")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
