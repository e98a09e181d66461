"""The GPU check: everything jaxserve claims on an NVIDIA GPU, checked and measured on one H100/H200 in one run.

Parts (benchmarks/gpu_parts/, one registry entry each; `--list` prints them with their budgets):

    group 1  env            device, driver and CUDA (nvidia-smi), jax/jaxlib and package versions; imports every
                            module the other parts need, so a missing wheel shows up first
             decode_profile benchmarks/engine_bench.py with the 8B-shaped pallas engine alone: decode at batch 1, 64
                            and 256 against the roofline at the card's spec bandwidth and at the copy rate measured
                            in the engine's process (cross-checked by a memcpy and a read-only reduction); then 20
                            steps at batch 1 and 64 traced with jax.profiler: kernels per step, GPU busy fraction,
                            top kernels by time per named scope (layers/decoder_layer, logits, sample)
             program_audit  `jaxserve compile --audit` of the 8B H100 preset's decode, mixed and sampler programs,
                            deviceless and --on-device (autotuned on this GPU): what differs, program by program
             ceilings       HBM copy bandwidth (and its memcpy and read-only cross-checks, against the spec), bf16
                            matmul rate, fp8 matmul rate as XLA compiles it and with its Triton GEMM fusion off (and
                            whether each is a cuBLASLt FP8 GEMM), dispatch floor
    group 2  engine_parity  Llama-3.1-8B-shaped random bf16 model, pallas vs xla attention: log-probabilities of the
                            same tokens (32 prompts + 64 greedy tokens) against a float32 engine of the same weights,
                            prefill and decode paths (pallas within 1.5x XLA's distance); greedy ids compared too
             engine_speed   benchmarks/engine_bench.py: batch-1 decode against the HBM roofline (measured copy rate
                            and spec), throughput at 64 and 256 sequences, pallas vs xla, host time per step phase
                            (schedule, dispatch, wait, outputs)
    group 3  quantized_engine  benchmarks/engine_bench.py with six engines alive at once: bf16, int8 and fp8
                            weights through XLA's GEMMs and through the Pallas W8A16 kernel (--gemm-backend
                            pallas), 4-bit weights (group 128) through the Pallas W4A16 kernel; batch 1 and 64
                            decode, each against bf16
             serve          `jaxserve serve --config configs/llama-3.1-8b-h100.yaml` on a random 8B checkpoint (its
                            tokenizer widened to the model's vocabulary), benchmarks/serve.py for 30 s at concurrency
                            16 and 30 s at 64: TTFT / TPOT p50 and p95
    group 4  lora           benchmarks/lora.py on the 8B-shaped model (one copy of the weights, two engines): 64
                            requests on the base model vs spread over 4 adapters of rank 16 on every projection, and
                            vs an engine without LoRA: generated tokens/s and the ratios within each round
             lora_kernels   benchmarks/lora_kernels.py: the LoRA delta's one-hot (the engine's), gather and Pallas
                            forms per 8B projection and token count, against the projection itself
             host_overhead  benchmarks/host_overhead.py on this host's CPU (no device work): schedule + prepare and
                            update + outputs at 64 and 256 decoding sequences, against the <= 1 ms targets
    group 5  structured_output  benchmarks/structured_output.py: host ms to fill 64 grammar masks over a 128k
                            vocabulary; the 8B-shaped engine's tokens/s with JSON Schema constraints vs without
                            (target 0.9x) and vs constrained without async overlap
             speculative    benchmarks/speculative.py on the 8B-shaped model, engines without and with speculation:
                            n-gram drafts and replayed drafts at acceptance 0/0.5/0.8/1, batch 1 and 16: target steps
                            per token, verifying-step cost, wall speed-up
             graphed_loop   benchmarks/engine_bench.py at batch 1: pallas vs pallas with the scanned layers' loop
                            in one CUDA graph (XLA's command buffers), what the per-layer launches cost
    group 6  kernel_check   every Pallas kernel compiled by Triton and checked against the float32 XLA reference on
                            random ragged batches: decode, prefill, mixed x GQA 1/4/8 x head_dim 64/128, 16-token pages
             kernel_timing  benchmarks/kernels.py at decode 64 seqs x 2k context (Llama-3.1-8B's 32/8 heads, and GQA 8)
                            and prefill: fractions of copy bandwidth / matmul rate, vs JAX's shipped op and XLA
    group 7  startup        benchmarks/startup.py --store at the 8B preset's shapes: cold (fresh compilation cache)
                            and warm, each without a program store, then a start that fills a store and one that
                            loads every program from it (its ready time over the warm start's)

Each part runs in a process of its own under a wall-clock budget: a Triton crash, an out-of-memory or a hang costs
that part alone (reported with its status and the tail of its output) and the rest still runs. The report is
rewritten after every part, so a run killed midway keeps what finished. Each group's budgets add up to 8.2 minutes
at most, so each group fits one 10-minute command; a second run into the same --out adds its parts to the report.

Results, flat in --out: gpu_check.json (every figure, the sub-benchmarks' whole reports, run metadata: commit or
source hash, date, command), gpu_check.md (the same as tables), gpu_check.log (every part's output), the plots
kernels.png, engine.png, startup.png, serve.png, quantized_engine.png, speculative.png, lora.png,
lora_kernels.png, and decode_profile.trace.json.gz (the profiled steps' device events, for ui.perfetto.dev): one
group's run writes the three reports and its own parts' files, at most 8. Scratch (logs, sub-reports, the random
checkpoint, the whole traces, reused by later runs) goes to --work-dir.

On a machine with the package index, once (the GPU host needs no index: it installs from .whl/):

    scripts/gpu_wheels.sh                          # .whl/: the wheels a GPU host with JAX lacks (about 32 MB)

On the GPU host, from the source tree with .whl/ in it (its own python3 with CUDA JAX; no .venv):

    make gpu-check OUT=gpu-results ARGS="--group 1"     # first where GPU time is short
    make gpu-check OUT=gpu-results ARGS="--group 2"     # adds to gpu-results/
    make gpu-check OUT=gpu-results ARGS="--group 3"
    make gpu-check OUT=gpu-results ARGS="--group 4"
    make gpu-check OUT=gpu-results ARGS="--group 5"
    make gpu-check OUT=gpu-results ARGS="--group 6"
    make gpu-check OUT=gpu-results ARGS="--group 7"
    make gpu-check OUT=gpu-results ARGS="--parts kernel_check,engine_parity"

Anywhere, on the CPU, with tiny shapes and the kernels interpreted (what tests/test_gpu_check.py runs):

    python benchmarks/gpu_check.py --smoke --out /tmp/gpu-check-smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from gpu_parts import GROUPS, PARTS, PARTS_BY_NAME, Part
from gpu_parts.isolation import FAULTS, PartJob, run_in_own_process, run_job
from gpu_parts.report import (STATUS_OK, append_log, load_report, log_tail, save_report, source_revision)

DEFAULT_WORK_DIR = {False: Path("/tmp/jaxserve-gpu-check"), True: Path("/tmp/jaxserve-gpu-check-smoke")}


@dataclasses.dataclass(frozen=True)
class Options:
    """How this run runs its parts."""

    out_dir: Path  # the report's folder
    work_dir: Path  # scratch kept between runs
    smoke: bool  # CPU, tiny shapes
    budgets: dict[str, float]  # seconds per part name, overriding the registry's
    faults: dict[str, str]  # part name -> fault (tests only)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="the report's folder (created; an earlier report there is merged)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help=f"scratch kept between runs (default {DEFAULT_WORK_DIR[False]}, with --smoke "
                             f"{DEFAULT_WORK_DIR[True]})")
    parser.add_argument("--smoke", action="store_true", help="on the CPU: tiny shapes, kernels interpreted")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--group", type=int, choices=GROUPS, help="run one group (each fits a 10-minute command)")
    which.add_argument("--parts", type=lambda text: text.split(","), help="comma-separated part names")
    parser.add_argument("--list", action="store_true", help="print the parts, their groups and budgets, and exit")
    parser.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS",
                        help="override a part's time budget (repeatable)")
    parser.add_argument("--inject-fault", action="append", default=[], help=argparse.SUPPRESS)  # PART=raise|hang
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a PartJob as JSON: run that part here
    args = parser.parse_args(argv)
    if not args.list and not args.child and args.out is None:
        parser.error("--out is required")
    unknown = [name for name in (args.parts or []) if name not in PARTS_BY_NAME]
    if unknown:
        parser.error(f"unknown parts {unknown}; --list names them")
    return args


def name_values(pairs: list[str], convert) -> dict[str, Any]:
    """PART=VALUE flags as a dict, each part checked against the registry."""
    values = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in PARTS_BY_NAME:
            raise SystemExit(f"unknown part {name!r} in {pair!r}")
        values[name] = convert(value)
    return values


def fault_name(text: str) -> str:
    if text not in FAULTS:
        raise SystemExit(f"fault must be one of {FAULTS}, got {text!r}")
    return text


def selected_parts(args: argparse.Namespace) -> list[Part]:
    if args.parts:
        return [part for part in PARTS if part.name in args.parts]
    return [part for part in PARTS if args.group is None or part.group == args.group]


def listing() -> str:
    lines = [f"{'part':<14} {'group':>5} {'budget s':>8} {'smoke s':>7}  what"]
    lines += [f"{p.name:<14} {p.group:>5} {p.budget_s:>8.0f} {p.smoke_budget_s:>7.0f}  {p.about}" for p in PARTS]
    totals = ", ".join(f"group {g}: {sum(p.budget_s for p in PARTS if p.group == g):.0f} s" for g in GROUPS)
    return "\n".join(lines + [f"budgets on a GPU: {totals}"])


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_part(part: Part, options: Options, report: dict[str, Any]) -> dict[str, Any]:
    """Runs one part in its own process and records it in the report (saved before it starts and after it ends)."""
    budget = options.budgets.get(part.name, part.smoke_budget_s if options.smoke else part.budget_s)
    entry: dict[str, Any] = {"group": part.group, "about": part.about, "budget_s": budget, "status": "running",
                             "started_at": now(), "mode": "smoke" if options.smoke else "gpu"}
    report["parts"][part.name] = entry
    save_report(options.out_dir, report)
    log_path, result_path = (options.work_dir / f"{part.name}.{suffix}" for suffix in ("log", "result.json"))
    log_path.unlink(missing_ok=True)
    result_path.unlink(missing_ok=True)
    job = PartJob(part.name, part.smoke_args if options.smoke else part.gpu_args, str(options.out_dir),
                  str(options.work_dir), options.smoke, str(result_path), options.faults.get(part.name))
    print(f"[gpu_check] {part.name}: started (budget {budget:.0f} s)", flush=True)
    finished = run_in_own_process(job, budget, log_path)
    entry["seconds"] = finished.seconds
    if finished.status == "timeout":
        entry.update(status="timeout", error=f"ran past its budget of {budget:.0f} s", log_tail=log_tail(log_path))
    elif finished.returncode != 0 or not result_path.exists():
        entry.update(status="error", error=f"exit code {finished.returncode}", log_tail=log_tail(log_path))
    else:
        outcome = json.loads(result_path.read_text())
        entry.update(status=STATUS_OK if outcome["passed"] else "check_failed", outcome=outcome)
    append_log(options.out_dir, f"{part.name} ({entry['mode']}, started {entry['started_at']}): {entry['status']}",
               log_path)
    save_report(options.out_dir, report)
    print(f"[gpu_check] {part.name}: {entry['status']} in {finished.seconds:.0f} s", flush=True)
    return entry


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        run_job(PartJob(**json.loads(args.child)))
        return 0
    if args.list:
        print(listing())
        return 0
    options = Options(out_dir=args.out, work_dir=args.work_dir or DEFAULT_WORK_DIR[args.smoke], smoke=args.smoke,
                      budgets=name_values(args.budget, float), faults=name_values(args.inject_fault, fault_name))
    options.out_dir.mkdir(parents=True, exist_ok=True)
    options.work_dir.mkdir(parents=True, exist_ok=True)
    parts = selected_parts(args)
    report = load_report(options.out_dir)
    run = {"started_at": now(), "mode": "smoke" if options.smoke else "gpu", "parts": [p.name for p in parts],
           "argv": sys.argv[1:] if argv is None else argv, "revision": source_revision(), "finished_at": None}
    report["runs"].append(run)
    statuses = [run_part(part, options, report)["status"] for part in parts]
    run["finished_at"] = now()
    save_report(options.out_dir, report)
    print(f"[gpu_check] {statuses.count(STATUS_OK)}/{len(parts)} parts ok; report in {options.out_dir}", flush=True)
    return 0 if all(status == STATUS_OK for status in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
