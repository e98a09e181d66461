"""The host's work per engine step on the GPU host's CPU, by benchmarks/host_overhead.py (no device work): schedule
and prepare, update and output assembly at 64 and 256 decoding sequences, against the <= 1 ms targets. The CPU a
GPU serves from decides these figures, not the GPU."""

from __future__ import annotations

from gpu_parts.context import PartContext, PartOutcome, markdown_table, run_benchmark_script

TARGET_MS = 1.0  # per half of the step's host work, at 256 sequences
SPANS = ("schedule", "prepare", "transfer", "update", "outputs", "schedule+prepare")


def run(context: PartContext, args: list[str]) -> PartOutcome:
    report = run_benchmark_script("host_overhead.py", args, context.work_dir / "host_overhead.json")
    host = report["host_ms"]
    for size in host.values():  # the second span, which the script reports as its parts
        size["update+outputs"] = {q: size["update"][q] + size["outputs"][q] for q in ("median_ms", "p90_ms")}
    largest = host[max(host, key=int)]
    figures = {"host_ms": host, "report": report, "meets_target_at_largest": {
        span: largest[span]["median_ms"] <= TARGET_MS for span in ("schedule+prepare", "update+outputs")}}
    table = [[span, *(f"{host[n][span]['median_ms']:.3f} / {host[n][span]['p90_ms']:.3f}" for n in host)]
             for span in (*SPANS, "update+outputs")]
    machine = report["machine"]
    summary = (f"- {machine['cpu']} ({machine['cpu_count']} cores); ms median / p90; target <= {TARGET_MS} ms per "
               f"half at the largest batch: {figures['meets_target_at_largest']}\n\n"
               + markdown_table(["span", *(f"{n} seqs" for n in host)], table))
    return PartOutcome(figures, summary)
