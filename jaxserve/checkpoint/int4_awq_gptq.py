"""AutoAWQ (GEMM) and GPTQ (v1 and v2) 4-bit checkpoints, read as downloaded into the canonical 4-bit form
(int4_layout.py), as vLLM reads them.

Per decoder projection (K = in, N = out features, g = group size, G = ceil(K / g); unsigned 4-bit values 0..15):
  - AutoAWQ GEMM (`quant_method: awq`, `version: gemm`): `qweight` I32 [K, N/8] packed along N with AWQ's interleave
    (nibble i of word c holds column 8c + [0,2,4,6,1,3,5,7][i]); `qzeros` I32 [G, N/8] the same way; `scales` [G, N];
    weight[n, k] = (q[k, n] - zero[k // g, n]) * scale[k // g, n].
  - GPTQ (`quant_method: gptq`): `qweight` I32 [K/8, N] packed along K in order (nibble i of word r is row 8r + i);
    `qzeros` I32 [G, N/8] packed along N in order; `scales` [G, N]; `g_idx` I32 [K], each input feature's group.
    The v1 format (`checkpoint_format: gptq`, the default) stores each zero point less one, subtracted from the
    packed word as a whole (0x11111111 for eight nibbles, borrowing across them): it is added back to the word before
    unpacking. A symmetric checkpoint's zero points are 8 by definition and not read.
Act-order GPTQ checkpoints (desc_act: a g_idx that is not k // g, each group still g features) have each weight's
columns sorted by group as they are read, and keep the sorting permutation (`weight_perm`) to gather the activations
into the same order. Other AWQ versions (gemv, gemv_fast, marlin), per-module overrides (`dynamic`), a quantized
lm_head, uneven act-order groups and widths other than 4 bits are refused by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxserve.checkpoint.int4_layout import (AWQ_ORDER, INT32, PER_WORD, Int4Quantization, packed, signed,
                                             sorted_columns, unpack_int4)
from jaxserve.checkpoint.param_tree import TensorTarget, UnreadTensors
from jaxserve.errors import UnsupportedModelError
from jaxserve.model.quantization import WeightFormat, scale_shape

AWQ, GPTQ = "awq", "gptq"
METHODS = (AWQ, GPTQ)
_GPTQ_FORMATS = {"gptq": "v1", "gptq_v2": "v2"}
_V1_ZERO_OFFSET = np.uint32(0x11111111)  # what v1 subtracted from each packed word of zero points
_WEIGHT = ".weight"
_QWEIGHT, _QZEROS, _SCALES, _G_IDX = ".qweight", ".qzeros", ".scales", ".g_idx"


def quantization(config: Mapping[str, Any]) -> Int4Quantization:
    """The scheme of an AWQ or GPTQ quantization_config after checking that jaxserve runs it; UnsupportedModelError
    naming the setting for any other."""
    method = config.get("quant_method")
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise UnsupportedModelError(f"{method} checkpoints with bits {bits!r} are not supported: jaxserve loads 4-bit "
                                    f"ones")
    group_size = _group_size(config.get("group_size", config.get("q_group_size", 128)))
    if method == AWQ:
        return _awq(config, group_size)
    return _gptq(config, group_size)


def _group_size(value: Any) -> int | None:
    if value == -1:
        return None
    if not isinstance(value, int) or value <= 0:
        raise UnsupportedModelError(f"quantization_config.group_size must be a positive integer or -1 (per channel), "
                                    f"got {value!r}")
    return value


def _awq(config: Mapping[str, Any], group_size: int | None) -> Int4Quantization:
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise UnsupportedModelError(f"AWQ checkpoints of version {version!r} are not supported: jaxserve loads AutoAWQ "
                                    f"GEMM ones (version 'gemm')")
    if not config.get("zero_point", True):
        raise UnsupportedModelError("AWQ checkpoints without zero points (zero_point false) are not supported")
    skipped = tuple(config.get("modules_to_not_convert") or ())
    return Int4Quantization(method=AWQ, variant="GEMM", group_size=group_size, symmetric=False,
                            unquantized_reason=lambda module: next(
                                (f"quantization_config.modules_to_not_convert lists {entry!r}"
                                 for entry in skipped if entry in module), None))


def _gptq(config: Mapping[str, Any], group_size: int | None) -> Int4Quantization:
    stored_format = config.get("checkpoint_format", "gptq")
    if stored_format not in _GPTQ_FORMATS:
        raise UnsupportedModelError(f"GPTQ checkpoint_format {stored_format!r} is not supported "
                                    f"({', '.join(_GPTQ_FORMATS)})")
    if config.get("dynamic"):
        raise UnsupportedModelError("GPTQ checkpoints with per-module overrides (quantization_config.dynamic) are not "
                                    "supported")
    if config.get("lm_head"):
        raise UnsupportedModelError("GPTQ checkpoints with a quantized lm_head (lm_head true) are not supported")
    listed = config.get("modules_in_block_to_quantize")
    names = tuple(name for names in listed or () for name in names)
    return Int4Quantization(method=GPTQ, variant=_GPTQ_FORMATS[stored_format], group_size=group_size,
                            symmetric=bool(config.get("sym", True)), g_idx_suffix=_G_IDX,
                            unquantized_reason=lambda module: None if listed is None or any(
                                module.endswith("." + name) for name in names)
                            else "quantization_config.modules_in_block_to_quantize leaves it out")


def targets(weight: TensorTarget, scale: TensorTarget, zero: TensorTarget | None, fmt: WeightFormat,
            quantization: Int4Quantization,
            orders: Mapping[str, np.ndarray | None]) -> tuple[TensorTarget, TensorTarget, TensorTarget | None]:
    """(weight, scale, zero point or None) targets of one projection, read from its qweight, scales and qzeros; an
    act-order GPTQ weight's columns sorted by group as they are read (`orders`: group_orders)."""
    out_features, in_features = weight.stored_shape
    modules = tuple(source.removesuffix(_WEIGHT) for source in weight.sources)
    groups = scale_shape(fmt, out_features, in_features)[1:] or (1,)  # (G,), or (1,) per channel
    placed_scale = (out_features, *scale_shape(fmt, out_features, in_features)[1:])
    awq = quantization.method == AWQ
    if awq:
        stored = (in_features, -(-out_features // PER_WORD))
        convert = lambda words: packed(signed(unpack_int4(words, out_features, 1, AWQ_ORDER)).T)  # noqa: E731
    else:
        stored = (-(-in_features // PER_WORD), out_features)
        convert = lambda words: packed(signed(unpack_int4(words, in_features, 0)).T)  # noqa: E731
    weights = dataclasses.replace(weight, sources=tuple(m + _QWEIGHT for m in modules), stored_shape=stored,
                                 stored_dtype=INT32, convert=convert)
    if any(orders.get(source) is not None for source in weight.sources):
        weights = dataclasses.replace(weights, convert=None, source_converts=tuple(
            sorted_columns(lambda words: signed(unpack_int4(words, in_features, 0)).T, orders[source])
            for source in weight.sources))
    scales = dataclasses.replace(scale, sources=tuple(m + _SCALES for m in modules),
                                 stored_shape=(*groups, out_features), stored_rows=weight.stored_rows,
                                 convert=lambda values: np.reshape(values.T, placed_scale))
    if zero is None:
        return weights, scales, None
    order = AWQ_ORDER if awq else tuple(range(PER_WORD))
    v1 = quantization.method == GPTQ and quantization.variant == "v1"
    zeros = dataclasses.replace(
        zero, sources=tuple(m + _QZEROS for m in modules), stored_shape=(*groups, -(-out_features // PER_WORD)),
        stored_dtype=INT32, stored_rows=weight.stored_rows,
        convert=lambda words: np.reshape(signed(unpack_zero_points(words, out_features, order, v1)).T, placed_scale))
    return weights, scales, zeros


def unpack_zero_points(words: np.ndarray, count: int, order: tuple[int, ...], v1: bool) -> np.ndarray:
    """u8[G, count] zero points of qzeros I32 [G, ceil(count/8)]; `v1`: GPTQ v1's words, each stored less
    0x11111111, which is added back to the whole word (a zero point of 0 was stored as 15, borrowing from the next)."""
    if v1:
        words = (np.asarray(words, np.int32).view(np.uint32) + _V1_ZERO_OFFSET).view(np.int32)
    return unpack_int4(words, count, 1, order)


def unread_tensors(quantization: Int4Quantization) -> UnreadTensors:
    """GPTQ's g_idx where no weight_perm reads it (read apart: int4_layout.group_orders), and a symmetric
    checkpoint's zero points."""
    if quantization.method != GPTQ:
        return UnreadTensors()
    return UnreadTensors(dropped_suffixes=(*(() if quantization.act_order else (_G_IDX,)),
                                           *((_QZEROS,) if quantization.symmetric else ())))
