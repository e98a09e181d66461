"""Weight-only 4-bit matmul over a layer-stacked packed weight (W4A16): y = x @ ((q[layer] - zero) * scale).T.

For x f[T, in] and a stacked weight q u8[L, out, in/2] packed as model/quantization.py `pack_int4` packs it (in
blocks of 64 input features, byte j holds feature j in its low nibble and feature j + 32 in its high one, each as its
signed value + 8), with scales f32[L, out, G] per group of `group_size` input features (a multiple of 64) or
f32[L, out] per output channel, and optional zero points i8 of the scales' shape (signed, the checkpoint's zero
point - 8): each program reads only layer `layer`'s rows of its output tile straight from the stacked array (the
index offsets its loads, so no slice is copied out), unpacks each 64-feature block into two 32-feature halves in
registers, subtracts the zero points and applies the group's scales there, and accumulates two dots per block in
float32. Per-channel scales multiply the accumulator once at the end instead. No widened weight exists in memory:
each weight is read at half a byte.

Grid (T / block_t, out / block_out); the loop runs over the packed blocks. The layer index is an ordinary input read
inside the kernel (GPU lowerings of Pallas have no scalar prefetch). The wrapper pads x's rows to block_t (Triton's
dot needs at least 16) and its columns to whole blocks with zeros, which meet the packing's zero padding.

File order: kernel, wrapper, public API, plain-jnp reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.common import MIN_DOT_DIM, dot_precision
from kernels_pallas.quantized_matmul import QuantizedMatmulTuning, default_tuning

PACK_COLUMNS = 64  # input features per packed block (model/quantization.py)
_HALF = PACK_COLUMNS // 2
_OFFSET = 8.0  # a nibble holds its signed value + 8


# ---------------------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------------------


def _kernel(
    layer_ref,  # i32[1]: the layer whose weight is read
    x_ref,  # f[block_t, blocks * 64]: this program's rows of x
    q_ref,  # u8[L, block_out, blocks * 32]: every layer's packed rows of this output tile
    scale_ref,  # f32[L, block_out, G] per group, or f32[L, block_out] per channel
    *rest,  # zero_ref (i8, the scales' shape) where there are zero points, then out_ref f[block_t, block_out]
    group_blocks: int | None,  # packed blocks per group; None: per-channel scales
):
    zero_ref, out_ref = rest if len(rest) == 2 else (None, rest[0])
    layer = layer_ref[0]
    rows = x_ref.shape[0]
    block_out = out_ref.shape[1]
    blocks = q_ref.shape[2] // _HALF

    def shift_of(group):  # f32[block_out, 1]: what each row's nibbles are less, the offset and the zero point
        if zero_ref is None:
            return jnp.full((block_out, 1), _OFFSET, jnp.float32)
        zero = zero_ref[layer, :] if group is None else zero_ref[layer, :, group]
        return (zero.astype(jnp.float32) + _OFFSET)[:, None]

    def fold(block, acc):
        group = None if group_blocks is None else block // group_blocks
        packed = q_ref[layer, :, pl.ds(pl.multiple_of(block * _HALF, _HALF), _HALF)]  # u8[block_out, 32]
        shift = shift_of(group)
        low = (packed & 0xF).astype(jnp.float32) - shift  # f32[block_out, 32]: features 0..31 of the block
        high = (packed >> 4).astype(jnp.float32) - shift  # features 32..63
        if group is not None:
            scale = scale_ref[layer, :, group][:, None]  # f32[block_out, 1]
            low, high = low * scale, high * scale
        start = pl.multiple_of(block * PACK_COLUMNS, PACK_COLUMNS)
        xs_low = x_ref[:, pl.ds(start, _HALF)]  # f[block_t, 32]
        xs_high = x_ref[:, pl.ds(start + _HALF, _HALF)]
        precision = dot_precision(xs_low.dtype)
        acc += plgpu.dot(xs_low, low.astype(xs_low.dtype), trans_b=True, precision=precision)
        return acc + plgpu.dot(xs_high, high.astype(xs_high.dtype), trans_b=True, precision=precision)

    acc = lax.fori_loop(0, blocks, fold, jnp.zeros((rows, block_out), jnp.float32))
    if group_blocks is None:
        acc = acc * scale_ref[layer, :][None, :]
    out_ref[...] = acc.astype(out_ref.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------------------------


def _call(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array | None, layer: jax.Array,
          group_blocks: int | None, tuning: QuantizedMatmulTuning, interpret: bool) -> jax.Array:
    tokens, width = x.shape
    layers, out, packed = q.shape
    bt, bo = tuning.block_t, tuning.block_out
    per_group = scale.shape[2:]  # (G,) or ()
    scale_spec = pl.BlockSpec((layers, bo, *per_group), lambda i, j: (0, j, *([0] * len(per_group))))
    in_specs = [pl.BlockSpec((1,), lambda i, j: (0,)),
                pl.BlockSpec((bt, width), lambda i, j: (i, 0)),
                pl.BlockSpec((layers, bo, packed), lambda i, j: (0, j, 0)),
                scale_spec] + ([scale_spec] if zero is not None else [])
    return pl.pallas_call(
        functools.partial(_kernel, group_blocks=group_blocks),
        grid=(tokens // bt, out // bo),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bt, bo), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((tokens, out), x.dtype),
        # Explicit Triton parameters: without them a GPU pallas_call may pick another GPU backend.
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret,
        name=f"int4_matmul_{bt}x{bo}",
    )(layer, x, q, scale, *([zero] if zero is not None else []))


def int4_fits(out_features: int, group_size: int | None) -> bool:
    """The kernel takes a weight of `out_features` rows (a multiple of 16) with this grouping (per channel, or a
    multiple of the 64-feature packed block)."""
    return out_features % MIN_DOT_DIM == 0 and (group_size is None or group_size % PACK_COLUMNS == 0)


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("group_size", "tuning", "interpret"))
def int4_matmul(
    x: jax.Array,  # f[T, in]
    q: jax.Array,  # u8[L, out, packed]: every layer's packed weight, packed = ceil(in / 64) * 32
    scale: jax.Array,  # f32[L, out, G] per group, or f32[L, out] per channel
    zero: jax.Array | None,  # i8, the scales' shape: zero points less 8; None: symmetric
    layer: jax.Array,  # i32[]: the layer to multiply by (traced: one program serves every layer)
    *,
    group_size: int | None,  # input features per scale (a multiple of 64); None: per channel
    tuning: QuantizedMatmulTuning | None = None,
    interpret: bool = False,
) -> jax.Array:  # f[T, out], x's dtype
    """x @ (((q[layer] unpacked) - zero[layer]) * scale[layer]).T, accumulated in float32, reading only layer `layer`
    of each stack. `interpret=True` runs the kernel on any backend (CPU included) for testing."""
    layers, out, packed = q.shape
    if q.dtype != jnp.uint8 or not int4_fits(out, group_size) or x.shape[1] > 2 * packed:
        raise ValueError(f"int4_matmul takes x f[T, in] and q u8[L, out, ceil(in/64)*32] with out a multiple of "
                         f"{MIN_DOT_DIM} and group_size None or a multiple of {PACK_COLUMNS}; got x {x.shape}, q "
                         f"{q.dtype}{list(q.shape)}, group_size {group_size}")
    tuning = tuning or default_tuning(x.shape[0], 2 * packed, out)
    tokens = x.shape[0]
    padded = -(-tokens // tuning.block_t) * tuning.block_t
    rows = jnp.pad(x, ((0, padded - tokens), (0, 2 * packed - x.shape[1])))  # f[padded, packed * 2]
    group_blocks = None if group_size is None else group_size // PACK_COLUMNS
    out_rows = _call(rows, q, scale.astype(jnp.float32), zero, jnp.asarray(layer, jnp.int32).reshape(1),
                     group_blocks, tuning, interpret)
    return out_rows[:tokens]


# ---------------------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------------------


def int4_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array, zero: jax.Array | None, layer: jax.Array,
                          group_size: int | None) -> jax.Array:
    """Plain jnp: layer `layer` sliced out, unpacked and dequantized whole in float32, then the matmul; for tests."""
    packed = lax.dynamic_index_in_dim(q, layer, keepdims=False)  # u8[out, packed]
    blocks = packed.reshape(packed.shape[0], -1, _HALF)
    values = jnp.stack([blocks & 0xF, blocks >> 4], axis=-2).reshape(packed.shape[0], -1).astype(jnp.float32)
    values = values[:, :x.shape[1]] - _OFFSET  # f32[out, in]
    size = x.shape[1] if group_size is None else group_size
    per_feature = (lambda a: jnp.repeat(a.reshape(a.shape[0], -1), size, axis=1)[:, :x.shape[1]])
    if zero is not None:
        values = values - per_feature(lax.dynamic_index_in_dim(zero, layer, keepdims=False).astype(jnp.float32))
    weight = values * per_feature(lax.dynamic_index_in_dim(scale, layer, keepdims=False))
    y = jnp.einsum("ti,oi->to", x.astype(jnp.float32), weight, precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)
