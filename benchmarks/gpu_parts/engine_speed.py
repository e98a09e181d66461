"""The engine's decode speed, by benchmarks/engine_bench.py: a Llama-3.1-8B-shaped random bf16 model in two engine
processes (pallas and xla attention), batch-1 decode against the HBM roofline and steady throughput at larger
batches. engine_bench.py's roofline (weights plus every layer's KV pages read per step) at two bandwidths: the copy
rate measured in the engine's process (cross-checked there by a device memcpy and a read-only reduction) and the
card's spec bandwidth; and the weights-only one (weight bytes / copy bandwidth) that published batch-1 figures
quote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpu_parts.context import PartContext, PartOutcome, markdown_table, run_benchmark_script

HOST_PHASES = ("schedule", "dispatch", "wait", "outputs")  # StepPhaseTimes' phases, as the table orders them
# engine_bench.STREAM_KINDS, the stream rates each engine process reports (named here: this process imports no JAX).
STREAM_KINDS = ("copy", "memcpy", "read")


def run(context: PartContext, args: list[str]) -> PartOutcome:
    report = run_benchmark_script("engine_bench.py", args, context.work_dir / "engine.json")
    engine = report["engine"]
    rows = speed_rows(engine)
    if context.plot is not None and rows:
        plot(rows, context.plot)
    figures = {"rows": rows, "weights_only_roofline": weights_only_roofline(engine), "report": report}
    started = [name for name, ready in engine["ready"].items() if "error" not in ready]
    return PartOutcome(figures, summary(figures, engine),
                       passed=bool(rows) and len(started) == len(engine["settings"]["variants"]))


def speed_rows(engine: dict[str, Any]) -> list[dict[str, Any]]:
    """Per batch and engine variant: median step time, tokens/s and share of engine_bench.py's roofline."""
    return [{"batch": int(batch), "backend": name, **row[name]}
            for batch, row in engine.get("summary", {}).items() for name in engine["settings"]["variants"]
            if name in row]


def weights_only_roofline(engine: dict[str, Any]) -> dict[str, Any]:
    """Per backend's process: weight bytes a step reads, the copy bandwidth, and the batch-1 tokens/s they allow."""
    roofline = {}
    for backend, ready in engine["ready"].items():
        if "error" not in ready:
            bandwidth = ready["copy"]["bytes_per_s"]
            roofline[backend] = {"weight_bytes": ready["weight_bytes_per_step"], "copy_bytes_per_s": bandwidth,
                                 "tokens_per_s": bandwidth / ready["weight_bytes_per_step"]}
    return roofline


def summary(figures: dict[str, Any], engine: dict[str, Any]) -> str:
    lines = [f"- {backend} process: {bandwidth_text(ready)}" for backend, ready in engine["ready"].items()
             if "error" not in ready]
    for backend, roof in figures["weights_only_roofline"].items():
        lines.append(f"- {backend} process: {roof['weight_bytes'] / 1e9:.2f} GB of weights per step at "
                     f"{roof['copy_bytes_per_s'] / 1e9:.0f} GB/s: weights-only roofline {roof['tokens_per_s']:.0f} "
                     f"tok/s at batch 1")
    for backend, ready in engine["ready"].items():
        if "error" in ready:
            lines.append(f"- {backend} engine failed to start: {ready['error'][:300]}")
    first, *others = engine["settings"]["variants"]
    for batch, row in engine.get("summary", {}).items():
        if "pallas_vs_xla" in row:
            lines.append(f"- batch {batch}: pallas / xla tokens/s {row['pallas_vs_xla']:.2f}x")
        lines += [f"- batch {batch}: {other} / {first} tokens/s {row[f'{other}_vs_{first}']:.2f}x"
                  for other in others if f"{other}_vs_{first}" in row and other != "xla"]
    rows = [[r["batch"], r["backend"], f"{r['step_s'] * 1e3:.2f}", f"{r['tokens_per_s']:.1f}",
             *roofline_cells(r), " / ".join(f"{r['host_phase_ms'][phase]:.2f}" for phase in HOST_PHASES)]
            for r in figures["rows"]]
    return "\n".join(lines) + "\n\n" + markdown_table(
        ["batch", "engine", "ms/step", "tok/s", *ROOFLINE_HEADER, "host ms/step: " + " / ".join(HOST_PHASES)],
        rows) + (
        "\n\nHost phases (jaxserve.engine.step_phases): the host's own work (schedule, dispatch, outputs) and the "
        "wait for a step's samples, which is the device time that work did not hide; with async overlap a step "
        "whose wait is near zero is host-bound.")


# The roofline columns of a speed table: weights + KV bytes of a step at the measured copy rate, then at the spec.
ROOFLINE_HEADER = ["roofline ms (weights + KV at measured copy)", "of measured roofline", "spec roofline ms",
                   "of spec roofline"]


def roofline_cells(row: dict[str, Any]) -> list[str]:
    """ROOFLINE_HEADER's cells of a speed row; the spec ones "-" where the device's spec is unknown (the CPU)."""
    measured = [f"{row['roofline_step_s'] * 1e3:.2f}", f"{row['fraction_of_roofline']:.0%}"]
    if "spec_roofline_step_s" not in row:
        return measured + ["-", "-"]
    return measured + [f"{row['spec_roofline_step_s'] * 1e3:.2f}", f"{row['fraction_of_spec_roofline']:.0%}"]


def bandwidth_text(ready: dict[str, Any]) -> str:
    """An engine process's stream rates (copy: x * s, which the measured roofline uses; memcpy: a device memcpy,
    both read + written; read: a read-only reduction) and the card's spec bandwidth, with each rate's share of it."""
    spec = ready.get("spec_bandwidth")
    rates = []
    for name in STREAM_KINDS:
        entry = ready.get(name, {})
        if "bytes_per_s" not in entry:
            rates.append(f"{name} failed ({entry.get('error', 'not measured')[:200]})")
            continue
        share = f" ({entry['bytes_per_s'] / spec['bytes_per_s']:.0%} of spec)" if spec else ""
        rates.append(f"{name} {entry['bytes_per_s'] / 1e9:.0f} GB/s{share}")
    spec_text = (f"spec {spec['bytes_per_s'] / 1e9:.0f} GB/s ({spec['source']})" if spec
                 else "spec bandwidth unknown for this device")
    return f"{', '.join(rates)}; {spec_text}"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Tokens/s per batch, one bar per engine variant, each labelled with its share of the roofline."""
    import matplotlib  # here: only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({row["batch"] for row in rows})
    figure, axes = plt.subplots(figsize=(7, 4.5))
    variants = list(dict.fromkeys(row["backend"] for row in rows))
    width = 0.8 / len(variants)
    for offset, backend in enumerate(variants):
        mine = {row["batch"]: row for row in rows if row["backend"] == backend}
        positions = [i + offset * width for i, batch in enumerate(batches) if batch in mine]
        bars = axes.bar(positions, [mine[b]["tokens_per_s"] for b in batches if b in mine], width, label=backend)
        axes.bar_label(bars, [f"{mine[b]['fraction_of_roofline']:.0%}" for b in batches if b in mine], fontsize=8)
    axes.set_xticks([i + 0.4 - width / 2 for i in range(len(batches))], [f"batch {b}" for b in batches])
    axes.set_yscale("log")
    axes.set_ylabel("decode tokens/s (label: share of the HBM roofline)")
    axes.set_title(f"engine decode, random weights: {' vs '.join(variants)}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
