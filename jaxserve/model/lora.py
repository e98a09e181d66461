"""Many LoRA adapters in one batch: each token's projection output gains its own adapter's low-rank delta.

The device holds every adapter slot of a projection at once, stacked: A f[slots, r, in] and B f[slots, out, r],
slot 0 all zeros (no adapter), the scaling folded into B and every rank padded to the engine's maximum with zero
rows of A and zero columns of B (which leaves each delta exact). A step brings one slot index per token, so one
compiled program serves any mix of adapters, and loading an adapter only writes its slot's arrays.

Two forms of the same product, y[t] = B[s_t] @ (A[s_t] @ x[t]) with s_t token t's slot:

- `lora_delta` (the one the step runs): every token times every slot's A, f[T, slots, r], the other slots' rows
  zeroed by a one-hot of the token's slot, then one contraction with all of B. It costs T · slots · r · (in + out)
  multiply-adds, small against the base projection's T · in · out while slots · r is small against min(in, out),
  and needs no gather of per-token weight copies;
- `lora_delta_by_gather` (the reference): gathers each token's own A and B, f[T, r, in] and f[T, out, r], as a
  per-token loop would; simple, but its memory grows with T · r · (in + out).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraStack:
    """Every adapter slot of every decoder projection, on the device (checkpoint/lora_slots.py lays them out).

    Layer-leading, so the decoder's scan hands each layer its slice: inside the scan each leaf loses its first axis.
    """

    a: dict[str, jax.Array]  # projection (q_proj ... down_proj) -> f[layers, slots, max_rank, in]
    b: dict[str, jax.Array]  # projection -> f[layers, slots, out, max_rank], each adapter's scaling folded in


def empty_lora_stack(shapes: dict[str, tuple[int, int]], num_layers: int, num_slots: int, max_rank: int,
                     dtype) -> LoraStack:
    """Every slot empty; `shapes` maps each projection to its weight's (out, in); `num_slots` counts slot 0."""
    return LoraStack(a={p: jnp.zeros((num_layers, num_slots, max_rank, i), dtype) for p, (_, i) in shapes.items()},
                     b={p: jnp.zeros((num_layers, num_slots, o, max_rank), dtype) for p, (o, _) in shapes.items()})


def with_slot(stack: LoraStack, slot: jax.Array, a: dict[str, jax.Array], b: dict[str, jax.Array]) -> LoraStack:
    """The stack with `slot` (i32[]) holding one adapter: a maps each projection to f[layers, max_rank, in], b to
    f[layers, out, max_rank] (checkpoint/lora_slots.py's SlotWeights)."""
    return LoraStack(a={p: leaf.at[:, slot].set(a[p].astype(leaf.dtype)) for p, leaf in stack.a.items()},
                     b={p: leaf.at[:, slot].set(b[p].astype(leaf.dtype)) for p, leaf in stack.b.items()})


@dataclasses.dataclass(frozen=True)
class LayerLora:
    """One layer's adapter slots and each token's slot: what the layer's projections add their deltas from."""

    a: dict[str, jax.Array]  # projection -> f[slots, max_rank, in]
    b: dict[str, jax.Array]  # projection -> f[slots, out, max_rank]
    token_slots: jax.Array  # i32[T]: each token's slot (0: no adapter)

    def delta(self, projection: str, x: jax.Array) -> jax.Array:
        """f[..., out]: each token's adapter delta for `projection` of x f[..., in] (T = the leading axes' size)."""
        flat = x.reshape(-1, x.shape[-1])
        out = self.b[projection].shape[1]
        return lora_delta(flat, self.a[projection], self.b[projection], self.token_slots).reshape(*x.shape[:-1], out)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, token_slots: jax.Array) -> jax.Array:
    """f[T, out]: each token's adapter delta. x f[T, in], a f[slots, r, in], b f[slots, out, r] (scaling folded
    in), token_slots i32[T] in [0, slots)."""
    down = jnp.einsum("ti,sri->tsr", x, a, preferred_element_type=jnp.float32)  # f32[T, slots, r]
    own = token_slots[:, None] == jnp.arange(a.shape[0], dtype=token_slots.dtype)[None, :]  # bool[T, slots]
    down = jnp.where(own[:, :, None], down, 0.0)
    return jnp.einsum("tsr,sor->to", down, b, preferred_element_type=jnp.float32).astype(x.dtype)


def lora_delta_by_gather(x: jax.Array, a: jax.Array, b: jax.Array, token_slots: jax.Array) -> jax.Array:
    """The same delta by gathering each token's own A and B (the reference form)."""
    down = jnp.einsum("ti,tri->tr", x, a[token_slots], preferred_element_type=jnp.float32)  # f32[T, r]
    return jnp.einsum("tr,tor->to", down, b[token_slots], preferred_element_type=jnp.float32).astype(x.dtype)
