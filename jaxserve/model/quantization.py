"""Weight quantization of the decoder's projections: int8 or float8 weights with one float32 scale per output channel.

A quantized projection stores `weight` q[..., out, in] and `weight_scale` f32[..., out] (the names compressed-tensors
checkpoints use), with weight ≈ q * scale[..., None]. The forward pass multiplies by q cast to the activations'
dtype and scales the output channels after the matmul, which is the same product (a per-output-channel scale
commutes with the contraction over `in`); XLA fuses the cast into the dot, so the weights are read from memory at
one byte each. `dequantize` is the plain reference: the weight rebuilt in full, for a dense model to run.

Embeddings, norms and lm_head stay unquantized, as vLLM leaves them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import QUANTIZATIONS
from jaxserve.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How one quantization mode stores a weight."""

    name: str  # the --quantization value
    dtype: np.dtype  # the stored weights' dtype
    max_value: float  # the largest magnitude the dtype holds; a channel's largest weight maps onto it
    rounds: bool  # integers: round to the nearest before the cast (a float8 cast rounds by itself)


WEIGHT_FORMATS = {
    "int8": WeightFormat("int8", np.dtype(jnp.int8), 127.0, rounds=True),
    "fp8": WeightFormat("fp8", np.dtype(jnp.float8_e4m3fn), float(jnp.finfo(jnp.float8_e4m3fn).max), rounds=False),
}
SCALE_SUFFIX = "_scale"  # `...q_proj.weight_scale` beside `...q_proj.weight`


def weight_format(quantization: str) -> WeightFormat:
    """The format of a --quantization value; ConfigError naming the choices for any other."""
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    return WEIGHT_FORMATS[quantization]


def quantize(weight: jax.Array, fmt: WeightFormat) -> tuple[jax.Array, jax.Array]:
    """(q[..., out, in], scale f32[..., out]) of weight f[..., out, in]: each output channel scaled so its largest
    magnitude is the format's largest value (an all-zero channel gets scale 1)."""
    w32 = weight.astype(jnp.float32)
    largest = jnp.max(jnp.abs(w32), axis=-1)  # f32[..., out]
    scale = jnp.where(largest > 0, largest / fmt.max_value, 1.0)  # f32[..., out]
    scaled = w32 / scale[..., None]
    if fmt.rounds:
        scaled = jnp.round(scaled)
    return jnp.clip(scaled, -fmt.max_value, fmt.max_value).astype(fmt.dtype), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:  # f[..., out, in]
    """The weight q[..., out, in] * scale f32[..., out] stands for, in `dtype`."""
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def scaled_matmul(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:  # f[..., out]
    """x f[..., in] @ (q * scale).T: the matmul on q cast to x's dtype, accumulated in float32, then the output
    channels scaled."""
    y = jnp.einsum("...i,oi->...o", x, q.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scale).astype(x.dtype)
