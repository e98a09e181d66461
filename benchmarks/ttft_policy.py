"""Time to first token of a mixed burst under the chunked-prefill policy before and after its partial-prefill limits,
in one run on the built-in tiny model.

Workload (seeded, fresh each round): --num-long prompts of --long-len tokens and --num-short prompts of --short-len
tokens, shuffled, all added at once (a burst), greedy with ignore_eos, --output-len tokens each, streamed. A
request's TTFT is the time from the burst's start to the host holding its first token (what a server would stream),
and also counted in engine steps (which do not move with the machine's load).

Policies, each on its own engine of the same shapes (the second compiles nothing: its programs come from the
persistent compilation cache the first filled):

    before   vLLM's defaults (max_num_partial_prefills 1): the first prompt that does not fit a step's budget takes
             all of it, so a long prompt fills whole steps and the short ones behind it wait; this is how the
             scheduler packed prompts before the limits existed
    after    --max-num-partial-prefills P --max-long-partial-prefills L --long-prefill-token-threshold T: each
             prefill chunk at most budget / (prompts prefilling, up to P), at most L long prompts per step, so short
             prompts start beside long ones (engine/scheduler.py, "A step")

Each engine runs one untimed burst first; then --rounds rounds run both policies on the same burst, the starting one
alternating. Per round: TTFT p50 and p95 (all requests, short ones, long ones), the burst's makespan (from its start
to the last token) and after / before ratios; the report gives each figure's median over rounds. Greedy outputs of
both policies are compared (`outputs_identical`): scheduling must change no token.

    python benchmarks/ttft_policy.py --out ttft_policy.json      # PNG beside it when matplotlib imports
    python benchmarks/ttft_policy.py --smoke --out /tmp/ttft.json  # tiny, for tests
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a CPU benchmark: never wait for a CUDA start-up that cannot work
from bench_machine import machine_description  # noqa: E402
from jaxserve import LLM, SamplingParams  # noqa: E402

BEFORE, AFTER = "before", "after"
CLASSES = ("all", "short", "long")
FIRST_TOKEN_ID = 3  # prompts draw ids from here up: clear of the special ids at the start of the vocabulary
# --smoke: the shapes of the test suite's session engine (tests/conftest.py), so its programs come from the cache.
SMOKE = dict(num_long=2, long_len=40, num_short=6, short_len=6, output_len=3, rounds=1, max_model_len=64,
             max_num_seqs=4, max_num_batched_tokens=32, long_prefill_token_threshold=16)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-long", type=int, default=4)
    parser.add_argument("--long-len", type=int, default=1536, help="tokens of each long prompt")
    parser.add_argument("--num-short", type=int, default=28)
    parser.add_argument("--short-len", type=int, default=64, help="tokens of each short prompt")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="the step's token budget (the "
                        "CPU default)")
    parser.add_argument("--max-num-partial-prefills", type=int, default=4, help="the after policy's P")
    parser.add_argument("--max-long-partial-prefills", type=int, default=1, help="the after policy's L")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0,
                        help="the after policy's T (0: 4%% of max_model_len, as vLLM)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a tiny run, for tests")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    parser.add_argument("--plot", type=Path, default=None,
                        help="the PNG (default: --out with .png, when matplotlib imports)")
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    if args.long_len + args.output_len > args.max_model_len:
        parser.error("--long-len + --output-len must fit --max-model-len")
    return args


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The shapes both engines share."""
    return dict(model=None, dtype="float32", max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, use_tqdm_on_load=False)


def policies(args: argparse.Namespace) -> dict[str, dict[str, int]]:
    return {BEFORE: dict(max_num_partial_prefills=1),
            AFTER: dict(max_num_partial_prefills=args.max_num_partial_prefills,
                        max_long_partial_prefills=args.max_long_partial_prefills,
                        long_prefill_token_threshold=args.long_prefill_token_threshold)}


def make_burst(args: argparse.Namespace, index: int, vocab_size: int) -> list[tuple[str, list[int]]]:
    """(class, prompt ids) per request, in arrival order: long and short prompts shuffled, fresh per round index."""
    rng = np.random.default_rng((args.seed, index))
    kinds = ["long"] * args.num_long + ["short"] * args.num_short
    rng.shuffle(kinds)
    length = {"long": args.long_len, "short": args.short_len}
    return [(kind, rng.integers(FIRST_TOKEN_ID, vocab_size, size=length[kind]).tolist()) for kind in kinds]


def run_burst(llm: LLM, burst: list[tuple[str, list[int]]], output_len: int) -> dict[str, Any]:
    """Adds every request at once and steps the engine until all finish: each one's first-token time (s) and step,
    the makespan, and the tokens generated."""
    engine = llm.engine
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for index, (_, prompt) in enumerate(burst):
        engine.add_request(f"b{index}", prompt, params, stream=True)
    first_s: dict[str, float] = {}
    first_step: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        now = time.perf_counter() - start
        for delta in engine.pop_deltas():
            if delta.token_ids and delta.request_id not in first_s:
                first_s[delta.request_id], first_step[delta.request_id] = now, steps
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
    ids = [f"b{index}" for index in range(len(burst))]
    return {"ttft_s": [first_s[i] for i in ids], "ttft_steps": [first_step[i] for i in ids],
            "makespan_s": time.perf_counter() - start, "steps": steps, "tokens": [tokens[i] for i in ids]}


def percentiles(values: Sequence[float]) -> dict[str, float]:
    return {"p50": float(np.percentile(values, 50)), "p95": float(np.percentile(values, 95))}


def round_figures(run: dict[str, Any], kinds: list[str]) -> dict[str, Any]:
    """TTFT p50 / p95 in seconds and steps per class, the makespan and step count of one policy's burst."""
    figures: dict[str, Any] = {"makespan_s": run["makespan_s"], "steps": run["steps"]}
    for name in CLASSES:
        chosen = [i for i, kind in enumerate(kinds) if name in ("all", kind)]
        figures[name] = {"ttft_s": percentiles([run["ttft_s"][i] for i in chosen]),
                         "ttft_steps": percentiles([run["ttft_steps"][i] for i in chosen])}
    return figures


def ratios(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """after / before for each class's TTFT p50 and p95 (seconds) and for the makespan."""
    result = {f"{name}_ttft_{q}": after[name]["ttft_s"][q] / before[name]["ttft_s"][q]
              for name in CLASSES for q in ("p50", "p95")}
    result["makespan"] = after["makespan_s"] / before["makespan_s"]
    return result


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over rounds, per policy, and the median of the per-round ratios."""
    def median_of(path: Sequence[str]) -> float:
        values = []
        for record in rounds:
            node = record
            for key in path:
                node = node[key]
            values.append(node)
        return float(statistics.median(values))

    summary: dict[str, Any] = {}
    for policy in (BEFORE, AFTER):
        summary[policy] = {"makespan_s": median_of([policy, "makespan_s"]), "steps": median_of([policy, "steps"])}
        for name in CLASSES:
            summary[policy][name] = {unit: {q: median_of([policy, name, unit, q]) for q in ("p50", "p95")}
                                     for unit in ("ttft_s", "ttft_steps")}
    summary["ratio"] = {key: median_of(["ratio", key]) for key in rounds[0]["ratio"]}
    return summary


def plot(report: dict[str, Any], path: Path) -> bool:
    """TTFT distributions (all rounds pooled) and the p50 / p95 per class, before against after; False (nothing
    written) without matplotlib."""
    try:
        import matplotlib  # here: only the plot needs it, and it is optional
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (cdf, bars) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy in (BEFORE, AFTER):
        pooled = np.sort([t for record in report["rounds"] for t in record[f"{policy}_ttft_s"]])
        cdf.step(pooled, np.arange(1, len(pooled) + 1) / len(pooled), where="post", label=policy)
    cdf.set(xlabel="TTFT (s)", ylabel="share of requests", title="TTFT of the burst, rounds pooled")
    cdf.legend()
    labels = [f"{name} {q}" for name in CLASSES for q in ("p50", "p95")]
    positions = np.arange(len(labels))
    for offset, policy in ((-0.2, BEFORE), (0.2, AFTER)):
        values = [report["summary"][policy][name]["ttft_s"][q] for name in CLASSES for q in ("p50", "p95")]
        bars.bar(positions + offset, values, width=0.4, label=policy)
    bars.set_xticks(positions, labels, rotation=30)
    bars.set(ylabel="TTFT (s), median over rounds", title="TTFT by class")
    bars.legend()
    settings = report["settings"]
    figure.suptitle(f"{settings['num_long']} x {settings['long_len']} + {settings['num_short']} x "
                    f"{settings['short_len']} tokens at once, budget {settings['max_num_batched_tokens']}; after: "
                    f"P={settings['max_num_partial_prefills']} L={settings['max_long_partial_prefills']} "
                    f"T={report['long_prefill_tokens']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def print_table(report: dict[str, Any]) -> None:
    summary = report["summary"]
    print(f"{'TTFT, median over rounds':28s} {'before':>10s} {'after':>10s} {'after/before':>13s}")
    for name in CLASSES:
        for q in ("p50", "p95"):
            before, after = (summary[p][name]["ttft_s"][q] for p in (BEFORE, AFTER))
            steps = (summary[p][name]["ttft_steps"][q] for p in (BEFORE, AFTER))
            ratio = summary["ratio"][f"{name}_ttft_{q}"]
            print(f"{name + ' ' + q + ' (s)':28s} {before:10.3f} {after:10.3f} {ratio:13.2f}"
                  f"   steps {' -> '.join(f'{s:g}' for s in steps)}")
    print(f"{'makespan (s)':28s} {summary[BEFORE]['makespan_s']:10.3f} {summary[AFTER]['makespan_s']:10.3f} "
          f"{summary['ratio']['makespan']:13.2f}   steps {summary[BEFORE]['steps']:g} -> {summary[AFTER]['steps']:g}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    engines = {policy: LLM(**engine_settings(args), **settings) for policy, settings in policies(args).items()}
    vocab_size = engines[BEFORE].engine.vocab_size
    for policy, llm in engines.items():  # untimed
        run_burst(llm, make_burst(args, 0, vocab_size), args.output_len)
    rounds, identical = [], True
    for index in range(1, args.rounds + 1):
        burst = make_burst(args, index, vocab_size)
        kinds = [kind for kind, _ in burst]
        order = (BEFORE, AFTER) if index % 2 else (AFTER, BEFORE)
        runs = {policy: run_burst(engines[policy], burst, args.output_len) for policy in order}
        identical &= runs[BEFORE]["tokens"] == runs[AFTER]["tokens"]
        record = {"order": list(order), **{policy: round_figures(runs[policy], kinds) for policy in order}}
        record["ratio"] = ratios(record[BEFORE], record[AFTER])
        for policy in order:
            record[f"{policy}_ttft_s"] = runs[policy]["ttft_s"]
        rounds.append(record)
    report = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine_description(),
        "policies": policies(args),
        "long_prefill_tokens": engines[AFTER].engine.config.long_prefill_tokens,
        "outputs_identical": identical,
        "compiles_after_warmup": {policy: llm.engine.compiles_after_warmup for policy, llm in engines.items()},
        "rounds": rounds,
        "summary": summarize(rounds),
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2))
    plot_path = args.plot or (args.out.with_suffix(".png") if args.out is not None else None)
    if plot_path is not None:
        plot(report, plot_path)
    print_table(report)
    return report


if __name__ == "__main__":
    main()
