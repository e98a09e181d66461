"""Time `load_model` from HF safetensors against the same weights converted to Orbax.

Writes a random ~0.5B-parameter Llama (hidden 2048, 8 layers, vocab 32000, GQA 16/4 heads) as bfloat16 safetensors
(`--checkpoint-dtype`, loaded as `--dtype`, both bfloat16 by default) in a temporary folder, converts it with `convert_hf_to_orbax`, then loads each folder alternately: one untimed warm-up
each, then `--rounds` timed loads each, in two settings:
    warm  the files sit in the page cache, so only deserialisation and the copy to the device are timed;
    cold  the checkpoint's files are evicted from the page cache (posix_fadvise DONTNEED, no root needed) before
          every load, as on a server's first start, so disk reads are timed too.

    python benchmarks/load_time.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax

from jaxserve.checkpoint import convert_hf_to_orbax, load_model
from jaxserve.checkpoint.safetensors_writer import save_random_llama
from bench_machine import machine_description

BENCHMARK_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
SHARD_BYTES = 512 * 2**20  # several shards, as real checkpoints come
SOURCES = ("safetensors", "orbax")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="timed loads per format, interleaved")
    parser.add_argument("--checkpoint-dtype", default="bfloat16", help="dtype the safetensors files store")
    parser.add_argument("--dtype", default="bfloat16", help="dtype to load into (as jaxserve's --dtype)")
    parser.add_argument("--workdir", type=Path, default=None, help="parent of the temporary checkpoint folder")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return parser.parse_args()


CACHE_STATES = ("warm", "cold")


def evict_from_page_cache(folder: Path) -> None:
    """Drop the folder's file pages from the OS page cache, so the next read comes from disk."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed_load(model_dir: Path, dtype: str, cache: str) -> float:
    """Seconds for one `load_model`, until every parameter is resident on the device."""
    if cache == "cold":
        evict_from_page_cache(model_dir)
    start = time.perf_counter()
    loaded = load_model(model_dir, dtype=dtype, progress=False)
    jax.block_until_ready(loaded.params)
    return time.perf_counter() - start


def prepare_checkpoints(workdir: Path, checkpoint_dtype: str) -> dict[str, Any]:
    """Write the safetensors folder and its Orbax conversion; return sizes and preparation times."""
    start = time.perf_counter()
    tensors = save_random_llama(workdir / "hf", BENCHMARK_CONFIG, checkpoint_dtype, max_shard_bytes=SHARD_BYTES)
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    convert_hf_to_orbax(workdir / "hf", workdir / "converted", progress=False)
    return {
        "parameters": sum(array.size for array in tensors.values()),
        "checkpoint_bytes": sum(array.nbytes for array in tensors.values()),
        "write_safetensors_s": write_s,
        "convert_to_orbax_s": time.perf_counter() - start,
    }


def run_rounds(workdir: Path, dtype: str, rounds: int, cache: str) -> dict[str, list[float]]:
    """One warm-up load per format, then `rounds` timed loads, alternating formats."""
    folders = {"safetensors": workdir / "hf", "orbax": workdir / "converted"}
    for source in SOURCES:
        timed_load(folders[source], dtype, cache)
    times: dict[str, list[float]] = {source: [] for source in SOURCES}
    for _ in range(rounds):
        for source in SOURCES:
            times[source].append(timed_load(folders[source], dtype, cache))
    return times


def format_table(times: dict[str, dict[str, list[float]]], checkpoint_bytes: int) -> str:
    """One row per cache state and format: median, best, throughput and every run."""
    lines = [f"{'cache':<6} {'format':<12} {'median s':>9} {'min s':>7} {'GB/s':>6}  {'vs safetensors':>14}  runs (s)"]
    for cache, by_source in times.items():
        baseline = statistics.median(by_source["safetensors"])
        for source, runs in by_source.items():
            median = statistics.median(runs)
            runs_text = " ".join(f"{t:.2f}" for t in runs)
            lines.append(
                f"{cache:<6} {source:<12} {median:>9.2f} {min(runs):>7.2f} {checkpoint_bytes / median / 1e9:>6.2f}  "
                f"{baseline / median:>13.2f}x  {runs_text}"
            )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        prepared = prepare_checkpoints(Path(workdir), args.checkpoint_dtype)
        times = {cache: run_rounds(Path(workdir), args.dtype, args.rounds, cache) for cache in CACHE_STATES}
    results = {
        "machine": machine_description(),
        "model": BENCHMARK_CONFIG,
        "checkpoint_dtype": args.checkpoint_dtype,
        "load_dtype": args.dtype,
        **prepared,
        "load_seconds": times,
        "median_load_seconds": {
            cache: {source: statistics.median(runs) for source, runs in by_source.items()}
            for cache, by_source in times.items()
        },
    }
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    print(f"{prepared['parameters'] / 1e9:.2f}B parameters, {prepared['checkpoint_bytes'] / 1e9:.2f} GB "
          f"{args.checkpoint_dtype} on disk, loaded as {args.dtype} on {results['machine']['device']}; "
          f"conversion took {prepared['convert_to_orbax_s']:.1f} s")
    print(format_table(times, prepared["checkpoint_bytes"]))


if __name__ == "__main__":
    main()
