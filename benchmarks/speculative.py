"""Speculative decoding against none, in one run: target steps per emitted token and wall speed-up on a repetitive
workload, and what the verifying machinery gains at a given acceptance rate whatever proposes the drafts.

Workload (seeded, fresh each round): prompts that repeat themselves, half of them code edits (a "file" of lines of
random tokens, then a copy of some of its lines with a token changed here and there, cut off mid-line) and half
summaries that copy (a "document" of sentences, then some of its sentences again, whole or their first half, cut
off mid-sentence). Greedy, ignore_eos, --output-len tokens each. A run at batch b keeps b requests in flight
(a finished one is replaced at once) until --waves x b requests have finished.

Modes, on two engines of the same shapes, each in its own process (one engine's programs load from the persistent
compilation cache the other filled; one process per engine keeps each under Linux's limit on memory mappings,
vm.max_map_count, as in offline_throughput.py):

    plain       no speculative_config: the baseline (async overlap on, as users run it)
    no-drafts   the speculating engine with its proposer switched off: what losing async overlap costs alone
                (speculation turns it off, since drafts continue the tokens just read back)
    ngram       prompt lookup (`--num-speculative-tokens k --prompt-lookup-max n --prompt-lookup-min m`)
    replay@a    a proposer that knows the plain engine's greedy continuation of each prompt (from an untimed
                reference pass in the same round) and proposes it, each drafted token replaced by another with
                probability 1 - a (seeded): drafts of a known quality, so acceptance is set rather than found

The built-in model has random weights: it does not copy its prompt as a trained model does, so prompt lookup
seldom finds a match in what it generates, the few drafts it proposes are mostly rejected, and the ngram figures are
a floor. The replay sweep is the honest figure for the machinery: per a, the measured acceptance, target steps per
emitted token (engine steps / generated tokens) and the wall speed-up over plain. Drafting k tokens with each right
with probability a emits 1 + a + ... + a^k tokens per verifying step on average (`iid_tokens_per_draft_step`). On a
GPU a decode step is memory-bound (the weights are read once whatever the few tokens per sequence), so a verifying
step with k + 1 tokens per sequence costs about what a decode step does and the step saving is nearly all wall
saving. On a CPU the step's cost grows with its tokens (at batch 1 a verifying step runs the 16-token mixed bucket,
against the 1-token decode bucket, and its sampler scores k + 1 rows per sequence row), so a verifying step costs
several decode steps (`step_time_vs_plain`) and the wall gain is far smaller than the step saving, or a loss.

Each engine runs one untimed warm-up per batch size; then `--rounds` rounds, per batch size, alternate the modes
(the starting one rotates each round). Ratios to plain are taken within each round (same workload, close in time),
then their median is reported. Greedy outputs of every mode are compared with the reference pass
(`outputs_identical`): speculation must change no token. Prefix caching is off in both engines, so the reference pass
cannot warm the timed plain run.

    python benchmarks/speculative.py --out speculative.json            # PNG beside it when matplotlib imports
    python benchmarks/speculative.py --smoke --out /tmp/spec.json      # tiny, for tests
    python benchmarks/speculative.py --model-shape llama-3.1-8b --dtype bfloat16 --mem-fraction 0.45 ...  # a GPU
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.proposers import SequenceProposer
from jaxserve.sampling_params import SamplingParams
from model_shapes import ENGINE_SHAPES, model_of_shape

PLAIN, NO_DRAFTS, NGRAM = "plain", "no-drafts", "ngram"
REPLAY_PREFIX = "replay@"
ENGINES = ("plain", "speculative")  # the two engine processes
WARM_UP_ROUND = 0  # workload index of the untimed warm-up; timed rounds use 1..rounds
KEY_TOKENS = 8  # a replayed run is found by its prompt's first tokens (unique within a workload: checked)
FIRST_ORDINARY_TOKEN = 16  # prompts draw ids from here up: clear of the special ids at the start of a vocabulary
SEPARATOR, PERIOD = 10, 11  # the edit/summary marker and the sentence end, as fixed ids
# --smoke: the shapes of the test suite's tiny engines (tests/conftest.py, tests/test_speculative.py), so the test
# finds their programs in the persistent compilation cache.
SMOKE = dict(batch_sizes=[1, 4], waves=1, output_len=12, rounds=1, acceptance=[0.0, 1.0], num_speculative_tokens=3,
             prompt_lookup_max=3, prompt_lookup_min=1, max_num_batched_tokens=32, max_model_len=64, units=3,
             copied_units=2, unit_len=[3, 5])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (the test's); other flags still apply")
    parser.add_argument("--model-shape", choices=ENGINE_SHAPES, default="builtin",
                        help="builtin: the built-in tiny model; llama-3.1-8b: random weights of its shapes")
    parser.add_argument("--dtype", default="float32", help="weights and activations")
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=4, help="k: drafts per sequence and step")
    parser.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest suffix looked up")
    parser.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: shortest suffix looked up")
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.0, 0.5, 0.8, 1.0],
                        help="replay modes: chance that each drafted token is the right one")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8],
                        help="requests in flight; the engines' max_num_seqs is the largest")
    parser.add_argument("--waves", type=int, default=4, help="a run at batch b serves waves x b requests")
    parser.add_argument("--output-len", type=int, default=64, help="tokens each request generates")
    parser.add_argument("--units", type=int, default=16, help="lines of a prompt's file / sentences of its document")
    parser.add_argument("--copied-units", type=int, default=6, help="lines / sentences a prompt copies again")
    parser.add_argument("--unit-len", type=int, nargs=2, default=[4, 12], metavar=("MIN", "MAX"),
                        help="tokens per line / sentence")
    parser.add_argument("--rounds", type=int, default=5, help="timed runs per mode and batch size, alternated")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: longest prompt + output")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--mem-fraction", type=float, default=None,
                        help="XLA_PYTHON_CLIENT_MEM_FRACTION of each engine process (a GPU: two engines at once)")
    parser.add_argument("--seed", type=int, default=0, help="seeds workloads, drafts' corruption and the weights")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, default=None,
                        help="the PNG (default: --out with .png, when matplotlib imports)")
    smoke, _ = parser.parse_known_args(argv)
    if smoke.smoke:
        parser.set_defaults(**SMOKE)
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not all(0.0 <= a <= 1.0 for a in args.acceptance):
        parser.error("--acceptance values must be in [0, 1]")
    if not 1 <= args.unit_len[0] <= args.unit_len[1]:
        parser.error("--unit-len needs 1 <= MIN <= MAX")
    if args.copied_units > args.units:
        parser.error("--copied-units must not exceed --units")
    needed = longest_prompt(args) + args.output_len
    if args.max_model_len is None:
        args.max_model_len = needed
    elif args.max_model_len < needed:
        parser.error(f"--max-model-len must hold the longest prompt plus the output: {needed}")


# --- the workload --------------------------------------------------------------------------------------------------

def longest_prompt(args: argparse.Namespace) -> int:
    """Tokens of the longest prompt make_workload can draw: every unit at its longest, copied ones included."""
    return (args.units + args.copied_units) * args.unit_len[1] + 1


def random_units(rng: np.random.Generator, args: argparse.Namespace, vocab_size: int, end: int | None) -> list[list]:
    """--units lines (end None) or sentences (each closed by `end`) of random tokens."""
    low, high = args.unit_len
    units = []
    for _ in range(args.units):
        length = int(rng.integers(low, high + 1)) - (end is not None)
        body = [int(t) for t in rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, max(length, 1))]
        units.append(body + ([end] if end is not None else []))
    return units


def code_edit_prompt(rng: np.random.Generator, args: argparse.Namespace, vocab_size: int) -> list[int]:
    """A file, then some consecutive lines of it again with about one token in two lines changed, cut mid-line:
    what continuing an edit of code looks like."""
    lines = random_units(rng, args, vocab_size, end=None)
    first = int(rng.integers(0, args.units - args.copied_units + 1))
    edited = []
    for line in lines[first:first + args.copied_units]:
        line = list(line)
        if rng.random() < 0.5:
            line[int(rng.integers(len(line)))] = int(rng.integers(FIRST_ORDINARY_TOKEN, vocab_size))
        edited.append(line)
    edited[-1] = edited[-1][:max(1, len(edited[-1]) // 2)]
    return [t for line in lines for t in line] + [SEPARATOR] + [t for line in edited for t in line]


def summary_prompt(rng: np.random.Generator, args: argparse.Namespace, vocab_size: int) -> list[int]:
    """A document, then some of its sentences in order, each whole or its first half, the last cut mid-sentence:
    a summary that copies."""
    sentences = random_units(rng, args, vocab_size, end=PERIOD)
    chosen = sorted(rng.choice(args.units, size=args.copied_units, replace=False))
    copied = [sentences[i] if rng.random() < 0.5 else sentences[i][:max(1, len(sentences[i]) // 2)] for i in chosen]
    copied[-1] = copied[-1][:max(1, len(copied[-1]) // 2)]
    return [t for s in sentences for t in s] + [SEPARATOR] + [t for s in copied for t in s]


def make_workload(args: argparse.Namespace, index: int, batch: int, vocab_size: int) -> list[tuple[int, ...]]:
    """The index-th workload for batch size `batch`: waves x batch prompts, code edits and summaries alternating."""
    rng = np.random.default_rng([args.seed, index, batch])
    prompts = [tuple((code_edit_prompt if i % 2 == 0 else summary_prompt)(rng, args, vocab_size))
               for i in range(args.waves * batch)]
    keys = {p[:KEY_TOKENS] for p in prompts}
    if len(keys) != len(prompts) or min(map(len, prompts)) < KEY_TOKENS:
        raise ValueError("prompts must be at least KEY_TOKENS long and differ in their first KEY_TOKENS tokens")
    return prompts


# --- drafts of a set quality ---------------------------------------------------------------------------------------

class ReplayProposer(SequenceProposer):
    """Proposes a known greedy continuation, each drafted token replaced by another id with probability
    1 - accuracy, so that the acceptance rate is set by the benchmark rather than by the model."""

    def __init__(self, runs: Sequence[tuple[int, ...]], accuracy: float, vocab_size: int, seed: Sequence[int]):
        """`runs`: each prompt followed by its continuation."""
        self._runs = {run[:KEY_TOKENS]: run for run in runs}
        self._accuracy = accuracy
        self._vocab_size = vocab_size
        self._rng = np.random.default_rng(seed)

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> tuple[int, ...]:
        """The continuation's next max_drafts tokens after `token_ids`, some replaced; () for an unknown prompt."""
        run = self._runs.get(tuple(token_ids[:KEY_TOKENS]))
        if run is None or max_drafts < 1:
            return ()
        truth = np.asarray(run[len(token_ids):len(token_ids) + max_drafts], np.int64)
        wrong = self._rng.random(truth.size) >= self._accuracy
        other = (truth + self._rng.integers(1, self._vocab_size, truth.size)) % self._vocab_size  # never the truth
        return tuple(int(t) for t in np.where(wrong, other, truth))


def iid_expected_accepted(accuracy: float, k: int) -> float:
    """Accepted drafts per full k-draft step when each draft is right with probability `accuracy`: a + ... + a^k."""
    return sum(accuracy ** j for j in range(1, k + 1))


# --- one engine per process ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RunTask:
    """One timed run, as the parent sends it to an engine process."""

    mode: str  # PLAIN, NO_DRAFTS, NGRAM or REPLAY_PREFIX + accuracy
    batch: int  # requests in flight
    prompts: list[tuple[int, ...]]
    tag: str  # request id prefix, unique per run
    continuations: list[tuple[int, ...]] | None = None  # replay: the reference outputs, one per prompt
    accuracy: float = 1.0  # replay: chance a drafted token is right
    seed: tuple[int, ...] = (0,)  # replay: seeds the corruption


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One run through one engine; outputs in prompt order."""

    wall_s: float
    generated_tokens: int
    steps: int  # engine steps (target forward passes) the run took
    num_drafts: int  # sequence steps that brought drafts
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: list[int]
    outputs: list[tuple[int, ...]]

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s

    @property
    def steps_per_token(self) -> float:
        return self.steps / self.generated_tokens

    @property
    def step_s(self) -> float:
        return self.wall_s / self.steps


def engine_config(args: argparse.Namespace, speculative: bool) -> EngineConfig:
    """Both engines' shapes; pages for every sequence at max_model_len (nothing sized from free memory, which the
    other engine process shares)."""
    max_num_seqs = max(args.batch_sizes)
    pages = max_num_seqs * -(-args.max_model_len // args.block_size) + 1
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    return EngineConfig(max_model_len=args.max_model_len, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                        num_kv_pages=pages, enable_prefix_caching=False, seed=args.seed,
                        speculative_config=spec if speculative else None)


def run_at_concurrency(engine: LLMEngine, prompts: list[tuple[int, ...]], batch: int, output_len: int,
                       tag: str) -> RunResult:
    """Keeps `batch` requests in flight, replacing each finished one at once, until every prompt is served."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    before = engine.stats()
    waiting = collections.deque(enumerate(prompts))
    index_of: dict[str, int] = {}
    outputs: dict[int, tuple[int, ...]] = {}

    def submit() -> None:
        index, prompt = waiting.popleft()
        index_of[f"{tag}-{index}"] = index
        engine.add_request(f"{tag}-{index}", prompt, params)

    start = time.perf_counter()
    for _ in range(min(batch, len(waiting))):
        submit()
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[index_of[output.request_id]] = tuple(output.outputs[0].token_ids)
            if waiting:
                submit()
    wall_s = time.perf_counter() - start
    return counted_run(before, engine.stats(), wall_s, [outputs[i] for i in range(len(prompts))])


def counted_run(before, after, wall_s: float, outputs: list[tuple[int, ...]]) -> RunResult:
    """The run's figures from the engine's counters before and after it (SchedulerStats)."""
    spec_before, spec_after = before.spec_decode, after.spec_decode
    return RunResult(
        wall_s=wall_s, generated_tokens=sum(map(len, outputs)), steps=after.num_steps - before.num_steps,
        num_drafts=spec_after.num_drafts - spec_before.num_drafts,
        draft_tokens=spec_after.num_draft_tokens - spec_before.num_draft_tokens,
        accepted_tokens=spec_after.num_accepted_tokens - spec_before.num_accepted_tokens,
        accepted_per_position=[a - b for a, b in zip(spec_after.accepted_per_position,
                                                       spec_before.accepted_per_position)],
        outputs=outputs)


def proposer_for(task: RunTask, ngram: Any, vocab_size: int) -> Any:
    """The proposer a mode runs with: the engine's own (ngram, or none on the plain engine), none, or a replay."""
    if task.mode == NO_DRAFTS:
        return None
    if task.mode.startswith(REPLAY_PREFIX):
        runs = [prompt + continuation for prompt, continuation in zip(task.prompts, task.continuations)]
        return ReplayProposer(runs, task.accuracy, vocab_size, task.seed)
    return ngram


def engine_worker(args: argparse.Namespace, speculative: bool, connection: Connection) -> None:
    """Runs in its own process: builds one engine, reports ready, then runs each RunTask it is sent ("compiles":
    reports the compiles since warm-up; None: exits)."""
    from bench_machine import machine_description
    from jaxserve.tokenizer import load_tokenizer

    model = model_of_shape(args.model_shape, args.dtype, args.seed)
    start = time.perf_counter()
    engine = LLMEngine(model, load_tokenizer(model.model_dir), engine_config(args, speculative), progress=False)
    connection.send({"startup_s": time.perf_counter() - start, "programs": engine.startup_stats.programs,
                     "vocab_size": model.config.vocab_size, "machine": machine_description()})
    ngram = engine.scheduler.proposer
    while (task := connection.recv()) is not None:
        if task == "compiles":
            connection.send(engine.compiles_after_warmup)
            continue
        engine.scheduler.proposer = proposer_for(task, ngram, engine.vocab_size)
        try:
            result = run_at_concurrency(engine, task.prompts, task.batch, args.output_len, task.tag)
        finally:
            engine.scheduler.proposer = ngram
        connection.send(dataclasses.asdict(result))


class EngineProcess:
    """One engine in a child process; `run` blocks until its run has finished there."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.name = name
        self._connection, child_end = multiprocessing.Pipe()
        self._process = multiprocessing.get_context("spawn").Process(
            target=engine_worker, args=(args, name == "speculative", child_end), name=f"engine-{name}")
        self._process.start()
        child_end.close()
        self.ready = self._receive()

    def run(self, task: RunTask) -> RunResult:
        self._connection.send(task)
        return RunResult(**self._receive())

    def compiles_after_warmup(self) -> int:
        self._connection.send("compiles")
        return self._receive()

    def close(self) -> None:
        if self._process.is_alive():
            self._connection.send(None)
        self._process.join(timeout=60)
        if self._process.is_alive():
            self._process.terminate()

    def _receive(self) -> Any:
        try:
            return self._connection.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(f"the {self.name} engine process exited with code {self._process.exitcode}") from None


def start_engines(args: argparse.Namespace) -> dict[str, EngineProcess]:
    """The plain engine, then the speculating one (it loads the plain programs and compiles its verifying ones)."""
    if args.mem_fraction is not None:  # read by each child's JAX as it starts; this process never touches a device
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(args.mem_fraction)
    engines: dict[str, EngineProcess] = {}
    try:
        for name in ENGINES:
            engines[name] = EngineProcess(name, args)
            ready = engines[name].ready
            print(f"{name} engine ready in {ready['startup_s']:.1f} s ({ready['programs']} programs)", flush=True)
    except BaseException:
        stop_engines(engines)
        raise
    return engines


def stop_engines(engines: dict[str, EngineProcess]) -> None:
    for engine in engines.values():
        engine.close()


# --- rounds --------------------------------------------------------------------------------------------------------

def mode_names(args: argparse.Namespace) -> list[str]:
    return [PLAIN, NO_DRAFTS, NGRAM] + [f"{REPLAY_PREFIX}{a:g}" for a in args.acceptance]


def accuracy_of(mode: str) -> float:
    return float(mode[len(REPLAY_PREFIX):])


def run_mode(engines: dict[str, EngineProcess], mode: str, batch: int, prompts: list[tuple[int, ...]],
             reference: RunResult | None, tag: str, seed: tuple[int, ...]) -> RunResult:
    """One run of `mode` over `prompts`; replays draw on the reference outputs."""
    if mode == PLAIN:
        return engines["plain"].run(RunTask(mode, batch, prompts, tag))
    if mode.startswith(REPLAY_PREFIX):
        return engines["speculative"].run(RunTask(mode, batch, prompts, tag, continuations=reference.outputs,
                                                  accuracy=accuracy_of(mode), seed=seed))
    return engines["speculative"].run(RunTask(mode, batch, prompts, tag))


def warm_up(engines: dict[str, EngineProcess], args: argparse.Namespace, vocab_size: int) -> None:
    """Untimed, per batch size: the plain engine once, the speculating one with n-gram and with replayed drafts."""
    for batch in args.batch_sizes:
        prompts = make_workload(args, WARM_UP_ROUND, batch, vocab_size)
        reference = run_mode(engines, PLAIN, batch, prompts, None, f"warm-b{batch}-plain", ())
        for mode in (NGRAM, f"{REPLAY_PREFIX}{max(args.acceptance):g}"):
            run_mode(engines, mode, batch, prompts, reference, f"warm-b{batch}-{mode}", (args.seed, WARM_UP_ROUND))


def run_rounds(engines: dict[str, EngineProcess], args: argparse.Namespace,
               vocab_size: int) -> dict[int, dict[str, list[tuple[RunResult, RunResult]]]]:
    """Per round and batch size: an untimed reference pass on the plain engine, then every mode (the starting one
    rotating each round). Returns (run, that round's reference) per batch size and mode."""
    modes = mode_names(args)
    results: dict[int, dict[str, list]] = {batch: {mode: [] for mode in modes} for batch in args.batch_sizes}
    for round_index in range(1, args.rounds + 1):
        for batch in args.batch_sizes:
            prompts = make_workload(args, round_index, batch, vocab_size)
            reference = run_mode(engines, PLAIN, batch, prompts, None, f"r{round_index}-b{batch}-reference", ())
            shift = (round_index - 1) % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                run = run_mode(engines, mode, batch, prompts, reference, f"r{round_index}-b{batch}-{mode}",
                               (args.seed, round_index, batch, modes.index(mode)))
                results[batch][mode].append((run, reference))
                print(f"round {round_index} batch {batch:>3} {mode:<12} {run.tokens_per_s:8.1f} tok/s "
                      f"{run.steps_per_token:6.3f} steps/token, accepted {run.accepted_tokens}/{run.draft_tokens}",
                      flush=True)
    return results


# --- figures -------------------------------------------------------------------------------------------------------

def ratio_or_none(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def per_round_ratios(runs: list[RunResult], plain: list[RunResult], figure: str) -> list[float]:
    """`figure` of each run over the plain run of the same round (same workload, close in time)."""
    return [getattr(run, figure) / getattr(base, figure) for run, base in zip(runs, plain)]


def summarize_mode(mode: str, pairs: list[tuple[RunResult, RunResult]], plain: list[RunResult],
                   k: int) -> dict[str, Any]:
    """Medians over rounds of the timings, totals of the draft counters, and the per-round ratios to plain."""
    runs = [run for run, _ in pairs]
    draft_steps, drafted, accepted = (sum(getattr(r, name) for r in runs)
                                      for name in ("num_drafts", "draft_tokens", "accepted_tokens"))
    speedups = per_round_ratios(runs, plain, "tokens_per_s")
    summary = {
        "tokens_per_s": statistics.median(r.tokens_per_s for r in runs),
        "wall_s": statistics.median(r.wall_s for r in runs),
        "steps": statistics.median(r.steps for r in runs),
        "steps_per_token": statistics.median(r.steps_per_token for r in runs),
        "step_ms": statistics.median(r.step_s for r in runs) * 1e3,
        "draft_steps": draft_steps, "draft_tokens": drafted, "accepted_tokens": accepted,
        "accepted_per_position": [sum(column) for column in zip(*(r.accepted_per_position for r in runs))],
        "acceptance_rate": ratio_or_none(accepted, drafted),
        "mean_accepted_per_draft_step": ratio_or_none(accepted, draft_steps),
        "speedup_vs_plain_per_round": speedups,
        "speedup_vs_plain": statistics.median(speedups),
        "steps_vs_plain": statistics.median(per_round_ratios(runs, plain, "steps_per_token")),
        "step_time_vs_plain": statistics.median(per_round_ratios(runs, plain, "step_s")),
        "mismatched_requests": sum(sum(a != b for a, b in zip(run.outputs, ref.outputs)) for run, ref in pairs),
    }
    summary["outputs_identical"] = summary["mismatched_requests"] == 0
    if mode.startswith(REPLAY_PREFIX):
        accuracy = accuracy_of(mode)
        expected = iid_expected_accepted(accuracy, k)
        summary.update(draft_accuracy=accuracy, iid_expected_acceptance=expected / k,
                       iid_tokens_per_draft_step=1 + expected)
    return summary


def summarize(results: dict[int, dict[str, list[tuple[RunResult, RunResult]]]], k: int) -> dict[str, dict]:
    summary = {}
    for batch, by_mode in results.items():
        plain = [run for run, _ in by_mode[PLAIN]]
        summary[str(batch)] = {mode: summarize_mode(mode, pairs, plain, k) for mode, pairs in by_mode.items()}
    return summary


def run_record(run: RunResult, reference: RunResult) -> dict[str, Any]:
    """A run for the JSON: its counters and timings, whether its outputs were the reference's (not the tokens)."""
    record = {key: value for key, value in dataclasses.asdict(run).items() if key != "outputs"}
    return {**record, "tokens_per_s": run.tokens_per_s, "steps_per_token": run.steps_per_token,
            "outputs_identical": run.outputs == reference.outputs}


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def format_table(summary: dict[str, dict], args: argparse.Namespace) -> str:
    lines = []
    header = (f"{'mode':<12} {'accept':>6} {'acc/draft step':>14} {'steps/token':>11} {'steps vs plain':>14} "
              f"{'ms/step':>7} {'step time vs plain':>18} {'tok/s':>8} {'speed-up':>8} {'identical':>9}")
    for batch, by_mode in summary.items():
        lines += [f"batch {batch}: {args.waves * int(batch)} requests x {args.output_len} tokens", header]
        for mode, row in by_mode.items():
            per_draft = row["mean_accepted_per_draft_step"]
            lines.append(f"{mode:<12} {percent(row['acceptance_rate']):>6} "
                         f"{'-' if per_draft is None else f'{per_draft:.2f}':>14} {row['steps_per_token']:>11.3f} "
                         f"{row['steps_vs_plain']:>13.2f}x {row['step_ms']:>7.2f} {row['step_time_vs_plain']:>17.2f}x "
                         f"{row['tokens_per_s']:>8.1f} {row['speedup_vs_plain']:>7.2f}x "
                         f"{str(row['outputs_identical']):>9}")
        speedups = ", ".join(f"{mode} {' '.join(f'{r:.2f}' for r in row['speedup_vs_plain_per_round'])}"
                             for mode, row in by_mode.items() if mode != PLAIN)
        lines += [f"speed-up per round: {speedups}", ""]
    return "\n".join(lines)


def plot(summary: dict[str, dict], k: int, path: Path) -> bool:
    """Wall speed-up and target steps per token, both relative to plain, against the measured acceptance; False
    (nothing written) without matplotlib."""
    try:
        import matplotlib  # here: only the plot needs it, and it is optional
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, steps) = plt.subplots(1, 2, figsize=(11, 4.5))
    for batch, by_mode in summary.items():
        replays = sorted((row["acceptance_rate"] or 0.0, row) for mode, row in by_mode.items()
                         if mode.startswith(REPLAY_PREFIX))
        x = [rate for rate, _ in replays]
        line, = speed.plot(x, [row["speedup_vs_plain"] for _, row in replays], "o-", label=f"replay, batch {batch}")
        steps.plot(x, [row["steps_vs_plain"] for _, row in replays], "o-", color=line.get_color(),
                   label=f"replay, batch {batch}")
        ngram = by_mode[NGRAM]
        for axes, figure_name in ((speed, "speedup_vs_plain"), (steps, "steps_vs_plain")):
            axes.plot([ngram["acceptance_rate"] or 0.0], [ngram[figure_name]], "*", markersize=14,
                      color=line.get_color(), label=f"ngram, batch {batch}")
        speed.axhline(by_mode[NO_DRAFTS]["speedup_vs_plain"], color=line.get_color(), linestyle=":",
                      label=f"no drafts (overlap off), batch {batch}")
    rates = np.linspace(0, 1, 50)
    steps.plot(rates, 1 / (1 + k * rates), "k--", linewidth=1, label=f"1 / (1 + {k} x acceptance): every step drafts")
    speed.axhline(1.0, color="gray", linewidth=0.8)
    speed.set(xlabel="measured acceptance (accepted / drafted)", ylabel="generated tokens/s over plain",
              title="wall speed-up")
    steps.set(xlabel="measured acceptance (accepted / drafted)", ylabel="target steps per token over plain",
              title="target steps per emitted token")
    for axes in (speed, steps):
        axes.legend(fontsize=7)
    figure.suptitle(f"speculative decoding, k = {k}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    engines = start_engines(args)
    try:
        ready = {name: engine.ready for name, engine in engines.items()}
        vocab_size = ready["plain"]["vocab_size"]
        warm_up(engines, args, vocab_size)
        results = run_rounds(engines, args, vocab_size)
        compiles = {name: engine.compiles_after_warmup() for name, engine in engines.items()}
    finally:
        stop_engines(engines)
    summary = summarize(results, args.num_speculative_tokens)
    report = {
        "machine": ready["plain"]["machine"],
        "model": "built-in tiny random model" if args.model_shape == "builtin" else f"random {args.model_shape}",
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "engine_startup_s": {name: r["startup_s"] for name, r in ready.items()},
        "compiles_after_warmup": compiles,
        "modes": mode_names(args),
        "results": summary,
        "runs": {str(batch): {mode: [run_record(run, ref) for run, ref in pairs] for mode, pairs in by_mode.items()}
                 for batch, by_mode in results.items()},
        "outputs_identical": all(row["outputs_identical"] for by_mode in summary.values() for row in by_mode.values()),
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    plot_path = args.plot or (args.out.with_suffix(".png") if args.out else None)
    drawn = plot_path is not None and plot(summary, args.num_speculative_tokens, plot_path)
    machine = report["machine"]
    print(f"{report['model']} ({args.dtype}) on {machine['device']} ({machine['jax_backend']}); k "
          f"{args.num_speculative_tokens}, prompt lookup {args.prompt_lookup_max}..{args.prompt_lookup_min}; "
          f"{args.rounds} rounds, modes alternated; compiles after warm-up {compiles}; "
          f"plot: {plot_path if drawn else 'none'}")
    print(format_table(summary, args))
    print(f"greedy outputs identical to no speculation in every mode: {report['outputs_identical']}")


if __name__ == "__main__":
    main()
