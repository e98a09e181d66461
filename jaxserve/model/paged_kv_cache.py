"""The paged KV cache of the continuous-batching engine: a fixed pool of pages, written and read inside the step.

Each step flattens its tokens into one ragged batch of T tokens (prefill chunks and decode tokens of many sequences,
concatenated, padded to a bucket). `PagedAttentionMetadata` tells the step where each token's K/V goes and which
pages each sequence reads. The pool is donated state: it enters the jitted step, each layer scatters this step's K/V
into it (in place, since the buffer is donated) and attends over it, and the updated pool comes back out.

The pool keeps every layer: f[kv_heads, num_layers, num_pages, page_size, head_dim]. The model scans over its layers
and hands the cache a traced layer index; the write and the attention receive the whole pool with that index, never
a slice of it (a slice passed into a kernel or carried out of a loop iteration could be materialised as a copy of a
whole layer's pages). Since KV heads lead and layers follow, the pool of one KV head viewed as
[num_layers * num_pages, page_size, head_dim] is a free reshape, in which layer l's page p is page l * num_pages + p:
so attention needs only block tables offset by l * num_pages, and the kernels stay layer-agnostic.

Page 0 (of every layer) is the null page: it stays all-zero, padded block-table entries point at it, and padding tokens never write
into it (their slot is out of range and the scatter drops it). Freed pages keep whatever they held; attention masks
every slot a query may not see, and masks V with `where` (not a multiply) so stale or NaN slots never reach an
output.

A sliding window (Mistral, windowed Qwen layers) narrows what a query sees to the `window` slots that end at its
last visible slot; both attention backends mask older slots (and skip the blocks wholly before every window). The
pool keeps those slots: the window changes what is read, not what is stored.

Attention sits behind `PagedAttentionFn`; the cache's static `attention_backend` names which implementation runs,
so swapping in a kernel is a change of one string that jit sees as part of the cache's tree structure. Users pick
auto, pallas or xla plus an interpret switch; `EngineConfig.attention_implementation` turns that into one of those
names.

With tensor parallelism the pool is split over KV heads (its `pool_sharding`), and the KV write and attention run
inside `jax.shard_map` over that axis: each device writes and reads only its own KV heads, with the query heads
that read them, so attention (XLA or Pallas kernel alike) needs no communication and the pool is never resharded.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import PALLAS_BACKEND, PALLAS_INTERPRET_BACKEND, XLA_BACKEND
from jaxserve.model.kv_quantization import KVScales, is_float8, to_pool_dtype
from kernels_pallas import (PrefillPlan, default_prefill_tuning, paged_prefill_attention, plan_prefill,
                            planned_prefill_attention)

PADDING_SLOT = -1  # slot_mapping value of padding tokens; mapped past the pool's end so their writes are dropped
# Query-key pairs per block of the reference's page loop: bounds its gathered K/V to this many slots per KV head.
QUERY_KEY_PAIRS_PER_BLOCK = 1 << 15


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedAttentionMetadata:
    """Where this step's tokens write their K/V and what each of them reads, for T tokens of S sequence rows.

    Tokens of one sequence are contiguous in the flattened batch and sorted by position. Padding tokens (bucket
    fill) point at a padding sequence row whose `seq_lens` is 0 and whose block table is all null page, so they see
    nothing and attend to zeros. The query positions are not here: the model passes them to every layer anyway.
    """

    slot_mapping: jax.Array  # i32[T]: page * page_size + offset receiving the token's K/V; PADDING_SLOT for padding
    token_seq: jax.Array  # i32[T]: row of the token's sequence in block_tables / seq_lens
    block_tables: jax.Array  # i32[S, max_pages]: the sequence's pages in order; unused entries are 0 (null page)
    seq_lens: jax.Array  # i32[S]: tokens in the cache for the sequence after this step's writes; 0 for padding rows
    # The Pallas kernel's work items for this layout, planned once per step (PagedKVCache.with_metadata) over the
    # block tables before any layer offset; None: the kernel plans per call
    kernel_plan: PrefillPlan | None = None
    # i32[]: what layer_view added to block_tables and slot_mapping's pages (the layer's first page); None: nothing
    page_offset: jax.Array | None = None


class PagedAttentionFn(Protocol):
    """The attention interface the cache calls and kernels implement.

    Each query attends causally over its own sequence's cached tokens 0..its position (earlier chunks' K/V and
    this step's, already written), grouping query heads over KV heads; with a `window`, over only the last `window`
    of those. A token whose sequence row has length 0 (padding) gets zeros.
    """

    def __call__(
        self,
        q: jax.Array,  # f[T, heads, head_dim], already rotated
        k_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim]
        v_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim]
        metadata: PagedAttentionMetadata,
        positions: jax.Array,  # i32[T]
        scale: float,
        window: jax.Array | None = None,  # i32[]: slots a query sees, itself included; None: all before it
    ) -> jax.Array:  # f[T, heads, head_dim]
        ...


def layer_view(
    pages: jax.Array,  # f[kv_heads, num_layers, num_pages, page_size, head_dim]
    metadata: PagedAttentionMetadata,
    layer: jax.Array,  # i32[]
) -> tuple[jax.Array, PagedAttentionMetadata]:  # f[kv_heads, num_layers * num_pages, page_size, head_dim], offset
    """The whole pool as one page space per KV head (a reshape, free), with block tables and slots pointing at
    `layer`'s pages in it: what a one-layer attention or write reads to act on that layer alone.

    Padding tokens' slots (negative) stay negative, so their writes are still dropped rather than landing in
    another layer.
    """
    kv_heads, num_layers, num_pages, page_size, head_dim = pages.shape
    flat = pages.reshape(kv_heads, num_layers * num_pages, page_size, head_dim)
    page_offset = layer * num_pages  # i32[]
    slot_mapping = jnp.where(metadata.slot_mapping >= 0, metadata.slot_mapping + page_offset * page_size,
                             metadata.slot_mapping)
    return flat, dataclasses.replace(metadata, block_tables=metadata.block_tables + page_offset,
                                     slot_mapping=slot_mapping, page_offset=page_offset)


def paged_attention_xla(
    q: jax.Array,  # f[T, heads, head_dim], already rotated
    k_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim]
    metadata: PagedAttentionMetadata,
    positions: jax.Array,  # i32[T]
    scale: float,
    window: jax.Array | None = None,  # i32[]: slots a query sees, itself included; None: all before it
    *,
    pages_per_block: int | None = None,
) -> jax.Array:  # f[T, heads, head_dim]
    """Plain-XLA paged attention: a loop over blocks of each token's pages with an online (flash) softmax.

    Block j holds pages j*pages_per_block.. of every token's sequence; the token's K/V for that block are gathered
    ([kv_heads, T, block_slots, head_dim]), scored, masked, and folded into a running max, sum and weighted value
    sum kept in float32. The loop runs only as many blocks as the longest visible context needs, so a short batch
    does not pay for the block table's full width; with a window it starts at the block of the earliest window.

    Memory: per block, the gathered K and V (each T * block_slots * kv_heads * head_dim elements) and float32
    scores (T * heads * block_slots); plus the float32 state T * heads * (head_dim + 2). Nothing scales with the
    whole context: `pages_per_block` defaults to keep T * block_slots at most QUERY_KEY_PAIRS_PER_BLOCK (but at
    least one page), e.g. 64 MiB each for K and V of Llama-3-8B (8 KV heads of 128, bfloat16) whether T is 64 or
    512. Gathering per token re-reads a prefill chunk's shared context once per query (T * context * kv_heads *
    head_dim traffic); a kernel avoids that, this backend trades it for simplicity.
    """
    tokens, heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_pages.shape
    pages_per_block = pages_per_block or _default_pages_per_block(tokens, page_size, metadata.block_tables.shape[1])
    block_slots = pages_per_block * page_size
    token_pages = _pad_columns(metadata.block_tables, pages_per_block)[metadata.token_seq]  # i32[T, padded_pages]
    # A query sees slots 0..its position, and never past its sequence's length (padding rows have length 0).
    visible_len = jnp.minimum(positions + 1, metadata.seq_lens[metadata.token_seq])  # i32[T]
    first_visible = window_starts(visible_len, window)  # i32[T]
    grouped_q = q.reshape(tokens, kv_heads, heads // kv_heads, head_dim)  # f[T, kv_heads, group, head_dim]

    def fold_block(block, state):
        pages = jax.lax.dynamic_slice_in_dim(token_pages, block * pages_per_block, pages_per_block, axis=1)
        # A float8 pool's pages are cast to the query's dtype as they are read (its scales are folded by the cache).
        keys = _gather_slots(k_pages, pages).astype(q.dtype)  # f[kv_heads, T, block_slots, head_dim]
        values = _gather_slots(v_pages, pages).astype(q.dtype)  # f[kv_heads, T, block_slots, head_dim]
        slots = block * block_slots + jnp.arange(block_slots)  # i32[block_slots]
        visible = slots[None, :] < visible_len[:, None]  # bool[T, block_slots]
        if window is not None:
            visible &= slots[None, :] >= first_visible[:, None]
        return _online_softmax_step(state, grouped_q, keys, values, visible, scale)

    num_blocks = -(-jnp.max(visible_len, initial=0) // block_slots)  # i32[]
    # Blocks before every query's window hold nothing any query sees (padding rows, seeing nothing, set no bound).
    no_slot = jnp.iinfo(jnp.int32).max
    first_block = 0 if window is None else jnp.min(jnp.where(visible_len > 0, first_visible, no_slot)) // block_slots
    state = _empty_softmax_state(tokens, kv_heads, heads // kv_heads, head_dim)
    _, total, weighted = jax.lax.fori_loop(first_block, num_blocks, fold_block, state)
    # A query that saw nothing has total 0 and weighted 0; divide by 1 instead so it yields zeros, not NaN.
    out = weighted / jnp.where(total > 0, total, 1.0)[..., None]  # f32[T, kv_heads, group, head_dim]
    return out.reshape(tokens, heads, head_dim).astype(q.dtype)


def window_starts(
    visible_len: jax.Array,  # i32[...]: slots each query may see, counted from slot 0
    window: jax.Array | None,  # i32[]: slots a query sees, itself included
) -> jax.Array:  # i32[...]: each query's first visible slot
    """A query sees the `window` slots ending at its last visible one (transformers: key > query - window); all of
    them without a window."""
    return jnp.zeros_like(visible_len) if window is None else jnp.maximum(visible_len - window, 0)


def _default_pages_per_block(tokens: int, page_size: int, max_pages: int) -> int:
    return max(1, min(max_pages, QUERY_KEY_PAIRS_PER_BLOCK // (tokens * page_size)))


def _pad_columns(block_tables: jax.Array, multiple: int) -> jax.Array:  # i32[S, max_pages rounded up to multiple]
    """Null-page columns so every block of the loop is a full, in-bounds slice."""
    return jnp.pad(block_tables, ((0, 0), (0, -block_tables.shape[1] % multiple)))


def _gather_slots(pages: jax.Array, page_ids: jax.Array) -> jax.Array:
    """f[kv_heads, T, n * page_size, head_dim] from pool f[kv_heads, num_pages, page_size, head_dim], ids i32[T, n]."""
    kv_heads, _, page_size, head_dim = pages.shape
    tokens, n = page_ids.shape
    return pages[:, page_ids].reshape(kv_heads, tokens, n * page_size, head_dim)


def _empty_softmax_state(tokens: int, kv_heads: int, group: int, head_dim: int):
    """(running max f32[T, kv_heads, group], running sum f32[...], weighted values f32[..., head_dim])."""
    shape = (tokens, kv_heads, group)
    return (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, head_dim), jnp.float32))


def _online_softmax_step(
    state,  # running max f32[T, kv_heads, group], sum f32[T, kv_heads, group], weighted f32[T, kv_heads, group, D]
    grouped_q: jax.Array,  # f[T, kv_heads, group, head_dim]
    keys: jax.Array,  # f[kv_heads, T, block_slots, head_dim]
    values: jax.Array,  # f[kv_heads, T, block_slots, head_dim]
    visible: jax.Array,  # bool[T, block_slots]
    scale: float,
):
    """Folds one block of slots into the running softmax; masked slots contribute nothing, whatever they hold."""
    running_max, total, weighted = state
    scores = jnp.einsum("tkgd,ktsd->tkgs", grouped_q, keys, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)  # f32[T, kv_heads, group, block_slots]
    new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
    # Until a query has seen a slot its max is -inf; shifting by 0 then keeps exp(-inf - shift) = 0, not NaN.
    shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    probs = jnp.exp(scores - shift[..., None])
    rescale = jnp.exp(running_max - shift)
    # where, not a multiply by the mask: a masked slot may hold NaN, and 0 * NaN would poison the row.
    values = jnp.where(visible[None, :, :, None], values, jnp.zeros((), values.dtype))
    block_weighted = jnp.einsum("tkgs,ktsd->tkgd", probs.astype(values.dtype), values,
                                preferred_element_type=jnp.float32)
    return (new_max, total * rescale + jnp.sum(probs, axis=-1), weighted * rescale[..., None] + block_weighted)


def _pallas_attention(interpret: bool) -> PagedAttentionFn:
    """The Pallas mixed prefill/decode kernel behind the cache's attention interface: with the step's plan when the
    metadata carries one (the layer's page offset applied in the kernel), else planned for this call alone."""

    def attend(q, k_pages, v_pages, metadata: PagedAttentionMetadata, positions, scale, window=None):
        if metadata.kernel_plan is not None:
            offset = 0 if metadata.page_offset is None else metadata.page_offset
            return planned_prefill_attention(q, k_pages, v_pages, metadata.kernel_plan, page_offset=offset,
                                             sm_scale=scale, sliding_window=window, interpret=interpret)
        tuning = kernel_tuning(metadata, q.shape[1], k_pages)
        return paged_prefill_attention(q, k_pages, v_pages, metadata.block_tables, metadata.seq_lens,
                                       metadata.token_seq, positions, sm_scale=scale, sliding_window=window,
                                       tuning=tuning, interpret=interpret)

    return attend


def kernel_tuning(metadata: PagedAttentionMetadata, heads: int, k_pages: jax.Array):
    """The Pallas kernel's tuning for this step's shapes (static under jit, so every bucket's program is traced with
    the tuning for its own shape); `k_pages` is any pool view f[kv_heads, ..., page_size, head_dim]."""
    kv_heads, page_size, head_dim = k_pages.shape[0], k_pages.shape[-2], k_pages.shape[-1]
    num_seqs, max_pages = metadata.block_tables.shape
    return default_prefill_tuning(num_tokens=metadata.token_seq.shape[0], num_seqs=num_seqs, group=heads // kv_heads,
                                  max_pages_per_seq=max_pages, page_size=page_size, head_dim=head_dim,
                                  dtype=k_pages.dtype)


ATTENTION_BACKENDS: types.MappingProxyType[str, PagedAttentionFn] = types.MappingProxyType({
    XLA_BACKEND: paged_attention_xla,
    PALLAS_BACKEND: _pallas_attention(interpret=False),
    # The interpreted kernel lets the whole engine be tested through the kernel on a CPU.
    PALLAS_INTERPRET_BACKEND: _pallas_attention(interpret=True),
})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """The page pool (one K and one V array holding every layer), plus the current step's metadata.

    Layout f[kv_heads, num_layers, num_pages, page_size, head_dim]: KV heads lead so tensor parallelism shards the
    pool on its first axis, and one (head, layer, page) is a contiguous [page_size, head_dim] tile, the unit a GPU
    kernel copies per page (the layout of JAX's Pallas GPU paged attention, with layers as more pages). A token's write touches kv_heads rows of head_dim,
    which costs the scatter nothing.

    The pool without metadata (`metadata=None`) is the state the runner keeps and donates; inside the jitted step
    it attaches that step's metadata with `with_metadata` and strips it from the result with `without_metadata`,
    so the metadata is an ordinary (non-donated) input.
    """

    k_pages: jax.Array  # f[kv_heads, num_layers, num_pages, page_size, head_dim]
    v_pages: jax.Array  # f[kv_heads, num_layers, num_pages, page_size, head_dim]
    metadata: PagedAttentionMetadata | None = None  # this step's batch layout; None outside the step
    # Which ATTENTION_BACKENDS entry attends. Static: part of the tree structure, so jit keys its cache on it.
    attention_backend: str = dataclasses.field(default=XLA_BACKEND, metadata=dict(static=True))
    # How every pool array is split over a mesh, its first (KV-head) axis named in the spec; the KV write and
    # attention then run per device under shard_map. None: one device, no shard_map. Static, like the backend.
    pool_sharding: NamedSharding | None = dataclasses.field(default=None, metadata=dict(static=True))
    # A float8 pool's per-layer scales (model/kv_quantization.py), replicated on every device; None: the pool
    # stores K and V as computed
    scales: KVScales | None = None

    def __post_init__(self):
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {self.attention_backend!r} "
                             f"(choose from {', '.join(ATTENTION_BACKENDS)})")

    @classmethod
    def zeros(cls, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype,
              attention_backend: str = XLA_BACKEND, pool_sharding: NamedSharding | None = None,
              float8_scales: tuple[Sequence[float], Sequence[float]] | None = None) -> PagedKVCache:
        """A zero-filled pool (zeros, not jnp.empty: the null page must be zero and stale memory must not leak),
        created in place on each device when `pool_sharding` is given. A float8 pool's scales are
        `float8_scales` (K per layer, V per layer), 1.0 where not given."""
        shape = (kv_heads, num_layers, num_pages, page_size, head_dim)
        replicated = None if pool_sharding is None else NamedSharding(pool_sharding.mesh, P())
        return cls(
            k_pages=jnp.zeros(shape, dtype, device=pool_sharding),
            v_pages=jnp.zeros(shape, dtype, device=pool_sharding),
            attention_backend=attention_backend,
            pool_sharding=pool_sharding,
            scales=KVScales.of(float8_scales or ((1.0,) * num_layers,) * 2, replicated) if is_float8(dtype) else None,
        )

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[2]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[3]

    def with_metadata(self, metadata: PagedAttentionMetadata, positions: jax.Array | None = None,
                      num_query_heads: int | None = None) -> PagedKVCache:
        """The pool with this step's metadata attached. Given the step's positions (i32[T]) and the model's query
        heads, a Pallas backend plans its kernel's work items here, once for every layer of the step (built in
        each layer's call instead, they are a dozen small launches per layer)."""
        if positions is not None and num_query_heads is not None and self.attention_backend != XLA_BACKEND:
            tuning = kernel_tuning(metadata, num_query_heads, self.k_pages)
            group = num_query_heads // self.k_pages.shape[0]
            metadata = dataclasses.replace(metadata, kernel_plan=plan_prefill(
                metadata.block_tables, metadata.seq_lens, metadata.token_seq, positions, group=group, tuning=tuning))
        return dataclasses.replace(self, metadata=metadata)

    def without_metadata(self) -> PagedKVCache:
        return dataclasses.replace(self, metadata=None)

    def update_and_attend(
        self,
        layer: jax.Array,  # i32[]
        q: jax.Array,  # f[1, T, heads, head_dim], already rotated
        k: jax.Array,  # f[1, T, kv_heads, head_dim], already rotated
        v: jax.Array,  # f[1, T, kv_heads, head_dim]
        positions: jax.Array,  # i32[1, T]
        scale: float,
        window: jax.Array | None = None,  # i32[]: this layer's sliding window; None: full causal attention
    ) -> tuple[jax.Array, PagedKVCache]:  # f[1, T, heads, head_dim], updated cache
        """Scatter this step's K/V into the pool at slot_mapping, then attend over the updated pool (within the
        last `window` slots of each query, when given).

        The batch dimension must be 1: the engine's tokens are one flattened ragged batch.
        """
        if self.metadata is None:
            raise ValueError("PagedKVCache has no metadata: attach the step's batch layout with with_metadata()")
        if q.shape[0] != 1:
            raise ValueError(f"the paged cache takes one flattened batch (batch dim 1), got batch {q.shape[0]}")
        write_and_attend = functools.partial(_write_and_attend, ATTENTION_BACKENDS[self.attention_backend], scale)
        if self.pool_sharding is not None:
            write_and_attend = _per_head_shard(write_and_attend, self.pool_sharding)
        out, new_k, new_v = write_and_attend(q[0], k[0], v[0], self.k_pages, self.v_pages, self.scales,
                                             self.metadata, positions[0], layer, window)
        return out[None], dataclasses.replace(self, k_pages=new_k, v_pages=new_v)


def _write_and_attend(
    attend: PagedAttentionFn,
    scale: float,
    q: jax.Array,  # f[T, heads, head_dim], already rotated
    k: jax.Array,  # f[T, kv_heads, head_dim], already rotated
    v: jax.Array,  # f[T, kv_heads, head_dim]
    k_pages: jax.Array,  # f[kv_heads, num_layers, num_pages, page_size, head_dim]
    v_pages: jax.Array,  # f[kv_heads, num_layers, num_pages, page_size, head_dim]
    scales: KVScales | None,
    metadata: PagedAttentionMetadata,
    positions: jax.Array,  # i32[T]
    layer: jax.Array,  # i32[]
    window: jax.Array | None,  # i32[]: the layer's sliding window; None: full causal attention
) -> tuple[jax.Array, jax.Array, jax.Array]:  # f[T, heads, head_dim], the updated k_pages and v_pages
    flat_k, layer_metadata = layer_view(k_pages, metadata, layer)
    flat_v, _ = layer_view(v_pages, metadata, layer)
    if scales is not None:
        k_scale, v_scale = scales.k[layer], scales.v[layer]  # f32[], f32[]
        k, v = to_pool_dtype(k, k_scale, k_pages.dtype), to_pool_dtype(v, v_scale, v_pages.dtype)
        q = (q.astype(jnp.float32) * k_scale).astype(q.dtype)  # (q * k_scale) · stored = q · (stored * k_scale)
    flat_k = write_slots(flat_k, k, layer_metadata.slot_mapping)
    flat_v = write_slots(flat_v, v, layer_metadata.slot_mapping)
    # Without a window the call is the plain one, so backends and programs of full-attention models are unchanged.
    windowed = {} if window is None else {"window": window}
    out = attend(q, flat_k, flat_v, layer_metadata, positions, scale, **windowed)
    if scales is not None:
        out = (out.astype(jnp.float32) * v_scale).astype(out.dtype)  # (probs · stored) * v_scale
    return out, flat_k.reshape(k_pages.shape), flat_v.reshape(v_pages.shape)


def _per_head_shard(write_and_attend, pool_sharding: NamedSharding):
    """`write_and_attend` run on each device over its own heads: q/k/v split on their head axis, the pool on its
    KV-head axis, the batch layout (metadata, positions) whole on every device.

    Query head q reads KV head q // group, so device d's contiguous block of query heads reads exactly its block of
    KV heads, and each device's attention is the whole computation for its heads.
    """
    head_axis = pool_sharding.spec[0]
    by_head = P(None, head_axis, None)  # f[T, heads, head_dim]
    return jax.shard_map(write_and_attend, mesh=pool_sharding.mesh,
                         in_specs=(by_head, by_head, by_head, pool_sharding.spec, pool_sharding.spec, P(), P(), P(),
                                   P(), P()),
                         out_specs=(by_head, pool_sharding.spec, pool_sharding.spec),
                         # The bodies are one-device code that the varying-axis check rejects: the reference's loop
                         # state starts as unvarying constants, and pallas_call's out_shape names no varying axes.
                         check_vma=False)


def write_slots(
    pages: jax.Array,  # f[kv_heads, num_pages, page_size, head_dim]
    new: jax.Array,  # f[T, kv_heads, head_dim]
    slot_mapping: jax.Array,  # i32[T]
) -> jax.Array:  # f[kv_heads, num_pages, page_size, head_dim]
    """The pool with token t's K (or V) at flat slot slot_mapping[t]; padding tokens (negative slots) are dropped.

    jnp would wrap a negative index to the pool's end, so negative slots are moved past the end first, where the
    scatter's drop mode discards them. The reshapes are bitcasts, so a donated pool is updated in place.

    A one-token write gets a second, dropped slot: XLA rewrites a one-index scatter in drop mode into a bounds check
    selecting between the pool and a dynamic-update-slice of it, which needs the old pool and the new one alive at
    once, so it copies the pool (every layer, every step of one token).
    """
    kv_heads, num_pages, page_size, head_dim = pages.shape
    capacity = num_pages * page_size
    slots = jnp.where(slot_mapping >= 0, slot_mapping, capacity)  # i32[T]
    if slots.shape[0] == 1:
        slots = jnp.concatenate([slots, jnp.full(1, capacity, slots.dtype)])  # i32[2]
        new = jnp.concatenate([new, jnp.zeros_like(new)])  # f[2, kv_heads, head_dim]
    flat = pages.reshape(kv_heads, capacity, head_dim)
    flat = flat.at[:, slots].set(new.swapaxes(0, 1).astype(pages.dtype), mode="drop")
    return flat.reshape(pages.shape)
