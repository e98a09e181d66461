"""Serving over HTTP as users run it: `jaxserve serve --config PRESET --model DIR` on a random-weight checkpoint of
the model's shapes, driven by benchmarks/serve.py at each concurrency level for a fixed time (streamed completions,
random token-id prompts, ignore_eos), TTFT / TPOT / ITL at p50 and p95.

The checkpoint (HF safetensors, the built-in tokenizer beside it) is written once into the work folder, by a process
of its own so that the GPU memory its weights took is free before the server starts, and reused by later runs.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import shutil
import time
from pathlib import Path
from typing import Any

from engine_bench import ENGINE_INIT_STD
from gpu_parts.context import REPO, PartContext, PartOutcome, markdown_table, run_benchmark_script
from jaxserve.checkpoint import BUILTIN_MODEL_DIR
from jaxserve.checkpoint.safetensors_writer import save_random_llama
from model_shapes import model_config

PERCENTILES = "50,95,99"
CHECKPOINT_MARKER = "written.json"  # written last: a folder without it is half written and is written again
SHARD_BYTES = 5 * 10**9  # as HF shards Llama checkpoints


def run(context: PartContext, model: str, dtype: str, config: str, concurrency: list[int], seconds_per_level: float,
        input_len: int, output_len: int, max_prompts: int) -> PartOutcome:
    server_env = dict(os.environ)  # before serve_overhead's import: serve.py sets its own process's JAX allocator
    from serve_overhead import running_server

    folder = context.work_dir / f"random-{model}-{dtype}"
    checkpoint_s = ensure_checkpoint(folder, model, dtype)
    with running_server(REPO / config, context.work_dir, "--model", str(folder), env=server_env) as (url, startup_s):
        plot_args = ["--plot", str(context.plot)] if context.plot is not None else []
        report = run_benchmark_script("serve.py", [
            "--base-url", url, "--input-len", str(input_len), "--output-len", str(output_len),
            "--num-prompts", str(max_prompts), "--concurrency-sweep", ",".join(map(str, concurrency)),
            "--duration-s", str(seconds_per_level), "--metric-percentiles", PERCENTILES, *plot_args,
        ], context.work_dir / "serve.json")
    figures = {"checkpoint_seconds": checkpoint_s, "server_startup_seconds": startup_s, "config": config,
               "model": model, "levels": [level_figures(s) for s in report["scenarios"]], "report": report}
    passed = all(level["completed"] > 0 and level["failed"] == 0 for level in figures["levels"])
    return PartOutcome(figures, summary(figures), passed)


def ensure_checkpoint(folder: Path, model: str, dtype: str) -> float | None:
    """Writes the random checkpoint unless a complete one of this model and dtype is there; the seconds it took, or
    None when it was reused."""
    marker = folder / CHECKPOINT_MARKER
    wanted = {"model": model, "dtype": dtype}
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return None
    shutil.rmtree(folder, ignore_errors=True)
    start = time.perf_counter()
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as writer:
        writer.submit(write_checkpoint, folder, model, dtype).result()
    marker.write_text(json.dumps(wanted))
    return time.perf_counter() - start


def write_checkpoint(folder: Path, model: str, dtype: str) -> None:
    """Runs in the writer's process: random weights of the model's shapes at a trained model's scale, and the
    built-in tokenizer widened to the model's vocabulary (prompts are token ids)."""
    config = model_config(model)
    save_random_llama(folder, config, dtype=dtype, init_std=ENGINE_INIT_STD, max_shard_bytes=SHARD_BYTES)
    for source in BUILTIN_MODEL_DIR.iterdir():
        if source.name != "config.json":
            shutil.copy(source, folder / source.name)
    cover_vocabulary(folder / "tokenizer.json", config["vocab_size"])


def cover_vocabulary(tokenizer_file: Path, vocab_size: int) -> None:
    """Spells every id below `vocab_size` that the tokenizer lacks as a plain added token, `[id]`.

    A random model samples its whole vocabulary (128,256 ids for Llama 3) and the built-in tokenizer knows 512:
    the ids past it decode to no text, so a stream would carry no output chunk to time. Added tokens, as Llama 3's
    own tokenizer.json keeps its specials past the BPE vocabulary, leave the encoding of ordinary text unchanged."""
    spec = json.loads(tokenizer_file.read_text())
    known = {token["id"] for token in spec["added_tokens"]} | set(spec["model"]["vocab"].values())
    spec["added_tokens"] += [{"id": token_id, "content": f"[{token_id}]", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": False}
                             for token_id in range(vocab_size) if token_id not in known]
    tokenizer_file.write_text(json.dumps(spec))


def level_figures(scenario: dict[str, Any]) -> dict[str, Any]:
    """What the report shows of one concurrency level (serve.py's scenario keeps everything else)."""
    keys = ("max_concurrency", "requests", "completed", "failed", "errors", "duration_s", "request_throughput",
            "output_token_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms")
    return {key: scenario[key] for key in keys}


def milliseconds(distribution: dict[str, float | None], key: str) -> str:
    value = distribution.get(key)
    return "-" if value is None else f"{value:.1f}"


def summary(figures: dict[str, Any]) -> str:
    made = ("reused" if figures["checkpoint_seconds"] is None
            else f"written in {figures['checkpoint_seconds']:.0f} s")
    rows = [[level["max_concurrency"], f"{level['completed']}/{level['requests']}", f"{level['duration_s']:.0f}",
             f"{level['request_throughput']:.2f}", f"{level['output_token_throughput']:.0f}",
             *(f"{milliseconds(level[m], 'p50')} / {milliseconds(level[m], 'p95')}"
               for m in ("ttft_ms", "tpot_ms", "itl_ms"))] for level in figures["levels"]]
    errors = {message: count for level in figures["levels"] for message, count in level["errors"].items()}
    return (f"`jaxserve serve --config {figures['config']}` on random {figures['model']} weights (checkpoint "
            f"{made}); ready in {figures['server_startup_seconds']:.0f} s.\n\n"
            + markdown_table(["concurrency", "completed", "s", "req/s", "output tok/s", "TTFT p50 / p95 ms",
                              "TPOT p50 / p95 ms", "ITL p50 / p95 ms"], rows)
            + "".join(f"\n\n{count} failed: {message}" for message, count in errors.items()))
