"""Weight quantization of the decoder's projections: int8 or float8 weights with float32 scales, one per output
channel or one per block of the weight.

A quantized projection stores `weight` q[..., out, in] and `weight_scale` (the names compressed-tensors checkpoints
use), either f32[..., out], with weight ≈ q * scale[..., None], or, in a block-scaled format (`WeightFormat.block`
= (rows, columns), as pre-quantized FP8 checkpoints store them), f32[..., ceil(out/rows), ceil(in/columns)], each
scale multiplying one rows x columns block (the last row and column of blocks may be partial).

The forward pass of a per-channel format multiplies by q cast to the activations' dtype and scales the output
channels after the matmul, which is the same product (a per-output-channel scale commutes with the contraction over
`in`); XLA fuses the cast into the dot, so the weights are read from memory at one byte each. A block scale varies
along `in` and cannot move past the contraction: the weight is dequantized block by block inside the jitted step
(q cast to float32 times each block's scale, then cast to the activations' dtype) and fed to the dot, a chain of
element-wise ops XLA can fuse into the dot's operand on GPU. `dequantize` is the plain reference for both layouts:
the weight rebuilt in full, for a dense model to run.

FP8 activations (W8A8): decode steps are bound by reading the weights and keep bf16 (or f32) activations (W8A16).
Steps of more than IN_PLACE_MAX_ROWS tokens (prefill and mixed steps) are bound by the GEMMs' arithmetic, which
H100/H200 tensor cores do in float8 at twice the bf16 rate: a per-channel fp8 format whose `activations` say so
quantizes each projection's input to float8 too, as vLLM's `fp8` and compressed-tensors' FP8 schemes run them:
"dynamic", one scale per token computed in the step (each token's largest magnitude onto 448); "static", the
checkpoint's calibrated per-tensor `input_scale`. The GEMM then multiplies two float8 operands, accumulating in
float32, and both scales multiply its output (`w8a8_matmul`; `w8a8_reference` is the same product on dequantized
float32 operands). Block-scaled formats keep W8A16.

4-bit checkpoints (W4A16; checkpoint/int4_checkpoint.py) run as `int4_format`: 4-bit weights packed two a byte, a
scale per group of input features (a block of one row) or per channel, and zero points where asymmetric: weight =
(q - zero) * scale. The packing (`pack_int4`) is one a kernel reads without shuffling: in each block of PACK_COLUMNS
input features, byte j holds feature j in its low nibble and feature j + PACK_COLUMNS / 2 in its high one, each as
its signed value + 8, so a block unpacks into two contiguous halves. kernels_pallas/int4_matmul.py reads the packed
stacks in place for every step (`reads_in_place`); the reference path (`unpack_int4`, then `dequantize`) rebuilds
the weight in the activations' dtype inside the step and feeds it to the dot.

Embeddings, norms and lm_head stay unquantized, as vLLM leaves them.

Inside the decoder's layer scan, XLA reads a per-channel weight's layer slice either by copying it out of the stack
first (its Triton GEMM fusion) or by widening it to the activations' dtype in memory (cuBLAS): each weight byte is
moved three to five times. With `stacked_gemm` "pallas" the model keeps the quantized weights out of the scan and
hands each projection the whole stack and the layer index; kernels_pallas/quantized_matmul.py then reads the layer's
rows in place and widens them in registers (`reads_in_place` says where it applies).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import PALLAS_BACKEND, PALLAS_INTERPRET_BACKEND, QUANTIZATIONS, XLA_BACKEND
from jaxserve.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    """How one quantization mode stores a weight."""

    name: str  # the --quantization value
    dtype: np.dtype  # the stored weights' dtype
    max_value: float  # the largest magnitude the dtype holds; a channel's largest weight maps onto it
    rounds: bool  # integers: round to the nearest before the cast (a float8 cast rounds by itself)
    # (rows, columns) of the weight block one scale covers, as pre-quantized checkpoints store them; None: one scale
    # per output channel
    block: tuple[int, int] | None = None
    # How steps of more than IN_PLACE_MAX_ROWS tokens quantize the projections' inputs: DYNAMIC_ACTIVATIONS (per
    # token), STATIC_ACTIVATIONS (the checkpoint's per-tensor `input_scale`), or None (weight-only, W8A16)
    activations: str | None = None
    # Each scale has a zero point beside it (`weight_zero_point`, int8 of the scale's shape): weight ≈ (q - zero) *
    # scale, as asymmetric 4-bit checkpoints store them
    zero_points: bool = False
    # Each projection's input features are stored permuted so that its groups are contiguous (an act-order GPTQ
    # checkpoint's g_idx, sorted): `weight_perm` i32[in] gathers the activations into the same order first
    act_order: bool = False

    @property
    def quantizes_activations(self) -> bool:
        """Prefill and mixed steps run W8A8: float8 per-channel weights with activations quantized to float8."""
        return self.activations is not None and self.block is None and self.dtype == np.dtype(jnp.float8_e4m3fn)

    @property
    def kernel_reads_stacks(self) -> bool:
        """kernels_pallas/quantized_matmul.py can read this format's stacked weights in place (8-bit, per channel)."""
        return self.block is None and not self.zero_points and not self.packs_int4

    @property
    def packs_int4(self) -> bool:
        """Weights are 4-bit, two a byte: a weight [out, in] is stored u8[out, packed_width(in)] (`pack_int4`)."""
        return self.dtype == PACKED_INT4


# How a step program multiplies by layer-stacked quantized weights (EngineConfig.stacked_gemm): XLA on each layer's
# slice, or the Pallas kernel on the whole stack (compiled for a GPU, or interpreted on any device).
XLA_GEMM, PALLAS_GEMM, PALLAS_INTERPRET_GEMM = XLA_BACKEND, PALLAS_BACKEND, PALLAS_INTERPRET_BACKEND
STACKED_GEMMS = (XLA_GEMM, PALLAS_GEMM, PALLAS_INTERPRET_GEMM)
# The most tokens a step may have for its projections to take the kernel: decode steps, bound by reading the weights.
# More rows are compute-bound, where XLA's GEMMs are the faster (and the slice copy is spread over the rows).
IN_PLACE_MAX_ROWS = 64
# How a W8A8 format's activations are quantized: a scale per token computed in the step, or the checkpoint's one.
DYNAMIC_ACTIVATIONS, STATIC_ACTIVATIONS = "dynamic", "static"
# The smallest per-token scale of dynamic activations (vLLM's): a row of zeros quantizes to zeros.
_MIN_TOKEN_SCALE_FACTOR = 1 / 512


WEIGHT_FORMATS = {
    "int8": WeightFormat("int8", np.dtype(jnp.int8), 127.0, rounds=True),
    "fp8": WeightFormat("fp8", np.dtype(jnp.float8_e4m3fn), float(jnp.finfo(jnp.float8_e4m3fn).max), rounds=False,
                        activations=DYNAMIC_ACTIVATIONS),
}
PACKED_INT4 = np.dtype(np.uint8)  # 4-bit weights (W4A16 checkpoints), two a byte (pack_int4)
PACK_COLUMNS = 64  # input features per packed block: byte j holds feature j and feature j + 32
_INT4_OFFSET = 8  # a nibble holds its signed value + 8


def int4_format(group_size: int | None, zero_points: bool, act_order: bool = False) -> WeightFormat:
    """A 4-bit checkpoint's format: signed 4-bit weights packed two a byte, with a scale per `group_size`
    consecutive input features of each output channel (None: one per channel), zero points where the checkpoint is
    asymmetric, and the input features permuted where it was quantized in activation order."""
    return WeightFormat("int4", PACKED_INT4, 7.0, rounds=True, block=None if group_size is None else (1, group_size),
                        zero_points=zero_points, act_order=act_order)


def packed_width(in_features: int) -> int:
    """Bytes per output channel of a packed 4-bit weight: the input features padded to whole blocks, two a byte."""
    return -(-in_features // PACK_COLUMNS) * PACK_COLUMNS // 2


def pack_int4(values: np.ndarray) -> np.ndarray:
    """u8[..., packed_width(K)] of signed 4-bit values i8[..., K] (on the host, as a checkpoint is read), padded with
    zeros to whole blocks."""
    in_features = values.shape[-1]
    stored = np.asarray(values, np.int16) + _INT4_OFFSET
    padded = np.pad(stored, [(0, 0)] * (stored.ndim - 1) + [(0, 2 * packed_width(in_features) - in_features)],
                    constant_values=_INT4_OFFSET).astype(np.uint8)
    halves = padded.reshape(*padded.shape[:-1], -1, 2, PACK_COLUMNS // 2)  # [..., blocks, low/high, 32]
    return (halves[..., 0, :] | (halves[..., 1, :] << 4)).reshape(*padded.shape[:-1], -1)


def unpack_int4(packed: jax.Array, in_features: int) -> jax.Array:  # i8[..., in_features]
    """The signed 4-bit values u8[..., packed_width(in_features)] holds (`pack_int4`), in order."""
    blocks = packed.reshape(*packed.shape[:-1], -1, PACK_COLUMNS // 2)  # u8[..., blocks, 32]
    halves = jnp.stack([blocks & 0xF, blocks >> 4], axis=-2)  # u8[..., blocks, 2, 32]
    values = halves.reshape(*packed.shape[:-1], -1)[..., :in_features]
    return values.astype(jnp.int8) - _INT4_OFFSET


# What a quantized weight is stored in
QUANTIZED_DTYPES = (*(fmt.dtype for fmt in WEIGHT_FORMATS.values()), PACKED_INT4)
SCALE_SUFFIX = "_scale"  # `...q_proj.weight_scale` beside `...q_proj.weight`
ZERO_POINT_SUFFIX = "_zero_point"  # `...q_proj.weight_zero_point` beside `...q_proj.weight_scale`
PERMUTATION_SUFFIX = "_perm"  # `...q_proj.weight_perm`: an act-order weight's input permutation


def weight_format(quantization: str | WeightFormat) -> WeightFormat:
    """The format of a --quantization value (a format passes through); ConfigError naming the choices for any other."""
    if isinstance(quantization, WeightFormat):
        return quantization
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    return WEIGHT_FORMATS[quantization]


def scale_shape(fmt: WeightFormat, out_features: int, in_features: int) -> tuple[int, ...]:
    """The shape of one weight's scales: (out,) per output channel, or (out blocks, in blocks) of a block format."""
    if fmt.block is None:
        return (out_features,)
    rows, columns = fmt.block
    return (-(-out_features // rows), -(-in_features // columns))


def quantize(weight: jax.Array, fmt: WeightFormat) -> tuple[jax.Array, jax.Array]:
    """(q[..., out, in], scale f32[..., out]) of weight f[..., out, in]: each output channel scaled so its largest
    magnitude is the format's largest value (an all-zero channel gets scale 1). Per-channel formats only: block
    formats come quantized in their checkpoints."""
    w32 = weight.astype(jnp.float32)
    largest = jnp.max(jnp.abs(w32), axis=-1)  # f32[..., out]
    scale = jnp.where(largest > 0, largest / fmt.max_value, 1.0)  # f32[..., out]
    scaled = w32 / scale[..., None]
    if fmt.rounds:
        scaled = jnp.round(scaled)
    return jnp.clip(scaled, -fmt.max_value, fmt.max_value).astype(fmt.dtype), scale


def dequantize(q: jax.Array, scale: jax.Array, dtype, block: tuple[int, int] | None = None,
               zero_point: jax.Array | None = None) -> jax.Array:
    """The weight q[..., out, in] stands for, in `dtype`: times scale f32[..., out] per output channel, or, with
    `block` = (rows, columns), times scale f32[..., out blocks, in blocks] over each block; less its zero point
    (of the scale's shape) first, where one is given."""
    values = q.astype(jnp.float32)
    if zero_point is not None:
        values = values - _scale_per_weight(zero_point.astype(jnp.float32), block, q.shape[-2:])
    return (values * _scale_per_weight(scale, block, q.shape[-2:])).astype(dtype)


def _scale_per_weight(scale: jax.Array, block: tuple[int, int] | None, shape: tuple[int, int]) -> jax.Array:
    """f32[..., out, 1] of per-channel scales, or f32[..., out, in] with each block's scale repeated over the block
    (cut at the weight's edge, where the last blocks are partial)."""
    if block is None:
        return scale[..., None]
    rows, columns = block
    repeated = jnp.repeat(jnp.repeat(scale, rows, axis=-2), columns, axis=-1)  # f32[..., >= out, >= in]
    return repeated[..., :shape[0], :shape[1]]


def scaled_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, block: tuple[int, int] | None = None,
                  zero_point: jax.Array | None = None) -> jax.Array:  # f[..., out]
    """x f[..., in] @ (q * scale).T, accumulated in float32. Per channel: the matmul on q cast to x's dtype, then the
    output channels scaled; with `block` or zero points: the weight dequantized into x's dtype, then the matmul."""
    if block is not None or zero_point is not None:
        weight = dequantize(q, scale, x.dtype, block, zero_point)  # f[out, in]
        return jnp.einsum("...i,oi->...o", x, weight, preferred_element_type=jnp.float32).astype(x.dtype)
    y = jnp.einsum("...i,oi->...o", x, q.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scale).astype(x.dtype)


def quantizes_activations(fmt: WeightFormat | None, rows: int) -> bool:
    """Whether a step of `rows` tokens quantizes its projections' activations (W8A8) in format `fmt` (None: the
    weights are not quantized)."""
    return fmt is not None and fmt.quantizes_activations and rows > IN_PLACE_MAX_ROWS


def quantize_activations(x: jax.Array, fmt: WeightFormat,
                         input_scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(xq f8[..., in], scale f32[..., 1] or f32[1]) with x ≈ xq * scale: one scale per token (each row's largest
    magnitude onto the format's largest value), or the given static per-tensor `input_scale` f32[1]."""
    x32 = x.astype(jnp.float32)
    if input_scale is None:
        largest = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)  # f32[..., 1]
        scale = jnp.maximum(largest / fmt.max_value, _MIN_TOKEN_SCALE_FACTOR / fmt.max_value)
    else:
        scale = input_scale.astype(jnp.float32)
    return jnp.clip(x32 / scale, -fmt.max_value, fmt.max_value).astype(fmt.dtype), scale


def w8a8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, fmt: WeightFormat,
                input_scale: jax.Array | None = None) -> jax.Array:  # f[..., out]
    """x f[..., in] @ (q * scale).T with x quantized to float8 first (`quantize_activations`): one f8 x f8 GEMM
    accumulating in float32 (what XLA:GPU gives cuBLASLt's FP8 GEMM), then the token and channel scales."""
    xq, x_scale = quantize_activations(x, fmt, input_scale)
    y = jnp.einsum("...i,oi->...o", xq, q, preferred_element_type=jnp.float32)
    return (y * x_scale * scale).astype(x.dtype)


def w8a8_reference(x: jax.Array, q: jax.Array, scale: jax.Array, fmt: WeightFormat,
                   input_scale: jax.Array | None = None) -> jax.Array:  # f[..., out]
    """`w8a8_matmul` the plain way: both operands dequantized to float32, multiplied at full precision."""
    xq, x_scale = quantize_activations(x, fmt, input_scale)
    activations = xq.astype(jnp.float32) * x_scale
    weight = dequantize(q, scale, jnp.float32)
    y = jnp.einsum("...i,oi->...o", activations, weight, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)


def reads_in_place(stacked_gemm: str, rows: int, fmt: WeightFormat | None = None) -> bool:
    """Whether a step of `rows` tokens multiplies by its quantized weights (in format `fmt`) on the whole stacks
    (the Pallas kernels): decode steps, or every step where the weights are packed 4-bit (which XLA would widen)."""
    if stacked_gemm not in STACKED_GEMMS:
        raise ValueError(f"stacked_gemm must be one of {', '.join(STACKED_GEMMS)}, got {stacked_gemm!r}")
    packed = fmt is not None and fmt.packs_int4
    return stacked_gemm != XLA_GEMM and (packed or rows <= IN_PLACE_MAX_ROWS)


def is_stacked_quantized_weight(path: tuple, variable) -> bool:
    """An nnx filter: a quantized projection's weight or scales, which a step reading in place keeps out of the scan."""
    return path[-1] in ("weight_scale", "weight_zero_point") or (
        path[-1] == "weight" and variable.get_value().dtype in QUANTIZED_DTYPES)
