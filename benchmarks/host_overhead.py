"""The host's share of an engine step at 8, 64 and 256 running decode sequences, and the step time with overlap on/off.

Part 1, host work per step (no device work at all). For each batch size N a `Scheduler` and a `ModelRunner` are built
with the engine's sizes (max_num_seqs N, max_model_len 2048, page size 16, greedy requests with ignore_eos); the
runner's `warm_up()` is never called, so nothing compiles. N requests with random 512-token prompts are added, and
the scheduler is driven with fake sampled tokens (`update_from_output`) until every request is in steady decode.
Then `--cycles` cycles are timed phase by phase, each phase being what the engine does per step:

    schedule   Scheduler.schedule(): one decode token (and its SamplingRow) per running request
    prepare    StepInputBuilder.prepare(schedule): bucket choice and padded numpy inputs (block tables, slots, ...)
    transfer   ModelRunner.transfer: those inputs packed into one buffer and put on the device, as the runner does
               before launching the step (the call's cost to the host; on a GPU the copy itself is asynchronous)
    update     Scheduler.update_from_output() with a fake sampled token per sequence
    outputs    Sequence.append per sampled token: stop checks and incremental detokenization

The product target (<= 1 ms at 256 sequences) is on schedule + prepare, the numpy work between deciding a step and
dispatching it; transfer, update and outputs are reported beside it because the host does them once per step as
well.
Cycles here run schedule after update, so decode tokens are known ids; in the overlapped engine they are
PENDING_TOKEN placeholders, which costs `prepare` one dictionary lookup per sequence more.

Part 2, wall time per decode step of the real (built-in tiny) model, async scheduling on against off: two engines of
identical shapes (max_num_seqs 8, max_num_batched_tokens 64, max_model_len 512), so the programs compile once and
the second engine loads them from the persistent cache. Each decodes 8 requests in steady state (prompts of 32
tokens, `--decode-warm-steps` untimed steps after admission, then `--decode-steps` timed steps), the two alternated
over `--decode-rounds` rounds. Without overlap a step's wall time is the host work plus the device step; with
overlap the host schedules step N+1 while the device runs step N, so the difference is the device idle gap that
overlap removes.

On the CPU backend the "device" is XLA's worker threads on the very cores the host's Python runs on, so overlap
can only help while a core is free for it: read the figure as what overlap buys on this machine, not as a GPU's
idle gap. On a 2-core VM overlap gave a clear gain while the machine was otherwise idle and none while another
process kept one core busy (the step's dispatch then returned only once the step had run). `--skip-decode` leaves
part 2 out.

    python benchmarks/host_overhead.py --out results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import zlib
from pathlib import Path

import numpy as np

from jaxserve.checkpoint import LoadedModel, load_model
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.logprobs import SampledToken
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.schedule import SchedulerOutput
from jaxserve.tokenizer import Tokenizer, load_tokenizer
from bench_machine import machine_description

PHASES = ("schedule", "prepare", "transfer", "update", "outputs")
DISPATCH_PHASES = ("schedule", "prepare")  # the product target's span
TARGET_MS_AT_256 = 1.0
OVERLAP_MODES = {"overlap on": True, "overlap off": False}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[8, 64, 256], help="running decode sequences")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="token budget; only sets how fast the prompts are admitted (no device work runs)")
    parser.add_argument("--warm-cycles", type=int, default=50, help="untimed decode cycles before timing")
    parser.add_argument("--cycles", type=int, default=300, help="timed decode cycles per batch size")
    parser.add_argument("--decode-steps", type=int, default=100, help="timed engine steps per overlap run")
    parser.add_argument("--decode-warm-steps", type=int, default=20, help="untimed engine steps before timing")
    parser.add_argument("--decode-rounds", type=int, default=3, help="overlap on/off runs each, alternated")
    parser.add_argument("--skip-decode", action="store_true", help="leave out part 2 (the real model's steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if longest_sequence(args, max(args.num_seqs)) >= args.max_model_len:
        parser.error("requests would reach --max-model-len before the last cycle; use fewer cycles or shorter prompts")
    return args


# Part 1: host work per step, no device.

@dataclasses.dataclass
class HostBench:
    """A scheduler and runner sized for one batch of decode sequences, with each request's output assembly."""

    scheduler: Scheduler
    runner: ModelRunner
    sequences: dict[str, Sequence]
    eos_token_ids: tuple[int, ...]
    rng: np.random.Generator
    vocab_size: int


def longest_sequence(args: argparse.Namespace, num_seqs: int) -> int:
    """Tokens of the first-admitted request by the last timed cycle: it decodes while later prompts are prefilled."""
    prefill_steps = -(-num_seqs * args.prompt_len // args.max_num_batched_tokens) + 1
    return args.prompt_len + prefill_steps + args.warm_cycles + args.cycles + 1


def pages_needed(args: argparse.Namespace, num_seqs: int) -> int:
    """A pool no request outgrows during the benchmark, so nothing is preempted; plus the null page."""
    return num_seqs * -(-longest_sequence(args, num_seqs) // args.block_size) + 1


def build_host_bench(model: LoadedModel, tokenizer: Tokenizer, args: argparse.Namespace, num_seqs: int) -> HostBench:
    config = EngineConfig(max_num_seqs=num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, block_size=args.block_size,
                          num_kv_pages=pages_needed(args, num_seqs))
    scheduler = Scheduler(config)
    runner = ModelRunner(model.config, model.graphdef, model.params, model.dtype, config)
    rng = np.random.default_rng([args.seed, num_seqs])
    max_new = args.max_model_len - args.prompt_len
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    sequences = {}
    for i in range(num_seqs):
        prompt = tuple(int(t) for t in rng.integers(0, model.config.vocab_size, size=args.prompt_len))
        scheduler.add_request(Request(f"seq-{i}", prompt, params, arrival_index=i, max_new_tokens=max_new,
                                      eos_token_ids=tuple(tokenizer.eos_token_ids)))
        sequences[f"seq-{i}"] = Sequence(tokenizer, prompt, params, max_new)
    return HostBench(scheduler, runner, sequences, tuple(tokenizer.eos_token_ids), rng, model.config.vocab_size)


def fake_samples(bench: HostBench, schedule: SchedulerOutput) -> dict[str, int]:
    """A random token for every sequence that samples in this step, standing in for the device's output."""
    sampling = [s.request_id for s in schedule.sequences if s.samples]
    return dict(zip(sampling, (int(t) for t in bench.rng.integers(0, bench.vocab_size, size=len(sampling)))))


def append_outputs(bench: HostBench, sampled: dict[str, int]) -> None:
    for request_id, token in sampled.items():
        bench.sequences[request_id].append(SampledToken(token_id=token, logprob=-1.0, rank=1, top=()))


def reach_steady_decode(bench: HostBench) -> None:
    """Prefills every prompt (host bookkeeping only) until each step schedules one token per request."""
    num_seqs = len(bench.sequences)
    while True:
        schedule = bench.scheduler.schedule()
        sampled = fake_samples(bench, schedule)
        bench.scheduler.update_from_output(schedule, sampled)
        append_outputs(bench, sampled)
        if len(schedule.sequences) == num_seqs and schedule.num_batched_tokens == num_seqs:
            return


def timed_cycle(bench: HostBench, times: dict[str, list[float]]) -> None:
    """One step's host work, each phase timed separately."""
    clock = time.perf_counter
    t0 = clock()
    schedule = bench.scheduler.schedule()
    t1 = clock()
    bucket, host_arrays = bench.runner.inputs.prepare(schedule)
    t2 = clock()
    bench.runner.transfer(bucket, host_arrays)
    t3 = clock()
    sampled = fake_samples(bench, schedule)
    t4 = clock()
    bench.scheduler.update_from_output(schedule, sampled)
    t5 = clock()
    append_outputs(bench, sampled)
    t6 = clock()
    # The fake sampling (t3..t4) stands in for the device and is not host overhead.
    for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t5 - t4, t6 - t5)):
        times[phase].append(seconds)


def measure_host(model: LoadedModel, tokenizer: Tokenizer, args: argparse.Namespace,
                 num_seqs: int) -> dict[str, list[float]]:
    bench = build_host_bench(model, tokenizer, args, num_seqs)
    reach_steady_decode(bench)
    scratch: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for _ in range(args.warm_cycles):
        timed_cycle(bench, scratch)
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for _ in range(args.cycles):
        timed_cycle(bench, times)
    if bench.scheduler.stats().num_preemptions:
        raise RuntimeError("requests were preempted: the pool is too small for a steady decode measurement")
    return times


def percentile_ms(samples: list[float], q: float) -> float:
    return float(np.percentile(samples, q)) * 1e3


def summarize_host(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Median and p90 in ms per phase, and of the per-cycle sums (dispatch span, whole cycle)."""
    spans = {phase: times[phase] for phase in PHASES}
    spans["schedule+prepare"] = [sum(parts) for parts in zip(*(times[p] for p in DISPATCH_PHASES))]
    spans["whole cycle"] = [sum(parts) for parts in zip(*(times[p] for p in PHASES))]
    return {name: {"median_ms": percentile_ms(s, 50), "p90_ms": percentile_ms(s, 90)} for name, s in spans.items()}


# Part 2: real engine steps, overlap on against off.

def decode_engine_config(async_scheduling: bool) -> EngineConfig:
    """Small shapes (few programs to compile) holding 8 decoding sequences."""
    return EngineConfig(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=64, block_size=16,
                        num_kv_pages=256, async_scheduling=async_scheduling)


def timed_decode_run(engine: LLMEngine, args: argparse.Namespace, tag: str, vocab_size: int) -> list[float]:
    """Seconds per engine step over `decode_steps` steady decode steps; the requests are aborted afterwards."""
    rng = np.random.default_rng([args.seed, zlib.crc32(tag.encode())])  # fresh prompts per run: no prefix hits
    ids = [f"{tag}-{i}" for i in range(engine.config.max_num_seqs)]
    max_tokens = args.decode_warm_steps + args.decode_steps + 16
    for request_id in ids:
        prompt = [int(t) for t in rng.integers(0, vocab_size, size=32)]
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    for _ in range(args.decode_warm_steps):
        engine.step()
    step_s = []
    for _ in range(args.decode_steps):
        start = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - start)
    for request_id in ids:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return step_s


def measure_overlap(model: LoadedModel, tokenizer: Tokenizer, args: argparse.Namespace) -> dict[str, list[float]]:
    """Median ms per step for each mode and round, alternating the modes; one untimed run per engine first."""
    engines = {mode: LLMEngine(model, tokenizer, decode_engine_config(on), progress=False)
               for mode, on in OVERLAP_MODES.items()}
    for mode, engine in engines.items():
        timed_decode_run(engine, args, f"warm-{mode}", model.config.vocab_size)
    medians: dict[str, list[float]] = {mode: [] for mode in OVERLAP_MODES}
    for round_index in range(args.decode_rounds):
        for mode, engine in alternated(engines, round_index):
            step_s = timed_decode_run(engine, args, f"round{round_index}-{mode}", model.config.vocab_size)
            medians[mode].append(statistics.median(step_s) * 1e3)
    return medians


def alternated(engines: dict[str, LLMEngine], round_index: int) -> list[tuple[str, LLMEngine]]:
    """The modes in an order that flips every round, so neither always runs first."""
    items = list(engines.items())
    return items if round_index % 2 == 0 else items[::-1]


# Report.

def format_host_table(summary: dict[int, dict[str, dict[str, float]]]) -> str:
    names = list(next(iter(summary.values())))
    lines = [f"{'host work, ms (median / p90)':<28}" + "".join(f"{f'{n} seqs':>16}" for n in summary)]
    for name in names:
        cells = "".join(f"{summary[n][name]['median_ms']:>8.3f} /{summary[n][name]['p90_ms']:>6.3f}" for n in summary)
        lines.append(f"{name:<28}{cells}")
    return "\n".join(lines)


def format_overlap_table(medians: dict[str, list[float]]) -> str:
    on, off = medians["overlap on"], medians["overlap off"]
    ratios = [b / a for a, b in zip(on, off)]
    lines = [f"{'decode step, 8 seqs':<28}{'median ms':>10}  per round (ms)"]
    for mode, values in medians.items():
        lines.append(f"{mode:<28}{statistics.median(values):>10.3f}  {' '.join(f'{v:.3f}' for v in values)}")
    lines.append(f"{'off / on':<28}{statistics.median(ratios):>9.2f}x  {' '.join(f'{r:.2f}x' for r in ratios)}")
    return "\n".join(lines)


def measure_all_sizes(model: LoadedModel, tokenizer: Tokenizer,
                      args: argparse.Namespace) -> dict[int, dict[str, list[float]]]:
    times = {}
    for num_seqs in args.num_seqs:
        times[num_seqs] = measure_host(model, tokenizer, args, num_seqs)
        dispatch = summarize_host(times[num_seqs])["schedule+prepare"]
        print(f"{num_seqs} seqs: schedule+prepare median {dispatch['median_ms']:.3f} ms", flush=True)
    return times


def main() -> None:
    args = parse_args()
    model = load_model(None, "float32", progress=False)
    tokenizer = load_tokenizer(model.model_dir)
    host_times = measure_all_sizes(model, tokenizer, args)
    host_summary = {n: summarize_host(t) for n, t in host_times.items()}
    overlap = None if args.skip_decode else measure_overlap(model, tokenizer, args)
    report = {
        "machine": machine_description(),
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "host_ms": {str(n): s for n, s in host_summary.items()},
        "target_ms_at_256": TARGET_MS_AT_256,
        "decode_step_median_ms_per_round": overlap,
    }
    if overlap is not None:
        report["decode_step_ratio_off_vs_on"] = statistics.median(
            off / on for on, off in zip(overlap["overlap on"], overlap["overlap off"]))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    print(f"prompts of {args.prompt_len} tokens computed, max_model_len {args.max_model_len}, {args.cycles} cycles; "
          f"{report['machine']['device']} ({report['machine']['jax_backend']}), target <= {TARGET_MS_AT_256} ms at 256 "
          "for schedule+prepare")
    if overlap is not None:
        print(format_overlap_table(overlap))
    print(format_host_table(host_summary))


if __name__ == "__main__":
    main()
