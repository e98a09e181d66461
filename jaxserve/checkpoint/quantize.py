"""Online quantization: an unquantized checkpoint's projections quantized on the devices right after they are read
(`--quantization int8|fp8`), each weight replaced by its quantized form and per-channel scale, sharded as the
quantized layout says."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jaxserve.model.quantization import (PACKED_INT4, PERMUTATION_SUFFIX, SCALE_SUFFIX, ZERO_POINT_SUFFIX,
                                         WeightFormat, dequantize, quantize, unpack_int4, weight_format)


def quantized_arrays(arrays: Mapping[str, jax.Array], specs: Mapping[str, jax.ShapeDtypeStruct],
                     quantization: str) -> dict[str, jax.Array]:
    """`arrays` (tensor name -> unquantized array) with every weight that has a scale in `specs` (the quantized
    layout) quantized; each unquantized weight is freed as soon as its quantized form exists, so the peak is the
    unquantized model plus one weight."""
    fmt = weight_format(quantization)
    out = {}
    for name, array in arrays.items():
        scale_name = name + SCALE_SUFFIX
        if scale_name not in specs:
            out[name] = array
            continue
        out[name], out[scale_name] = _quantizer(fmt, specs[name].sharding, specs[scale_name].sharding)(array)
        array.delete()
    return out


@functools.cache
def _quantizer(fmt: WeightFormat, weight_sharding: jax.sharding.Sharding, scale_sharding: jax.sharding.Sharding):
    """One jitted quantization per format and layout, so projections of one shape (gate and up, k and v) share a
    compile."""
    return jax.jit(functools.partial(quantize, fmt=fmt), out_shardings=(weight_sharding, scale_sharding))


def online_quantization_name(quantization: str | None) -> str | None:
    """The format `--quantization` runs, in words (as `LoadedModel.quantization` names it)."""
    if quantization is None:
        return None
    fmt = weight_format(quantization)
    w8a8 = f"; prefill W8A8, {fmt.activations} activations" if fmt.quantizes_activations else ""
    return f"{quantization} (quantized at load, per-channel scales{w8a8})"


def dequantized_arrays(arrays: Mapping[str, jax.Array], dtype, block: tuple[int, int] | None = None,
                       in_features: Mapping[str, int] | None = None) -> dict[str, jax.Array]:
    """The reference path: each quantized weight rebuilt in full (`dtype`) and its scale (and zero point) dropped,
    so that an unquantized model runs exactly the weights a quantized one stands for; `block` is the block-scaled
    (or grouped) format's block (None: per-channel scales); `in_features` (weight name -> its input features) is
    needed where weights are packed 4-bit."""
    def rebuilt(name: str, array: jax.Array) -> jax.Array:
        if array.dtype == PACKED_INT4:
            array = unpack_int4(array, in_features[name])
        weight = dequantize(array, arrays[name + SCALE_SUFFIX], dtype, block, arrays.get(name + ZERO_POINT_SUFFIX))
        if name + PERMUTATION_SUFFIX not in arrays:
            return weight
        # An act-order weight's columns are sorted by group: column j holds input feature perm[j]
        restore = jnp.argsort(arrays[name + PERMUTATION_SUFFIX], axis=-1)  # i32[..., in]
        return jnp.take_along_axis(weight, restore[..., None, :], axis=-1)

    return {name: rebuilt(name, array) if name + SCALE_SUFFIX in arrays else array for name, array in arrays.items()
            if not name.endswith((SCALE_SUFFIX, ZERO_POINT_SUFFIX, PERMUTATION_SUFFIX))}
