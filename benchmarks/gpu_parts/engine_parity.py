"""The whole engine, Pallas attention against XLA attention, judged against a float32 engine of the same weights.

The same random prompts are decoded greedily by a bf16 engine of each backend over one random model
(benchmarks/engine_bench.py's model and EngineConfig, so the programs compiled here are the ones engine_speed
loads from the compilation cache), and the token ids are compared: identical, or the first divergence with both
runs' margins there (the log-probability gap between the top two candidates).

On random weights that comparison cannot decide: the next-token distribution is close to uniform over the whole
vocabulary, its top-two gaps are a few hundredths, and bf16 rounding, either backend's, flips them within a few
tokens (measured on an H200: 2 of 32 prompts identical over 64 tokens, with kernels as exact as XLA's bf16 path).
So the check is on log-probabilities instead. Every sequence (prompt + XLA's greedy tokens) is scored by each bf16
engine (prompt log-probabilities: the prefill path) and by a float32 XLA engine whose weights are the bf16 ones
widened, matmuls at full precision (the reference); each greedy run's own log-probabilities of its tokens, up to
where it leaves the scored sequence, cover the decode path. Pallas passes where its mean distance from the
reference is within TOLERANCE of XLA's: both carry the same bf16 noise, while a kernel that reads a wrong page or
masks wrongly moves log-probabilities by the spread of the distribution, which the report gives for scale.

The reference is built to start fast (on an H100 the part ran past 300 s with the reference engine still starting):
its weights are the bf16 ones widened on the device by one program, and since it only scores, it runs one sequence
at a time in 16-token steps, which makes its bucket grid a single decode and a single mixed shape: 6 programs, the
only cold float32 compiles of the part (its GEMMs at two row counts to autotune), instead of 38 programs over 12 row
counts for one batch of 32 rows in 1024-token steps. The scores are the same: every token is still scored by a
float32 engine given the tokens before it, in prefill chunks instead of whole prompts.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from engine_bench import ENGINE_VARIANTS, EngineSettings, engine_config, engine_settings, parse_args, random_model
from gpu_parts.context import PartContext, PartOutcome, markdown_table
from jaxserve.checkpoint import BUILTIN_MODEL_DIR
from jaxserve.checkpoint.loading import LoadedModel
from jaxserve.checkpoint.param_tree import abstract_params, fill_params, flat_arrays
from jaxserve.config import PALLAS_BACKEND, XLA_BACKEND
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.tokenizer import load_tokenizer

TOP_CANDIDATES = 2  # log-probabilities kept per token: the margin at a divergence needs the top two
# The reference engine's step: one sequence, a 16-token prefill chunk (MIN_TOKEN_BUCKET, the smallest mixed bucket)
REFERENCE_ROWS = 1
REFERENCE_STEP_TOKENS = 16
REFERENCE = "float32"  # the reference engine's name in the figures
PATHS = ("prefill", "decode")
# Pallas' mean distance from the reference may exceed XLA's by this factor plus SLACK (nats) and still pass.
TOLERANCE = 1.5
SLACK = 1e-3


def run(context: PartContext, engine_args: list[str], prompts: int, new_tokens: int, min_prompt_len: int,
        seed: int = 0) -> PartOutcome:
    settings = engine_settings(parse_args(engine_args))
    if new_tokens > settings.max_new_tokens:
        raise ValueError(f"new_tokens {new_tokens} exceeds the engine's room of {settings.max_new_tokens} tokens")
    model = random_model(settings)
    rng = np.random.default_rng(seed)
    token_prompts = [rng.integers(0, model.config.vocab_size, rng.integers(min_prompt_len, settings.prompt_len + 1))
                     .tolist() for _ in range(prompts)]
    greedy, scores = {}, {}
    # XLA first: its greedy tokens make the sequences that every engine scores.
    greedy[XLA_BACKEND], scores[XLA_BACKEND], sequences = with_engine(
        model, settings, XLA_BACKEND, lambda engine: greedy_and_scores(engine, token_prompts, new_tokens))
    greedy[PALLAS_BACKEND], scores[PALLAS_BACKEND], _ = with_engine(
        model, settings, PALLAS_BACKEND, lambda engine: greedy_and_scores(engine, token_prompts, new_tokens, sequences))
    started = time.perf_counter()
    wide = widened(model)
    jax.block_until_ready(wide.params)
    print(f"float32 weights widened on the device in {time.perf_counter() - started:.1f} s", flush=True)
    del model  # the bf16 weights go before the float32 engine allocates its pool
    gc.collect()
    scores[REFERENCE] = reference_scores(wide, settings, sequences)
    figures = compare(greedy[PALLAS_BACKEND], greedy[XLA_BACKEND])
    figures.update(log_prob_errors(token_prompts, sequences, greedy, scores))
    figures.update(prompts=prompts, new_tokens=new_tokens, prompt_lens=[len(p) for p in token_prompts],
                   model_config=settings.hf_config, dtype=settings.dtype)
    return PartOutcome(figures, summary(figures), passed=all(figures["log_prob_verdicts"].values()))


def with_engine(model: LoadedModel, settings: EngineSettings, backend: str, work: Callable[[LLMEngine], Any]) -> Any:
    """`work`'s result on an engine of this attention backend, which is shut down and released after."""
    started = time.perf_counter()
    engine = LLMEngine(model, load_tokenizer(BUILTIN_MODEL_DIR), engine_config(settings, ENGINE_VARIANTS[backend]),
                       progress=False)
    ready = time.perf_counter()
    stats = engine.startup_stats
    print(f"{backend} {np.dtype(model.dtype).name} engine ready in {ready - started:.1f} s: {stats.programs} programs "
          f"(lowered in {stats.lower_seconds:.1f} s, compiled in {stats.compile_seconds:.1f} s)", flush=True)
    try:
        return work(engine)
    finally:
        # A timed-out run's log then says where the time went.
        print(f"{backend} {np.dtype(model.dtype).name} engine's work done in {time.perf_counter() - ready:.1f} s "
              f"(its steps ran {len(engine.runner.bucket_counts)} of its {engine.runner.programs.count} programs)",
              flush=True)
        engine.shutdown()
        del engine
        gc.collect()  # the engine's KV pool goes before the next engine allocates its own


def greedy_and_scores(engine: LLMEngine, prompts: list[list[int]], new_tokens: int,
                      sequences: list[list[int]] | None = None
                      ) -> tuple[list[RequestOutput], list[np.ndarray], list[list[int]]]:
    """Greedy continuations, then the scores of `sequences` (by default each prompt with its own continuation),
    and those sequences."""
    outputs = generate(engine, prompts, new_tokens)
    if sequences is None:
        sequences = [prompt + list(output.outputs[0].token_ids) for prompt, output in zip(prompts, outputs)]
    return outputs, score(engine, sequences), sequences


def run_all(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        finished.update((output.request_id, output) for output in engine.step())
    return [finished[str(index)] for index in range(len(prompts))]


def generate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> list[RequestOutput]:
    """Greedy continuations with each token's log-probability and the top candidates'."""
    return run_all(engine, prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True,
                                                   logprobs=TOP_CANDIDATES))


def score(engine: LLMEngine, sequences: list[list[int]]) -> list[np.ndarray]:
    """Per sequence, f64[len - 1]: the log-probability of each token after the first given the ones before it."""
    outputs = run_all(engine, sequences, SamplingParams(max_tokens=1, prompt_logprobs=0))
    return [np.array([entries[token].logprob for token, entries in zip(sequence[1:], output.prompt_logprobs[1:])])
            for sequence, output in zip(sequences, outputs)]


def reference_scores(model: LoadedModel, settings: EngineSettings, sequences: list[list[int]]) -> list[np.ndarray]:
    """The sequences scored by a float32 XLA engine, its matmuls at full float32 precision rather than TF32."""
    precision = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")  # global: the engine compiles in threads of its own
    try:
        return with_engine(model, reference_settings(settings, sequences), XLA_BACKEND,
                           lambda engine: score(engine, sequences))
    finally:
        jax.config.update("jax_default_matmul_precision", precision)


def reference_settings(settings: EngineSettings, sequences: list[list[int]]) -> EngineSettings:
    """The bf16 engines' settings with REFERENCE_ROWS rows and REFERENCE_STEP_TOKENS-token steps: the reference only
    scores the sequences (prompt log-probabilities, max_tokens 1), so it needs neither batches nor long steps, and
    the fewest programs compile soonest; its float32 pool then holds one sequence (the bf16 engines' 256 rows would
    be 28 GiB beside 32 GB of float32 weights)."""
    lean = dataclasses.replace(settings, batches=(REFERENCE_ROWS,),
                               max_num_batched_tokens=min(REFERENCE_STEP_TOKENS, settings.max_num_batched_tokens))
    longest = max(len(sequence) for sequence in sequences)
    if longest > lean.max_model_len:
        raise ValueError(f"a scored sequence of {longest} tokens exceeds the reference engine's {lean.max_model_len}")
    return lean


def widened(model: LoadedModel) -> LoadedModel:
    """The model in float32 with the bf16 weights widened: the same numbers, computed in float32. One program
    widens them all where they are (32 GB written at the 8B shapes, nothing through the host)."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    placed = abstract_params(model.config, jnp.float32, lambda name, shape: device)
    arrays = _widen(flat_arrays(model.params))
    return LoadedModel(model.config, placed.graphdef, fill_params(placed, arrays), jnp.float32, model.model_dir,
                       model.source)


@jax.jit
def _widen(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {name: array.astype(jnp.float32) for name, array in arrays.items()}


def log_prob_errors(prompts: list[list[int]], sequences: list[list[int]], greedy: dict[str, list[RequestOutput]],
                    scores: dict[str, list[np.ndarray]]) -> dict[str, Any]:
    """Each backend's distance from the reference on each path, the verdicts, and the spread for scale."""
    reference = scores[REFERENCE]
    distances = {backend: {"prefill": np.concatenate([b - r for b, r in zip(scores[backend], reference)]),
                           "decode": decode_distances(prompts, sequences, greedy[backend], reference)}
                 for backend in (PALLAS_BACKEND, XLA_BACKEND)}
    errors = {backend: {path: distance_figures(values) for path, values in paths.items()}
              for backend, paths in distances.items()}
    verdicts = {path: within_tolerance(errors[PALLAS_BACKEND][path]["mean"], errors[XLA_BACKEND][path]["mean"])
                for path in PATHS}
    return {"log_prob_errors": errors, "log_prob_verdicts": verdicts,
            "reference_log_prob_spread": float(np.std(np.concatenate(reference)))}


def decode_distances(prompts: list[list[int]], sequences: list[list[int]], outputs: list[RequestOutput],
                     reference: list[np.ndarray]) -> np.ndarray:
    """A greedy run's log-probability of each scored-sequence token minus the reference's, while the run is on that
    sequence: up to and including the first position where it chose another token (the scored token's
    log-probability there counts when the run kept it among its top candidates)."""
    distances = []
    for prompt, sequence, output, scored in zip(prompts, sequences, outputs, reference):
        completion = output.outputs[0]
        for j, (token, entries) in enumerate(zip(completion.token_ids, completion.logprobs)):
            position = len(prompt) + j  # the token's index in the sequence; scored[position - 1] is its score
            if position >= len(sequence):
                break
            if sequence[position] in entries:
                distances.append(entries[sequence[position]].logprob - scored[position - 1])
            if token != sequence[position]:
                break
    return np.array(distances)


def distance_figures(distances: np.ndarray) -> dict[str, float]:
    magnitudes = np.abs(distances)
    return {"mean": float(magnitudes.mean()), "p99": float(np.quantile(magnitudes, 0.99)),
            "max": float(magnitudes.max()), "positions": int(magnitudes.size)}


def within_tolerance(pallas_mean: float, xla_mean: float) -> bool:
    return pallas_mean <= TOLERANCE * xla_mean + SLACK


def compare(pallas: list[RequestOutput], xla: list[RequestOutput]) -> dict[str, Any]:
    """Identical or not, tokens agreeing per prompt, and the first divergence with both runs' margins there."""
    agreeing, first = [], None
    for index, (ours, theirs) in enumerate(zip(pallas, xla)):
        ours_ids, their_ids = ours.outputs[0].token_ids, theirs.outputs[0].token_ids
        position = next((i for i, (a, b) in enumerate(zip(ours_ids, their_ids)) if a != b), None)
        if position is None and len(ours_ids) != len(their_ids):
            position = min(len(ours_ids), len(their_ids))
        agreeing.append(len(ours_ids) if position is None else position)
        if position is not None and first is None:
            first = divergence(index, position, ours, theirs)
    return {"identical": first is None, "identical_prompts": sum(a == len(o.outputs[0].token_ids)
                                                                 for a, o in zip(agreeing, xla)),
            "agreeing_tokens_per_prompt": agreeing, "first_divergence": first}


def divergence(prompt: int, position: int, pallas: RequestOutput, xla: RequestOutput) -> dict[str, Any]:
    return {"prompt": prompt, "position": position,
            "pallas_token": token_at(pallas, position), "xla_token": token_at(xla, position),
            "pallas_margin": margin(pallas, position), "xla_margin": margin(xla, position)}


def token_at(output: RequestOutput, position: int) -> int | None:
    ids = output.outputs[0].token_ids
    return ids[position] if position < len(ids) else None


def margin(output: RequestOutput, position: int) -> float | None:
    """Log-probability of the likeliest candidate minus the second's at this position."""
    logprobs = output.outputs[0].logprobs
    if not logprobs or position >= len(logprobs):
        return None
    ranked = sorted((entry.logprob for entry in logprobs[position].values()), reverse=True)
    return ranked[0] - ranked[1] if len(ranked) > 1 else None


def summary(figures: dict[str, Any]) -> str:
    errors, verdicts = figures["log_prob_errors"], figures["log_prob_verdicts"]
    rows = [[path, *(f"{errors[b][path]['mean']:.2e} / {errors[b][path]['p99']:.2e} / {errors[b][path]['max']:.2e}"
                     for b in (PALLAS_BACKEND, XLA_BACKEND)),
             errors[PALLAS_BACKEND][path]["positions"], "pass" if verdicts[path] else "**fail**"] for path in PATHS]
    text = (f"Log-probabilities of the same tokens against a float32 engine of the same weights "
            f"(|difference| mean / p99 / max, nats; the reference's log-probabilities spread "
            f"{figures['reference_log_prob_spread']:.2g}); pallas passes within {TOLERANCE}x XLA's mean + {SLACK}:\n\n"
            + markdown_table(["path", "pallas", "xla", "pallas positions", "verdict"], rows))
    text += (f"\n\nGreedy tokens: {figures['identical_prompts']}/{figures['prompts']} prompts identical for "
             f"{figures['new_tokens']} tokens ({figures['dtype']}, random weights).")
    first = figures["first_divergence"]
    if first is None:
        return text
    cells = [first["prompt"], first["position"], first["pallas_token"], first["xla_token"],
             *(f"{first[key]:.3g}" if first[key] is not None else "-" for key in ("pallas_margin", "xla_margin"))]
    return (text + " First divergence (margin: top-1 minus top-2 log-probability there):\n\n"
            + markdown_table(["prompt", "position", "pallas token", "xla token", "pallas margin", "xla margin"],
                             [cells]))
