"""Pieces both paged-attention kernels share: Triton's limits, input checks, default key tiles, the sliding window, the
scores and the online softmax (`OnlineSoftmax`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

# Score given to masked slots: finite, so a block whose slots are all masked yields exp2(mask - max) = 0, not NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LOG2_E = 1.4426950408889634
# Triton's dot needs at least this many rows and columns in each operand.
MIN_DOT_DIM = 16
# Widest key tile (slots) a default tuning picks: wider tiles add registers for the f32 scores [rows, slots] but
# no more overlap of memory traffic, and 128 is where Triton's flash-attention tutorials stop as well.
MAX_DEFAULT_KEY_SLOTS = 128
# Bytes of one K (or V) tile a default tuning allows. Each pipeline stage (2 by default) stages a K and a V tile in
# shared memory, so 32 KiB tiles take 128 KiB: within the 227 KiB an H100 thread block may use, and the A100's 163.
MAX_DEFAULT_TILE_BYTES = 32 * 1024


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def is_positive_int(value) -> bool:
    """True for ints >= 1; bools are ints to Python, but never a size."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_tuning(tuning, positive_fields: tuple[str, ...], power_of_two_fields: tuple[str, ...]) -> None:
    """Raises ValueError naming the first tuning field that is not a positive int or not a power of two."""
    kind = type(tuning).__name__
    for name in positive_fields:
        value = getattr(tuning, name)
        if not is_positive_int(value):
            raise ValueError(f"{kind}.{name} must be a positive int, got {value!r}")
    for name in power_of_two_fields:
        if not is_power_of_two(getattr(tuning, name)):
            raise ValueError(f"{kind}.{name} must be a power of two (Triton tiles), got {getattr(tuning, name)}")


def check_pool(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
               pages_per_block: int) -> None:
    """Raises ValueError for a query, pool or block table the kernels cannot take (shapes shared by both kernels)."""
    heads, head_dim = q.shape[1:]
    kv_heads, _, page_size, pool_head_dim = k_pages.shape
    if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages {k_pages.dtype}{k_pages.shape} and v_pages {v_pages.dtype}{v_pages.shape} must "
                         f"have the same shape and dtype")
    if pool_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} differs from the pool's head_dim {pool_head_dim}")
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    if block_tables.ndim != 2 or block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be i32[S, max_pages], got {block_tables.dtype}{block_tables.shape}")
    if not is_power_of_two(head_dim) or not is_power_of_two(page_size):
        raise ValueError(f"head_dim ({head_dim}) and page_size ({page_size}) must be powers of two (Triton tiles)")
    if pages_per_block * page_size < MIN_DOT_DIM:
        raise ValueError(f"pages_per_block * page_size = {pages_per_block} * {page_size} must be at least "
                         f"{MIN_DOT_DIM} (Triton's dot); raise the tuning's pages_per_block")


def check_window(sliding_window) -> None:
    """Raises ValueError unless the sliding window is None or an integer scalar. Its value is traced (one program
    serves every window), so keeping it positive is the caller's part."""
    if sliding_window is None:
        return
    if jnp.shape(sliding_window) != () or not jnp.issubdtype(jnp.result_type(sliding_window), jnp.integer):
        raise ValueError(f"sliding_window must be None or an integer scalar, got {sliding_window!r}")


def window_input(sliding_window) -> jax.Array | None:
    """The window as the kernels read it, i32[1] (an input, not a constant, so one program serves every window)."""
    return None if sliding_window is None else jnp.asarray(sliding_window, jnp.int32).reshape(1)


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def previous_power_of_two(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def check_shape_arguments(function: str, **sizes) -> None:
    """Raises ValueError naming the first size argument of `function` that is not a positive int."""
    for name, value in sizes.items():
        if not is_positive_int(value):
            raise ValueError(f"{function}: {name} must be a positive int, got {value!r}")


def default_pages_per_block(max_pages_per_seq: int, page_size: int, head_dim: int, dtype) -> int:
    """Pages per key tile for a default tuning: a power of two, as wide as MAX_DEFAULT_KEY_SLOTS and
    MAX_DEFAULT_TILE_BYTES allow, no wider than the block table (wider tiles would only read the null page), and
    never below MIN_DOT_DIM slots (Triton's dot), which wins over both caps."""
    slots = min(MAX_DEFAULT_KEY_SLOTS, MAX_DEFAULT_TILE_BYTES // (head_dim * jnp.dtype(dtype).itemsize))
    pages = min(previous_power_of_two(max(1, slots // page_size)), next_power_of_two(max_pages_per_seq))
    return max(pages, next_power_of_two(-(-MIN_DOT_DIM // page_size)))


def padded_rows(rows: int) -> int:
    """Query rows per program: padded to a power of two of at least MIN_DOT_DIM (Triton's dot)."""
    return max(MIN_DOT_DIM, next_power_of_two(rows))


@dataclasses.dataclass(frozen=True)
class OnlineSoftmax:
    """How a kernel scores a key block and folds it into its running softmax (static: a kernel argument).

    Scores are kept in base 2 and exponentiated with exp2: on a GPU that is one instruction (MUFU.EX2), where
    exp is libdevice's accurate expf, several FFMAs around it, for every score. Without a soft-cap the scale
    (sm_scale * log2 e) is applied in the fold, as one fused multiply-add with the max subtraction.
    """

    sm_scale: float  # q·k is multiplied by this before the softmax
    logits_soft_cap: float | None  # scores become cap * tanh(score / cap) when given
    native_exp2: bool  # True in a kernel compiled for the GPU: PTX's ex2.approx.ftz; False: jnp.exp2 (interpret)

    @property
    def fold_scale(self) -> float:
        """What `scores` must be multiplied by to be base-2 scores."""
        return self.sm_scale * LOG2_E if self.logits_soft_cap is None else 1.0

    def scores(self, query, keys):
        """f32[rows, slots]: query · keysᵀ, the soft-cap applied (in base 2) when given; times `fold_scale`, the
        base-2 scores. Callers mask them with MASK_VALUE, which stays hugely negative once scaled."""
        scores = plgpu.dot(query, keys, trans_b=True, precision=dot_precision(query.dtype))
        if self.logits_soft_cap is None:
            return scores
        cap = self.logits_soft_cap
        return (cap * LOG2_E) * jnp.tanh(scores * (self.sm_scale / cap))

    def fold(self, state, scores, values):
        """Folds one block of `scores` into (running max f32[rows] in base 2, running sum f32[rows], weighted
        values f32[rows, head_dim]).

        Without a window callers visit blocks from slot 0 and every row that holds a query sees slot 0, so its
        running max is a real score after the first block and masked slots give exp2(MASK_VALUE - max) = 0
        exactly. A row that sees nothing of a block (a sliding window starting later) gets a max of a masked score
        and sums of finite junk there, which its first real score rescales by exp2(masked - score) = 0 exactly:
        callers must keep the values of every visited slot finite (zero the others) and give each query row a
        visible slot.
        """
        running_max, total, weighted = state
        scale = self.fold_scale
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=1) * scale)  # f32[rows]
        rescale = self.exp2(running_max - new_max)  # f32[rows]
        probs = self.exp2(self.multiply_add(scores, jnp.full(scores.shape, scale, jnp.float32),
                                            -lax.broadcast_in_dim(new_max, scores.shape, (0,))))  # f32[rows, slots]
        block_weighted = plgpu.dot(probs.astype(values.dtype), values, precision=dot_precision(values.dtype))
        return (new_max, total * rescale + jnp.sum(probs, axis=1),
                weighted * lax.broadcast_in_dim(rescale, weighted.shape, (0,)) + block_weighted)

    def multiply_add(self, x: jax.Array, y: jax.Array, z: jax.Array) -> jax.Array:
        """x * y + z. Native: one FFMA (PTX's fma.rn; Triton's separate multiply and add are not fused by ptxas)."""
        if not self.native_exp2:
            return x * y + z
        [result] = plgpu.elementwise_inline_asm("fma.rn.f32 $0, $1, $2, $3;", args=[x, y, z], constraints="=f,f,f,f",
                                                pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
        return result

    def exp2(self, x: jax.Array) -> jax.Array:
        """2**x. Native: PTX's ex2.approx.ftz, the one MUFU.EX2 instruction (`jnp.exp2` lowers to libdevice's
        exp2f, which adds a compare and two multiplies per element to keep results below 2**-126, probabilities
        too small to change a sum)."""
        if not self.native_exp2:
            return jnp.exp2(x)
        [result] = plgpu.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
                                                result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
        return result


def dot_precision(dtype) -> lax.Precision:
    """Full float32 products for float32 inputs (TF32 would cost accuracy the tests check against)."""
    return lax.Precision.HIGHEST if dtype == jnp.float32 else lax.Precision.DEFAULT
