"""What serving LoRA adapters costs: generated tokens/s of one batch on the base model against the same batch spread
over several adapters, on one engine, in one run.

Model: --model (a checkpoint folder), or --model-shape: the built-in tiny model (the default) or random weights of
Llama-3.1-8B's shapes, built on the device, so that a GPU without weights runs it. The weights are read once and
both engines run the same arrays (a step donates only its KV pool): two 8B engines take 16 GB of weights, not 32.
Each engine's pool holds --num-kv-pages pages, by default max_num_seqs sequences of max_model_len (never sized from
free memory, which would leave the second engine none).

Workload (seeded, fresh each round, the same for every variant of a round): --num-requests prompts of --prompt-len
random token ids, each generating --max-tokens tokens (greedy, ignore_eos), all added to the engine at once; the
timed span runs from the first `add_request` to the step that finishes the last request. Variants:

    base      an engine with enable_lora (max_loras = --num-adapters, max_lora_rank = --rank), every request on the
              base model (lora_request None)
    adapters  the same engine, the requests spread round-robin over --num-adapters random adapters of rank --rank
              on all seven projections (q/k/v/o/gate/up/down), written in PEFT's format and shaped to the model
    lora-off  (--lora-off, the default) an engine without enable_lora, of the same limits, on the base-only batch:
              what enabling LoRA costs requests that use no adapter

`base` and `adapters` share one engine, so they run the same compiled programs; the product's target is adapters /
base >= 0.8x. The step computes every slot's delta for every token and masks the other slots' (model/lora.py), so
the device work of both is the same and adapters / base shows what the adapters' requests add around it (their slot
per token, slot writes). The device cost of the adapter path is base / lora-off: it grows with slots x rank against
the projections' width, so the built-in tiny model (hidden 64, with 5 slots x rank 16 = 80 rows of A per projection)
pays far more than a real model would. On a CPU, though, the built-in model's step is bound by host work (a few ms
of scheduling and dispatch per step), so its ratios stay near 1 and load from other processes decides their spread.
`lora-off` compiles programs of its own (start-up time is reported); --no-lora-off leaves it out, halving start-up.

Each variant runs one untimed warm-up (it writes the adapters into their slots, which stay there: there are as many
slots as adapters); then `--rounds` rounds alternate the variants, the starting one rotating each round. Ratios are
taken within each round, then their median is reported. Per round the script also compares greedy outputs: the
adapters must change them (`adapters_change_outputs`, the share of requests whose output differs from base), and the
base model must give the same tokens with LoRA on and off (`base_same_as_lora_off`).

    python benchmarks/lora.py --out lora.json                       # PNG beside it when matplotlib imports
    python benchmarks/lora.py --model-shape llama-3.1-8b --max-num-seqs 64 --max-num-batched-tokens 2048 \
        --num-requests 256 --prompt-len 512 --max-tokens 256 --out lora.json  # a GPU, random 8B weights in bf16
    python benchmarks/lora.py --model /models/llama-3.1-8b ...      # a checkpoint's weights instead
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve import LoRARequest, SamplingParams
from jaxserve.checkpoint import LoadedModel, load_model
from jaxserve.checkpoint.lora_config import PROJECTIONS
from jaxserve.checkpoint.random_lora import write_random_lora_adapter
from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.model.config import LlamaConfig
from jaxserve.tokenizer import Tokenizer, load_tokenizer
from bench_machine import machine_description
from model_shapes import ENGINE_SHAPES, model_of_shape

BASE, ADAPTERS, LORA_OFF = "base", "adapters", "lora-off"
LORA_ON_ENGINE, LORA_OFF_ENGINE = "lora-on", "lora-off"
ENGINE_OF = {BASE: LORA_ON_ENGINE, ADAPTERS: LORA_ON_ENGINE, LORA_OFF: LORA_OFF_ENGINE}  # variant -> its engine
TARGET_ADAPTERS_VS_BASE = 0.8  # the product's target for adapters / base
TARGET_RATIO = f"{ADAPTERS} / {BASE}"  # the ratio the target is for, as summarize names it
WARM_UP_ROUND = 0  # workload index of the untimed warm-up; timed rounds use 1..rounds


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", type=Path, default=None, help="HF or converted model folder (default: --model-shape)")
    model.add_argument("--model-shape", choices=ENGINE_SHAPES, default="builtin",
                       help="builtin: the built-in tiny model; llama-3.1-8b: random weights of its shapes")
    parser.add_argument("--dtype", default="auto",
                        help="weights and activations (auto: the checkpoint's or shape's dtype, float32 on the CPU)")
    parser.add_argument("--num-requests", type=int, default=64, help="prompts in the batch")
    parser.add_argument("--prompt-len", type=int, default=64, help="random token ids per prompt")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates")
    parser.add_argument("--num-adapters", type=int, default=4, help="adapters the requests spread over; max_loras")
    parser.add_argument("--rank", type=int, default=16, help="rank of every adapter; max_lora_rank")
    parser.add_argument("--lora-off", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the base-only batch on an engine without enable_lora (compiles its programs; "
                             "--no-lora-off: one engine, half the start-up)")
    parser.add_argument("--rounds", type=int, default=7, help="timed runs per variant, alternated")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: --prompt-len plus --max-tokens")
    parser.add_argument("--num-kv-pages", type=int, default=None,
                        help="KV pool pages per engine, the null page included (default: --max-num-seqs sequences "
                             "of --max-model-len)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompts and the adapters' weights")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, default=None,
                        help="the PNG (default: --out with .png, when matplotlib imports)")
    args = parser.parse_args(argv)
    needed = args.prompt_len + args.max_tokens
    if args.max_model_len is None:
        args.max_model_len = needed
    elif args.max_model_len < needed:
        parser.error(f"--max-model-len must hold a prompt plus its output: {needed}")
    if min(args.num_requests, args.prompt_len, args.max_tokens, args.num_adapters, args.rank, args.rounds) < 1:
        parser.error("--num-requests, --prompt-len, --max-tokens, --num-adapters, --rank and --rounds must be >= 1")
    return args


def variant_names(args: argparse.Namespace) -> list[str]:
    return [BASE, ADAPTERS] + ([LORA_OFF] if args.lora_off else [])


# --- workload and adapters -----------------------------------------------------------------------------------------

def make_prompts(args: argparse.Namespace, index: int, vocab_size: int) -> list[list[int]]:
    """The index-th seeded batch of random prompts, as token ids."""
    rng = np.random.default_rng([args.seed, index])
    return [[int(t) for t in rng.integers(0, vocab_size, args.prompt_len)] for _ in range(args.num_requests)]


def write_adapters(folder: Path, config: LlamaConfig, args: argparse.Namespace) -> list[LoRARequest]:
    """--num-adapters random adapters of rank --rank on every projection, each seeded apart, shaped to `config`."""
    adapters = []
    for index in range(args.num_adapters):
        path = folder / f"adapter{index}"
        write_random_lora_adapter(path, config, rank=args.rank, projections=tuple(PROJECTIONS),
                                  seed=args.seed * 1000 + index)
        adapters.append(LoRARequest(f"adapter{index}", index + 1, str(path)))
    return adapters


def round_robin(adapters: Sequence[LoRARequest], count: int) -> list[LoRARequest]:
    """Request i gets adapter i mod len(adapters)."""
    return [adapters[i % len(adapters)] for i in range(count)]


# --- engines and runs ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RunResult:
    """One batch through one engine; outputs in prompt order."""

    wall_s: float  # from the first add_request to the step that finished the last request
    generated_tokens: int
    steps: int  # engine steps the batch took
    outputs: tuple[tuple[int, ...], ...]  # each request's generated token ids

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s

    @property
    def step_ms(self) -> float:
        return self.wall_s / self.steps * 1e3


def load_benchmark_model(args: argparse.Namespace) -> LoadedModel:
    """--model's weights, or --model-shape's model; read once, both engines run it."""
    if args.model is not None:
        return load_model(args.model, args.dtype, progress=False)
    return model_of_shape(args.model_shape, args.dtype, args.seed)


def model_name(args: argparse.Namespace) -> str:
    if args.model is not None:
        return str(args.model)
    return "built-in tiny random model" if args.model_shape == "builtin" else f"random {args.model_shape}"


def engine_config(args: argparse.Namespace, model: LoadedModel, enable_lora: bool) -> EngineConfig:
    """The benchmark's limits, with or without adapter slots; --num-kv-pages pages, or max_num_seqs full sequences."""
    lora = dict(enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank) if enable_lora else {}
    config = EngineConfig(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed, **lora)
    pages = args.num_kv_pages
    if pages is None:
        pages = args.max_num_seqs * -(-args.max_model_len // config.block_size) + 1
    return config.with_model_limit(model.config.max_position_embeddings).with_pool(pages)


def start_engines(args: argparse.Namespace, model: LoadedModel,
                  tokenizer: Tokenizer) -> tuple[dict[str, LLMEngine], dict[str, float]]:
    """The engines by ENGINE_OF's names (lora-off only with --lora-off), all on `model`'s weights, and each one's
    start-up seconds (compiling its step programs)."""
    engines, startup_s = {}, {}
    for name in dict.fromkeys(ENGINE_OF[variant] for variant in variant_names(args)):
        started = time.perf_counter()
        engines[name] = LLMEngine(model, tokenizer, engine_config(args, model, name == LORA_ON_ENGINE),
                                  progress=False)
        startup_s[name] = time.perf_counter() - started
        print(f"{name} engine ready in {startup_s[name]:.1f} s ({engines[name].startup_stats.programs} programs)",
              flush=True)
    return engines, startup_s


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
              loras: list[LoRARequest | None], tag: str) -> RunResult:
    """The whole batch added at once, stepped until every request has finished; timed."""
    steps_before = engine.stats().num_steps
    ids = [f"{tag}-{index}" for index in range(len(prompts))]
    outputs: dict[str, tuple[int, ...]] = {}
    started = time.perf_counter()
    for request_id, prompt, lora in zip(ids, prompts, loras):
        engine.add_request(request_id, prompt, params, lora_request=lora)
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = tuple(output.outputs[0].token_ids)
    wall_s = time.perf_counter() - started
    token_ids = tuple(outputs[request_id] for request_id in ids)
    return RunResult(wall_s=wall_s, generated_tokens=sum(map(len, token_ids)),
                     steps=engine.stats().num_steps - steps_before, outputs=token_ids)


def run_variant(variant: str, engines: dict[str, LLMEngine], prompts: list[list[int]],
                adapters: list[LoRARequest], params: SamplingParams, tag: str) -> RunResult:
    """One variant's run: its engine, and the adapters round-robin for `adapters`, else the base model."""
    loras = round_robin(adapters, len(prompts)) if variant == ADAPTERS else [None] * len(prompts)
    return run_batch(engines[ENGINE_OF[variant]], prompts, params, loras, tag)


def run_rounds(engines: dict[str, LLMEngine], adapters: list[LoRARequest],
               args: argparse.Namespace) -> dict[str, list[RunResult]]:
    """One untimed warm-up per variant, then `rounds` rounds alternating the variants over each round's prompts."""
    variants = variant_names(args)
    vocab_size = engines[LORA_ON_ENGINE].vocab_size
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warm_up = make_prompts(args, WARM_UP_ROUND, vocab_size)
    for variant in variants:
        run_variant(variant, engines, warm_up, adapters, params, f"warm-up-{variant}")
    results: dict[str, list[RunResult]] = {variant: [] for variant in variants}
    for round_index in range(1, args.rounds + 1):
        prompts = make_prompts(args, round_index, vocab_size)
        shift = (round_index - 1) % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            results[variant].append(run_variant(variant, engines, prompts, adapters, params,
                                                f"round{round_index}-{variant}"))
            print(f"round {round_index} {variant:<9} {results[variant][-1].tokens_per_s:8.1f} generated tok/s",
                  flush=True)
    return results


# --- figures -------------------------------------------------------------------------------------------------------

def per_round_ratios(results: dict[str, list[RunResult]], numerator: str, denominator: str) -> list[float]:
    """Throughput ratio within each round: both variants ran the same prompts there."""
    return [a.tokens_per_s / b.tokens_per_s for a, b in zip(results[numerator], results[denominator])]


def ratio_pairs(results: dict[str, list[RunResult]]) -> list[tuple[str, str]]:
    """The ratios reported, each as (numerator, denominator) variants; the lora-off ones only when it ran."""
    return [(ADAPTERS, BASE)] + ([(BASE, LORA_OFF), (ADAPTERS, LORA_OFF)] if LORA_OFF in results else [])


def ratio_name(numerator: str, denominator: str) -> str:
    return f"{numerator} / {denominator}"


def summarize(results: dict[str, list[RunResult]]) -> dict[str, Any]:
    """Per variant its engine and medians over rounds; each ratio per round and its median; the output checks."""
    variants = {variant: {"engine": ENGINE_OF[variant],
                          "tokens_per_s": statistics.median(r.tokens_per_s for r in runs),
                          "tokens_per_s_per_round": [r.tokens_per_s for r in runs],
                          "wall_s": statistics.median(r.wall_s for r in runs),
                          "steps": statistics.median(r.steps for r in runs),
                          "step_ms": statistics.median(r.step_ms for r in runs),
                          "generated_tokens": statistics.median(r.generated_tokens for r in runs)}
                for variant, runs in results.items()}
    ratios = {}
    for numerator, denominator in ratio_pairs(results):
        rounds = per_round_ratios(results, numerator, denominator)
        ratios[ratio_name(numerator, denominator)] = {"median": statistics.median(rounds), "per_round": rounds}
    pairs = list(zip(results[BASE], results[ADAPTERS]))
    changed = sum(a != b for base, adapted in pairs for a, b in zip(base.outputs, adapted.outputs))
    checks = {"adapters_change_outputs": changed / sum(len(base.outputs) for base, _ in pairs)}
    if LORA_OFF in results:
        checks["base_same_as_lora_off"] = all(a.outputs == b.outputs for a, b in zip(results[BASE], results[LORA_OFF]))
    return {"variants": variants, "ratios": ratios, "checks": checks,
            "meets_target": ratios[TARGET_RATIO]["median"] >= TARGET_ADAPTERS_VS_BASE}


def format_table(summary: dict[str, Any]) -> str:
    header = (f"{'variant':<9} {'engine':<8} {'gen tok/s':>9} {'wall s':>7} {'steps':>6} {'ms/step':>7} {'vs base':>8}"
              "  per round tok/s")
    lines = [header]
    base = summary["variants"][BASE]["tokens_per_s"]
    for variant, row in summary["variants"].items():
        engine = row["engine"]
        per_round = " ".join(f"{t:.1f}" for t in row["tokens_per_s_per_round"])
        lines.append(f"{variant:<9} {engine:<8} {row['tokens_per_s']:>9.1f} {row['wall_s']:>7.2f} "
                     f"{row['steps']:>6.0f} {row['step_ms']:>7.2f} {row['tokens_per_s'] / base:>7.2f}x  {per_round}")
    for name, ratio in summary["ratios"].items():
        per_round = " ".join(f"{r:.2f}" for r in ratio["per_round"])
        target = (f" (target >= {TARGET_ADAPTERS_VS_BASE}x: {'met' if summary['meets_target'] else 'NOT met'})"
                  if name == TARGET_RATIO else "")
        lines.append(f"{name}: {ratio['median']:.2f}x{target}; per round {per_round}")
    checks = summary["checks"]
    lines.append(f"requests whose output the adapters change: {checks['adapters_change_outputs']:.0%}"
                 + (f"; base outputs same with LoRA on and off: {checks['base_same_as_lora_off']}"
                    if "base_same_as_lora_off" in checks else ""))
    return "\n".join(lines)


def plot(summary: dict[str, Any], title: str, path: Path) -> bool:
    """Tokens/s per variant (median bar, rounds as dots) and each ratio per round against the target; False (nothing
    written) without matplotlib."""
    try:
        import matplotlib  # here: only the plot needs it, and it is optional
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, ratios) = plt.subplots(1, 2, figsize=(11, 4.5))
    for x, (variant, row) in enumerate(summary["variants"].items()):
        speed.bar(x, row["tokens_per_s"], color=f"C{x}", alpha=0.6, label=variant)
        speed.plot([x] * len(row["tokens_per_s_per_round"]), row["tokens_per_s_per_round"], "k.")
    speed.set_xticks(range(len(summary["variants"])), list(summary["variants"]))
    speed.set(ylabel="generated tokens/s", title="throughput (bars: median; dots: rounds)")
    rounds = range(1, len(summary["variants"][BASE]["tokens_per_s_per_round"]) + 1)
    for name, ratio in summary["ratios"].items():
        ratios.plot(rounds, ratio["per_round"], "o-", label=name)
    ratios.axhline(TARGET_ADAPTERS_VS_BASE, color="red", linestyle="--", linewidth=1,
                   label=f"target adapters / base >= {TARGET_ADAPTERS_VS_BASE}")
    ratios.axhline(1.0, color="gray", linewidth=0.8)
    ratios.set(xlabel="round", ylabel="tokens/s ratio", title="ratios within each round", xticks=rounds)
    ratios.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model = load_benchmark_model(args)
    engines, startup_s = start_engines(args, model, load_tokenizer(model.model_dir))
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as folder:
        adapters = write_adapters(Path(folder), model.stored_config, args)
        results = run_rounds(engines, adapters, args)
    summary = summarize(results)
    compiles = {name: engine.compiles_after_warmup for name, engine in engines.items()}
    report = {
        "machine": machine_description(),
        "model": model_name(args),
        "dtype": np.dtype(model.dtype).name,
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
        "num_kv_pages": {name: engine.config.num_kv_pages for name, engine in engines.items()},
        "engine_startup_s": startup_s,
        "engine_programs": {name: engine.startup_stats.programs for name, engine in engines.items()},
        "compiles_after_warmup": compiles,
        "target_adapters_vs_base": TARGET_ADAPTERS_VS_BASE,
        **summary,
        "runs": {variant: [{**{k: v for k, v in dataclasses.asdict(r).items() if k != "outputs"},
                            "tokens_per_s": r.tokens_per_s, "step_ms": r.step_ms} for r in runs]
                 for variant, runs in results.items()},
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    machine = report["machine"]
    title = (f"LoRA, {report['model']}: {args.num_requests} requests x {args.max_tokens} tokens, {args.num_adapters} "
             f"adapters of rank {args.rank}, {machine['device']}")
    plot_path = args.plot or (args.out.with_suffix(".png") if args.out else None)
    drawn = plot_path is not None and plot(summary, title, plot_path)
    print(f"{report['model']} ({report['dtype']}) on {machine['device']} ({machine['jax_backend']}); "
          f"{args.num_requests} requests, prompts {args.prompt_len}, outputs {args.max_tokens}; {args.num_adapters} "
          f"adapters of rank {args.rank} on every projection; max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
          f"{args.max_num_batched_tokens}, max_model_len {args.max_model_len}; {args.rounds} rounds, variants "
          f"alternated; start-up s: {', '.join(f'{k} {v:.1f}' for k, v in startup_s.items())}; compiles after "
          f"warm-up {compiles}; plot: {plot_path if drawn else 'none'}")
    print(format_table(summary))
    return report


if __name__ == "__main__":
    main()
