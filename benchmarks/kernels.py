"""GPU attention kernels against the ceilings measured in the same run, JAX's shipped op and the XLA path.

What is measured:

    ceilings  device copy bandwidth (a jitted x * s over a 1 GiB array: bytes read + written / time), the bf16
              matmul rate (8192^3: 2 n^3 / time), and the dispatch floor (per-call time of a one-element op: a
              kernel's per-call time near it is bound by the host, not the device)
    decode    a grid of batch x context (GQA: --heads query heads over --kv-heads KV heads, --head-dim, pages of
              --page-size tokens). Per point: our Pallas decode kernel (`paged_decode_attention`), JAX's shipped
              `jax.experimental.pallas.ops.gpu.paged_attention`, our mixed kernel (`paged_prefill_attention`, what
              the engine's pallas backend runs for every step) and the XLA path (`paged_attention_xla`, the
              engine's xla backend). Achieved bandwidth = bytes the call must move (the KV slots of every page it
              reads, sum over sequences of ceil(len / page) * page * kv_heads * head_dim * 2 (K, V) * itemsize, plus
              q and the output) / time, as a fraction of the copy bandwidth; speed-ups against the shipped op and
              XLA.
    prefill   prefill chunks (sequences x chunk tokens, after a prior context already in the pool): our mixed
              kernel and the XLA path. TFLOP/s counts causal attention only: 4 * heads * head_dim per visible key
              slot of each query token (QK^T and PV), as a fraction of the matmul rate.

Method. Every callable is jitted once, checked, warmed up, then timed: a rep is a run of back-to-back calls
(enough for about TARGET_REP_S) blocked once at the end, divided by the call count, so dispatch overlaps the device
as in serving. The variants of a point alternate rep by rep (the starting one rotates) and the median per call is
reported. Block tables are random permutations of the pool's pages. A point whose K/V would fit in the GPU's L2
cache is given a pool of several disjoint page sets (at least --rotate-mib in all), and consecutive calls cycle
through them, so that calls read memory rather than the cache. Each variant's output for the first few sequences is
compared once with a float32 reference at full matmul precision (max abs and relative L2 error in the JSON); a
variant whose relative error exceeds CORRECT_REL_ERROR is never a point's best. The shipped op has no scale
argument, so it gets q * scale (rounded to q's dtype outside the timed call) and a block table padded with the
null page to the width its asserts need. `--sweep` times a few tunings of each kernel (and split counts of the
shipped op) and reports the best of each; without it our kernels use the shape-derived default tunings the engine
uses and the shipped op its own defaults.

A point's failure (a Triton compile error, an out-of-memory) is recorded in the JSON with its message and the run
goes on; the JSON is rewritten after every point, so a crash keeps what was measured. Points whose pool exceeds
--max-pool-gib are skipped (recorded as such).

The whole engine end to end against the HBM roofline is benchmarks/engine_bench.py.

    python benchmarks/kernels.py --out kernels.json                  # ceilings and both kernel grids (GPU)
    python benchmarks/kernels.py --quick --out kernels_quick.json    # a few points
    python benchmarks/kernels.py --sweep --batches 1 8 --out sweep.json   # tunings, on part of the grid
    python benchmarks/kernels.py --smoke --out smoke.json            # CPU: tiny sizes, kernels interpreted
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.model.paged_kv_cache import PagedAttentionMetadata, paged_attention_xla
from jaxserve.schedule import NULL_PAGE
from kernels_pallas import (DecodeTuning, PrefillTuning, default_decode_tuning, default_prefill_tuning,
                            paged_decode_attention, paged_prefill_attention)
from bench_machine import machine_description

GOALS = {
    "decode_fraction_of_copy": 0.80,
    "decode_speedup_vs_shipped": 2.0,
    "prefill_fraction_of_matmul": 0.50,
}
TARGET_REP_S = 0.005  # one rep's length: host clock resolution and the final sync are small against it
MAX_CALLS_PER_REP = 200
CHECKED_SEQUENCES = 4  # sequences whose outputs are compared with the float32 reference (bounds its memory)
CORRECT_REL_ERROR = 2e-2  # bf16 operands land between 1e-3 and 1e-2; above this a variant is wrong
MAX_ROTATION_SETS = 1024
SHIPPED_PAGES_PER_COMPUTE_BLOCK = 8  # the shipped op's default, passed explicitly so the table padding agrees
SHIPPED_DEFAULT_SPLITS = 16  # the shipped op's default
SHIPPED_SWEEP_SPLITS = (16, 4, 1)


# ---------------------------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """Heads, page size and dtype shared by every point of a grid."""

    heads: int  # query heads
    kv_heads: int  # KV heads (heads // kv_heads query heads share one)
    head_dim: int
    page_size: int  # tokens per KV page
    dtype: str

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def kv_slot_bytes(self) -> int:
        """K and V of one token slot over all KV heads."""
        return 2 * self.kv_heads * self.head_dim * self.itemsize


@dataclasses.dataclass(frozen=True)
class GridSettings:
    """What a mode measures and how long it times each point."""

    shape: AttentionShape
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_shapes: tuple[tuple[int, int], ...]  # (sequences, chunk tokens)
    prefill_priors: tuple[int, ...]  # tokens already in the pool before the chunk
    reps: int
    warmup: int
    copy_bytes: int
    matmul_size: int
    rotate_bytes: int
    max_pool_bytes: int
    sweep: bool
    interpret: bool
    seed: int


FULL_GRID = dict(decode_batches=(1, 8, 32, 64, 128, 256), decode_contexts=(128, 512, 2048, 8192, 32768),
                 prefill_shapes=((1, 2048), (4, 512), (16, 128)), prefill_priors=(0, 4096))
QUICK_GRID = dict(decode_batches=(1, 32, 128), decode_contexts=(512, 8192),
                  prefill_shapes=((1, 2048), (16, 128)), prefill_priors=(0, 4096))
# Tiny, for the CPU: kernels run in Pallas' interpreter. Lengths that are not page multiples exercise the counting.
SMOKE_GRID = dict(decode_batches=(3,), decode_contexts=(40, 200), prefill_shapes=((2, 16),), prefill_priors=(0, 40))
SMOKE_SHAPE = AttentionShape(heads=8, kv_heads=2, head_dim=32, page_size=16, dtype="bfloat16")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a few points of each grid")
    mode.add_argument("--smoke", action="store_true", help="CPU check: tiny sizes, kernels in interpret mode")
    parser.add_argument("--sweep", action="store_true", help="best of a few tunings per kernel and point")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here (after every point)")
    parser.add_argument("--max-pool-gib", type=float, default=24.0, help="skip points whose K+V pool is larger")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes (default: mode's)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None, help="decode contexts (default: mode's)")
    parser.add_argument("--prefill-shapes", nargs="+", default=None,
                        help="prefill chunks as SEQSxTOKENS, e.g. 1x2048 16x128 (default: mode's)")
    parser.add_argument("--prefill-priors", type=int, nargs="+", default=None,
                        help="context already cached before each chunk (default: mode's)")
    parser.add_argument("--reps", type=int, default=None, help="timed reps per variant (default 20, quick 10, smoke 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls after the compiling one (default 3)")
    parser.add_argument("--rotate-mib", type=float, default=256.0,
                        help="smallest pool: small points get disjoint page sets up to this size (beats the L2)")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def parse_prefill_shape(text: str) -> tuple[int, int]:
    seqs, tokens = text.lower().split("x")
    return int(seqs), int(tokens)


def grid_settings(args: argparse.Namespace) -> GridSettings:
    """The mode's grid, with any size the command line gives instead."""
    grid = SMOKE_GRID if args.smoke else QUICK_GRID if args.quick else FULL_GRID
    shape = SMOKE_SHAPE if args.smoke else AttentionShape(args.heads, args.kv_heads, args.head_dim, args.page_size,
                                                          args.dtype)
    return GridSettings(
        shape=shape,
        decode_batches=tuple(args.batches or grid["decode_batches"]),
        decode_contexts=tuple(args.contexts or grid["decode_contexts"]),
        prefill_shapes=tuple(map(parse_prefill_shape, args.prefill_shapes)) if args.prefill_shapes
        else grid["prefill_shapes"],
        prefill_priors=tuple(args.prefill_priors if args.prefill_priors is not None else grid["prefill_priors"]),
        reps=args.reps or (3 if args.smoke else 10 if args.quick else 20),
        warmup=args.warmup if args.warmup is not None else 1 if args.smoke else 3,
        copy_bytes=16 * 2**20 if args.smoke else 2**30,
        matmul_size=256 if args.smoke else 8192,
        rotate_bytes=int((1.0 if args.smoke else args.rotate_mib) * 2**20),
        max_pool_bytes=int(args.max_pool_gib * 2**30),
        sweep=args.sweep,
        interpret=args.smoke,
        seed=args.seed,
    )


# ---------------------------------------------------------------------------------------------------------------
# What a call must move and compute
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Batch:
    """The sequences of one attention call: every sequence's last query_lens[s] tokens query its first seq_lens[s]."""

    seq_lens: tuple[int, ...]  # tokens each sequence holds, this call's K/V included
    query_lens: tuple[int, ...]  # query tokens each sequence brings (1 for decode), its last ones

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def token_seq(self) -> np.ndarray:  # i32[T]: each query token's sequence row, rows contiguous
        return np.repeat(np.arange(self.num_seqs, dtype=np.int32), self.query_lens)

    def positions(self) -> np.ndarray:  # i32[T]: each query token's position in its sequence
        return np.concatenate([np.arange(length - queries, length, dtype=np.int32)
                               for length, queries in zip(self.seq_lens, self.query_lens)])


def decode_batch(num_seqs: int, context: int) -> Batch:
    return Batch(seq_lens=(context,) * num_seqs, query_lens=(1,) * num_seqs)


def prefill_batch(num_seqs: int, chunk: int, prior: int) -> Batch:
    return Batch(seq_lens=(prior + chunk,) * num_seqs, query_lens=(chunk,) * num_seqs)


def pages_per_seq(seq_lens: Sequence[int], page_size: int) -> list[int]:
    return [-(-length // page_size) for length in seq_lens]


def kv_bytes_read(seq_lens: Sequence[int], shape: AttentionShape) -> int:
    """K and V bytes of every page the sequences fill: kernels read whole pages, so the last one's padding counts."""
    return sum(pages_per_seq(seq_lens, shape.page_size)) * shape.page_size * shape.kv_slot_bytes


def attention_bytes(batch: Batch, shape: AttentionShape) -> int:
    """Fewest bytes one call moves: the KV pages read once, each query token's q read and its output written."""
    return kv_bytes_read(batch.seq_lens, shape) + 2 * batch.num_tokens * shape.heads * shape.head_dim * shape.itemsize


def visible_slots(batch: Batch) -> int:
    """Key slots all query tokens see: a query at position p sees p + 1 (causal), summed over the last query_lens."""
    return sum(queries * length - queries * (queries - 1) // 2
               for length, queries in zip(batch.seq_lens, batch.query_lens))


def attention_flops(batch: Batch, shape: AttentionShape) -> int:
    """Causal attention FLOPs: per visible slot and query head, head_dim multiply-adds for QK^T and as many for PV."""
    return 4 * shape.heads * shape.head_dim * visible_slots(batch)


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------


def describe(error: BaseException) -> str:
    """An exception as one JSON-friendly string (Triton and XLA messages can be long; the start says what failed)."""
    return f"{type(error).__name__}: {error}"[:4000]


def seconds_per_call(run: Callable[..., Any], argument_sets: Sequence[tuple], calls: int, first_set: int = 0) -> float:
    """Back-to-back calls cycling through the argument sets, blocked once at the end.

    Only the last output is waited for: a device runs one stream's programs in order, so it finishes last, and
    keeping every output alive would hold `calls` outputs in memory at once.
    """
    start = time.perf_counter()
    output = None
    for i in range(calls):
        output = run(*argument_sets[(first_set + i) % len(argument_sets)])
    jax.block_until_ready(output)
    return (time.perf_counter() - start) / calls


def calls_per_rep(time_calls: Callable[[int], float], warmup: int) -> int:
    """Calls per rep of a compiled callable (`time_calls(n)` runs n calls and returns seconds per call): `warmup`
    untimed calls, then one timed call sizes the rep to about TARGET_REP_S."""
    if warmup:
        time_calls(warmup)
    return max(1, min(MAX_CALLS_PER_REP, math.ceil(TARGET_REP_S / max(time_calls(1), 1e-9))))


def timed_reps(run: Callable[..., Any], argument_sets: Sequence[tuple], reps: int, warmup: int) -> list[float]:
    """Seconds per call of each of `reps` reps of a callable timed alone (a ceiling), after compiling it."""
    seconds_per_call(run, argument_sets, 1)
    calls = calls_per_rep(functools.partial(seconds_per_call, run, argument_sets), warmup)
    return [seconds_per_call(run, argument_sets, calls) for _ in range(reps)]


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def random_normal(key: jax.Array, shape: tuple[int, ...], dtype: str) -> jax.Array:
    """Standard normal values (never zeros: they hide unwritten outputs and can time faster than real data), drawn
    one slice of the leading axis at a time so that no full-size random-bits or float32 intermediate exists."""
    return jax.lax.map(lambda k: jax.random.normal(k, shape[1:], dtype), jax.random.split(key, shape[0]))


# ---------------------------------------------------------------------------------------------------------------
# Ceilings
# ---------------------------------------------------------------------------------------------------------------


def stream_input(num_bytes: int, dtype: str, seed: int) -> jax.Array:  # f[16, num_bytes / itemsize / 16]
    """The buffer the stream ceilings run over: far larger than the GPU's L2 cache at the sizes used (1 GiB)."""
    slices = 16
    return random_normal(jax.random.key(seed), (slices, num_bytes // jnp.dtype(dtype).itemsize // slices), dtype)


def stream_rate(run: Callable[..., Any], arguments: tuple, moved: int, reps: int, warmup: int) -> dict[str, Any]:
    """Bytes per second of a compiled stream kernel that moves `moved` bytes per call. Each rep is back-to-back calls
    for about TARGET_REP_S (8 calls of a 1 GiB copy on an H100), so the first call's launch is a small share."""
    times = timed_reps(run, [arguments], reps, warmup)
    return {"bytes_moved": moved, "median_s": statistics.median(times), "times_s": times,
            "bytes_per_s": moved / statistics.median(times)}


def measure_copy_bandwidth(num_bytes: int, dtype: str, reps: int, warmup: int, seed: int = 0) -> dict[str, Any]:
    """Bytes read plus written per second by a jitted x * s (s a runtime scalar, so XLA cannot drop the copy):
    one elementwise loop fusion, the whole buffer read once and a buffer of the same size written."""
    x = stream_input(num_bytes, dtype, seed)
    factor = jnp.asarray(1.0, dtype)
    return stream_rate(jax.jit(lambda a, s: a * s), (x, factor), 2 * x.nbytes, reps, warmup)


def measure_memcpy_bandwidth(num_bytes: int, dtype: str, reps: int, warmup: int, seed: int = 0) -> dict[str, Any]:
    """Bytes read plus written per second by a jitted jnp.copy, which XLA:GPU runs as one device-to-device memcpy:
    the same stream as measure_copy_bandwidth by the driver's copy rather than an XLA kernel, to cross-check it.
    Not donated: with the input donated XLA aliases the output to it and drops the copy (nothing is timed)."""
    x = stream_input(num_bytes, dtype, seed)
    compiled = jax.jit(jnp.copy).lower(x).compile()
    return {**stream_rate(compiled, (x,), 2 * x.nbytes, reps, warmup),
            "copies_in_program": compiled.as_text().count(" copy(")}  # 1: the program is the copy itself


def measure_read_bandwidth(num_bytes: int, dtype: str, reps: int, warmup: int, seed: int = 0) -> dict[str, Any]:
    """Bytes read per second by a jitted sum of the buffer into one f32: a reduction that reads every byte once and
    writes almost nothing, as a decode step reads its weights."""
    x = stream_input(num_bytes, dtype, seed)
    return stream_rate(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), (x,), x.nbytes, reps, warmup)


def measure_stream_rates(num_bytes: int, dtype: str, reps: int, warmup: int, seed: int = 0) -> dict[str, Any]:
    """The three stream ceilings by name ("copy": x * s, "memcpy", "read"), each the error that stopped it if one
    did; the roofline uses "copy", the others check it."""
    measures = {"copy": measure_copy_bandwidth, "memcpy": measure_memcpy_bandwidth, "read": measure_read_bandwidth}
    rates = {}
    for name, measure in measures.items():
        try:
            rates[name] = measure(num_bytes, dtype, reps, warmup, seed)
        except Exception as error:  # a failed cross-check leaves the others measured
            rates[name] = {"error": describe(error)}
    return rates


def measure_matmul_rate(size: int, dtype: str, reps: int, warmup: int, seed: int = 0) -> dict[str, Any]:
    """FLOP/s of an n x n x n matmul in `dtype` (f32 accumulation, XLA's library call)."""
    a = random_normal(jax.random.key(seed), (size, size), dtype)  # f[n, n]
    b = random_normal(jax.random.key(seed + 1), (size, size), dtype)  # f[n, n]
    times = timed_reps(jax.jit(jnp.matmul), [(a, b)], reps, warmup)
    flops = 2 * size**3
    return {"size": size, "flops": flops, "median_s": statistics.median(times), "times_s": times,
            "flops_per_s": flops / statistics.median(times)}


def measure_dispatch_floor(dtype: str, reps: int, warmup: int, seed: int = 0) -> dict[str, Any]:
    """Seconds per call of a jitted one-element op timed as the kernels are: per-call times near it are bound by
    host dispatch, not by the device (the engine runs its kernels inside one step program, without that cost)."""
    x = random_normal(jax.random.key(seed), (1,), dtype)  # f[1]
    times = timed_reps(jax.jit(lambda a: a + 1), [(x,)], reps, warmup)
    return {"median_s": statistics.median(times), "times_s": times}


def measure_ceilings(settings: GridSettings) -> dict[str, Any]:
    """Each ceiling, or the error that stopped it (the grids then give times without fractions)."""
    measures = {"copy": functools.partial(measure_copy_bandwidth, settings.copy_bytes),
                "matmul": functools.partial(measure_matmul_rate, settings.matmul_size),
                "dispatch": measure_dispatch_floor}
    ceilings: dict[str, Any] = {}
    for name, measure in measures.items():
        try:
            ceilings[name] = measure(settings.shape.dtype, settings.reps, settings.warmup, settings.seed)
        except Exception as error:
            ceilings[name] = {"error": describe(error)}
    return ceilings


# ---------------------------------------------------------------------------------------------------------------
# Inputs of one point
# ---------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedInputs:
    """One attention call's arguments; a point has several that differ only in their block tables. A pytree, so
    jax.eval_shape gives a point's shapes without allocating it."""

    q: jax.Array  # f[T, heads, head_dim]
    k_pages: jax.Array  # f[kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array  # f[kv_heads, num_pages, page_size, head_dim]
    block_tables: jax.Array  # i32[S, max_pages]: this set's pages
    seq_lens: jax.Array  # i32[S]
    token_seq: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]


def rotation_sets(batch: Batch, shape: AttentionShape, rotate_bytes: int) -> int:
    """Disjoint copies of the batch's pages in one pool, so that the pool is at least rotate_bytes."""
    return max(1, min(MAX_ROTATION_SETS, -(-rotate_bytes // kv_bytes_read(batch.seq_lens, shape))))


def pool_pages(batch: Batch, shape: AttentionShape, rotate_bytes: int) -> int:
    """Pages of the point's pool: every rotation set's pages plus the null page."""
    return 1 + rotation_sets(batch, shape, rotate_bytes) * sum(pages_per_seq(batch.seq_lens, shape.page_size))


def random_block_tables(rng: np.random.Generator, page_counts: Sequence[int], sets: int) -> np.ndarray:
    """i32[sets, S, max_pages]: in each set, sequence s owns page_counts[s] pages; all sets' pages are disjoint and
    in random order (as an engine's pool is after some serving); unused entries are the null page."""
    per_set = sum(page_counts)
    pages = rng.permutation(np.arange(1, 1 + sets * per_set, dtype=np.int32)).reshape(sets, per_set)
    tables = np.full((sets, len(page_counts), max(page_counts)), NULL_PAGE, np.int32)
    first = 0
    for row, count in enumerate(page_counts):
        tables[:, row, :count] = pages[:, first:first + count]
        first += count
    return tables


def build_inputs(batch: Batch, shape: AttentionShape, rotate_bytes: int, seed: int) -> list[PagedInputs]:
    """Random q and pool, and one block-table set per rotation set."""
    keys = jax.random.split(jax.random.key(seed), 3)
    pool_shape = (shape.kv_heads, pool_pages(batch, shape, rotate_bytes), shape.page_size, shape.head_dim)
    k_pages = random_normal(keys[0], pool_shape, shape.dtype)  # f[kv_heads, num_pages, page_size, head_dim]
    v_pages = random_normal(keys[1], pool_shape, shape.dtype)  # f[kv_heads, num_pages, page_size, head_dim]
    q = random_normal(keys[2], (batch.num_tokens, shape.heads, shape.head_dim), shape.dtype)  # f[T, heads, D]
    tables = random_block_tables(np.random.default_rng(seed), pages_per_seq(batch.seq_lens, shape.page_size),
                                 rotation_sets(batch, shape, rotate_bytes))  # i32[sets, S, max_pages]
    seq_lens = jnp.asarray(batch.seq_lens, jnp.int32)
    token_seq = jnp.asarray(batch.token_seq())
    positions = jnp.asarray(batch.positions())
    return [PagedInputs(q, k_pages, v_pages, jnp.asarray(table), seq_lens, token_seq, positions) for table in tables]


def xla_attention(q, k_pages, v_pages, block_tables, seq_lens, token_seq, positions, *, scale: float) -> jax.Array:
    """The engine's xla backend on one call's arguments (slot_mapping only places writes; attention ignores it)."""
    metadata = PagedAttentionMetadata(slot_mapping=positions, token_seq=token_seq, block_tables=block_tables,
                                      seq_lens=seq_lens)
    return paged_attention_xla(q, k_pages, v_pages, metadata, positions, scale)


def checked_reference(inputs: PagedInputs, batch: Batch, scale: float,
                      max_seqs: int = CHECKED_SEQUENCES) -> tuple[jax.Array, int]:
    """The first `max_seqs` sequences' outputs f32[rows, heads, head_dim] in float32 at full matmul precision, and
    rows, their query tokens (the batch's first). Only their pages are upcast, so this stays small whatever the
    pool."""
    seqs = min(max_seqs, batch.num_seqs)
    rows = sum(batch.query_lens[:seqs])
    tables = inputs.block_tables[:seqs]  # i32[seqs, max_pages]
    compact = jnp.arange(tables.size, dtype=jnp.int32).reshape(tables.shape)  # i32[seqs, max_pages]
    k_pages = inputs.k_pages[:, tables.reshape(-1)].astype(jnp.float32)  # f32[kv_heads, seqs*max_pages, page, D]
    v_pages = inputs.v_pages[:, tables.reshape(-1)].astype(jnp.float32)  # f32[kv_heads, seqs*max_pages, page, D]
    with jax.default_matmul_precision("highest"):
        reference = jax.jit(functools.partial(xla_attention, scale=scale))(
            inputs.q[:rows].astype(jnp.float32), k_pages, v_pages, compact, inputs.seq_lens[:seqs],
            inputs.token_seq[:rows], inputs.positions[:rows])
    return reference, rows


def output_errors(output: jax.Array, reference: jax.Array) -> tuple[float, float]:
    """(max abs error, relative L2 error) of output rows against the float32 reference; NaN shows as NaN."""
    difference = output.astype(jnp.float32) - reference  # f32[rows, heads, head_dim]
    return (float(jnp.max(jnp.abs(difference))),
            float(jnp.linalg.norm(difference) / jnp.linalg.norm(reference)))


# ---------------------------------------------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    """One implementation with one tuning: a jitted callable and the (untimed) choice of its arguments."""

    implementation: str  # "pallas", "shipped", "pallas_mixed", "cudnn" or "xla"
    tuning: dict[str, Any]  # its launch parameters; empty for xla
    run: Callable[..., jax.Array]  # jitted; returns f[T, heads, head_dim]
    arguments: Callable[[PagedInputs], tuple]

    @property
    def label(self) -> str:
        return " ".join([self.implementation] + [f"{key}={value}" for key, value in self.tuning.items()])


def decode_arguments(x: PagedInputs) -> tuple:
    return x.q, x.k_pages, x.v_pages, x.block_tables, x.seq_lens


def step_arguments(x: PagedInputs) -> tuple:
    return x.q, x.k_pages, x.v_pages, x.block_tables, x.seq_lens, x.token_seq, x.positions


def pallas_decode_variant(tuning: DecodeTuning, scale: float, interpret: bool) -> Variant:
    attend = functools.partial(paged_decode_attention, sm_scale=scale, tuning=tuning, interpret=interpret)
    return Variant("pallas", dataclasses.asdict(tuning), jax.jit(attend), decode_arguments)


def pallas_step_variant(implementation: str, tuning: PrefillTuning, scale: float, interpret: bool) -> Variant:
    """Our mixed prefill/decode kernel: "pallas" in the prefill grid, "pallas_mixed" in the decode grid."""
    attend = functools.partial(paged_prefill_attention, sm_scale=scale, tuning=tuning, interpret=interpret)
    return Variant(implementation, dataclasses.asdict(tuning), jax.jit(attend), step_arguments)


def xla_variant(scale: float) -> Variant:
    return Variant("xla", {}, jax.jit(functools.partial(xla_attention, scale=scale)), step_arguments)


def cudnn_variant(batch: Batch, scale: float) -> Variant:
    """cuDNN's fused flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`) on the same prompts
    held contiguously, [S, chunk, heads, head_dim]: the rate a vendor kernel reaches on this GPU, for prompts with no
    cached prefix of equal length (it takes no pages). Gathering K/V out of the pages is not timed."""
    seqs, chunk = batch.num_seqs, batch.query_lens[0]

    def attend(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")
        return out.reshape(seqs * chunk, *out.shape[2:])  # f[T, heads, head_dim]

    def contiguous(pages: jax.Array, block_tables: jax.Array) -> jax.Array:  # f[S, chunk, kv_heads, head_dim]
        kv_heads, _, page_size, head_dim = pages.shape
        gathered = pages[:, block_tables]  # f[kv_heads, S, max_pages, page_size, head_dim]
        flat = gathered.reshape(kv_heads, seqs, -1, head_dim)[:, :, :chunk]
        return flat.transpose(1, 2, 0, 3)

    def arguments(x: PagedInputs) -> tuple:
        return (x.q.reshape(seqs, chunk, *x.q.shape[1:]), contiguous(x.k_pages, x.block_tables),
                contiguous(x.v_pages, x.block_tables))

    return Variant("cudnn", {}, jax.jit(attend), arguments)


def shipped_paged_attention() -> Callable[..., jax.Array]:
    """JAX's Pallas GPU paged attention. Its module warns at import that it is deprecated; that is known."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as shipped
    return shipped.paged_attention


def shipped_block_tables(block_tables: jax.Array, k_splits: int) -> jax.Array:  # i32[S, padded_pages]
    """The table padded with the null page to a width the shipped op asserts on: a multiple of k_splits whose
    per-split share is a multiple of its compute block (or smaller than one block, which it then shrinks to).
    The padding lies past every length, so it is never read."""
    width = block_tables.shape[1]
    per_split = -(-width // k_splits)
    if per_split > SHIPPED_PAGES_PER_COMPUTE_BLOCK:
        per_split = -(-per_split // SHIPPED_PAGES_PER_COMPUTE_BLOCK) * SHIPPED_PAGES_PER_COMPUTE_BLOCK
    return jnp.pad(block_tables, ((0, 0), (0, per_split * k_splits - width)), constant_values=NULL_PAGE)


def shipped_variant(k_splits: int, scale: float, interpret: bool) -> Variant:
    """The shipped op; it has no scale argument, so it gets q * scale. An import failure (the op removed from a
    later JAX) surfaces at the first call and is recorded like any failure."""

    def attend(scaled_q, k_pages, v_pages, padded_tables, seq_lens):
        return shipped_paged_attention()(scaled_q, k_pages, v_pages, padded_tables, seq_lens, k_splits=k_splits,
                                         pages_per_compute_block=SHIPPED_PAGES_PER_COMPUTE_BLOCK, interpret=interpret)

    def arguments(x: PagedInputs) -> tuple:
        return ((x.q * scale).astype(x.q.dtype), x.k_pages, x.v_pages, shipped_block_tables(x.block_tables, k_splits),
                x.seq_lens)

    return Variant("shipped", {"k_splits": k_splits}, jax.jit(attend), arguments)


def decode_tunings(default: DecodeTuning, sweep: bool) -> list[DecodeTuning]:
    """The default alone, or it and its neighbours (splits, key tile, warps, stages), without repeats."""
    if not sweep:
        return [default]
    return list(dict.fromkeys([
        default,
        dataclasses.replace(default, k_splits=1),
        dataclasses.replace(default, k_splits=2 * default.k_splits),
        dataclasses.replace(default, pages_per_block=2 * default.pages_per_block),
        dataclasses.replace(default, num_warps=8),
        dataclasses.replace(default, num_stages=3),
    ]))


def prefill_tunings(default: PrefillTuning, sweep: bool) -> list[PrefillTuning]:
    """The default alone, or it and its neighbours, without repeats: half the query rows on half the warps (a
    warpgroup per 64 rows either way; smaller programs, more of them per SM), half and twice the key tile, one
    more pipeline stage. Twice the rows is left out: at 256 rows the accumulators spill (benchmarks/kernel_code.py)."""
    if not sweep:
        return [default]
    return list(dict.fromkeys([
        default,
        dataclasses.replace(default, block_q=max(1, default.block_q // 2), num_warps=max(4, default.num_warps // 2)),
        dataclasses.replace(default, pages_per_block=max(1, default.pages_per_block // 2)),
        dataclasses.replace(default, pages_per_block=2 * default.pages_per_block),
        dataclasses.replace(default, num_stages=3),
    ]))


def engine_prefill_tuning(batch: Batch, shape: AttentionShape) -> PrefillTuning:
    """The tuning the engine's pallas backend picks for a call of this shape."""
    return default_prefill_tuning(num_tokens=batch.num_tokens, num_seqs=batch.num_seqs,
                                  group=shape.heads // shape.kv_heads,
                                  max_pages_per_seq=max(pages_per_seq(batch.seq_lens, shape.page_size)),
                                  page_size=shape.page_size, head_dim=shape.head_dim, dtype=shape.dtype)


def shape_decode_tuning(batch: Batch, shape: AttentionShape) -> DecodeTuning:
    """The decode kernel's default tuning for a call of this shape."""
    return default_decode_tuning(num_seqs=batch.num_seqs, kv_heads=shape.kv_heads,
                                 max_pages_per_seq=max(pages_per_seq(batch.seq_lens, shape.page_size)),
                                 page_size=shape.page_size, head_dim=shape.head_dim, dtype=shape.dtype)


def decode_variants(batch: Batch, settings: GridSettings) -> list[Variant]:
    shape = settings.shape
    variants = [pallas_decode_variant(tuning, shape.scale, settings.interpret)
                for tuning in decode_tunings(shape_decode_tuning(batch, shape), settings.sweep)]
    splits = SHIPPED_SWEEP_SPLITS if settings.sweep else (SHIPPED_DEFAULT_SPLITS,)
    variants += [shipped_variant(k, shape.scale, settings.interpret) for k in splits]
    variants.append(pallas_step_variant("pallas_mixed", engine_prefill_tuning(batch, shape), shape.scale,
                                        settings.interpret))
    return variants + [xla_variant(shape.scale)]


def prefill_variants(batch: Batch, settings: GridSettings) -> list[Variant]:
    shape = settings.shape
    tunings = prefill_tunings(engine_prefill_tuning(batch, shape), settings.sweep)
    variants = [pallas_step_variant("pallas", t, shape.scale, settings.interpret) for t in tunings]
    # cuDNN runs on a GPU only, and takes prompts whose K/V are all this call's (no cached prefix).
    if not settings.interpret and batch.seq_lens == batch.query_lens:
        variants.append(cudnn_variant(batch, shape.scale))
    return variants + [xla_variant(shape.scale)]


# ---------------------------------------------------------------------------------------------------------------
# Measuring one point
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class VariantRun:
    """A variant's state through one point: its arguments, check, calibration and timings, or its failure."""

    variant: Variant
    argument_sets: list[tuple] = dataclasses.field(default_factory=list)
    calls: int = 1
    next_set: int = 0  # where its next rep starts cycling, so reps do not reread only the first sets
    times_s: list[float] = dataclasses.field(default_factory=list)
    max_abs_error: float | None = None
    rel_error: float | None = None
    error: str | None = None

    def time_rep(self, calls: int) -> float:
        seconds = seconds_per_call(self.variant.run, self.argument_sets, calls, self.next_set)
        self.next_set = (self.next_set + calls) % len(self.argument_sets)
        return seconds

    @property
    def correct(self) -> bool:
        """No error, timed, and not wrong against the reference (unknown when the reference failed)."""
        return (self.error is None and bool(self.times_s)
                and (self.rel_error is None or self.rel_error <= CORRECT_REL_ERROR))

    def summary(self) -> dict[str, Any]:
        return {
            "implementation": self.variant.implementation, "tuning": self.variant.tuning, "label": self.variant.label,
            "median_s": statistics.median(self.times_s) if self.times_s else None,
            "min_s": min(self.times_s) if self.times_s else None, "times_s": self.times_s,
            "calls_per_rep": self.calls, "max_abs_error": self.max_abs_error, "rel_error": self.rel_error,
            "correct": self.correct, "error": self.error,
        }


def prepare_run(variant: Variant, input_sets: list[PagedInputs], reference: jax.Array | None, rows: int,
                warmup: int) -> VariantRun:
    """Builds the variant's arguments, compiles and checks it, warms it up and sizes its reps; records a failure."""
    run = VariantRun(variant)
    try:
        run.argument_sets = [variant.arguments(inputs) for inputs in input_sets]
        output = jax.block_until_ready(variant.run(*run.argument_sets[0]))  # f[T, heads, head_dim]
        if reference is not None:
            run.max_abs_error, run.rel_error = output_errors(output[:rows], reference)
        del output
        run.calls = calls_per_rep(run.time_rep, warmup)
    except Exception as error:
        run.error = describe(error)
    return run


def alternate_reps(runs: list[VariantRun], reps: int) -> None:
    """Each rep times every live variant once, starting one further along each time (DESIGN §4: A/B alternated)."""
    for rep in range(reps):
        live = [run for run in runs if run.error is None]
        if not live:
            return
        shift = rep % len(live)
        for run in live[shift:] + live[:shift]:
            try:
                run.times_s.append(run.time_rep(run.calls))
            except Exception as error:
                run.error = describe(error)


def measure_variants(point: dict[str, Any], batch: Batch, variants: list[Variant], settings: GridSettings) -> None:
    """Fills point with every variant's summary; the inputs are freed on return."""
    input_sets = build_inputs(batch, settings.shape, settings.rotate_bytes, settings.seed)
    point["rotation_sets"] = len(input_sets)
    try:
        reference, rows = checked_reference(input_sets[0], batch, settings.shape.scale)
    except Exception as error:
        reference, rows = None, 0
        point["reference_error"] = describe(error)
    runs = [prepare_run(v, input_sets, reference, rows, settings.warmup) for v in variants]
    alternate_reps(runs, settings.reps)
    point["variants"] = [run.summary() for run in runs]


def best_by_implementation(variants: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each implementation's fastest correct variant."""
    best: dict[str, dict[str, Any]] = {}
    for variant in variants:
        name = variant["implementation"]
        if variant["correct"] and (name not in best or variant["median_s"] < best[name]["median_s"]):
            best[name] = variant
    return best


def add_figures(point: dict[str, Any], work: int, ceiling_per_s: float | None, rate_name: str,
                fraction_name: str) -> None:
    """Per implementation its best variant's rate (work per second) and fraction of the ceiling; our kernel's
    speed-up over every other implementation."""
    best = best_by_implementation(point.get("variants", []))
    point["best"] = {
        name: {"label": v["label"], "median_s": v["median_s"], rate_name: work / v["median_s"],
               fraction_name: work / v["median_s"] / ceiling_per_s if ceiling_per_s else None}
        for name, v in best.items()
    }
    if "pallas" in best:
        for name, v in best.items():
            if name != "pallas":
                point[f"speedup_vs_{name}"] = v["median_s"] / best["pallas"]["median_s"]


def measure_point(point: dict[str, Any], batch: Batch, variants_for: Callable[[Batch, GridSettings], list[Variant]],
                  settings: GridSettings) -> dict[str, Any]:
    """One grid point, or the reason it was skipped or failed."""
    shape = settings.shape
    pool_bytes = pool_pages(batch, shape, settings.rotate_bytes) * shape.page_size * shape.kv_slot_bytes
    point.update(bytes=attention_bytes(batch, shape), flops=attention_flops(batch, shape), pool_bytes=pool_bytes)
    if pool_bytes > settings.max_pool_bytes:
        point["skipped"] = f"pool of {pool_bytes / 2**30:.1f} GiB exceeds --max-pool-gib"
        return point
    try:
        measure_variants(point, batch, variants_for(batch, settings), settings)
    except Exception as error:
        point["error"] = describe(error)
    return point


def rate(ceiling: dict[str, Any], name: str) -> float | None:
    return ceiling.get(name) if isinstance(ceiling, dict) else None


def run_decode_grid(settings: GridSettings, ceilings: dict[str, Any], save: Callable[[], None],
                    points: list[dict[str, Any]]) -> None:
    copy_rate = rate(ceilings.get("copy"), "bytes_per_s")
    for num_seqs in settings.decode_batches:
        for context in settings.decode_contexts:
            point = measure_point({"batch": num_seqs, "context": context}, decode_batch(num_seqs, context),
                                  decode_variants, settings)
            add_figures(point, point["bytes"], copy_rate, "bytes_per_s", "fraction_of_copy")
            points.append(point)
            save()
            print(decode_line(point), flush=True)


def run_prefill_grid(settings: GridSettings, ceilings: dict[str, Any], save: Callable[[], None],
                     points: list[dict[str, Any]]) -> None:
    matmul_rate = rate(ceilings.get("matmul"), "flops_per_s")
    for num_seqs, chunk in settings.prefill_shapes:
        for prior in settings.prefill_priors:
            point = measure_point({"sequences": num_seqs, "chunk": chunk, "prior_context": prior},
                                  prefill_batch(num_seqs, chunk, prior), prefill_variants, settings)
            add_figures(point, point["flops"], matmul_rate, "flops_per_s", "fraction_of_matmul")
            points.append(point)
            save()
            print(prefill_line(point), flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def microseconds(best: dict[str, Any], name: str) -> str:
    return f"{best[name]['median_s'] * 1e6:.1f}" if name in best else "-"


def ratio(point: dict[str, Any], key: str) -> str:
    return f"{point[key]:.2f}x" if key in point else "-"


def worst_error(point: dict[str, Any]) -> str:
    errors = [v["rel_error"] for v in point.get("variants", []) if v["rel_error"] is not None]
    return f"{max(errors):.1e}" if errors else "-"


def failures(point: dict[str, Any]) -> str:
    """What did not give a figure: a skipped or failed point, or its failed and wrong variants."""
    if "skipped" in point or "error" in point:
        return point.get("skipped") or point["error"][:60]
    bad = [v["label"] + (" (wrong)" if v["error"] is None else " (failed)")
           for v in point.get("variants", []) if not v["correct"]]
    return "; ".join(bad)


def decode_line(point: dict[str, Any]) -> str:
    best = point.get("best", {})
    pallas = best.get("pallas", {})
    fraction = pallas.get("fraction_of_copy")
    return (f"{point['batch']:>5} {point['context']:>7} {microseconds(best, 'pallas'):>9} "
            f"{pallas.get('bytes_per_s', 0) / 1e9:>7.0f} {f'{fraction:.0%}' if fraction else '-':>6} "
            f"{microseconds(best, 'shipped'):>9} {ratio(point, 'speedup_vs_shipped'):>8} "
            f"{microseconds(best, 'pallas_mixed'):>9} {microseconds(best, 'xla'):>9} "
            f"{ratio(point, 'speedup_vs_xla'):>8} "
            f"{worst_error(point):>8}  {failures(point)}")


DECODE_HEADER = (f"{'batch':>5} {'context':>7} {'pallas us':>9} {'GB/s':>7} {'%copy':>6} {'shipped':>9} "
                 f"{'vs ship':>8} {'mixed us':>9} {'xla us':>9} {'vs xla':>8} {'rel err':>8}  not measured")


def prefill_line(point: dict[str, Any]) -> str:
    best = point.get("best", {})
    pallas = best.get("pallas", {})
    fraction = pallas.get("fraction_of_matmul")
    shape = f"{point['sequences']}x{point['chunk']}"
    return (f"{shape:>9} {point['prior_context']:>7} {microseconds(best, 'pallas'):>10} "
            f"{pallas.get('flops_per_s', 0) / 1e12:>8.1f} {f'{fraction:.0%}' if fraction else '-':>8} "
            f"{microseconds(best, 'xla'):>10} {ratio(point, 'speedup_vs_xla'):>8} {worst_error(point):>8}  "
            f"{failures(point)}")


PREFILL_HEADER = (f"{'seqs x q':>9} {'prior':>7} {'pallas us':>10} {'TFLOP/s':>8} {'%matmul':>8} {'xla us':>10} "
                  f"{'vs xla':>8} {'rel err':>8}  not measured")


def format_ceilings(ceilings: dict[str, Any]) -> str:
    copy, matmul, dispatch = (ceilings.get(name, {}) for name in ("copy", "matmul", "dispatch"))
    copy_text = f"{copy['bytes_per_s'] / 1e9:.0f} GB/s" if "bytes_per_s" in copy else f"failed ({copy.get('error')})"
    matmul_text = (f"{matmul['flops_per_s'] / 1e12:.1f} TFLOP/s" if "flops_per_s" in matmul
                   else f"failed ({matmul.get('error')})")
    dispatch_text = f"{dispatch['median_s'] * 1e6:.1f} us" if "median_s" in dispatch else "failed"
    return f"ceilings: copy {copy_text}, matmul {matmul_text}; dispatch floor per call {dispatch_text}"


def goal_summary(report: dict[str, Any]) -> str:
    """How many measured points meet each kernel goal."""
    decode = [p for p in report.get("decode", []) if "pallas" in p.get("best", {})]
    prefill = [p for p in report.get("prefill", []) if "pallas" in p.get("best", {})]
    copy_ok = sum((p["best"]["pallas"]["fraction_of_copy"] or 0) >= GOALS["decode_fraction_of_copy"] for p in decode)
    shipped_ok = sum(p.get("speedup_vs_shipped", 0) >= GOALS["decode_speedup_vs_shipped"] for p in decode)
    matmul_ok = sum((p["best"]["pallas"]["fraction_of_matmul"] or 0) >= GOALS["prefill_fraction_of_matmul"]
                    for p in prefill)
    return (f"goals: decode >= {GOALS['decode_fraction_of_copy']:.0%} of copy at {copy_ok}/{len(decode)} points, "
            f">= {GOALS['decode_speedup_vs_shipped']:.0f}x the shipped op at {shipped_ok}/{len(decode)}; prefill >= "
            f"{GOALS['prefill_fraction_of_matmul']:.0%} of matmul at {matmul_ok}/{len(prefill)}")


def print_report(report: dict[str, Any], settings: GridSettings) -> None:
    shape = settings.shape
    print(f"{report['machine']['device']} ({report['machine']['jax_backend']}); heads {shape.heads}/{shape.kv_heads}, "
          f"head_dim {shape.head_dim}, page {shape.page_size}, {shape.dtype}; {settings.reps} reps, median per call"
          f"{', sweep' if settings.sweep else ''}")
    if "ceilings" in report:
        print(format_ceilings(report["ceilings"]))
    if report.get("decode"):
        print("\n".join([DECODE_HEADER] + [decode_line(p) for p in report["decode"]]))
    if report.get("prefill"):
        print("\n".join([PREFILL_HEADER] + [prefill_line(p) for p in report["prefill"]]))
    if "ceilings" in report:
        print(goal_summary(report))


def json_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}


def main() -> None:
    args = parse_args()
    settings = grid_settings(args)
    start = time.perf_counter()
    report: dict[str, Any] = {"settings": json_settings(args), "grid": dataclasses.asdict(settings), "goals": GOALS,
                              "complete": False}

    def save() -> None:
        report["elapsed_s"] = time.perf_counter() - start
        if args.out:
            args.out.write_text(json.dumps(report, indent=2))

    report["machine"] = machine_description()
    report["ceilings"] = measure_ceilings(settings)
    print(format_ceilings(report["ceilings"]), flush=True)
    save()
    if not args.skip_decode:
        print(DECODE_HEADER, flush=True)
        run_decode_grid(settings, report["ceilings"], save, report.setdefault("decode", []))
    if not args.skip_prefill:
        print(PREFILL_HEADER, flush=True)
        run_prefill_grid(settings, report["ceilings"], save, report.setdefault("prefill", []))
    report["complete"] = True
    save()
    print(f"\nfinished in {report['elapsed_s']:.0f} s")
    print_report(report, settings)


if __name__ == "__main__":
    main()
