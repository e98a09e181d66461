"""What structured output costs: the host's time to fill a step's grammar masks, and engine throughput with every
request constrained by a JSON Schema against the same requests unconstrained, measured in one run.

    masks       64 sequences (--seqs) each following the JSON Schema below over a vocabulary of --vocab tokens (by
                default Llama 3's 128256: random byte strings of 1-8 printable bytes besides the 256 single bytes,
                since no real tokenizer of that size is at hand); per step, the whole step's masks are filled as the
                engine fills them, and a random allowed token accepted. Twice, by twin sequences that accept the
                same tokens: on the sequential path (one thread, row after row, all sequences copies of one start
                matcher: the engine before the parallel fill) and on llguidance's thread pool over --mask-threads
                threads (default: this host's cores; a start matcher per thread), each from a grammar compiler of
                its own (no cache shared), their order alternating step by step. Median and worst ms per step of
                each, the speed-up, and whether every step's masks were identical.
    throughput  an engine on --model-shape (the built-in model, or random Llama-3.1-8B weights), --requests
                greedy requests: constrained by the schema, then the same prompts unconstrained with ignore_eos and
                max_tokens set to the token counts the constrained run produced, so both generate the same tokens;
                constrained again with async overlap off (the same engine and programs), which shows what filling
                the masks during the forward pass saves; and constrained with the same matchers' masks filled on one
                thread (the engine before the parallel fill, in the same run). Rounds rotate the four modes.
                Generated tokens/s per mode (medians) and the ratios per round (medians). A random model's
                vocabulary is larger than the built-in tokenizer's, so its grammars read a synthetic tokenizer of
                the model's vocabulary (as the mask measurement does): masks cost what they would with a real
                tokenizer of that size, and outputs are checked against the schema through that tokenizer's bytes.

Constrained requests keep async overlap: each step's masks are filled after the previous step is read back, while
its forward pass runs (LLMEngine.step). On a CPU the "device" is the host's own cores and a step of the tiny model
takes about a millisecond, so what overlap hides there is far less than on a GPU.

    python benchmarks/structured_output.py --out structured_output.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from bench_machine import machine_description
from model_shapes import ENGINE_SHAPES, model_of_shape
from jaxserve.config import EngineConfig
from jaxserve.checkpoint.builtin import BUILTIN_MODEL_DIR
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.structured_output import GrammarCompiler, MaskFiller
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_outputs import StructuredOutputsParams
from jaxserve.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


MAX_MODEL_LEN = 256  # of the throughput engine: a prompt and its JSON fit with room


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=64, help="sequences per step in the mask measurement")
    parser.add_argument("--vocab", type=int, default=128256, help="synthetic vocabulary size for the masks")
    parser.add_argument("--steps", type=int, default=40, help="steps timed in the mask measurement")
    parser.add_argument("--mask-threads", type=int, default=None,
                        help="threads of the parallel mask fill (default: this host's cores, as the engine)")
    parser.add_argument("--requests", type=int, default=32, help="requests per throughput round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-shape", choices=ENGINE_SHAPES, default="builtin", help="the throughput engine's model")
    parser.add_argument("--dtype", default="float32", help="of the throughput engine's weights")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="of the throughput engine")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None,
                        help="the throughput engine's KV pool (default: sized from device memory)")
    parser.add_argument("--skip-masks", action="store_true", help="measure throughput only")
    parser.add_argument("--skip-throughput", action="store_true", help="measure the masks only")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


class SyntheticTokenizer:
    """The part of jaxserve's Tokenizer that GrammarCompiler reads, over random tokens (bytes encode one by one)."""

    def __init__(self, vocab_size: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        singles = [bytes([b]) for b in range(256)]
        lengths = rng.integers(1, 9, size=vocab_size - 256 - 1)
        self._tokens = singles + [bytes(rng.integers(32, 127, size=n).tolist()) for n in lengths] + [b"<|eos|>"]
        self.vocab_size = vocab_size
        self.eos_token_ids = (vocab_size - 1,)
        self.bos_token_id = None
        self.all_special_ids = frozenset(self.eos_token_ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self._tokens[token_id]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


MASK_PATHS = ("sequential", "parallel")  # one thread row after row (the reference), llguidance's pool (the engine's)


def measure_masks(args: argparse.Namespace) -> dict[str, Any]:
    """Each path's ms per step over twin sequences (the same tokens accepted), alternating which path goes first."""
    tokenizer = SyntheticTokenizer(args.vocab)
    started = time.perf_counter()
    compilers = {"sequential": GrammarCompiler(tokenizer, args.vocab, 60.0, mask_threads=1),
                 "parallel": GrammarCompiler(tokenizer, args.vocab, 60.0, mask_threads=args.mask_threads)}
    tokenizer_s = (time.perf_counter() - started) / len(compilers)
    constraint = StructuredOutputsParams(json=SCHEMA)
    rng = np.random.default_rng(0)
    twins = {path: [compiler.matcher(constraint) for _ in range(args.seqs)] for path, compiler in compilers.items()}
    step_ms: dict[str, list[float]] = {path: [] for path in MASK_PATHS}
    differing_steps = 0
    for step in range(args.steps):
        filled = {}
        for path in MASK_PATHS if step % 2 == 0 else MASK_PATHS[::-1]:
            started = time.perf_counter()
            filled[path] = compilers[path].masks.filled(dict(enumerate(twins[path])), args.seqs).allowed
            step_ms[path].append((time.perf_counter() - started) * 1e3)
        differing_steps += not np.array_equal(filled["sequential"], filled["parallel"])
        for index, mask in enumerate(filled["sequential"]):
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:args.vocab])
            token = int(rng.choice(allowed))
            for path, compiler in compilers.items():
                twins[path][index].accept(token)
                if twins[path][index].done:
                    twins[path][index] = compiler.matcher(constraint)
    medians = {path: statistics.median(ms) for path, ms in step_ms.items()}
    return {"seqs": args.seqs, "vocab": args.vocab, "tokenizer_setup_s": tokenizer_s,
            "threads": compilers["parallel"].masks.threads,
            # Whether the parallel path's steps were big enough to go to the pool (MaskFiller.parallel_from_tokens)
            "pooled": args.seqs * args.vocab >= compilers["parallel"].masks.parallel_from_tokens,
            # The engine's path (parallel), as the figures before the parallel fill were named:
            "mask_ms_per_step_median": medians["parallel"], "mask_ms_per_step_max": max(step_ms["parallel"]),
            "mask_us_per_seq_median": medians["parallel"] * 1e3 / args.seqs,
            "ms_per_step_median": medians, "ms_per_step_max": {path: max(ms) for path, ms in step_ms.items()},
            "ms_per_step": step_ms, "speedup_median": medians["sequential"] / medians["parallel"],
            "speedup_of_totals": sum(step_ms["sequential"]) / sum(step_ms["parallel"]),
            "identical_masks": differing_steps == 0, "differing_steps": differing_steps}


def run_requests(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    started = time.perf_counter()
    for index, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(index), prompt, p)
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    return time.perf_counter() - started, sorted(finished, key=lambda output: int(output.request_id))


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way the throughput requests run on the same engine."""

    constrained: bool  # every request under the schema, else the same tokens unconstrained
    overlap: bool  # async scheduling: masks filled while the step's forward pass runs
    parallel_masks: bool = True  # masks filled on llguidance's pool, else on one thread row after row


MODES = {"constrained": Mode(True, True), "unconstrained": Mode(False, True),
         "constrained-no-overlap": Mode(True, False),
         "constrained-sequential-masks": Mode(True, True, parallel_masks=False)}


def throughput_engine(args: argparse.Namespace) -> tuple[LLMEngine, Any]:
    """The engine on --model-shape, and the tokenizer its grammars read (the model's own, or a synthetic one of the
    model's vocabulary where the built-in tokenizer is smaller)."""
    model = model_of_shape(args.model_shape, args.dtype, seed=0)
    tokenizer = load_tokenizer(BUILTIN_MODEL_DIR)
    engine = LLMEngine(model, tokenizer, EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=args.max_num_seqs,
                                                      max_num_batched_tokens=MAX_MODEL_LEN,
                                                      kv_cache_memory_gb=args.kv_cache_memory_gb), progress=False)
    vocab = model.config.vocab_size
    if vocab <= tokenizer.vocab_size:
        return engine, tokenizer
    grammar_tokenizer = SyntheticTokenizer(vocab)
    engine.grammars = GrammarCompiler(grammar_tokenizer, vocab, engine.config.grammar_compile_timeout_s)
    return engine, grammar_tokenizer


def measure_throughput(args: argparse.Namespace) -> dict[str, Any]:
    engine, grammar_tokenizer = throughput_engine(args)
    rng = np.random.default_rng(1)
    prompts = [engine.tokenizer.encode(f"Person {i}: " + "x" * int(rng.integers(4, 40))) for i in range(args.requests)]
    constrained = [SamplingParams(max_tokens=64, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
                   for _ in prompts]
    _, outputs = run_requests(engine, prompts, constrained)  # warm-up, and the token counts to match
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    plain = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    overlap_config = engine.config
    fillers = {True: engine.grammars.masks, False: MaskFiller(engine.grammars.vocab_size, threads=1)}
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        order = list(MODES)[round_index % len(MODES):] + list(MODES)[:round_index % len(MODES)]
        for name in order:
            mode = MODES[name]
            engine.config = dataclasses.replace(overlap_config, async_scheduling=mode.overlap)  # same programs
            engine.grammars.masks = fillers[mode.parallel_masks]
            seconds, _ = run_requests(engine, prompts, constrained if mode.constrained else plain)
            rates[name].append(sum(lengths) / seconds)
    engine.config, engine.grammars.masks = overlap_config, fillers[True]

    def per_round(numerator: str, denominator: str) -> list[float]:
        return [a / b for a, b in zip(rates[numerator], rates[denominator])]

    ratios = {"constrained_over_unconstrained": per_round("constrained", "unconstrained"),
              "sequential_masks_over_unconstrained": per_round("constrained-sequential-masks", "unconstrained"),
              "parallel_over_sequential_masks": per_round("constrained", "constrained-sequential-masks"),
              "overlap_over_no_overlap": per_round("constrained", "constrained-no-overlap")}
    valid = sum(_matches(o.outputs[0].token_ids, grammar_tokenizer) for o in outputs)
    return {"model": args.model_shape, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
            "requests": args.requests, "generated_tokens": sum(lengths), "valid_outputs": valid,
            "tokens_per_s_median": {mode: statistics.median(r) for mode, r in rates.items()},
            "tokens_per_s": rates,
            **{name: statistics.median(values) for name, values in ratios.items()}, "ratios": ratios,
            "mask_threads": fillers[True].threads,
            "host_ms_per_step": engine.phase_times.per_step_ms(),
            "compiles_after_warmup": engine.compiles_after_warmup, "device_memory": _device_memory(engine)}


def _device_memory(engine: LLMEngine) -> dict[str, int] | None:
    """The device allocator's peak and the pool's and weights' bytes (None where the backend keeps no statistics):
    a peak well above weights + pool + workspace means a program allocated what its compiled temp did not say."""
    stats = jax.local_devices()[0].memory_stats()
    if not stats:
        return None
    runner = engine.runner
    pool = sum(leaf.nbytes for leaf in jax.tree.leaves(runner.pool))
    weights = sum(leaf.nbytes for leaf in jax.tree.leaves(runner.params))
    return {"peak_bytes_in_use": stats.get("peak_bytes_in_use", 0), "bytes_limit": stats.get("bytes_limit", 0),
            "pool_bytes": pool, "weight_bytes": weights,
            "largest_workspace_bytes": max(runner.programs.compiled_workspaces().values(), default=0)}


def _matches(token_ids, tokenizer) -> bool:
    """The output, spelled by the grammar's tokenizer, is JSON valid against the schema."""
    import jsonschema

    text = b"".join(tokenizer.token_bytes(t) for t in token_ids if t not in tokenizer.eos_token_ids)
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main(argv=None) -> None:
    args = parse_args(argv)
    result = {"machine": machine_description(), "masks": None if args.skip_masks else measure_masks(args),
              "throughput": None if args.skip_throughput else measure_throughput(args)}
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
