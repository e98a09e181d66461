"""Ragged paged decode attention: one query token per sequence, attending over that sequence's pages of the pool.

Layout (the serving cache's): the pool is f[kv_heads, num_pages, page_size, head_dim] for K and for V; sequence s
owns pages block_tables[s, 0..] in order and holds lengths[s] tokens. Each sequence's query has `heads` query heads,
grouped over the KV heads (grouped-query attention). With a sliding window of W slots a query sees only the last W
of its sequence's tokens, and each program's page loop starts at the window's first block.

The kernel runs on a static grid (kv_head, sequence, split): GPU lowerings of Pallas have neither scalar prefetch
nor a dynamic grid, so the block table and lengths are ordinary inputs read inside the kernel, and each program
loops only over the pages its sequence actually fills. One program processes all query heads of one KV head
together, so each K/V page is read once per KV head and the score computation is a matrix product; the group is
padded to at least 16 rows because Triton's dot needs that. Split-K (`DecodeTuning.k_splits`) divides each
sequence's pages among several programs, which then emit float32 partial results (unnormalised values, running
max, running sum) that a small XLA step combines; with one split the same path applies.

File order: kernel, wrapper (pallas_call), public API, plain-jnp reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.common import (MASK_VALUE, check_pool, check_shape_arguments, check_tuning, check_window,
                                   OnlineSoftmax, default_pages_per_block, padded_rows, window_input)

# Streaming multiprocessors of an H100 SXM: the GPU the default tunings are sized for.
H100_CORES = 132
# Programs per core a default tuning aims for: a second wave lets one program's loads overlap another's math and
# evens out sequences of unequal length.
WAVES_PER_CORE = 2
# Most splits a default tuning takes: the float32 partials [k_splits, S, kv_heads, rows, head_dim] and their XLA
# combine grow with it, while 16 splits of one sequence with 8 KV heads already give 128 programs, about a wave of
# an H100 (JAX's own Pallas GPU paged attention defaults to 16 splits too).
MAX_DEFAULT_K_SPLITS = 16
# Fewest key tiles per split (for a sequence that fills its block table) a default tuning allows: with one, the
# page loop has no next iteration for Triton's software pipeline to prefetch.
MIN_BLOCKS_PER_SPLIT = 2


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """Static launch parameters of the decode kernel; validated on creation.

    Hashable (frozen), so it can be a static argument of jit.
    """

    pages_per_block: int = 8
    """Pages folded into the online softmax per loop iteration; a power of two (Triton loads power-of-two tiles).
    Together with the page size it sets the key tile, which must be at least 16 slots."""
    k_splits: int = 1
    """Programs sharing one sequence's pages (split-K); more splits give more parallelism to short batches of long
    sequences at the cost of a combine step."""
    num_warps: int = 4
    """Warps per Triton program; a power of two."""
    num_stages: int = 2
    """Software-pipelining stages of the page loop in Triton."""

    def __post_init__(self):
        check_tuning(self, ("pages_per_block", "k_splits", "num_warps", "num_stages"), ("pages_per_block", "num_warps"))

    @property
    def kernel_name(self) -> str:
        """The pallas_call's name, which profiles and compiled modules show: it says which tuning ran."""
        return f"paged_decode_{self.pages_per_block}ppb_{self.k_splits}splits"


def default_decode_tuning(num_seqs: int, kv_heads: int, max_pages_per_seq: int, page_size: int, head_dim: int,
                          dtype, num_cores: int = H100_CORES) -> DecodeTuning:
    """The decode tuning for a call's static shapes: the pool's page size, head_dim and dtype, S sequences, and a
    block table of max_pages_per_seq columns. Deterministic, and always valid for those shapes.

    The key tile is `default_pages_per_block`'s. The grid has kv_heads * S * k_splits programs; split-K exists for
    few long sequences, which alone would leave most cores idle, so the splits grow until the grid fills
    WAVES_PER_CORE waves of `num_cores`, within MAX_DEFAULT_K_SPLITS and MIN_BLOCKS_PER_SPLIT key tiles per split.
    A large batch already fills the GPU and gets one split (no combine work). Warps and stages keep their defaults:
    they are a matter of measurement on the GPU, not of shape.
    """
    check_shape_arguments("default_decode_tuning", num_seqs=num_seqs, kv_heads=kv_heads,
                          max_pages_per_seq=max_pages_per_seq, page_size=page_size, head_dim=head_dim,
                          num_cores=num_cores)
    pages_per_block = default_pages_per_block(max_pages_per_seq, page_size, head_dim, dtype)
    blocks = -(-max_pages_per_seq // pages_per_block)
    wanted = -(-WAVES_PER_CORE * num_cores // (kv_heads * num_seqs))
    splits = max(1, min(wanted, MAX_DEFAULT_K_SPLITS, blocks // MIN_BLOCKS_PER_SPLIT))
    # The fewest splits of ceil(blocks / splits) tiles each: the kernel rounds every split up to whole tiles, so
    # a count that does not divide the tiles could otherwise leave its last splits with no page at all.
    splits = -(-blocks // -(-blocks // splits))
    return DecodeTuning(pages_per_block=pages_per_block, k_splits=splits)


# ---------------------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------------------


def _paged_decode_kernel(
    q_ref,  # f[group_rows, head_dim]: this sequence's query heads of this KV head, zero-padded rows
    k_pages_ref,  # f[num_pages, page_size, head_dim]: this KV head's whole K pool
    v_pages_ref,  # f[num_pages, page_size, head_dim]: this KV head's whole V pool
    block_table_ref,  # i32[pages_per_split]: this split's share of the sequence's block table
    length_ref,  # i32[1]: tokens the sequence holds
    *window_and_out_refs,  # (window i32[1], when windowed), then the outputs out, max and sum:
    # out f32[group_rows, head_dim]: unnormalised weighted values of this split
    # max f32[group_rows]: running max of this split's scores, in base 2 (OnlineSoftmax)
    # sum f32[group_rows]: sum of exp2(score - max) over this split
    softmax: OnlineSoftmax,
    pages_per_block: int,
    windowed: bool,
):
    """One (kv_head, sequence, split) program: online softmax over the split's visible pages, block by block."""
    window_ref, out_ref, max_ref, sum_ref = window_and_out_refs if windowed else (None, *window_and_out_refs)
    group_rows, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    pages_per_split = block_table_ref.shape[0]
    length = length_ref[0]
    first_page = pl.program_id(2) * pages_per_split
    # The query (at length - 1) sees the last `window` tokens; every row of the group sees the same slots.
    window_start = 0 if window_ref is None else jnp.maximum(length - window_ref[0], 0)
    # Only pages that hold tokens are visited; the grid is static, so a split past the sequence's end does nothing,
    # and one wholly before the window starts past its last block.
    pages_here = jnp.clip(pl.cdiv(length, page_size) - first_page, 0, pages_per_split)
    num_blocks = pl.cdiv(pages_here, pages_per_block)
    first_block = jnp.maximum(window_start - first_page * page_size, 0) // (pages_per_block * page_size)
    query = q_ref[...]  # f[group_rows, head_dim]

    def fold_block(block, state):
        keys, values, visible = _load_block(k_pages_ref, v_pages_ref, block_table_ref, block, pages_here,
                                            first_page, window_start, length, pages_per_block)
        # A float8 pool's pages are widened to the query's dtype in registers (its scales are folded outside).
        keys, values = keys.astype(query.dtype), values.astype(query.dtype)
        scores = softmax.scores(query, keys)  # f32[group_rows, block_slots]
        scores = jnp.where(lax.broadcast_in_dim(visible, scores.shape, (1,)), scores, MASK_VALUE)
        return softmax.fold(state, scores, values)

    state = (
        jnp.full((group_rows,), jnp.finfo(jnp.float32).min, jnp.float32),  # running max
        jnp.zeros((group_rows,), jnp.float32),  # running sum
        jnp.zeros((group_rows, head_dim), jnp.float32),  # weighted values
    )
    running_max, total, weighted = lax.fori_loop(first_block, num_blocks, fold_block, state)
    out_ref[...] = weighted
    max_ref[...] = running_max
    sum_ref[...] = total


def _load_block(k_pages_ref, v_pages_ref, block_table_ref, block, pages_here, first_page, window_start, length,
                pages_per_block: int):
    """Keys f[block_slots, head_dim], values (masked slots zeroed), and visible bool[block_slots] of one block."""
    _, page_size, head_dim = k_pages_ref.shape
    block_slots = pages_per_block * page_size
    local_pages = block * pages_per_block + jnp.arange(pages_per_block)  # i32[pages_per_block]
    page_ids = block_table_ref[pl.ds(block * pages_per_block, pages_per_block)]  # i32[pages_per_block]
    # Table entries past the sequence's last page are unspecified (they may even be out of range): read page 0
    # there instead, whose slots are masked below anyway.
    page_ids = jnp.where(local_pages < pages_here, page_ids, 0)
    keys = k_pages_ref[page_ids].reshape(block_slots, head_dim)  # f[block_slots, head_dim]
    values = v_pages_ref[page_ids].reshape(block_slots, head_dim)  # f[block_slots, head_dim]
    slot_positions = (first_page + block * pages_per_block) * page_size + jnp.arange(block_slots)  # i32[block_slots]
    visible = (slot_positions >= window_start) & (slot_positions < length)  # bool[block_slots]
    # where, not a multiply: a masked slot may hold NaN (stale or poisoned memory), and 0 * NaN is NaN.
    values = jnp.where(lax.broadcast_in_dim(visible, values.shape, (0,)), values, jnp.zeros((), values.dtype))
    return keys, values, visible


# ---------------------------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------------------------


def _split_block_tables(block_tables: jax.Array, tuning: DecodeTuning) -> jax.Array:
    """i32[S, k_splits, pages_per_split]: the table padded with page 0 so every split is a whole number of blocks."""
    seqs, max_pages = block_tables.shape
    pages_per_split = -(-max_pages // tuning.k_splits)
    pages_per_split = -(-pages_per_split // tuning.pages_per_block) * tuning.pages_per_block
    padded = jnp.pad(block_tables, ((0, 0), (0, tuning.k_splits * pages_per_split - max_pages)))
    return padded.reshape(seqs, tuning.k_splits, pages_per_split)


def _decode_partials(
    grouped_q: jax.Array,  # f[S, kv_heads, group_rows, head_dim]
    k_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim]
    split_tables: jax.Array,  # i32[S, k_splits, pages_per_split]
    lengths: jax.Array,  # i32[S]
    window: jax.Array | None,  # i32[1]: slots a query sees, itself included; None: all of its sequence
    *,
    sm_scale: float,
    logits_soft_cap: float | None,
    tuning: DecodeTuning,
    interpret: bool,
):
    """The pallas_call: per split, unnormalised values f32[k_splits, S, kv_heads, group_rows, head_dim], running
    max and running sum f32[k_splits, S, kv_heads, group_rows]."""
    seqs, kv_heads, group_rows, head_dim = grouped_q.shape
    _, num_pages, page_size, _ = k_pages.shape
    pages_per_split = split_tables.shape[2]
    pool_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda h, s, p: (h, 0, 0, 0))
    row_spec = pl.BlockSpec((None, None, None, group_rows), lambda h, s, p: (p, s, h, 0))
    kernel = functools.partial(_paged_decode_kernel, softmax=OnlineSoftmax(sm_scale, logits_soft_cap, not interpret),
                               pages_per_block=tuning.pages_per_block, windowed=window is not None)
    window_inputs = [] if window is None else [window]
    return pl.pallas_call(
        kernel,
        grid=(kv_heads, seqs, tuning.k_splits),
        in_specs=[
            pl.BlockSpec((None, None, group_rows, head_dim), lambda h, s, p: (s, h, 0, 0)),
            pool_spec,
            pool_spec,
            pl.BlockSpec((None, None, pages_per_split), lambda h, s, p: (s, p, 0)),
            pl.BlockSpec((1,), lambda h, s, p: (s,)),
        ] + [pl.BlockSpec((1,), lambda h, s, p: (0,))] * len(window_inputs),
        out_specs=[
            pl.BlockSpec((None, None, None, group_rows, head_dim), lambda h, s, p: (p, s, h, 0, 0)),
            row_spec,
            row_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((tuning.k_splits, seqs, kv_heads, group_rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((tuning.k_splits, seqs, kv_heads, group_rows), jnp.float32),
            jax.ShapeDtypeStruct((tuning.k_splits, seqs, kv_heads, group_rows), jnp.float32),
        ],
        # Explicit Triton parameters: without them a GPU pallas_call may pick another GPU backend.
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret,
        name=tuning.kernel_name,
    )(grouped_q, k_pages, v_pages, split_tables, lengths, *window_inputs)


def _combine_splits(
    partial_out: jax.Array,  # f32[k_splits, S, kv_heads, group_rows, head_dim]
    partial_max: jax.Array,  # f32[k_splits, S, kv_heads, group_rows], base 2 (OnlineSoftmax)
    partial_sum: jax.Array,  # f32[k_splits, S, kv_heads, group_rows]
) -> jax.Array:  # f32[S, kv_heads, group_rows, head_dim]
    """Merges the splits' softmax states; a row that saw no slot (length 0) comes out as zeros, not NaN."""
    global_max = jnp.max(partial_max, axis=0)  # f32[S, kv_heads, group_rows]
    correction = jnp.exp2(partial_max - global_max)  # f32[k_splits, S, kv_heads, group_rows]
    total = jnp.sum(partial_sum * correction, axis=0)  # f32[S, kv_heads, group_rows]
    weighted = jnp.sum(partial_out * correction[..., None], axis=0)  # f32[S, kv_heads, group_rows, head_dim]
    return weighted / jnp.where(total > 0, total, 1.0)[..., None]


def _check_shapes(q, k_pages, v_pages, block_tables, lengths, sliding_window, tuning: DecodeTuning):
    """Raises ValueError naming the first input that the kernel cannot take."""
    check_pool(q, k_pages, v_pages, block_tables, tuning.pages_per_block)
    check_window(sliding_window)
    seqs = q.shape[0]
    if block_tables.shape[0] != seqs:
        raise ValueError(f"block_tables must be i32[{seqs}, max_pages], got {block_tables.dtype}{block_tables.shape}")
    if lengths.shape != (seqs,) or lengths.dtype != jnp.int32:
        raise ValueError(f"lengths must be i32[{seqs}], got {lengths.dtype}{lengths.shape}")


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("sm_scale", "logits_soft_cap", "tuning", "interpret"))
def paged_decode_attention(
    q: jax.Array,  # f[S, heads, head_dim]
    k_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim]
    block_tables: jax.Array,  # i32[S, max_pages]
    lengths: jax.Array,  # i32[S]
    *,
    sm_scale: float,
    logits_soft_cap: float | None = None,
    sliding_window: jax.Array | int | None = None,  # i32[] or int: slots a query sees, itself included
    tuning: DecodeTuning = DecodeTuning(),
    interpret: bool = False,
) -> jax.Array:  # f[S, heads, head_dim], q's dtype
    """Decode attention of each sequence's single query over its first lengths[s] cached tokens (only the last
    `sliding_window` of them, when given: a traced value, so one program serves every window).

    Query head i attends with KV head i // (heads // kv_heads). Scores are q·k * sm_scale, then, if
    `logits_soft_cap` is given, cap * tanh(score / cap). Accumulation is float32. A sequence of length 0 gets
    zeros. Block-table entries past a sequence's last page are never read as pages, and slots past its length
    never reach the output, whatever they hold (NaN included). `interpret=True` runs the kernel on any backend
    (CPU included) for testing.
    """
    _check_shapes(q, k_pages, v_pages, block_tables, lengths, sliding_window, tuning)
    seqs, heads, head_dim = q.shape
    kv_heads = k_pages.shape[0]
    group = heads // kv_heads
    grouped_q = q.reshape(seqs, kv_heads, group, head_dim)  # f[S, kv_heads, group, head_dim]
    grouped_q = jnp.pad(grouped_q, ((0, 0), (0, 0), (0, padded_rows(group) - group), (0, 0)))
    partials = _decode_partials(grouped_q, k_pages, v_pages,
                                _split_block_tables(block_tables, tuning), lengths, window_input(sliding_window),
                                sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, tuning=tuning,
                                interpret=interpret)
    out = _combine_splits(*partials)[:, :, :group]  # f32[S, kv_heads, group, head_dim]
    return out.reshape(seqs, heads, head_dim).astype(q.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("sm_scale", "logits_soft_cap"))
def paged_decode_reference(
    q: jax.Array,  # f[S, heads, head_dim]
    k_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim]
    block_tables: jax.Array,  # i32[S, max_pages]
    lengths: jax.Array,  # i32[S]
    *,
    sm_scale: float,
    logits_soft_cap: float | None = None,
    sliding_window: jax.Array | int | None = None,  # i32[] or int: slots a query sees, itself included
) -> jax.Array:  # f[S, heads, head_dim], q's dtype
    """Plain-jnp decode attention with the kernel's semantics: gathers every sequence's whole context at once.

    Memory is S * max_pages * page_size * kv_heads * head_dim per K and V, so it is for tests, not serving.
    """
    seqs, heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    max_slots = block_tables.shape[1] * page_size
    # A float8 pool's pages read as the query's dtype, as in the kernel.
    keys = k_pages[:, block_tables].reshape(kv_heads, seqs, max_slots, head_dim).astype(q.dtype)  # f[K, S, slots, D]
    values = v_pages[:, block_tables].reshape(kv_heads, seqs, max_slots, head_dim).astype(q.dtype)  # f[K, S, slots, D]
    grouped_q = q.reshape(seqs, kv_heads, heads // kv_heads, head_dim)  # f[S, kv_heads, group, head_dim]
    scores = jnp.einsum("skgd,ksld->skgl", grouped_q, keys, preferred_element_type=jnp.float32,
                        precision=lax.Precision.HIGHEST) * sm_scale  # f32[S, kv_heads, group, slots]
    if logits_soft_cap is not None:
        scores = logits_soft_cap * jnp.tanh(scores / logits_soft_cap)
    slots = jnp.arange(max_slots)[None, :]  # i32[1, slots]
    visible = slots < lengths[:, None]  # bool[S, slots]
    if sliding_window is not None:
        visible &= slots >= lengths[:, None] - sliding_window
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    # A row that sees nothing has max -inf; shifting by 0 instead keeps its exp at 0 rather than NaN.
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))  # f32[S, kv_heads, group, slots]
    total = jnp.sum(probs, axis=-1, keepdims=True)  # f32[S, kv_heads, group, 1]
    # where, not a multiply: masked V slots may hold NaN.
    values = jnp.where(visible[None, :, :, None], values, jnp.zeros((), values.dtype))
    weighted = jnp.einsum("skgl,ksld->skgd", probs, values.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    out = weighted / jnp.where(total > 0, total, 1.0)  # f32[S, kv_heads, group, head_dim]
    return out.reshape(seqs, heads, head_dim).astype(q.dtype)
