"""Weight-only quantized matmul over a layer-stacked weight: y = x @ (q[layer] * scale[layer][:, None]).T (W8A16).

For x f[T, in], a stacked weight q i8 or f8e4m3fn [L, out, in] and per-output-channel scales f32[L, out], given the
layer index as an i32 input: each program reads only that layer's rows of its output tile, straight from the stacked
array (the index offsets its loads, so no slice of the stack is ever copied out), widens each tile to x's dtype in
registers, and accumulates in float32; the channel scales multiply the accumulator once at the end, since a scale
per output channel commutes with the contraction over `in`.

Grid (T / block_t, out / block_out): each program holds one [block_t, block_out] tile of the output and loops over
`in` in steps of block_in. The layer index is an ordinary input read inside the kernel (GPU lowerings of Pallas
have no scalar prefetch), and q and the scales are whole-array refs indexed by it. T need not be a multiple of
block_t: the wrapper pads x with zero rows and drops them again (for decode, a few rows; Triton's dot needs at least
16 rows). `in` must be a multiple of block_in and `out` of block_out (`fits` says whether a shape does).

This is the decode projections' path: at a few rows a step is bound by reading the weights, and this reads each
weight byte once. XLA's own choices read more (runner/compile_options.py): its Triton GEMM fusion copies each
layer's slice out of the stack first, cuBLAS widens the slice to bf16 in memory.

File order: tuning, kernel, wrapper, public API, plain-jnp reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.common import MIN_DOT_DIM, check_tuning, dot_precision

# Stored weight dtypes the kernel widens.
WEIGHT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


@dataclasses.dataclass(frozen=True)
class QuantizedMatmulTuning:
    """Static launch parameters of the kernel; validated on creation. Hashable: a static argument of jit."""

    block_t: int = 16
    """Rows of x per program; a power of two of at least 16 (Triton's dot)."""
    block_out: int = 64
    """Output channels per program; a power of two of at least 16 dividing `out`."""
    block_in: int = 128
    """Input features folded per loop iteration; a power of two of at least 16 dividing `in`."""
    num_warps: int = 4
    """Warps per Triton program; a power of two."""
    num_stages: int = 3
    """Software-pipelining stages of the loop over `in` in Triton."""

    def __post_init__(self):
        fields = ("block_t", "block_out", "block_in", "num_warps", "num_stages")
        check_tuning(self, fields, ("block_t", "block_out", "block_in", "num_warps"))
        for name in ("block_t", "block_out", "block_in"):
            if getattr(self, name) < MIN_DOT_DIM:
                raise ValueError(f"QuantizedMatmulTuning.{name} must be at least {MIN_DOT_DIM} (Triton's dot), got "
                                 f"{getattr(self, name)}")

    @property
    def kernel_name(self) -> str:
        """The pallas_call's name, which profiles and compiled modules show."""
        return f"quantized_matmul_{self.block_t}x{self.block_out}x{self.block_in}"


# Streaming multiprocessors of an H100 SXM: the GPU the default tunings are sized for.
H100_CORES = 132
_MAX_BLOCK_OUT = 128
_MAX_BLOCK_IN = 256


def default_tuning(tokens: int, in_features: int, out_features: int,
                   num_cores: int = H100_CORES) -> QuantizedMatmulTuning | None:
    """A tuning for a call's static shapes, or None where none fits (`in` or `out` not a multiple of 16).

    Rows: the tokens rounded up to a power of two, 16 to 64 (a decode step reads every weight once per row tile, so
    few tiles; larger T is compute-bound and 64-row tiles keep registers in bounds). Output channels: the widest
    power of two up to 128 dividing `out` that still gives every core a program (memory-bound decode needs all of
    them reading). Input features: the widest power of two up to 256 dividing `in`."""
    block_out = _widest_dividing(out_features, _MAX_BLOCK_OUT)
    block_in = _widest_dividing(in_features, _MAX_BLOCK_IN)
    if block_out is None or block_in is None:
        return None
    block_t = min(64, max(MIN_DOT_DIM, 1 << max(0, tokens - 1).bit_length()))
    row_tiles = -(-tokens // block_t)
    while block_out > MIN_DOT_DIM and row_tiles * (out_features // block_out) < num_cores:
        block_out //= 2
    return QuantizedMatmulTuning(block_t=block_t, block_out=block_out, block_in=block_in,
                                 num_warps=4 if block_t * block_out <= 64 * 64 else 8)


def _widest_dividing(size: int, largest: int) -> int | None:
    """The largest power of two in [16, largest] dividing `size`; None if 16 does not."""
    block = largest
    while block >= MIN_DOT_DIM:
        if size % block == 0:
            return block
        block //= 2
    return None


# ---------------------------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------------------------


def _kernel(
    layer_ref,  # i32[1]: the layer whose weight is read
    x_ref,  # f[block_t, in]: this program's rows of x
    q_ref,  # i8/f8[L, block_out, in]: every layer's rows of this output tile
    scale_ref,  # f32[L, block_out]: every layer's scales of this output tile
    out_ref,  # f[block_t, block_out]
    *,
    block_in: int,
):
    layer = layer_ref[0]
    rows, width = x_ref.shape
    block_out = out_ref.shape[1]

    def fold(i, acc):
        start = pl.multiple_of(i * block_in, block_in)
        xs = x_ref[:, pl.ds(start, block_in)]  # f[block_t, block_in]
        weights = q_ref[layer, :, pl.ds(start, block_in)].astype(xs.dtype)  # f[block_out, block_in], widened here
        return acc + plgpu.dot(xs, weights, trans_b=True, precision=dot_precision(xs.dtype))

    acc = lax.fori_loop(0, width // block_in, fold, jnp.zeros((rows, block_out), jnp.float32))
    scales = scale_ref[layer, :]  # f32[block_out]
    out_ref[...] = (acc * scales[None, :]).astype(out_ref.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------------------------------


def _call(x: jax.Array, q: jax.Array, scale: jax.Array, layer: jax.Array, tuning: QuantizedMatmulTuning,
          interpret: bool) -> jax.Array:  # f[T, out] with T a multiple of block_t
    tokens, width = x.shape
    layers, out, _ = q.shape
    bt, bo = tuning.block_t, tuning.block_out
    return pl.pallas_call(
        functools.partial(_kernel, block_in=tuning.block_in),
        grid=(tokens // bt, out // bo),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)),
                  pl.BlockSpec((bt, width), lambda i, j: (i, 0)),
                  pl.BlockSpec((layers, bo, width), lambda i, j: (0, j, 0)),
                  pl.BlockSpec((layers, bo), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bt, bo), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((tokens, out), x.dtype),
        # Explicit Triton parameters: without them a GPU pallas_call may pick another GPU backend.
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret,
        name=tuning.kernel_name,
    )(layer, x, q, scale)


def check_shapes(x: jax.Array, q: jax.Array, scale: jax.Array, layer: jax.Array,
                 tuning: QuantizedMatmulTuning) -> None:
    """Raises ValueError naming the first input the kernel cannot take."""
    if x.ndim != 2 or q.ndim != 3 or scale.ndim != 2:
        raise ValueError(f"expected x f[T, in], q [L, out, in], scale f32[L, out]; got {x.shape}, {q.shape}, "
                         f"{scale.shape}")
    layers, out, width = q.shape
    if x.shape[1] != width or scale.shape != (layers, out):
        raise ValueError(f"q {q.shape} and scale {scale.shape} do not fit x {x.shape}: q must be [L, out, in], "
                         f"scale [L, out]")
    if q.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"q must be int8 or float8_e4m3fn, got {q.dtype}")
    if jnp.shape(layer) not in ((), (1,)) or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar, got {layer!r}")
    if width % tuning.block_in or out % tuning.block_out:
        raise ValueError(f"in ({width}) and out ({out}) must be multiples of block_in ({tuning.block_in}) and "
                         f"block_out ({tuning.block_out})")


def fits(in_features: int, out_features: int) -> bool:
    """The kernel takes a weight of this shape (with its default tuning)."""
    return default_tuning(1, in_features, out_features) is not None


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def quantized_matmul(
    x: jax.Array,  # f[T, in]
    q: jax.Array,  # i8/f8e4m3fn[L, out, in]: every layer's weight
    scale: jax.Array,  # f32[L, out]: every layer's per-output-channel scales
    layer: jax.Array,  # i32[]: the layer to multiply by (traced: one program serves every layer)
    *,
    tuning: QuantizedMatmulTuning | None = None,
    interpret: bool = False,
) -> jax.Array:  # f[T, out], x's dtype
    """x @ (q[layer] * scale[layer][:, None]).T, accumulated in float32, reading only layer `layer` of q and scale
    (default tuning: `default_tuning` of the shapes). `interpret=True` runs the kernel on any backend (CPU
    included) for testing."""
    tuning = tuning or default_tuning(x.shape[0], q.shape[2], q.shape[1])
    if tuning is None:
        raise ValueError(f"no tuning fits in ({q.shape[2]}) and out ({q.shape[1]}): both must be multiples of "
                         f"{MIN_DOT_DIM}")
    check_shapes(x, q, scale, layer, tuning)
    tokens = x.shape[0]
    padded = -(-tokens // tuning.block_t) * tuning.block_t
    rows = x if padded == tokens else jnp.pad(x, ((0, padded - tokens), (0, 0)))  # f[padded, in]
    out = _call(rows, q, scale.astype(jnp.float32), jnp.asarray(layer, jnp.int32).reshape(1), tuning, interpret)
    return out if padded == tokens else out[:tokens]


# ---------------------------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------------------------


@jax.jit
def quantized_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array, layer: jax.Array) -> jax.Array:
    """Plain jnp: layer `layer` sliced out of q and scale (a copy), widened whole, then the matmul; for tests."""
    weight = lax.dynamic_index_in_dim(q, layer, keepdims=False).astype(jnp.float32)  # f32[out, in]
    y = jnp.einsum("ti,oi->to", x.astype(jnp.float32), weight, precision=lax.Precision.HIGHEST)
    return (y * lax.dynamic_index_in_dim(scale, layer, keepdims=False)).astype(x.dtype)

