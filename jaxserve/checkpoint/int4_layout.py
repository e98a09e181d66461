"""What every 4-bit (W4A16) checkpoint reader shares: the scheme read from config.json, and the unpacking of int32
words into 4-bit values.

Three layouts store the same thing (../int4_checkpoint.py: compressed-tensors; int4_awq_gptq.py: AutoAWQ GEMM and
GPTQ): 4-bit weights, one scale per group of input features (or per output channel) and, where asymmetric, one zero
point per scale, with weight = (q - zero) * scale. Each reader turns its files into the model's canonical form
(model/quantization.py `int4_format`): `weight` u8 [N, packed_width(K)] holding q - 8 packed two a byte
(`pack_int4`), `weight_scale` f32 [N, G] (per channel: [N]), and `weight_zero_point` int8 of the scale's shape
holding zero - 8, so that (q - 8) - (zero - 8) = q - zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import numpy as np

from jaxserve.checkpoint.param_tree import TensorTarget
from jaxserve.checkpoint.quantized_checkpoint import UnquantizedReason
from jaxserve.checkpoint.safetensors_loader import read_small_tensors
from jaxserve.errors import ConfigError, ModelLoadError, UnsupportedModelError
from jaxserve.model.quantization import PACK_COLUMNS, WeightFormat, int4_format, pack_int4

PER_WORD = 8  # 4-bit values in one int32 word
OFFSET = 8  # unsigned 4-bit values 0..15 stand for signed -8..7
INT32 = np.dtype(np.int32)
# AutoAWQ's interleave: nibble i of a word holds output column 8c + AWQ_ORDER[i] of word c
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SEQUENTIAL_ORDER = tuple(range(PER_WORD))


@dataclasses.dataclass(frozen=True)
class Int4Quantization:
    """How a 4-bit checkpoint stores the decoder's projections, from its config."""

    method: str  # whose layout the files have: "compressed-tensors", "awq" or "gptq"
    variant: str  # the layout's own name, for the start-up line: "pack-quantized", "GEMM", "v1", "v2"
    group_size: int | None  # input features per scale; None: one scale per output channel
    symmetric: bool  # no zero points: weight = (q - 8) * scale
    unquantized_reason: UnquantizedReason  # which modules the config leaves unquantized, and why
    kv_cache_scales: bool = False  # 4-bit checkpoints with KV-cache scales are refused
    act_order: bool = False  # some projection's groups are not consecutive features (GPTQ desc_act): sorted at load
    # The tensor beside each projection's weights naming each input feature's group (GPTQ's `.g_idx`,
    # compressed-tensors' `.weight_g_idx` under actorder group); None: the checkpoint stores none
    g_idx_suffix: str | None = None

    @property
    def weight_format(self) -> WeightFormat:
        return int4_format(self.group_size, zero_points=not self.symmetric, act_order=self.act_order)

    @property
    def name(self) -> str:
        """What runs, for the start-up line: "int4 (gptq v2 W4A16, group 128, asymmetric, zero points)"."""
        scales = "per-channel" if self.group_size is None else f"group {self.group_size}"
        kind = "symmetric" if self.symmetric else "asymmetric, zero points"
        return f"int4 ({self.method} {self.variant} W4A16, {scales}, {kind}{', act-order' if self.act_order else ''})"


def unpack_int4(words: np.ndarray, count: int, axis: int, order: tuple[int, ...] = SEQUENTIAL_ORDER) -> np.ndarray:
    """int8 values 0..15 of int32 `words` holding eight 4-bit values each along `axis`, lowest bits first, nibble i
    of word c holding value 8c + order[i] (AWQ interleaves); the first `count` of them along that axis."""
    moved = np.moveaxis(np.asarray(words, np.int32).view(np.uint32), axis, -1)  # u32[..., words]
    shifts = np.arange(PER_WORD, dtype=np.uint32) * 4
    nibbles = (moved[..., None] >> shifts) & 0xF  # u32[..., words, 8]: nibble i of each word
    in_order = np.empty_like(nibbles)
    in_order[..., list(order)] = nibbles  # value order[i] of each word is nibble i
    values = in_order.reshape(*moved.shape[:-1], -1)[..., :count].astype(np.int8)
    return np.moveaxis(values, -1, axis)


def signed(values: np.ndarray) -> np.ndarray:
    """Unsigned 4-bit values 0..15 as the signed -8..7 an int4 array holds."""
    return (values - OFFSET).astype(np.int8)


def unpacked(count: int, axis: int, order: tuple[int, ...] = SEQUENTIAL_ORDER,
             then: Callable[[np.ndarray], np.ndarray] = signed) -> Callable[[np.ndarray], np.ndarray]:
    """A target's host transform: the words unpacked (`unpack_int4`), then `then` (signed values by default)."""
    return lambda words: then(unpack_int4(words, count, axis, order))


def packed(values: np.ndarray) -> np.ndarray:
    """Signed 4-bit values i8[N, K] in the model's packed layout u8[N, packed_width(K)]."""
    return pack_int4(np.ascontiguousarray(values))


def check_whole_groups_per_device(name: str, placed: jax.ShapeDtypeStruct, in_features: int,
                                  group_size: int | None) -> None:
    """ConfigError unless tensor parallelism gives each device of a row-parallel packed weight u8[..., out, packed]
    whole groups of its `in_features` input features, and whole packed blocks."""
    width = placed.shape[-1]
    share = placed.sharding.shard_shape(placed.shape)[-1]
    if share == width:
        return
    for unit, what in ((group_size, f"the checkpoint's groups of {group_size} columns"),
                       (PACK_COLUMNS, f"the {PACK_COLUMNS}-column blocks its 4-bit weights are packed in")):
        if unit is not None and (2 * share) % unit:
            raise ConfigError(f"tensor parallelism gives each device {2 * share} of the {in_features} columns of "
                              f"{name}, not a whole number of {what}: choose a tensor_parallel_size that splits it "
                              f"into whole {'groups' if unit == group_size else 'blocks'}")


def group_orders(model_dir: Path, weights: Mapping[str, TensorTarget],
                 quantization: Int4Quantization) -> dict[str, np.ndarray | None]:
    """Checkpoint weight name -> the permutation i32[K] that sorts its input features by group (a stable sort of its
    g_idx), or None where g_idx is k // group_size already; read at plan time. Act-order checkpoints (GPTQ desc_act,
    compressed-tensors actorder group) have permutations; each of their groups must hold group_size features.
    ModelLoadError for a missing or misshapen g_idx, UnsupportedModelError for uneven groups. `weights` are the
    quantized projections' weight targets in the model's layout (sources `<module>.weight`, stored shape (N, K));
    {} where the checkpoint stores no g_idx."""
    if quantization.g_idx_suffix is None:
        return {}
    expected = {source: target.stored_shape[1] for target in weights.values() for source in target.sources}
    found = read_small_tensors(model_dir, [_g_idx_name(source, quantization) for source in expected])
    orders = {}
    for source, in_features in expected.items():
        name = _g_idx_name(source, quantization)
        if name not in found:
            raise ModelLoadError(f"{model_dir} lacks tensor {name} (the checkpoint stores each projection's g_idx)")
        g_idx = found[name]
        if g_idx.shape != (in_features,):
            raise ModelLoadError(f"tensor {name} has shape {list(g_idx.shape)}; the config implies [{in_features}]")
        in_order = np.arange(in_features) // (quantization.group_size or in_features)
        order = sorted_g_idx(g_idx)
        if not np.array_equal(g_idx[order], in_order):
            raise UnsupportedModelError(f"{name} does not give every group {quantization.group_size} input features: "
                                        f"jaxserve runs act-order checkpoints whose groups are all full")
        orders[source] = None if np.array_equal(g_idx, in_order) else order
    return orders


def sorted_g_idx(g_idx: np.ndarray) -> np.ndarray:
    """i32[K]: the input feature each stored column holds once an act-order weight's columns are sorted by group."""
    return np.argsort(np.asarray(g_idx), kind="stable").astype(np.int32)


def sorted_columns(values_of: Callable[[np.ndarray], np.ndarray],
                   order: np.ndarray | None) -> Callable[[np.ndarray], np.ndarray]:
    """A weight's transform: its signed values i8[N, K] (`values_of` the stored words), columns put in `order` (None:
    as stored), packed."""
    return lambda words: packed(values_of(words) if order is None else values_of(words)[:, order])


def permutation_target(weight: TensorTarget, target: TensorTarget, quantization: Int4Quantization) -> TensorTarget:
    """An act-order projection's `weight_perm` i32[L, K], read from its g_idx (sorted_g_idx)."""
    return dataclasses.replace(target, sources=tuple(_g_idx_name(source, quantization) for source in weight.sources),
                               stored_shape=(weight.stored_shape[1],), stored_dtype=INT32, convert=sorted_g_idx)


def _g_idx_name(weight_source: str, quantization: Int4Quantization) -> str:
    return weight_source.removesuffix(".weight") + quantization.g_idx_suffix
