"""Ragged paged prefill (mixed) attention: the flattened query tokens of a step, causal within each sequence.

A step's T query tokens are prefill chunks and decode tokens of several sequences, concatenated; token t belongs to
sequence row token_seq[t] and sits at position positions[t] of that sequence. Its K/V (and those of every earlier
chunk) are already in the page pool f[kv_heads, num_pages, page_size, head_dim], so token t attends over slots
0 .. min(positions[t] + 1, seq_lens[s]) - 1 of its sequence's pages, block_tables[s, 0..] in order; with a sliding
window of W slots, over only the last W of those (the loop then starts at the block of the item's earliest window).

GPU lowerings of Pallas have neither scalar prefetch nor a dynamic grid, so the wrapper computes in XLA a work list
of fixed length W: each work item is up to `block_q` consecutive tokens of ONE sequence (a run of tokens of one
sequence is cut into blocks of block_q; the last block of a run may be short, and unused items are empty). The
grid is static (kv_head, work item); each program loads its item's queries for all query heads of its KV head
(rows = block_q * group, padded to a power of two of at least 16 for Triton's dot), loops over the sequence's
pages up to the item's last visible slot with an online float32 softmax (key blocks every row sees wholly without a
mask, the others with a per-row causal mask), and writes its rows. XLA then gathers the item rows back to token
order. The work list, the rows' positions and the items' block tables depend on the batch layout alone: they form
a `PrefillPlan` (`plan_prefill`), which a model makes once per step and passes to every layer's call
(`planned_prefill_attention`, with the layer's first page as an offset into a pool that holds every layer).

The work list is derived from token_seq alone: a work item never spans a change of token_seq, and tokens of one
sequence must be contiguous (as `PagedAttentionMetadata` promises). Positions are read per query row, so they need
not be consecutive within a run (padding tokens that share the last real row at position 0 are handled). With
R runs of equal token_seq the list needs at most T // block_q + R items; W = min(T, T // block_q + S) covers any
batch whose rows are contiguous.

File order: kernel, work list, plan, wrapper (pallas_call), public API, reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.common import (MASK_VALUE, MIN_DOT_DIM, check_pool, check_shape_arguments, check_tuning,
                                   check_window, default_pages_per_block, next_power_of_two, OnlineSoftmax,
                                   padded_rows, previous_power_of_two, window_input)
from kernels_pallas.paged_decode import paged_decode_reference

_NO_POSITION = -1  # position of a query row that holds no token: it sees no slot
_NO_SLOT = jnp.iinfo(jnp.int32).max  # first visible slot of an item with no token
# Most query rows (block_q * group) per program a default tuning takes: the float32 accumulator [rows, head_dim]
# and scores [rows, slots] live in registers, 128 f32 registers per thread at head_dim 128 and 128 slots for each
# 64 rows a warpgroup (4 warps) holds. Hopper's wgmma computes 64 rows per warpgroup, so a default tuning gives
# every 64 rows 4 warps: 128 rows take 8 warps, two warpgroups sharing each K/V tile (246 registers, no spills, at
# Llama-3.1-8B's heads: benchmarks/kernel_code.py).
MAX_DEFAULT_ROWS = 128
ROWS_PER_WARPGROUP = 64
WARPS_PER_WARPGROUP = 4


@dataclasses.dataclass(frozen=True)
class PrefillTuning:
    """Static launch parameters of the prefill kernel; validated on creation.

    Hashable (frozen), so it can be a static argument of jit.
    """

    block_q: int = 16
    """Query tokens per work item (all of one sequence). Rows per program are block_q * group padded to a power of
    two, so a power of two wastes no rows when the group is one."""
    pages_per_block: int = 8
    """Pages folded into the online softmax per loop iteration; a power of two (Triton loads power-of-two tiles).
    Together with the page size it sets the key tile, which must be at least 16 slots."""
    num_warps: int = 4
    """Warps per Triton program; a power of two."""
    num_stages: int = 2
    """Software-pipelining stages of the page loop in Triton."""

    def __post_init__(self):
        check_tuning(self, ("block_q", "pages_per_block", "num_warps", "num_stages"), ("pages_per_block", "num_warps"))

    @property
    def kernel_name(self) -> str:
        """The pallas_call's name, which profiles and compiled modules show: it says which tuning ran."""
        return f"paged_prefill_{self.block_q}q_{self.pages_per_block}ppb_{self.num_warps}w_{self.num_stages}s"


def default_prefill_tuning(num_tokens: int, num_seqs: int, group: int, max_pages_per_seq: int, page_size: int,
                           head_dim: int, dtype) -> PrefillTuning:
    """The prefill tuning for a call's static shapes: T query tokens over S sequence rows with `group` query heads
    per KV head, the pool's page size, head_dim and dtype, and a block table of max_pages_per_seq columns.
    Deterministic, and always valid for those shapes.

    The key tile is `default_pages_per_block`'s. Every work item reads its sequence's pages up to its last query,
    so a larger query block reads a prefill chunk's context fewer times; but a block larger than a sequence's run
    of tokens only adds empty rows. T / S, the mean tokens per row of a full batch of this shape, stands for the
    run length, so block_q is that rounded down to a power of two, between MIN_DOT_DIM // group (rows Triton's dot
    pads to anyway, so free) and MAX_DEFAULT_ROWS // group (the register budget). Each 64 rows get a warpgroup
    (4 warps); stages keep their default, a matter of measurement on the GPU, not of shape.
    """
    check_shape_arguments("default_prefill_tuning", num_tokens=num_tokens, num_seqs=num_seqs, group=group,
                          max_pages_per_seq=max_pages_per_seq, page_size=page_size, head_dim=head_dim)
    smallest = max(1, MIN_DOT_DIM // group)
    largest = max(1, MAX_DEFAULT_ROWS // group)
    block_q = min(max(previous_power_of_two(max(1, num_tokens // num_seqs)), smallest), largest)
    warpgroups = max(1, padded_rows(block_q * group) // ROWS_PER_WARPGROUP)
    return PrefillTuning(block_q=block_q,
                         pages_per_block=default_pages_per_block(max_pages_per_seq, page_size, head_dim, dtype),
                         num_warps=WARPS_PER_WARPGROUP * warpgroups)


# ---------------------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------------------


def _paged_prefill_kernel(
    q_ref,  # f[rows, head_dim]: the item's queries of this KV head's query heads, token-major, zero-padded rows
    row_positions_ref,  # i32[rows]: each row's query position; _NO_POSITION for rows without a token
    k_pages_ref,  # f[num_pages, page_size, head_dim]: this KV head's whole K pool
    v_pages_ref,  # f[num_pages, page_size, head_dim]: this KV head's whole V pool
    block_table_ref,  # i32[table_pages]: the item's sequence's block table, padded
    length_ref,  # i32[1]: tokens the item's sequence holds; 0 for an empty item
    page_offset_ref,  # i32[1]: added to every block-table entry (the first page of the layer read)
    *window_and_out_refs,  # (window i32[1], when windowed), out f[rows, head_dim]: each row's normalised output
    softmax: OnlineSoftmax,
    pages_per_block: int,
    windowed: bool,
):
    """One (kv_head, work item) program: online softmax over the pages the item's queries can see.

    The key blocks fall in three runs: those some row may not see wholly (before the last row's window start),
    those every row sees wholly, and those past the first row's last visible slot (the causal diagonal and the
    sequence's end). Only the outer runs pay for masks and for zeroing values outside the item; in a long prompt's
    items the middle run is nearly every block, so the loop the GPU mostly runs is two GEMMs and the softmax.
    """
    window_ref, out_ref = window_and_out_refs if windowed else (None, *window_and_out_refs)
    rows, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    block_slots = pages_per_block * page_size
    row_positions = row_positions_ref[...]  # i32[rows]
    # Slots each row may see: causal (up to its position) and never past the sequence's length; with a window, only
    # the last `window` of those.
    row_limits = jnp.clip(row_positions + 1, 0, length_ref[0])  # i32[rows]
    row_starts = None if window_ref is None else jnp.maximum(row_limits - window_ref[0], 0)  # i32[rows]
    item_limit = jnp.max(row_limits)
    # Rows without a token see nothing and bound nothing; an empty item starts past its (absent) end.
    has_token = row_positions != _NO_POSITION  # bool[rows]
    item_start = 0 if row_starts is None else jnp.min(jnp.where(row_limits > 0, row_starts, _NO_SLOT))
    pages_here = pl.cdiv(item_limit, page_size)
    num_blocks = pl.cdiv(pages_here, pages_per_block)
    first_block = item_start // block_slots
    # The middle run: blocks inside every token row's [start, limit). Rows without a token read them too (finite
    # scores of zero queries), and their outputs are never gathered back.
    whole_from = first_block if row_starts is None else pl.cdiv(jnp.max(jnp.where(has_token, row_starts, 0)),
                                                                block_slots)
    whole_from = jnp.clip(whole_from, first_block, num_blocks)
    whole_to = jnp.clip(jnp.min(jnp.where(has_token, row_limits, _NO_SLOT)) // block_slots, whole_from, num_blocks)
    query = q_ref[...]  # f[rows, head_dim]

    def fold_masked_block(block, state):
        keys, values, slot_positions = _load_block(k_pages_ref, v_pages_ref, block_table_ref, page_offset_ref[0],
                                                   block, pages_here, pages_per_block, query.dtype)
        # Slots in [item_start, item_limit) are written tokens of the sequence, so finite; others may hold NaN, and a
        # row that masks them still multiplies them by probability 0 (0 * NaN = NaN): zero them with where.
        in_item = (slot_positions >= item_start) & (slot_positions < item_limit)  # bool[slots]
        values = jnp.where(lax.broadcast_in_dim(in_item, values.shape, (0,)), values, jnp.zeros((), values.dtype))
        slots = lax.broadcast_in_dim(slot_positions, (rows, slot_positions.shape[0]), (1,))  # i32[rows, slots]
        visible = slots < lax.broadcast_in_dim(row_limits, slots.shape, (0,))  # bool[rows, slots]
        if row_starts is not None:
            # A row whose window starts in a later block sees none of this one: its max becomes MASK_VALUE and its
            # sums collect finite junk, which its first real score then rescales by exp(MASK_VALUE - score) = 0.
            visible &= slots >= lax.broadcast_in_dim(row_starts, slots.shape, (0,))
        return softmax.fold(state, jnp.where(visible, softmax.scores(query, keys), MASK_VALUE), values)

    def fold_whole_block(block, state):
        keys, values, _ = _load_block(k_pages_ref, v_pages_ref, block_table_ref, page_offset_ref[0], block,
                                      pages_here, pages_per_block, query.dtype)
        return softmax.fold(state, softmax.scores(query, keys), values)

    state = (
        jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32),  # running max
        jnp.zeros((rows,), jnp.float32),  # running sum
        jnp.zeros((rows, head_dim), jnp.float32),  # weighted values
    )
    if row_starts is not None:
        state = lax.fori_loop(first_block, whole_from, fold_masked_block, state)
    state = lax.fori_loop(whole_from, whole_to, fold_whole_block, state)
    _, total, weighted = lax.fori_loop(whole_to, num_blocks, fold_masked_block, state)
    # An empty item (or a padding sequence of length 0) never enters a loop: total 0, so divide by 1 for zeros.
    out_ref[...] = (weighted / lax.broadcast_in_dim(jnp.where(total > 0, total, 1.0), weighted.shape, (0,))
                    ).astype(out_ref.dtype)


def _load_block(k_pages_ref, v_pages_ref, block_table_ref, page_offset, block, pages_here, pages_per_block: int,
                dtype):
    """Keys and values f[slots, head_dim] of one key block, in the query's dtype, and its slot positions i32[slots]."""
    _, page_size, head_dim = k_pages_ref.shape
    block_slots = pages_per_block * page_size
    local_pages = block * pages_per_block + jnp.arange(pages_per_block)  # i32[pages_per_block]
    page_ids = block_table_ref[pl.ds(block * pages_per_block, pages_per_block)]  # i32[pages_per_block]
    # Entries past the last page the item needs are unspecified (maybe out of range): read page 0 instead.
    page_ids = jnp.where(local_pages < pages_here, page_ids + page_offset, 0)
    keys = k_pages_ref[page_ids].reshape(block_slots, head_dim)  # f[slots, head_dim]
    values = v_pages_ref[page_ids].reshape(block_slots, head_dim)  # f[slots, head_dim]
    slot_positions = block * block_slots + jnp.arange(block_slots)  # i32[slots]
    # A float8 pool's pages are widened to the query's dtype in registers (its scales are folded outside).
    return keys.astype(dtype), values.astype(dtype), slot_positions


# ---------------------------------------------------------------------------------------------------------------
# Work list
# ---------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WorkList:
    """W work items, each up to block_q consecutive tokens of one sequence, and where every token landed."""

    first_token: jax.Array  # i32[W]: index of the item's first token in the batch
    num_tokens: jax.Array  # i32[W]: tokens in the item; 0 for an empty item
    seq_row: jax.Array  # i32[W]: the item's sequence row
    token_item: jax.Array  # i32[T]: each token's item; W (out of range) if the list overflowed
    token_offset: jax.Array  # i32[T]: each token's index within its item


def num_work_items(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Static list length: every item holds a token, and each run of one sequence wastes at most one short item."""
    return max(1, min(num_tokens, num_tokens // block_q + num_seqs))


def build_work_list(token_seq: jax.Array, num_seqs: int, block_q: int) -> WorkList:
    """Cuts every run of equal token_seq (i32[T]) into blocks of block_q tokens, in XLA, padded to a fixed length."""
    tokens = token_seq.shape[0]
    items = num_work_items(tokens, num_seqs, block_q)
    index = jnp.arange(tokens, dtype=jnp.int32)  # i32[T]
    run_start = jnp.concatenate([jnp.ones((1,), bool), token_seq[1:] != token_seq[:-1]])  # bool[T]
    run_first = lax.cummax(jnp.where(run_start, index, 0))  # i32[T]: first token of each token's run
    offset_in_run = index - run_first  # i32[T]
    item_start = offset_in_run % block_q == 0  # bool[T]
    token_item = jnp.cumsum(item_start.astype(jnp.int32)) - 1  # i32[T]
    token_item = jnp.where(token_item < items, token_item, items)  # overflow (non-contiguous rows) is dropped
    first_token = jnp.zeros((items,), jnp.int32).at[jnp.where(item_start, token_item, items)].set(index, mode="drop")
    num_tokens = jnp.zeros((items,), jnp.int32).at[token_item].add(1, mode="drop")
    return WorkList(first_token=first_token, num_tokens=num_tokens, seq_row=token_seq[first_token],
                    token_item=token_item, token_offset=offset_in_run % block_q)


# ---------------------------------------------------------------------------------------------------------------
# Plan: what the work items hold and read, from the batch layout alone
# ---------------------------------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """A call's work items, their query rows' positions and their sequences' block tables and lengths: everything
    the kernel needs besides the queries and the pool. It depends on the batch layout alone, so a model builds it
    once per step (outside its layer loop) and every layer's call reuses it (`planned_prefill_attention`); built
    per call, these are a dozen small XLA launches per layer."""

    work: WorkList
    row_positions: jax.Array  # i32[W, rows]: each query row's position; _NO_POSITION for rows without a token
    tables: jax.Array  # i32[W, table_pages]: each item's sequence's block table, null-padded to whole key tiles
    lengths: jax.Array  # i32[W]: tokens each item's sequence holds; 0 for empty items
    tuning: PrefillTuning = dataclasses.field(metadata=dict(static=True))  # the tuning the plan was cut for
    group: int = dataclasses.field(metadata=dict(static=True))  # query heads per KV head


def plan_prefill(
    block_tables: jax.Array,  # i32[S, max_pages]
    seq_lens: jax.Array,  # i32[S]
    token_seq: jax.Array,  # i32[T]: each token's sequence row; tokens of one row contiguous
    positions: jax.Array,  # i32[T]: each token's position in its sequence
    *,
    group: int,
    tuning: PrefillTuning,
) -> PrefillPlan:
    """The plan of a call with this batch layout, `group` query heads per KV head and `tuning` (XLA ops)."""
    _check_layout(block_tables, seq_lens, token_seq, positions)
    block_q, rows = tuning.block_q, padded_rows(tuning.block_q * group)
    work = build_work_list(token_seq, block_tables.shape[0], block_q)
    in_item = jnp.arange(block_q)[None, :] < work.num_tokens[:, None]  # bool[W, block_q]
    row_positions = jnp.where(in_item, positions[_item_token_ids(work, block_q, token_seq.shape[0])],
                              _NO_POSITION)  # i32[W, block_q]
    row_positions = jnp.repeat(row_positions, group, axis=1)  # i32[W, block_q * group]
    row_positions = jnp.pad(row_positions, ((0, 0), (0, rows - block_q * group)), constant_values=_NO_POSITION)
    max_pages = block_tables.shape[1]
    table_pages = max(tuning.pages_per_block, next_power_of_two(max_pages))
    tables = jnp.pad(block_tables, ((0, 0), (0, table_pages - max_pages)))[work.seq_row]  # i32[W, table_pages]
    lengths = jnp.where(work.num_tokens > 0, seq_lens[work.seq_row], 0)  # i32[W]
    return PrefillPlan(work=work, row_positions=row_positions, tables=tables, lengths=lengths, tuning=tuning,
                       group=group)


def _item_token_ids(work: WorkList, block_q: int, tokens: int) -> jax.Array:  # i32[W, block_q]
    """The batch index of each item's tokens (clipped into range for the rows past an item's last token)."""
    return jnp.clip(work.first_token[:, None] + jnp.arange(block_q)[None, :], 0, tokens - 1)


def _check_layout(block_tables, seq_lens, token_seq, positions):
    """Raises ValueError naming the first layout array that the kernel cannot take."""
    if block_tables.ndim != 2 or block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be i32[S, max_pages], got {block_tables.dtype}{block_tables.shape}")
    tokens, seqs = token_seq.shape[0], block_tables.shape[0]
    if seq_lens.shape != (seqs,) or seq_lens.dtype != jnp.int32:
        raise ValueError(f"seq_lens must be i32[{seqs}], got {seq_lens.dtype}{seq_lens.shape}")
    for name, array in (("token_seq", token_seq), ("positions", positions)):
        if array.shape != (tokens,) or array.dtype != jnp.int32:
            raise ValueError(f"{name} must be i32[{tokens}], got {array.dtype}{array.shape}")


# ---------------------------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------------------------


def _item_queries(q, plan: PrefillPlan, kv_heads: int) -> jax.Array:  # f[W, kv_heads, rows, head_dim]
    """Each item's queries, row = token * group + head in group, zero-padded rows."""
    tokens, _, head_dim = q.shape
    block_q, group, rows = plan.tuning.block_q, plan.group, plan.row_positions.shape[1]
    in_item = jnp.arange(block_q)[None, :] < plan.work.num_tokens[:, None]  # bool[W, block_q]
    item_q = q[_item_token_ids(plan.work, block_q, tokens)]  # f[W, block_q, heads, D]
    item_q = jnp.where(in_item[..., None, None], item_q, jnp.zeros((), q.dtype))
    item_q = item_q.reshape(-1, block_q, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    item_q = item_q.reshape(-1, kv_heads, block_q * group, head_dim)  # f[W, kv_heads, block_q * group, D]
    return jnp.pad(item_q, ((0, 0), (0, 0), (0, rows - block_q * group), (0, 0)))


def _prefill_items(
    item_q: jax.Array,  # f[W, kv_heads, rows, head_dim]
    k_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim]
    plan: PrefillPlan,
    page_offset: jax.Array,  # i32[1]
    window: jax.Array | None,  # i32[1]: slots a query sees, itself included; None: every slot before it
    *,
    sm_scale: float,
    logits_soft_cap: float | None,
    interpret: bool,
) -> jax.Array:  # f[W, kv_heads, rows, head_dim]
    """The pallas_call over the static grid (kv_head, work item)."""
    items, kv_heads, rows, head_dim = item_q.shape
    _, num_pages, page_size, _ = k_pages.shape
    tuning = plan.tuning
    pool_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda h, w: (h, 0, 0, 0))
    rows_spec = pl.BlockSpec((None, None, rows, head_dim), lambda h, w: (w, h, 0, 0))
    scalar_spec = pl.BlockSpec((1,), lambda h, w: (0,))
    kernel = functools.partial(_paged_prefill_kernel, softmax=OnlineSoftmax(sm_scale, logits_soft_cap, not interpret),
                               pages_per_block=tuning.pages_per_block, windowed=window is not None)
    window_inputs = [] if window is None else [window]
    return pl.pallas_call(
        kernel,
        grid=(kv_heads, items),
        in_specs=[
            rows_spec,
            pl.BlockSpec((None, rows), lambda h, w: (w, 0)),
            pool_spec,
            pool_spec,
            pl.BlockSpec((None, plan.tables.shape[1]), lambda h, w: (w, 0)),
            pl.BlockSpec((1,), lambda h, w: (w,)),
            scalar_spec,
        ] + [scalar_spec] * len(window_inputs),
        out_specs=rows_spec,
        out_shape=jax.ShapeDtypeStruct(item_q.shape, item_q.dtype),
        # Explicit Triton parameters: without them a GPU pallas_call may pick another GPU backend.
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret,
        name=tuning.kernel_name,
    )(item_q, plan.row_positions, k_pages, v_pages, plan.tables, plan.lengths, page_offset, *window_inputs)


def _token_outputs(item_out, work: WorkList, tokens: int, group: int) -> jax.Array:  # f[T, heads, head_dim]
    """Gathers each token's rows back from its item; tokens the list dropped get zeros."""
    items, kv_heads, _, head_dim = item_out.shape
    rows = work.token_offset[:, None] * group + jnp.arange(group)[None, :]  # i32[T, group]
    found = work.token_item < items  # bool[T]
    out = item_out[jnp.clip(work.token_item, 0, items - 1)[:, None, None], jnp.arange(kv_heads)[None, :, None],
                   rows[:, None, :]]  # f[T, kv_heads, group, head_dim]
    out = jnp.where(found[:, None, None, None], out, jnp.zeros((), out.dtype))
    return out.reshape(tokens, kv_heads * group, head_dim)


def _check_planned_call(q, k_pages, v_pages, plan: PrefillPlan, sliding_window):
    """Raises ValueError naming the first input that the kernel, or this plan, cannot take."""
    check_pool(q, k_pages, v_pages, plan.tables, plan.tuning.pages_per_block)
    check_window(sliding_window)
    group = q.shape[1] // k_pages.shape[0]
    if group != plan.group:
        raise ValueError(f"the plan was made for {plan.group} query heads per KV head, the call has {group}")
    if plan.work.token_item.shape[0] != q.shape[0]:
        raise ValueError(f"the plan was made for {plan.work.token_item.shape[0]} tokens, q has {q.shape[0]}")


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("sm_scale", "logits_soft_cap", "interpret"))
def planned_prefill_attention(
    q: jax.Array,  # f[T, heads, head_dim], already rotated
    k_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim], this step's K already written
    v_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim], this step's V already written
    plan: PrefillPlan,
    *,
    page_offset: jax.Array | int = 0,  # i32[]: added to every block-table entry of the plan
    sm_scale: float,
    logits_soft_cap: float | None = None,
    sliding_window: jax.Array | int | None = None,  # i32[] or int: slots a query sees, itself included
    interpret: bool = False,
) -> jax.Array:  # f[T, heads, head_dim], q's dtype
    """`paged_prefill_attention` with its plan made beforehand (`plan_prefill`), for block tables plus
    `page_offset`: a model reading one layer's pages of a pool that holds every layer passes the layer's first page
    here, so one plan serves all its layers."""
    _check_planned_call(q, k_pages, v_pages, plan, sliding_window)
    tokens = q.shape[0]
    item_q = _item_queries(q, plan, k_pages.shape[0])
    offset = jnp.asarray(page_offset, jnp.int32).reshape(1)
    item_out = _prefill_items(item_q, k_pages, v_pages, plan, offset, window_input(sliding_window),
                              sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, interpret=interpret)
    return _token_outputs(item_out, plan.work, tokens, plan.group)


@functools.partial(jax.jit, static_argnames=("sm_scale", "logits_soft_cap", "tuning", "interpret"))
def paged_prefill_attention(
    q: jax.Array,  # f[T, heads, head_dim], already rotated
    k_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim], this step's K already written
    v_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim], this step's V already written
    block_tables: jax.Array,  # i32[S, max_pages]
    seq_lens: jax.Array,  # i32[S]
    token_seq: jax.Array,  # i32[T]: each token's sequence row; tokens of one row contiguous
    positions: jax.Array,  # i32[T]: each token's position in its sequence
    *,
    sm_scale: float,
    logits_soft_cap: float | None = None,
    sliding_window: jax.Array | int | None = None,  # i32[] or int: slots a query sees, itself included
    tuning: PrefillTuning = PrefillTuning(),
    interpret: bool = False,
) -> jax.Array:  # f[T, heads, head_dim], q's dtype
    """Causal paged attention of a flattened ragged batch (prefill chunks and decode tokens of many sequences).

    Token t attends over slots 0 .. min(positions[t] + 1, seq_lens[token_seq[t]]) - 1 of its sequence (only the
    last `sliding_window` of them, when given: a traced value, so one program serves layers of any window), with
    query head i reading KV head i // (heads // kv_heads): the semantics of `paged_prefill_reference`. Scores are
    q·k * sm_scale, then cap * tanh(score / cap) if `logits_soft_cap` is given; accumulation is float32. Tokens of a
    length-0 row (padding) get zeros. Block-table entries past the pages a query needs are never read as pages,
    and slots a query may not see never reach its output, whatever they hold (NaN included). `interpret=True` runs
    the kernel on any backend (CPU included) for testing.
    """
    _check_layout(block_tables, seq_lens, token_seq, positions)
    if q.shape[0] != token_seq.shape[0]:
        raise ValueError(f"token_seq must be i32[{q.shape[0]}], got {token_seq.dtype}{token_seq.shape}")
    kv_heads = k_pages.shape[0]
    group = max(1, q.shape[1] // kv_heads)
    plan = plan_prefill(block_tables, seq_lens, token_seq, positions, group=group, tuning=tuning)
    return planned_prefill_attention(q, k_pages, v_pages, plan, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                                     sliding_window=sliding_window, interpret=interpret)


# ---------------------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("sm_scale", "logits_soft_cap"))
def paged_prefill_reference(
    q: jax.Array,  # f[T, heads, head_dim]
    k_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim]
    block_tables: jax.Array,  # i32[S, max_pages]
    seq_lens: jax.Array,  # i32[S]
    token_seq: jax.Array,  # i32[T]
    positions: jax.Array,  # i32[T]
    *,
    sm_scale: float,
    logits_soft_cap: float | None = None,
    sliding_window: jax.Array | int | None = None,  # i32[] or int: slots a query sees, itself included
) -> jax.Array:  # f[T, heads, head_dim], q's dtype
    """Plain-jnp attention with the kernel's semantics: each token is a decode query over its own sequence's pages,
    seeing min(position + 1, its sequence's length) slots (the last `sliding_window` of them, when given), so the
    decode reference computes it token by token.

    It gathers every token's whole context (T * max_pages * page_size per K and V): for tests, not serving.
    """
    visible = jnp.minimum(positions + 1, seq_lens[token_seq])  # i32[T]
    return paged_decode_reference(q, k_pages, v_pages, block_tables[token_seq], visible, sm_scale=sm_scale,
                                  logits_soft_cap=logits_soft_cap, sliding_window=sliding_window)
