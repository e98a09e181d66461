"""Pre-quantized 4-bit (W4A16) checkpoints loaded as they are, read into the model's canonical 4-bit form
(int4_layout.py): which format a quantization_config names (AutoAWQ and GPTQ: int4_awq_gptq.py), and
compressed-tensors `pack-quantized` (the `...quantized.w4a16` repositories llm-compressor writes).

The files, as compressed-tensors' pack-quantized compressor writes each decoder projection (K = in, N = out
features, g = group size, G = ceil(K / g)):
  - `weight_packed` I32 [N, ceil(K/8)]: eight 4-bit values per word along K, lowest bits first, each stored as its
    value + 8 (signed -8..7 kept as 0..15);
  - `weight_scale` (the model's float dtype) [N, G] per group, [N, 1] per channel;
  - `weight_zero_point` I32 [ceil(N/8), G] (or [ceil(N/8), 1]), packed the same way along N: asymmetric schemes only;
  - `weight_shape` I64 [2] = (N, K), which the config already gives: not read.
The weight is (q - zero) * scale, each scale and zero covering g consecutive input features of one output channel.

The canonical form (model/quantization.py `int4_format`): `weight` int4 [N, K], `weight_scale` f32 [N, G] (per
channel: [N]), `weight_zero_point` int8 of the scale's shape where asymmetric, unpacked on the host as each tensor is
read. Under tensor parallelism the scales and zero points split with their weight's rows or groups; a row-parallel
projection whose input features would split a group across devices is refused, naming the sizes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxserve.checkpoint import int4_awq_gptq
from jaxserve.checkpoint.int4_layout import (INT32, PER_WORD, Int4Quantization, check_whole_groups_per_device,
                                             packed, permutation_target, signed, sorted_columns, unpacked)
from jaxserve.checkpoint.param_tree import TensorTarget, UnreadTensors
from jaxserve.checkpoint.quantized_checkpoint import COMPRESSED_TENSORS, check_quantized, ct_scheme, ct_unquantized
from jaxserve.errors import UnsupportedModelError
from jaxserve.model.quantization import (PERMUTATION_SUFFIX, SCALE_SUFFIX, ZERO_POINT_SUFFIX, WeightFormat,
                                         scale_shape)

PACK_QUANTIZED = "pack-quantized"
_WEIGHT = ".weight"
_PACKED, _SHAPE = "_packed", "_shape"  # `...weight_packed` and `...weight_shape` beside `...weight_scale`
_G_IDX = ".weight_g_idx"  # each input feature's group, under actorder "group"
_STRATEGIES = ("group", "channel")


def is_int4_checkpoint(config: Any) -> bool:
    """Whether a quantization_config describes 4-bit weights: AWQ, GPTQ or compressed-tensors pack-quantized."""
    if isinstance(config, Mapping) and config.get("quant_method") in int4_awq_gptq.METHODS:
        return True
    return is_pack_quantized(config)


def is_pack_quantized(config: Any) -> bool:
    """Whether config.json's quantization_config describes compressed-tensors packed (4-bit) weights."""
    if not isinstance(config, Mapping) or config.get("quant_method") != COMPRESSED_TENSORS:
        return False
    groups = config.get("config_groups") or {}
    formats = [config.get("format")] + [group.get("format") for group in groups.values() if isinstance(group, Mapping)]
    return PACK_QUANTIZED in formats


def int4_quantization(config: Mapping[str, Any]) -> Int4Quantization:
    """The scheme of a 4-bit quantization_config (`is_int4_checkpoint`) after checking that jaxserve runs it:
    `UnsupportedModelError` naming the setting for any other."""
    if config.get("quant_method") in int4_awq_gptq.METHODS:
        return int4_awq_gptq.quantization(config)
    return _pack_quantized(config)


def _pack_quantized(config: Mapping[str, Any]) -> Int4Quantization:
    """A compressed-tensors pack-quantized scheme: one 4-bit integer weight scheme for every config group."""
    groups = config.get("config_groups") or {}
    if not isinstance(groups, Mapping) or not groups:
        raise UnsupportedModelError("compressed-tensors quantization_config has no config_groups")
    schemes = {name: ct_scheme(name, group) for name, group in groups.items()}
    formats = {group.get("format") or config.get("format") for group in groups.values()}
    if formats != {PACK_QUANTIZED} or len({repr(scheme) for scheme in schemes.values()}) != 1:
        raise UnsupportedModelError(
            f"compressed-tensors config groups {', '.join(groups)} quantize differently (formats "
            f"{sorted(map(str, formats))}); jaxserve runs every decoder projection in one format")
    weights, inputs, outputs = next(iter(schemes.values()))
    if inputs is not None or outputs is not None:
        raise UnsupportedModelError("compressed-tensors pack-quantized checkpoints with input_activations or "
                                    "output_activations (W4A8) are not supported: weight-only (W4A16) ones are")
    if (config.get("sparsity_config") or {}).get("format", "dense") != "dense" or config.get("transform_config"):
        raise UnsupportedModelError("compressed-tensors sparsity and transform configs are not supported with 4-bit "
                                    "weights")
    if config.get("kv_cache_scheme") is not None:
        raise UnsupportedModelError("compressed-tensors 4-bit checkpoints with a kv_cache_scheme are not supported")
    group_size, symmetric = _weights(weights)
    targets = tuple(target for group in groups.values() for target in group.get("targets") or ())
    # actorder "group" stores each projection's weight_g_idx (its groups in activation order); "weight" and
    # "static" reorder while quantizing but store plain groups
    act_ordered = weights.get("actorder") == "group" and group_size is not None
    return Int4Quantization(method=COMPRESSED_TENSORS, variant=PACK_QUANTIZED, group_size=group_size,
                            symmetric=symmetric, g_idx_suffix=_G_IDX if act_ordered else None,
                            unquantized_reason=functools.partial(ct_unquantized, targets,
                                                                 tuple(config.get("ignore") or ())))


def _weights(weights: Mapping[str, Any]) -> tuple[int | None, bool]:
    """(group size or None per channel, symmetric) of a 4-bit integer, static weight scheme."""
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if kind != "int" or bits != 4:
        raise UnsupportedModelError(
            f"compressed-tensors pack-quantized weights of type {kind!r} with num_bits {bits!r} are not supported: "
            f"jaxserve loads 4-bit integer ones (W4A16)")
    if strategy not in _STRATEGIES:
        raise UnsupportedModelError(f"compressed-tensors 4-bit weight strategy {strategy!r} is not supported "
                                    f"({', '.join(_STRATEGIES)})")
    if weights.get("dynamic", False):
        raise UnsupportedModelError("compressed-tensors 4-bit weights must be static (scales stored)")
    if strategy == "channel":
        return None, bool(weights.get("symmetric", True))
    group_size = weights.get("group_size")
    if not isinstance(group_size, int) or group_size <= 0:
        raise UnsupportedModelError(f"compressed-tensors quantization_config weights.group_size must be a positive "
                                    f"integer for the group strategy, got {group_size!r}")
    return group_size, bool(weights.get("symmetric", True))


def int4_targets(targets: Mapping[str, TensorTarget], quantization: Int4Quantization,
                 orders: Mapping[str, Any] | None = None) -> dict[str, TensorTarget]:
    """`targets` of the model's 4-bit layout with each projection's weight, scales and zero points (and an
    act-order one's permutation) read from the checkpoint's packed tensors; `orders`: int4_awq_gptq.group_orders.
    UnsupportedModelError where the config leaves a decoder projection unquantized, ConfigError where tensor
    parallelism would split a group."""
    out = dict(targets)
    fmt = quantization.weight_format
    for name, target in targets.items():
        if not name.endswith(_WEIGHT + SCALE_SUFFIX):
            continue
        weight_name = name.removesuffix(SCALE_SUFFIX)
        weight = targets[weight_name]
        check_quantized(weight, quantization.unquantized_reason)
        check_whole_groups_per_device(weight_name, weight.placed, weight.stored_shape[1], quantization.group_size)
        zero_name = weight_name + ZERO_POINT_SUFFIX
        zero = targets.get(zero_name)
        if quantization.method == COMPRESSED_TENSORS:
            out[weight_name], out[name], zero = _packed_targets(weight, target, zero, fmt, orders or {})
        else:
            out[weight_name], out[name], zero = int4_awq_gptq.targets(weight, target, zero, fmt, quantization,
                                                                      orders or {})
        if zero is not None:
            out[zero_name] = zero
        if fmt.act_order:
            out[weight_name + PERMUTATION_SUFFIX] = permutation_target(
                weight, targets[weight_name + PERMUTATION_SUFFIX], quantization)
    return out


def unread_tensors(quantization: Int4Quantization) -> UnreadTensors:
    """The checkpoint's tensors no parameter reads: compressed-tensors' `weight_shape`, which the config implies;
    GPTQ's g_idx and a symmetric one's zero points."""
    if quantization.method != COMPRESSED_TENSORS:
        return int4_awq_gptq.unread_tensors(quantization)
    g_idx = (_G_IDX,) if quantization.g_idx_suffix is not None and not quantization.act_order else ()
    return UnreadTensors(dropped_suffixes=(_WEIGHT + _SHAPE, *g_idx))


def _packed_targets(weight: TensorTarget, scale: TensorTarget, zero: TensorTarget | None, fmt: WeightFormat,
                    orders: Mapping[str, Any]) -> tuple[TensorTarget, TensorTarget, TensorTarget | None]:
    """(weight, scale, zero point or None) targets of one pack-quantized projection: the weight read from
    `weight_packed` I32 [N, ceil(K/8)], unpacked on the host (an act-order one's columns sorted by group) and packed
    the model's way."""
    out_features, in_features = weight.stored_shape
    packed_weight = dataclasses.replace(
        weight, sources=tuple(source + _PACKED for source in weight.sources),
        stored_shape=(out_features, -(-in_features // PER_WORD)), stored_dtype=INT32,
        convert=unpacked(in_features, axis=1, then=lambda values: packed(signed(values))))
    if any(orders.get(source) is not None for source in weight.sources):
        values_of = unpacked(in_features, axis=1)
        packed_weight = dataclasses.replace(packed_weight, convert=None, source_converts=tuple(
            sorted_columns(values_of, orders[source]) for source in weight.sources))
    return (packed_weight, _scale_target(weight, scale, fmt, SCALE_SUFFIX),
            None if zero is None else _scale_target(weight, zero, fmt, ZERO_POINT_SUFFIX))


def _scale_target(weight: TensorTarget, target: TensorTarget, fmt: WeightFormat, suffix: str) -> TensorTarget:
    """The scales (float [N, G] or [N, 1]) or zero points (I32 [ceil(N/8), G], packed along N) of one projection,
    read into f32 / int8 [N, G], or [N] per channel, with the weight's rows."""
    out_features, in_features = weight.stored_shape
    groups = scale_shape(fmt, out_features, in_features)[1:] or (1,)  # (G,), or (1,) per channel
    placed_shape = (out_features, *scale_shape(fmt, out_features, in_features)[1:])
    sources = tuple(source + suffix for source in weight.sources)
    if suffix == SCALE_SUFFIX:
        return dataclasses.replace(target, sources=sources, stored_shape=(out_features, *groups),
                                   convert=functools.partial(np.reshape, shape=placed_shape),
                                   stored_rows=weight.stored_rows)
    unpack = unpacked(out_features, axis=0)
    return dataclasses.replace(target, sources=sources, stored_shape=(-(-out_features // PER_WORD), *groups),
                               stored_dtype=INT32, stored_rows=weight.stored_rows,
                               convert=lambda words: np.reshape(unpack(words), placed_shape))

