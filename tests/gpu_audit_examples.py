"""Small hand-made programs, each built to break (or to keep) one property the GPU program guards check, compiled for
an H100 target like the engine's programs. Imported by tests/gpu_audit_probe.py inside its GPU compile process.

Each breaks its property the way the engine might: a layer loop whose GEMMs copy each layer's weight slice first
(XLA's Triton GEMM at a few rows), a pool layer materialized before it is read, an intermediate far larger than the
step's activations, a quantized weight widened whole in memory. Their twins keep the property.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxserve.gpu_programs.arguments import ProgramArgument, ProgramFacts, Role, xla_element_type

LAYERS, HIDDEN, FFN = 4, 1024, 4096  # small, but past the sizes XLA computes as plain reductions
WIDE = 2048  # an activation width whose outer product per row (16 MiB in f32) dwarfs the activations
ROWS = 8  # a decode step of 8 sequences: enough rows for XLA to emit GEMMs
KV_HEADS, PAGES, HEAD_DIM = 8, 512, 128


@dataclasses.dataclass(frozen=True)
class Example:
    """One hand-made program and what it stands for."""

    name: str
    function: Callable
    # (shape, dtype, role, layer axis) of each argument
    arguments: tuple[tuple[tuple[int, ...], object, Role, int | None], ...]
    activation_bytes: int  # what its temp is judged against
    compiler_options: dict = dataclasses.field(default_factory=dict)

    def facts(self) -> ProgramFacts:
        arguments = tuple(ProgramArgument(f"argument {i}", role, xla_element_type(dtype), shape, layer_axis)
                          for i, (shape, dtype, role, layer_axis) in enumerate(self.arguments))
        return ProgramFacts(self.name, "decode", arguments, must_read_bytes=sum(a.bytes for a in arguments),
                            activation_bytes=self.activation_bytes)

    def specs(self, sharding) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype, _, _ in self.arguments]


def _layer_loop(x, up, down):
    """A scanned MLP over layer-stacked weights, as the engine's decoder runs."""
    def layer(h, weights):
        w_up, w_down = weights
        return h + jax.nn.silu(h @ w_up) @ w_down, None
    return jax.lax.scan(layer, x, (up, down))[0]


def _pool_layers(q, pool, materialize: bool):
    """Each layer reads its pages of a layer-stacked pool f[kv_heads, layers, pages, head_dim]."""
    def layer(h, index):
        pages = jax.lax.dynamic_index_in_dim(pool, index, axis=1, keepdims=False)  # f[kv_heads, pages, head_dim]
        if materialize:
            pages = jax.lax.optimization_barrier(pages)
        # Summed over its contiguous axes, so that XLA reads the slice where it lies
        return h + jnp.sum(pages, axis=(1, 2))[:, None], None
    return jax.lax.scan(layer, q, jnp.arange(LAYERS))[0]


def _outer_product(x, w):
    """An f32[rows, wide, wide] intermediate (128 MiB) of activations only, forced into memory."""
    wide = jax.lax.optimization_barrier(jnp.tanh(x[:, :, None] * x[:, None, :]))
    return jnp.sum(wide, axis=2) @ w


def _plain_matmul(x, w):
    return x @ w


def _quantized_matmul(x, w, scale, widen_in_memory: bool):
    """Weight-only int8: the weight widened to the activations' dtype for the GEMM, its scale after."""
    wide = w.astype(jnp.bfloat16)
    if widen_in_memory:
        wide = jax.lax.optimization_barrier(wide)
    return (x @ wide) * scale


def _pallas_quantized_layer_loop(x, up, up_scale, down, down_scale):
    """The scanned MLP over layer-stacked int8 weights, each projection the Pallas W8A16 GEMM given the layer index."""
    from kernels_pallas.quantized_matmul import quantized_matmul

    def layer(h, index):
        hidden = jax.nn.silu(quantized_matmul(h, up, up_scale, index))
        return h + quantized_matmul(hidden, down, down_scale, index), None
    return jax.lax.scan(layer, x, jnp.arange(LAYERS))[0]


INT4_GROUP = 128  # input features per scale, the common 4-bit checkpoints' group


def _int4_layer_loop(x, up, up_scale, up_zero, down, down_scale, down_zero, kernel: bool):
    """The scanned MLP over layer-stacked packed 4-bit weights with group scales and zero points: each projection
    the Pallas W4A16 GEMM given the layer index, or (the twin) XLA multiplying by the weight dequantized first."""
    from jaxserve.model.quantization import dequantize, unpack_int4
    from kernels_pallas.int4_matmul import int4_matmul

    def project(h, q, scale, zero, index, in_features):
        if kernel:
            return int4_matmul(h, q, scale, zero, index, group_size=INT4_GROUP)
        weight = dequantize(unpack_int4(q[index], in_features), scale[index], h.dtype, (1, INT4_GROUP), zero[index])
        return h @ weight.T

    def layer(h, index):
        hidden = jax.nn.silu(project(h, up, up_scale, up_zero, index, HIDDEN))
        return h + project(hidden, down, down_scale, down_zero, index, FFN), None
    return jax.lax.scan(layer, x, jnp.arange(LAYERS))[0]


_X = ((ROWS, HIDDEN), jnp.bfloat16, Role.INPUT, None)
_STACKED = (((LAYERS, HIDDEN, FFN), jnp.bfloat16, Role.WEIGHT, 0),
            ((LAYERS, FFN, HIDDEN), jnp.bfloat16, Role.WEIGHT, 0))
_POOL = (((KV_HEADS, HEAD_DIM), jnp.float32, Role.INPUT, None),
         ((KV_HEADS, LAYERS, PAGES, HEAD_DIM), jnp.float32, Role.POOL, 1))
_QUANTIZED = (_X, ((HIDDEN, FFN), jnp.int8, Role.WEIGHT, None), ((FFN,), jnp.bfloat16, Role.WEIGHT, None))
_ACTIVATIONS = ROWS * (HIDDEN + FFN) * 2  # one layer's rows, bf16
# [L, out, in] weights as the engine stores them, with per-output-channel scales.
_STACKED_INT8 = (((LAYERS, FFN, HIDDEN), jnp.int8, Role.WEIGHT, 0), ((LAYERS, FFN), jnp.float32, Role.WEIGHT, 0),
                 ((LAYERS, HIDDEN, FFN), jnp.int8, Role.WEIGHT, 0), ((LAYERS, HIDDEN), jnp.float32, Role.WEIGHT, 0))

# [L, out, in / 2] packed 4-bit weights (model/quantization.py pack_int4), group scales and zero points.
_STACKED_INT4 = tuple(spec for out, width in ((FFN, HIDDEN), (HIDDEN, FFN))
                      for spec in (((LAYERS, out, width // 2), jnp.uint8, Role.WEIGHT, 0),
                                   ((LAYERS, out, width // INT4_GROUP), jnp.float32, Role.WEIGHT, 0),
                                   ((LAYERS, out, width // INT4_GROUP), jnp.int8, Role.WEIGHT, 0)))

EXAMPLES = (
    Example("weight slices copied", _layer_loop, (_X, *_STACKED), _ACTIVATIONS),
    Example("weights read in place", _layer_loop, (_X, *_STACKED), _ACTIVATIONS,
            {"xla_gpu_enable_triton_gemm": False}),
    Example("pool layer copied", lambda q, pool: _pool_layers(q, pool, True), _POOL, KV_HEADS * HEAD_DIM * 4),
    Example("pool read in place", lambda q, pool: _pool_layers(q, pool, False), _POOL, KV_HEADS * HEAD_DIM * 4),
    Example("temp far above activations", _outer_product,
            (((ROWS, WIDE), jnp.float32, Role.INPUT, None), ((WIDE, WIDE), jnp.float32, Role.WEIGHT, None)),
            ROWS * WIDE * 4),
    Example("temp within activations", _plain_matmul,
            (((ROWS, HIDDEN), jnp.float32, Role.INPUT, None), ((HIDDEN, HIDDEN), jnp.float32, Role.WEIGHT, None)),
            ROWS * HIDDEN * 4),
    Example("int8 weight widened in memory", lambda x, w, s: _quantized_matmul(x, w, s, True), _QUANTIZED,
            _ACTIVATIONS),
    Example("int8 weight widened in its GEMM", lambda x, w, s: _quantized_matmul(x, w, s, False), _QUANTIZED,
            _ACTIVATIONS),
    Example("int8 stacked weights read by the Pallas GEMM", _pallas_quantized_layer_loop, (_X, *_STACKED_INT8),
            _ACTIVATIONS),
    Example("int4 stacked weights read by the Pallas GEMM", lambda *a: _int4_layer_loop(*a, kernel=True),
            (_X, *_STACKED_INT4), _ACTIVATIONS),
    Example("int4 weights dequantized for XLA's GEMM", lambda *a: _int4_layer_loop(*a, kernel=False),
            (_X, *_STACKED_INT4), _ACTIVATIONS),
)
