"""Batched gather matrix-vector products for LoRA: each token times its own adapter's A, then its own adapter's B.

For tokens t with adapter slots s_t (slot 0 meaning none, whose weights are zeros), x f[T, in], A f[S, r, in] and
B f[S, out, r] (any scaling folded into B): y[t] = B[s_t] @ (A[s_t] @ x[t]), as Punica's BGMV computes it.

Two kernels on static grids (GPU lowerings of Pallas have no scalar prefetch, so the slots are an ordinary input
read inside the kernel, and A and B are whole-array refs indexed by that slot):
- shrink, grid (T,): one token per program, A[s_t] @ x[t] accumulated in float32 over `in` in tiles of in_block;
- expand, grid (T, out / out_block): B[s_t]'s rows of one output tile times the token's f32[r].
A token of slot 0 reads no weights (its delta is zero by definition). Each program reads only its token's adapter,
so the bytes read grow with the adapters the batch uses, not with the slots the engine holds (the one-hot einsum
the engine runs reads every slot); at prefill sizes a program per token re-reads its adapter per token (from L2),
where a matrix product over all slots does better. The products are sums of elementwise products rather than dots:
a token is one row, below Triton's 16-row dot minimum, and the work is bound by reading the weights anyway.

File order: tuning, kernels, wrapper, public API, plain-jnp reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.common import check_tuning, is_power_of_two


@dataclasses.dataclass(frozen=True)
class BgmvTuning:
    """Static launch parameters of the LoRA kernels; validated on creation. Hashable: a static argument of jit."""

    in_block: int = 512
    """Input features folded per loop iteration of the shrink; a power of two dividing `in`."""
    out_block: int = 256
    """Output features per expand program; a power of two dividing `out`."""
    num_warps: int = 4
    """Warps per Triton program; a power of two."""

    def __post_init__(self):
        check_tuning(self, ("in_block", "out_block", "num_warps"), ("in_block", "out_block", "num_warps"))


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------


def _shrink_kernel(
    slot_ref,  # i32[1]: this token's slot
    x_ref,  # f[in]: this token's input
    a_ref,  # f[S, r, in]: every slot's A
    out_ref,  # f32[r]: A[slot] @ x
    *,
    in_block: int,
):
    slot = slot_ref[0]
    rank, width = a_ref.shape[1], a_ref.shape[2]

    @pl.when(slot == 0)
    def _no_adapter():
        out_ref[...] = jnp.zeros((rank,), jnp.float32)

    @pl.when(slot != 0)
    def _adapter():
        def fold(i, acc):
            start = pl.multiple_of(i * in_block, in_block)
            xs = x_ref[pl.ds(start, in_block)].astype(jnp.float32)  # f32[in_block]
            weights = a_ref[slot, :, pl.ds(start, in_block)].astype(jnp.float32)  # f32[r, in_block]
            return acc + jnp.sum(weights * xs[None, :], axis=1)

        out_ref[...] = lax.fori_loop(0, width // in_block, fold, jnp.zeros((rank,), jnp.float32))


def _expand_kernel(
    slot_ref,  # i32[1]: this token's slot
    v_ref,  # f32[r]: A[slot] @ x of this token
    b_ref,  # f[S, out, r]: every slot's B
    out_ref,  # f[out_block]: this output tile of B[slot] @ v
    *,
    out_block: int,
):
    slot = slot_ref[0]
    start = pl.multiple_of(pl.program_id(1) * out_block, out_block)  # read outside pl.when: interpret mode needs it

    @pl.when(slot == 0)
    def _no_adapter():
        out_ref[...] = jnp.zeros((out_block,), out_ref.dtype)

    @pl.when(slot != 0)
    def _adapter():
        weights = b_ref[slot, pl.ds(start, out_block), :].astype(jnp.float32)  # f32[out_block, r]
        out_ref[...] = jnp.sum(weights * v_ref[...][None, :], axis=1).astype(out_ref.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------------------------


def _shrink(x: jax.Array, a: jax.Array, token_slots: jax.Array, tuning: BgmvTuning,
            interpret: bool) -> jax.Array:  # f32[T, r]
    tokens, width = x.shape
    slots, rank, _ = a.shape
    return pl.pallas_call(
        functools.partial(_shrink_kernel, in_block=tuning.in_block),
        grid=(tokens,),
        in_specs=[pl.BlockSpec((1,), lambda t: (t,)),
                  pl.BlockSpec((None, width), lambda t: (t, 0)),
                  pl.BlockSpec((slots, rank, width), lambda t: (0, 0, 0))],
        out_specs=pl.BlockSpec((None, rank), lambda t: (t, 0)),
        out_shape=jax.ShapeDtypeStruct((tokens, rank), jnp.float32),
        # Explicit Triton parameters: without them a GPU pallas_call may pick another GPU backend.
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=1),
        interpret=interpret,
        name=f"lora_shrink_{tuning.in_block}",
    )(token_slots, x, a)


def _expand(v: jax.Array, b: jax.Array, token_slots: jax.Array, dtype, tuning: BgmvTuning,
            interpret: bool) -> jax.Array:  # f[T, out]
    tokens, rank = v.shape
    slots, out, _ = b.shape
    return pl.pallas_call(
        functools.partial(_expand_kernel, out_block=tuning.out_block),
        grid=(tokens, out // tuning.out_block),
        in_specs=[pl.BlockSpec((1,), lambda t, j: (t,)),
                  pl.BlockSpec((None, rank), lambda t, j: (t, 0)),
                  pl.BlockSpec((slots, out, rank), lambda t, j: (0, 0, 0))],
        out_specs=pl.BlockSpec((None, tuning.out_block), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((tokens, out), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=1),
        interpret=interpret,
        name=f"lora_expand_{tuning.out_block}",
    )(token_slots, v, b)


def _check_shapes(x: jax.Array, a: jax.Array, b: jax.Array, token_slots: jax.Array, tuning: BgmvTuning) -> None:
    """Raises ValueError naming the first input the kernels cannot take."""
    if x.ndim != 2 or a.ndim != 3 or b.ndim != 3:
        raise ValueError(f"expected x f[T, in], a f[S, r, in], b f[S, out, r]; got {x.shape}, {a.shape}, {b.shape}")
    tokens, width = x.shape
    slots, rank, a_width = a.shape
    if a_width != width or b.shape[0] != slots or b.shape[2] != rank:
        raise ValueError(f"a {a.shape} and b {b.shape} do not fit x {x.shape}: a must be [S, r, in], b [S, out, r]")
    if token_slots.shape != (tokens,) or token_slots.dtype != jnp.int32:
        raise ValueError(f"token_slots must be i32[{tokens}], got {token_slots.dtype}{token_slots.shape}")
    if not is_power_of_two(rank):
        raise ValueError(f"the rank ({rank}) must be a power of two (Triton tiles)")
    if width % tuning.in_block or b.shape[1] % tuning.out_block:
        raise ValueError(f"in ({width}) and out ({b.shape[1]}) must be multiples of in_block ({tuning.in_block}) and "
                         f"out_block ({tuning.out_block})")


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def lora_bgmv(
    x: jax.Array,  # f[T, in]
    a: jax.Array,  # f[S, r, in]
    b: jax.Array,  # f[S, out, r], scaling folded in
    token_slots: jax.Array,  # i32[T] in [0, S); slot 0 holds zeros (no adapter)
    *,
    tuning: BgmvTuning = BgmvTuning(),
    interpret: bool = False,
) -> jax.Array:  # f[T, out], x's dtype
    """Each token's adapter delta B[s_t] @ (A[s_t] @ x[t]), accumulated in float32; tokens of slot 0 get zeros.
    `interpret=True` runs the kernels on any backend (CPU included) for testing."""
    _check_shapes(x, a, b, token_slots, tuning)
    down = _shrink(x, a, token_slots, tuning, interpret)  # f32[T, r]
    return _expand(down, b, token_slots, x.dtype, tuning, interpret)


# ---------------------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------------------


@jax.jit
def lora_bgmv_reference(x: jax.Array, a: jax.Array, b: jax.Array, token_slots: jax.Array) -> jax.Array:
    """Plain jnp: gathers each token's A and B (memory T · r · (in + out)); for tests. Slot 0 is taken as zeros."""
    down = jnp.einsum("ti,tri->tr", x, a[token_slots], preferred_element_type=jnp.float32,
                      precision=lax.Precision.HIGHEST)  # f32[T, r]
    out = jnp.einsum("tr,tor->to", down, b[token_slots].astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return jnp.where((token_slots != 0)[:, None], out, 0.0).astype(x.dtype)
