"""The dense KV cache of the reference decoder: one contiguous slab per sequence and layer.

It is the simple path the paged engine is tested against; it meets the model's `KVCache` protocol, as the paged
cache does.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseKVCache:
    """Keys and values for `batch` sequences of up to `max_len` tokens of every layer."""

    keys: jax.Array  # f[num_layers, batch, max_len, kv_heads, head_dim]
    values: jax.Array  # f[num_layers, batch, max_len, kv_heads, head_dim]

    @classmethod
    def zeros(cls, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int, dtype) -> DenseKVCache:
        shape = (num_layers, batch, max_len, kv_heads, head_dim)
        return cls(keys=jnp.zeros(shape, dtype), values=jnp.zeros(shape, dtype))

    def update_and_attend(
        self,
        layer: jax.Array,  # i32[]
        q: jax.Array,  # f[batch, tokens, heads, head_dim], already rotated
        k: jax.Array,  # f[batch, tokens, kv_heads, head_dim], already rotated
        v: jax.Array,  # f[batch, tokens, kv_heads, head_dim]
        positions: jax.Array,  # i32[batch, tokens]
        scale: float,
    ) -> tuple[jax.Array, DenseKVCache]:  # f[batch, tokens, heads, head_dim], updated cache
        """Write this step's K/V at their positions, then attend causally over everything up to each query.

        Slots past a query's position may hold stale or padding K/V; the causal mask hides them. Positions beyond
        `max_len` (bucket padding) are dropped rather than clamped, so they can never overwrite real entries.
        """
        rows = jnp.arange(q.shape[0])[:, None]  # i32[batch, 1]
        keys = self.keys.at[layer, rows, positions].set(k, mode="drop")
        values = self.values.at[layer, rows, positions].set(v, mode="drop")
        out = dense_causal_attention(q, keys[layer], values[layer], positions, scale)
        return out, DenseKVCache(keys=keys, values=values)


def dense_causal_attention(
    q: jax.Array,  # f[batch, tokens, heads, head_dim]
    keys: jax.Array,  # f[batch, max_len, kv_heads, head_dim]
    values: jax.Array,  # f[batch, max_len, kv_heads, head_dim]
    positions: jax.Array,  # i32[batch, tokens]
    scale: float,
) -> jax.Array:  # f[batch, tokens, heads, head_dim]
    """Softmax attention of each query over cache slots 0..its own position, GQA by grouping query heads."""
    batch, tokens, heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    grouped = q.reshape(batch, tokens, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, keys, preferred_element_type=jnp.float32) * scale
    slots = jnp.arange(keys.shape[1])  # i32[max_len]
    visible = slots[None, None, :] <= positions[:, :, None]  # bool[batch, tokens, max_len]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, values, preferred_element_type=jnp.float32)
    return out.reshape(batch, tokens, heads, head_dim).astype(q.dtype)
