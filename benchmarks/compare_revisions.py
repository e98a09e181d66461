"""Start-up and decode step time of this checkout against another revision, measured alternately in one run.

For a change that must not change behaviour or cost (a refactor), this is the before/after figure: each round runs a
probe in a fresh process for the base checkout and then for this one (or the other way round, alternating), with the
same engine settings, and reports the ratio new / base of the medians.

The probe builds `LLM(...)` on the built-in model with the settings below (JAX's persistent compilation cache is
warm after the first round, so start-up is load + lower + cache reads), then generates `--prompts` greedy requests
of `--max-tokens` tokens each (ignore_eos) and reports the wall time per engine step. Both revisions must accept these
`LLM` keywords.

    git worktree add /tmp/base REV
    .venv/bin/python benchmarks/compare_revisions.py --base-checkout /tmp/base --out /tmp/compare.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENGINE = dict(dtype="float32", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64)


def probe(prompts: int, max_tokens: int) -> dict[str, float]:
    """Runs inside the checkout under test (its jaxserve first on sys.path)."""
    from jaxserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(use_tqdm_on_load=False, **ENGINE)
    startup_s = time.perf_counter() - start
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    steps_before = llm.engine.stats().num_steps
    start = time.perf_counter()
    llm.generate([f"prompt number {i}" for i in range(prompts)], params, use_tqdm=False)
    decode_s = time.perf_counter() - start
    steps = llm.engine.stats().num_steps - steps_before
    return {"startup_s": startup_s, "step_ms": decode_s / steps * 1e3, "steps": steps}


def run_probe(checkout: Path, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, __file__, "--probe", "--prompts", str(args.prompts), "--max-tokens",
                          str(args.max_tokens)], env=env, capture_output=True, text=True, check=True, cwd=checkout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(args: argparse.Namespace) -> dict:
    checkouts = {"base": args.base_checkout.resolve(), "new": REPO}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
    for round_index in range(args.rounds):
        order = list(checkouts) if round_index % 2 == 0 else list(reversed(checkouts))
        for name in order:
            runs[name].append(run_probe(checkouts[name], args))
            print(f"round {round_index} {name}: {runs[name][-1]}", flush=True)
    medians = {name: {key: statistics.median(r[key] for r in results) for key in ("startup_s", "step_ms")}
               for name, results in runs.items()}
    ratios = {key: medians["new"][key] / medians["base"][key] for key in ("startup_s", "step_ms")}
    return {"engine": ENGINE, "prompts": args.prompts, "max_tokens": args.max_tokens, "rounds": args.rounds,
            "base_checkout": str(checkouts["base"]), "runs": runs, "medians": medians, "new_over_base": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-checkout", type=Path, help="a checkout of the revision to compare against")
    parser.add_argument("--rounds", type=int, default=4, help="probes per checkout, alternated")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(args.prompts, args.max_tokens)))
        return
    if args.base_checkout is None:
        parser.error("--base-checkout is required")
    report = compare(args)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    print(f"{'':10} {'base':>10} {'new':>10} {'new/base':>9}")
    for key in ("startup_s", "step_ms"):
        print(f"{key:10} {report['medians']['base'][key]:10.3f} {report['medians']['new'][key]:10.3f} "
              f"{report['new_over_base'][key]:9.3f}")


if __name__ == "__main__":
    main()
