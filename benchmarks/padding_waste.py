"""The padding the bucket grid costs over a realistic mixed workload, against the full token x row grid it replaced.

The real scheduler runs a closed-loop stream of requests (log-normal prompt and output lengths, a new request
arriving as one finishes, so the batch stays full) without a model: every sampling sequence gets a random token
back. For each step the real token and row counts are recorded with the bucket each grid picks:
    buckets  decode buckets by sequence count, mixed buckets by token count (jaxserve/runner/buckets.py)
    product  every power-of-two token count x every power-of-two row count (the grid before, as 4 sampler variants)
and the report gives padded / real tokens and rows, over all steps and per family (decode-only or mixed), with each
grid's program count.

    python benchmarks/padding_waste.py --out padding.json --plot padding.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.request import Request
from jaxserve.engine.scheduler import Scheduler
from jaxserve.runner.buckets import MIN_TOKEN_BUCKET, BucketSet
from jaxserve.sampling_params import SamplingParams

PRODUCT_SAMPLER_VARIANTS = 4  # penalties x truncation, each compiled separately by the old grid
FAMILIES = ("decode", "mixed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-pages", type=int, default=27000,
                        help="pool pages (default: about what an H100 holds beside a bf16 8B model)")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--prompt-median", type=float, default=700.0, help="median prompt tokens (log-normal)")
    parser.add_argument("--output-median", type=float, default=200.0, help="median output tokens (log-normal)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="draw padded / real per grid and family (PNG)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    steps = simulate(args)
    buckets = BucketSet.for_limits(args.max_num_batched_tokens, args.max_num_seqs)
    report = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "steps": len(steps),
        "programs": {"buckets": len(buckets.all_buckets()),
                     "product": product_program_count(args.max_num_batched_tokens, args.max_num_seqs)},
        "buckets": padding(steps, lambda t, s: _shape(buckets.select(t, s))),
        "product": padding(steps, lambda t, s: product_bucket(t, s, args.max_num_batched_tokens,
                                                               args.max_num_seqs)),
    }
    for grid in ("buckets", "product"):
        print(f"{grid:8s} {report['programs'][grid]:4d} programs: padded/real tokens "
              f"{report[grid]['all']['token_ratio']:.3f}, rows {report[grid]['all']['row_ratio']:.3f} "
              f"(decode steps {report[grid]['decode']['token_ratio']:.3f}, "
              f"mixed steps {report[grid]['mixed']['token_ratio']:.3f})")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    if args.plot is not None:
        plot(report, args.plot)
    return report


def simulate(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(real tokens, real rows) of every step the scheduler forms over the workload."""
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, block_size=args.block_size,
                          num_kv_pages=args.num_kv_pages)
    scheduler = Scheduler(config)
    rng = np.random.default_rng(args.seed)
    lengths = iter(workload(args, rng))
    generated: dict[str, int] = {}
    targets: dict[str, int] = {}

    def admit(index: int) -> None:
        prompt_len, output_len = next(lengths)
        request_id = f"r{index}"
        prompt = rng.integers(0, 1000, size=prompt_len).tolist()
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        scheduler.add_request(Request(request_id, prompt, params, arrival_index=index))
        generated[request_id], targets[request_id] = 0, output_len

    admitted = min(args.requests, 2 * args.max_num_seqs)
    for index in range(admitted):
        admit(index)
    steps = []
    while scheduler.has_unfinished_requests():
        schedule = scheduler.schedule()
        steps.append((schedule.num_batched_tokens, len(schedule.sequences)))
        sampled = {s.request_id: int(rng.integers(0, 1000)) for s in schedule.sequences if s.samples}
        scheduler.update_from_output(schedule, sampled)
        for request_id in sampled:
            generated[request_id] += 1
            if generated[request_id] >= targets[request_id]:
                scheduler.finish_request(request_id, "length")
                if admitted < args.requests:
                    admit(admitted)
                    admitted += 1
    return steps


def workload(args: argparse.Namespace, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) per request, log-normal around the medians, within max_model_len."""
    prompts = np.clip(rng.lognormal(math.log(args.prompt_median), 0.8, args.requests), 16, args.max_model_len // 2)
    outputs = np.clip(rng.lognormal(math.log(args.output_median), 0.8, args.requests), 8, args.max_model_len // 2)
    return [(int(p), int(o)) for p, o in zip(prompts, outputs)]


def product_bucket(tokens: int, seqs: int, max_tokens: int, max_seqs: int) -> tuple[int, int]:
    """The full grid's choice: the next power of two of each (tokens from MIN_TOKEN_BUCKET), tokens >= rows."""
    rows = _next_power_of_two(seqs)
    return max(_next_power_of_two(max(tokens, MIN_TOKEN_BUCKET)), rows), rows


def product_program_count(max_tokens: int, max_seqs: int) -> int:
    """Programs the full grid compiles: every (tokens, rows) with rows <= tokens, times the sampler variants, plus
    one prompt-scoring variant per distinct token count."""
    token_sizes = _powers_up_to(MIN_TOKEN_BUCKET, max_tokens)
    row_sizes = _powers_up_to(1, max_seqs)
    sampling = sum(1 for t in token_sizes for s in row_sizes if s <= t) * PRODUCT_SAMPLER_VARIANTS
    return sampling + len({max(t, row_sizes[-1]) for t in token_sizes})


def padding(steps: list[tuple[int, int]], choose) -> dict[str, dict[str, float]]:
    """padded / real tokens and rows, over all steps and per family (decode-only steps have tokens == rows)."""
    totals = {name: np.zeros(4) for name in ("all", *FAMILIES)}  # real tokens, padded tokens, real rows, padded
    for tokens, seqs in steps:
        padded_tokens, padded_rows = choose(tokens, seqs)
        for name in ("all", "decode" if tokens == seqs else "mixed"):
            totals[name] += (tokens, padded_tokens, seqs, padded_rows)
    return {name: {"steps_tokens": float(t[0]), "token_ratio": float(t[1] / max(t[0], 1)),
                   "row_ratio": float(t[3] / max(t[2], 1))} for name, t in totals.items()}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib  # here, not at the top: only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, ratio in zip(axes, ("token_ratio", "row_ratio")):
        positions = np.arange(3)
        for offset, grid in ((-0.2, "buckets"), (0.2, "product")):
            ax.bar(positions + offset, [report[grid][f][ratio] for f in ("all", *FAMILIES)], width=0.4,
                   label=f"{grid} ({report['programs'][grid]} programs)")
        ax.set_xticks(positions, ["all", *FAMILIES])
        ax.set_title(f"padded / real {ratio.split('_')[0]}s")
        ax.axhline(1.0, color="k", linewidth=0.5)
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _shape(bucket) -> tuple[int, int]:
    return bucket.num_tokens, bucket.num_seqs


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _powers_up_to(smallest: int, limit: int) -> list[int]:
    sizes = [smallest]
    while sizes[-1] < limit:
        sizes.append(sizes[-1] * 2)
    return sizes


if __name__ == "__main__":
    main()
