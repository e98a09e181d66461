"""`KVCache`: what the model asks of a KV cache. The model writes and reads K/V only through `update_and_attend`, so
the engine's paged pool (`PagedKVCache`) and the reference decoder's dense cache (jaxserve/reference/) stand in for
each other without the model changing."""

from __future__ import annotations

from typing import Protocol

import jax


class KVCache(Protocol):
    """Keys and values of every layer; a pytree, so it passes through jit (and is donated) as the step's state."""

    def update_and_attend(
        self,
        layer: jax.Array,  # i32[]: which layer's K/V (traced: the model scans over its layers)
        q: jax.Array,  # f[batch, tokens, heads, head_dim], already rotated
        k: jax.Array,  # f[batch, tokens, kv_heads, head_dim], already rotated
        v: jax.Array,  # f[batch, tokens, kv_heads, head_dim]
        positions: jax.Array,  # i32[batch, tokens]
        scale: float,  # softmax scale, head_dim ** -0.5
    ) -> tuple[jax.Array, KVCache]:  # f[batch, tokens, heads, head_dim], the cache with this step's K/V written
        """Writes this step's K/V of `layer`, then attends each query causally over its sequence up to itself."""
        ...
