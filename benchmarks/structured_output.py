"""What structured output costs: the host's time to fill a step's grammar masks, and engine throughput with every
request constrained by a JSON Schema against the same requests unconstrained, measured in one run.

    masks       64 sequences (--seqs) each following the JSON Schema below over a vocabulary of --vocab tokens (by
                default Llama 3's 128256: random byte strings of 1-8 printable bytes besides the 256 single bytes,
                since no real tokenizer of that size is at hand); per step, every sequence's mask is filled (as the
                scheduler does, one `next_mask` per row) and a random allowed token accepted. Median ms per step.
    throughput  the built-in model's engine, --requests greedy requests: constrained by the schema, then the same
                prompts unconstrained with ignore_eos and max_tokens set to the token counts the constrained run
                produced, so both generate the same tokens; rounds alternate the two (the starting one rotates).
                Generated tokens/s per mode (medians) and the constrained/unconstrained ratio per round (median).

Constrained requests keep async overlap: each step's masks are filled after the previous step is read back, while
its forward pass runs (LLMEngine.step). On a CPU the "device" is the host's own cores and a step of the tiny model
takes about a millisecond, so what overlap hides there is far less than on a GPU.

    python benchmarks/structured_output.py --out structured_output.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench_machine import machine_description
from jaxserve.config import EngineConfig
from jaxserve.checkpoint import load_model
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


def measure_throughput(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = load_tokenizer(BUILTIN_MODEL_DIR)
    engine = LLMEngine(load_model(None, dtype="float32"), tokenizer,
                       EngineConfig(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256), progress=False)
    rng = np.random.default_rng(1)
    prompts = [tokenizer.encode(f"Person {i}: " + "x" * int(rng.integers(4, 40))) for i in range(args.requests)]
    constrained = [SamplingParams(max_tokens=64, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
                   for _ in prompts]
    _, outputs = run_requests(engine, prompts, constrained)  # warm-up, and the token counts to match
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    plain = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
    modes = {"constrained": constrained, "unconstrained": plain}
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    ratios = []
    for round_index in range(args.rounds):
        order = list(modes) if round_index % 2 == 0 else list(modes)[::-1]
        seconds = {mode: run_requests(engine, prompts, modes[mode])[0] for mode in order}
        for mode in modes:
            rates[mode].append(sum(lengths) / seconds[mode])
        ratios.append(seconds["unconstrained"] / seconds["constrained"])
    valid = sum(_matches(o.outputs[0].text) for o in outputs)
    return {"requests": args.requests, "generated_tokens": sum(lengths), "valid_outputs": valid,
            "tokens_per_s_median": {mode: statistics.median(r) for mode, r in rates.items()},
            "constrained_over_unconstrained": statistics.median(ratios), "ratios": ratios,
            "compiles_after_warmup": engine.compiles_after_warmup}


def _matches(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main(argv=None) -> None:
    args = parse_args(argv)
    result = {"machine": machine_description(), "masks": measure_masks(args), "throughput": measure_throughput(args)}
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
