"""The decoder's quantized projections, one class per storage (model/quantization.py has the formats):

- `QuantizedLinear`: 8-bit weights (int8, float8) with per-channel or block scales; W8A16, and W8A8 in steps of many
  tokens where the format quantizes activations (fp8).
- `Int4Linear`: 4-bit weights packed two a byte, with group (or channel) scales, zero points where asymmetric and
  an input permutation where the checkpoint is act-order; W4A16.

Both hold HF's parameter names (`weight`, `weight_scale`, ...), layer-stacked like every decoder parameter, and
multiply either on one layer's slice (`__call__`, inside the layer scan) or on the whole stacks given the layer index
(`from_stack`, where a Pallas kernel reads the layer's rows in place: kernels_pallas/quantized_matmul.py,
kernels_pallas/int4_matmul.py), falling back to the slice where no kernel takes the shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.model.quantization import (PALLAS_INTERPRET_GEMM, STATIC_ACTIVATIONS, WeightFormat, packed_width,
                                         quantizes_activations, scale_shape, scaled_matmul, unpack_int4, w8a8_matmul,
                                         weight_format)
from kernels_pallas.int4_matmul import int4_fits, int4_matmul
from kernels_pallas.quantized_matmul import fits, quantized_matmul


class QuantizedLinear(nnx.Module):
    """y = x @ (weight * weight_scale).T (+ bias): weight q[out, in] in the quantization's dtype, weight_scale
    f32[out] per output channel or f32[out blocks, in blocks] per block; the loader fills both, from the unquantized
    weight or from a pre-quantized checkpoint. A W8A8 format quantizes x too in steps of many tokens, per token or by
    a static `input_scale` f32[1] the checkpoint calibrated."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, quantization: str | WeightFormat,
                 stack: tuple[int, ...] = (), **_unused_init):
        fmt = weight_format(quantization)
        self.weight = nnx.Param(jnp.zeros((*stack, out_features, in_features), fmt.dtype))
        self.weight_scale = nnx.Param(jnp.ones((*stack, *scale_shape(fmt, out_features, in_features)), jnp.float32))
        self.input_scale = (nnx.Param(jnp.ones((*stack, 1), jnp.float32)) if fmt.activations == STATIC_ACTIVATIONS
                            else None)
        self.bias = nnx.Param(jnp.zeros((*stack, out_features), dtype)) if bias else None
        self.block = fmt.block  # (rows, columns) one scale covers; None: per output channel
        self.format = fmt  # static: how the weights are stored and whether many-token steps quantize activations

    def __call__(self, x: jax.Array) -> jax.Array:
        q, scale = self.weight[...], self.weight_scale[...]
        if quantizes_activations(self.format, x.size // x.shape[-1]):
            input_scale = None if self.input_scale is None else self.input_scale[...]
            y = w8a8_matmul(x, q, scale, self.format, input_scale)
        else:
            y = scaled_matmul(x, q, scale, self.block)
        return _biased(self, y)

    def from_stack(self, x: jax.Array, layer: jax.Array, stacked_gemm: str) -> jax.Array:
        """The same product where weight and weight_scale hold every layer (q[L, out, in], f32[L, ...]) and `layer`
        (i32[]) says which: per-channel weights the kernel tiles are read in place by it; others are sliced, as the
        scan would have."""
        q, scale = self.weight[...], self.weight_scale[...]
        out_features, in_features = q.shape[-2:]
        if not self.format.kernel_reads_stacks or not fits(in_features, out_features):
            return _biased(self, scaled_matmul(x, q[layer], scale[layer], self.block))
        rows = x.reshape(-1, in_features)  # f[B * T, in]
        y = quantized_matmul(rows, q, scale, layer, interpret=stacked_gemm == PALLAS_INTERPRET_GEMM)
        return _biased(self, y.reshape(*x.shape[:-1], out_features))


class Int4Linear(nnx.Module):
    """y = x[..., perm] @ ((q - zero) * scale).T (+ bias): weight u8[out, packed_width(in)] (two 4-bit values a
    byte, model/quantization.py pack_int4), weight_scale f32[out, groups] per group of input features or f32[out]
    per channel, weight_zero_point i8 of the scale's shape where the checkpoint is asymmetric, and weight_perm
    i32[in] where it is act-order (the input feature each stored column holds)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype, quantization: WeightFormat,
                 stack: tuple[int, ...] = (), **_unused_init):
        fmt = quantization
        self.weight = nnx.Param(jnp.zeros((*stack, out_features, packed_width(in_features)), fmt.dtype))
        scales = (*stack, *scale_shape(fmt, out_features, in_features))
        self.weight_scale = nnx.Param(jnp.ones(scales, jnp.float32))
        self.weight_zero_point = nnx.Param(jnp.zeros(scales, jnp.int8)) if fmt.zero_points else None
        self.weight_perm = (nnx.Param(jnp.broadcast_to(jnp.arange(in_features, dtype=jnp.int32), (*stack, in_features)))
                            if fmt.act_order else None)
        self.bias = nnx.Param(jnp.zeros((*stack, out_features), dtype)) if bias else None
        self.block = fmt.block  # (1, group size); None: per output channel
        self.format = fmt  # static
        self.in_features = in_features  # static: the weight's columns, its packing's padding aside

    def __call__(self, x: jax.Array) -> jax.Array:
        q = unpack_int4(self.weight[...], self.in_features)
        return _biased(self, scaled_matmul(self._permuted(x), q, self.weight_scale[...], self.block,
                                           self._zero_point()))

    def from_stack(self, x: jax.Array, layer: jax.Array, stacked_gemm: str) -> jax.Array:
        """The same product where weight, scales and zero points hold every layer and `layer` (i32[]) says which
        (the permutation is scanned: this layer's already): the W4A16 kernel reads the layer's packed rows in place
        where it takes the shape; else the layer's weight is sliced and dequantized, as the scan would have."""
        x = self._permuted(x)
        q, scale = self.weight[...], self.weight_scale[...]
        out_features = q.shape[-2]
        group_size = None if self.block is None else self.block[1]
        if not int4_fits(out_features, group_size):
            weight = unpack_int4(q[layer], self.in_features)
            zero = None if self.weight_zero_point is None else self.weight_zero_point[...][layer]
            return _biased(self, scaled_matmul(x, weight, scale[layer], self.block, zero))
        rows = x.reshape(-1, self.in_features)  # f[B * T, in]
        y = int4_matmul(rows, q, scale, self._zero_point(), layer, group_size=group_size,
                        interpret=stacked_gemm == PALLAS_INTERPRET_GEMM)
        return _biased(self, y.reshape(*x.shape[:-1], out_features))

    def _permuted(self, x: jax.Array) -> jax.Array:
        """x f[..., in] in the stored columns' order (an act-order checkpoint's), or as it is."""
        return x if self.weight_perm is None else jnp.take(x, self.weight_perm[...], axis=-1)

    def _zero_point(self) -> jax.Array | None:
        return None if self.weight_zero_point is None else self.weight_zero_point[...]


QUANTIZED_LINEARS = (QuantizedLinear, Int4Linear)


def quantized_linear(in_features: int, out_features: int, *, quantization: str | WeightFormat,
                     **kwargs) -> QuantizedLinear | Int4Linear:
    """The projection of a quantized format: packed 4-bit ones are Int4Linear, the others QuantizedLinear."""
    fmt = weight_format(quantization)
    cls = Int4Linear if fmt.packs_int4 else QuantizedLinear
    return cls(in_features, out_features, quantization=fmt, **kwargs)


def _biased(projection: QuantizedLinear | Int4Linear, y: jax.Array) -> jax.Array:
    return y if projection.bias is None else y + projection.bias[...]
