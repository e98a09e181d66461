"""What structured output costs: the host's time to fill a step's grammar masks, and engine throughput with every
request constrained by a JSON Schema against the same requests unconstrained, measured in one run.

    masks       64 sequences (--seqs) each following the JSON Schema below over a vocabulary of --vocab tokens (by
                default Llama 3's 128256: random byte strings of 1-8 printable bytes besides the 256 single bytes,
                since no real tokenizer of that size is at hand); per step, every sequence's mask is filled (as the
                scheduler does, one `next_mask` per row) and a random allowed token accepted. Median ms per step.
    throughput  an engine on --model-shape (the built-in model, or random Llama-3.1-8B weights), --requests
                greedy requests: constrained by the schema, then the same prompts unconstrained with ignore_eos and
                max_tokens set to the token counts the constrained run produced, so both generate the same tokens;
                and constrained again with async overlap off (the same engine and programs), which shows what
                filling the masks during the forward pass saves. Rounds rotate the three modes. Generated tokens/s
                per mode (medians) and the ratios per round (medians). A random model's vocabulary is larger than
                the built-in tokenizer's, so its grammars read a synthetic tokenizer of the model's vocabulary (as
                the mask measurement does): masks cost what they would with a real tokenizer of that size, and
                outputs are checked against the schema through that tokenizer's bytes.

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
from jaxserve.engine.structured_output import GrammarCompiler
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_outputs import StructuredOutputsParams
from jaxserve.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=64, help="sequences per step in the mask measurement")
    parser.add_argument("--vocab", type=int, default=128256, help="synthetic vocabulary size for the masks")
    parser.add_argument("--steps", type=int, default=40, help="steps timed in the mask measurement")
    parser.add_argument("--requests", type=int, default=32, help="requests per throughput round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-shape", choices=ENGINE_SHAPES, default="builtin", help="the throughput engine's model")
    parser.add_argument("--dtype", default="float32", help="of the throughput engine's weights")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="of the throughput engine")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None,
                        help="the throughput engine's KV pool (default: sized from device memory)")
    parser.add_argument("--skip-masks", action="store_true", help="measure throughput only")
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


def measure_masks(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    compiler = GrammarCompiler(SyntheticTokenizer(args.vocab), args.vocab, compile_timeout_s=60.0)
    tokenizer_s = time.perf_counter() - started
    constraint = StructuredOutputsParams(json=SCHEMA)
    rng = np.random.default_rng(0)
    matchers = [compiler.matcher(constraint) for _ in range(args.seqs)]
    step_ms = []
    for _ in range(args.steps):
        started = time.perf_counter()
        masks = [m.next_mask() for m in matchers]
        step_ms.append((time.perf_counter() - started) * 1e3)
        for index, mask in enumerate(masks):
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:args.vocab])
            matchers[index].accept(int(rng.choice(allowed)))
            if matchers[index].done:
                matchers[index] = compiler.matcher(constraint)
    return {"seqs": args.seqs, "vocab": args.vocab, "tokenizer_setup_s": tokenizer_s,
            "mask_ms_per_step_median": statistics.median(step_ms), "mask_ms_per_step_max": max(step_ms),
            "mask_us_per_seq_median": statistics.median(step_ms) * 1e3 / args.seqs}


def run_requests(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    started = time.perf_counter()
    for index, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(index), prompt, p)
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    return time.perf_counter() - started, sorted(finished, key=lambda output: int(output.request_id))


# The throughput modes: (constrained, async overlap)
MODES = {"constrained": (True, True), "unconstrained": (False, True), "constrained-no-overlap": (True, False)}


def throughput_engine(args: argparse.Namespace) -> tuple[LLMEngine, Any]:
    """The engine on --model-shape, and the tokenizer its grammars read (the model's own, or a synthetic one of the
    model's vocabulary where the built-in tokenizer is smaller)."""
    model = model_of_shape(args.model_shape, args.dtype, seed=0)
    tokenizer = load_tokenizer(BUILTIN_MODEL_DIR)
    engine = LLMEngine(model, tokenizer, EngineConfig(max_model_len=256, max_num_seqs=args.max_num_seqs,
                                                      max_num_batched_tokens=256,
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
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_index in range(args.rounds):
        order = list(MODES)[round_index % len(MODES):] + list(MODES)[:round_index % len(MODES)]
        for mode in order:
            constrained_mode, overlap = MODES[mode]
            engine.config = dataclasses.replace(overlap_config, async_scheduling=overlap)  # same programs
            seconds, _ = run_requests(engine, prompts, constrained if constrained_mode else plain)
            rates[mode].append(sum(lengths) / seconds)
    engine.config = overlap_config
    ratios = {"constrained_over_unconstrained": [c / u for c, u in zip(rates["constrained"], rates["unconstrained"])],
              "overlap_over_no_overlap": [c / n for c, n in zip(rates["constrained"],
                                                                rates["constrained-no-overlap"])]}
    valid = sum(_matches(o.outputs[0].token_ids, grammar_tokenizer) for o in outputs)
    return {"model": args.model_shape, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
            "requests": args.requests, "generated_tokens": sum(lengths), "valid_outputs": valid,
            "tokens_per_s_median": {mode: statistics.median(r) for mode, r in rates.items()},
            "tokens_per_s": rates,
            "constrained_over_unconstrained": statistics.median(ratios["constrained_over_unconstrained"]),
            "overlap_over_no_overlap": statistics.median(ratios["overlap_over_no_overlap"]), "ratios": ratios,
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
            "largest_workspace_bytes": max(runner.compiled_workspaces().values(), default=0)}


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
              "throughput": measure_throughput(args)}
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
