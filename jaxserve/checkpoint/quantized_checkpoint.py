"""Pre-quantized FP8 checkpoints, loaded as they are: config.json's `quantization_config` read and checked, and the
tensor targets that read each decoder projection's float8 weight and its scales into the model's quantized layout.

Two formats, as vLLM loads them:
  - compressed-tensors (`quant_method: compressed-tensors`, format `float-quantized` or `naive-quantized`; the
    `...-FP8` and `...-FP8-dynamic` repositories llm-compressor writes): `<projection>.weight` F8_E4M3 [out, in] and
    `<projection>.weight_scale` (F32 or BF16) of shape [1] per tensor, [out, 1] per output channel, or
    [ceil(out/rows), ceil(in/columns)] per block; plus `<projection>.input_scale` [1] where activations are static.
  - transformers' fine-grained fp8 (`quant_method: fp8` with `weight_block_size`; Qwen3-*-FP8 and DeepSeek-V3
    style): `<projection>.weight` F8_E4M3 [out, in] and `<projection>.weight_scale_inv` F32 [ceil(out/rows),
    ceil(in/columns)], which despite its name multiplies.
Either way the weight is q * scale. A per-tensor scale is a per-channel one with every channel alike, so per-tensor
and per-channel checkpoints run as model/quantization.py's per-output-channel fp8 format, exactly (the scale is
broadcast or reshaped on the host as it is read); block scales run as its block-scaled format.

Activations run as the checkpoint's scheme says, in prefill and mixed steps (model/quantization.py): a dynamic
scheme (FP8_DYNAMIC) quantizes each token's activations with a scale of its own, a static one (FP8) by each
projection's calibrated `input_scale` [1] (read as the projection's `input_scale` parameter), and a weight-only
scheme (no `input_activations`) or a block-scaled checkpoint keeps bf16 activations (W8A16), as decode steps always
do. A `kv_cache_scheme`'s per-layer KV-cache scales (`self_attn.k_scale` / `v_scale`, or the older
`k_proj.output_scale` / `v_proj.output_scale`) are no weights: `kv_cache_scales` reads them at plan time for a
float8 KV pool (--kv-cache-dtype fp8), as vLLM uses them; a pool in the activations' dtype ignores them.

Every decoder projection must be quantized alike; lm_head and the embeddings stay unquantized, as these
checkpoints leave them.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.checkpoint.param_tree import TensorTarget, UnreadTensors
from jaxserve.checkpoint.safetensors_loader import read_scalars
from jaxserve.errors import ConfigError, ModelLoadError, UnsupportedModelError
from jaxserve.model.quantization import (DYNAMIC_ACTIVATIONS, SCALE_SUFFIX, STATIC_ACTIVATIONS, WEIGHT_FORMATS,
                                         WeightFormat, scale_shape)

COMPRESSED_TENSORS = "compressed-tensors"
FINE_GRAINED_FP8 = "fp8"
_CT_FORMATS = ("float-quantized", "naive-quantized")  # float8 tensors stored as they are, unpacked
_CT_STRATEGIES = ("tensor", "channel", "block")
_WEIGHT = ".weight"
# KV-cache scales of a kv_cache_scheme, read apart from the weights: per attention layer (K, V), and the older
# names on k_proj/v_proj.
KV_CACHE_SCALE_NAMES = ((".self_attn.k_scale", ".self_attn.v_scale"),
                        (".self_attn.k_proj.output_scale", ".self_attn.v_proj.output_scale"))
KV_CACHE_SCALE_SUFFIXES = tuple(suffix for names in KV_CACHE_SCALE_NAMES for suffix in names)
# The class name compressed-tensors `targets` and `ignore` use for every linear layer.
_LINEAR_CLASS = "Linear"

# Module name -> why the checkpoint leaves that module unquantized, or None where it quantizes it.
UnquantizedReason = Callable[[str], str | None]


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """How a pre-quantized checkpoint stores the decoder's projections, from its config.json."""

    method: str  # quant_method: COMPRESSED_TENSORS or FINE_GRAINED_FP8
    strategy: str  # granularity of the weight scales: "tensor", "channel" or "block"
    block: tuple[int, int] | None  # (rows, columns) one scale covers for the block strategy; else None
    scale_name: str  # the scale tensor's name beside each projection's `weight`: weight_scale or weight_scale_inv
    # How prefill steps quantize activations: STATIC_ACTIVATIONS (each projection stores `input_scale` f32[1]),
    # DYNAMIC_ACTIVATIONS (per token, in the step) or None (weight-only)
    activations: str | None
    kv_cache_scales: bool  # the attention layers store KV-cache scales (kv_cache_scales reads them)
    unquantized_reason: UnquantizedReason  # which modules the config leaves unquantized, and why

    @property
    def weight_format(self) -> WeightFormat:
        """The format the projections run in: fp8 per output channel, or block-scaled."""
        return dataclasses.replace(WEIGHT_FORMATS["fp8"], block=self.block, activations=self.activations)

    @property
    def name(self) -> str:
        """What runs, for the start-up line: e.g. "fp8 (compressed-tensors, per-channel scales)"."""
        scales = f"{self.block[0]}x{self.block[1]} block" if self.block else f"per-{self.strategy}"
        w8a8 = f"; prefill W8A8, {self.activations} activations" if self.weight_format.quantizes_activations else ""
        return f"fp8 ({'transformers fp8' if self.method == FINE_GRAINED_FP8 else self.method}, {scales} scales{w8a8})"


def checkpoint_quantization(config: Any) -> CheckpointQuantization | None:
    """The scheme config.json's `quantization_config` (None: an unquantized checkpoint) describes, after checking
    that jaxserve runs it; `UnsupportedModelError` naming the setting for any other."""
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise ModelLoadError(f"config.json's quantization_config must be an object, got {config!r}")
    method = config.get("quant_method")
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors(config)
    if method == FINE_GRAINED_FP8:
        return _fine_grained_fp8(config)
    raise UnsupportedModelError(
        f"quantization_config.quant_method {method!r} is not supported: jaxserve loads FP8 checkpoints of "
        f"quant_method 'compressed-tensors' (float-quantized) or 'fp8' (with weight_block_size), or quantizes an "
        f"unquantized checkpoint itself (--quantization int8 or fp8)")


def check_requested(checkpoint, requested: str | None) -> None:
    """A pre-quantized checkpoint (a CheckpointQuantization or a 4-bit one) decides its format: --quantization
    naming that format (fp8, as vLLM accepts it) agrees with it, anything else is a `ConfigError`."""
    if checkpoint is not None and requested not in (None, checkpoint.weight_format.name):
        raise ConfigError(f"--quantization {requested} contradicts the checkpoint's own scheme, {checkpoint.name}; "
                          f"leave --quantization out (or pass fp8) to run it as stored")


def quantized_targets(targets: Mapping[str, TensorTarget],
                      quantization: CheckpointQuantization) -> dict[str, TensorTarget]:
    """`targets` of the model's quantized layout (each laid out as if the checkpoint stored it), with every scale
    read from the checkpoint's own scale tensors. ConfigError where tensor parallelism would split a weight block;
    UnsupportedModelError where the config leaves a decoder projection unquantized."""
    out = dict(targets)
    for name, target in targets.items():
        if name.endswith(_WEIGHT + SCALE_SUFFIX):
            weight = targets[name.removesuffix(SCALE_SUFFIX)]
            check_quantized(weight, quantization.unquantized_reason)
            out[name] = _scale_target(name, target, weight, quantization)
    return out


def unread_tensors(quantization: CheckpointQuantization) -> UnreadTensors:
    """The checkpoint's tensors no parameter reads: KV-cache scales, read apart (kv_cache_scales)."""
    return UnreadTensors(dropped_suffixes=KV_CACHE_SCALE_SUFFIXES if quantization.kv_cache_scales else ())


def _scale_target(name: str, target: TensorTarget, weight: TensorTarget,
                  quantization: CheckpointQuantization) -> TensorTarget:
    """The target of one projection's scales: its stored tensors and their shape, and how they become the placed
    per-channel f32[layers, out] (broadcast or reshaped on the host) or block f32[layers, out blocks, in blocks]."""
    out_features, in_features = weight.stored_shape
    sources = tuple(source.removesuffix(_WEIGHT) + "." + quantization.scale_name for source in weight.sources)
    if quantization.strategy == "tensor":
        return dataclasses.replace(target, sources=sources, stored_shape=(1,),
                                   convert=functools.partial(np.broadcast_to, shape=(out_features,)))
    if quantization.strategy == "channel":
        return dataclasses.replace(target, sources=sources, stored_shape=(out_features, 1),
                                   convert=functools.partial(np.reshape, shape=(out_features,)))
    _check_whole_blocks_per_device(name, weight, quantization.block)
    return dataclasses.replace(target, sources=sources,
                               stored_shape=scale_shape(quantization.weight_format, out_features, in_features),
                               stored_rows=_block_rows(weight.stored_rows, quantization.block[0]))


def _check_whole_blocks_per_device(name: str, weight: TensorTarget, block: tuple[int, int]) -> None:
    """ConfigError unless each device's share of the weight's rows and columns is a whole number of blocks, so
    that its share of the scales covers exactly its share of the weight."""
    shape = weight.placed.shape[-2:]
    shard = weight.placed.sharding.shard_shape(weight.placed.shape)[-2:]
    repeated = " (its KV heads repeated, one per device)" if weight.stored_rows is not None else ""
    for size, share, block_size, what in zip(shape, shard, block, ("rows", "columns")):
        if share != size and share % block_size:
            raise ConfigError(
                f"tensor parallelism gives each device {share} of the {size} {what} of "
                f"{name.removesuffix(SCALE_SUFFIX)}{repeated}, not a whole number of the checkpoint's "
                f"{block[0]}x{block[1]} weight blocks: choose a tensor_parallel_size that splits it into whole blocks")


def _block_rows(weight_rows: np.ndarray | None, rows: int) -> np.ndarray | None:
    """i64[placed out blocks]: the stored block row each placed block row of scales copies, where tensor parallelism
    repeats KV heads (`weight_rows`, i64[placed out]: the stored row of each placed weight row; `rows` per block).

    Each device then holds one copy of one KV head, which `_check_whole_blocks_per_device` has found to be a whole
    number of blocks; so every placed block lies inside one head copy, and is a whole stored block."""
    return None if weight_rows is None else weight_rows[::rows] // rows


def check_quantized(weight: TensorTarget, unquantized_reason: UnquantizedReason) -> None:
    """UnsupportedModelError when the config leaves a decoder projection unquantized: jaxserve quantizes them all."""
    for source in weight.sources:
        module = source.removesuffix(_WEIGHT)
        reason = unquantized_reason(module)
        if reason is not None:
            raise UnsupportedModelError(
                f"the checkpoint leaves decoder projection {module} unquantized ({reason}); jaxserve runs every "
                f"decoder projection in one format")


def _compressed_tensors(config: Mapping[str, Any]) -> CheckpointQuantization:
    """A compressed-tensors float8 scheme: one scheme for every config group, weights float8 per tensor, channel or
    block."""
    _check_ct_storage(config)
    groups = config.get("config_groups") or {}
    if not isinstance(groups, Mapping) or not groups:
        raise UnsupportedModelError("compressed-tensors quantization_config has no config_groups")
    schemes = {name: ct_scheme(name, group) for name, group in groups.items()}
    scheme = next(iter(schemes.values()))
    if any(other != scheme for other in schemes.values()):
        raise UnsupportedModelError(
            f"compressed-tensors config groups {', '.join(groups)} quantize differently; jaxserve runs every decoder "
            f"projection in one format")
    weights, inputs, outputs = scheme
    if outputs is not None:
        raise UnsupportedModelError("compressed-tensors output_activations quantization is not supported")
    strategy, block = _ct_weights(weights)
    targets = tuple(target for group in groups.values() for target in group.get("targets") or ())
    return CheckpointQuantization(
        method=COMPRESSED_TENSORS, strategy=strategy, block=block, scale_name="weight" + SCALE_SUFFIX,
        activations=_ct_activations(inputs), kv_cache_scales=config.get("kv_cache_scheme") is not None,
        unquantized_reason=functools.partial(ct_unquantized, targets, tuple(config.get("ignore") or ())))


def _check_ct_storage(config: Mapping[str, Any]) -> None:
    """The weights are stored compressed as plain float8 tensors: no packing, sparsity or rotation to undo.
    `quantization_status` is not read, as vLLM does not: early FP8 repositories say "frozen" over float8 tensors;
    the tensors' own dtypes are checked instead."""
    formats = [config.get("format")] + [group.get("format") for group in (config.get("config_groups") or {}).values()
                                        if isinstance(group, Mapping)]
    for fmt in formats:
        if fmt is not None and fmt not in _CT_FORMATS:
            raise UnsupportedModelError(f"compressed-tensors format {fmt!r} is not supported (FP8 checkpoints in "
                                        f"{' or '.join(_CT_FORMATS)} format only)")
    sparsity = config.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise UnsupportedModelError(f"compressed-tensors sparsity format {sparsity['format']!r} is not supported")
    if config.get("transform_config"):
        raise UnsupportedModelError("compressed-tensors transform_config (weight rotations) is not supported")


def ct_scheme(name: str, group: Any) -> tuple:
    """(weights, input_activations, output_activations) of one config group: what must agree across groups."""
    if not isinstance(group, Mapping) or not isinstance(group.get("weights"), Mapping):
        raise UnsupportedModelError(f"compressed-tensors config group {name} has no weights scheme")
    return group["weights"], group.get("input_activations"), group.get("output_activations")


def _ct_weights(weights: Mapping[str, Any]) -> tuple[str, tuple[int, int] | None]:
    """(strategy, block) of an 8-bit float, symmetric, static weight scheme."""
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if kind != "float" or bits != 8:
        raise UnsupportedModelError(f"compressed-tensors weights of type {kind!r} with num_bits {bits!r} are not "
                                    f"supported: jaxserve loads 8-bit float (FP8) weights only")
    if strategy not in _CT_STRATEGIES:
        raise UnsupportedModelError(f"compressed-tensors weight strategy {strategy!r} is not supported "
                                    f"({', '.join(_CT_STRATEGIES)})")
    if not weights.get("symmetric", True) or weights.get("dynamic", False):
        raise UnsupportedModelError("compressed-tensors weights must be symmetric and static (scales stored)")
    return strategy, _block_size(weights.get("block_structure"), "block_structure") if strategy == "block" else None


def _ct_activations(inputs: Mapping[str, Any] | None) -> str | None:
    """How the scheme quantizes the projections' inputs: STATIC_ACTIVATIONS (each projection stores an input scale
    f32[1], a per-tensor static scheme), DYNAMIC_ACTIVATIONS (computed per token, or per tensor, which a per-token
    scale is at least as accurate as), or None (weight-only)."""
    if inputs is None:
        return None
    if inputs.get("type", "float") != "float" or inputs.get("num_bits", 8) != 8:
        raise UnsupportedModelError(f"compressed-tensors input activations of type {inputs.get('type')!r} with "
                                    f"num_bits {inputs.get('num_bits')!r} are not supported (8-bit float)")
    if inputs.get("dynamic", False):
        return DYNAMIC_ACTIVATIONS
    if inputs.get("strategy") != "tensor":
        raise UnsupportedModelError(f"compressed-tensors static input activations with strategy "
                                    f"{inputs.get('strategy')!r} are not supported (tensor only)")
    return STATIC_ACTIVATIONS


def ct_unquantized(targets: tuple[str, ...], ignore: tuple[str, ...], module: str) -> str | None:
    """compressed-tensors' rule: a module is quantized when a target and no ignore entry matches it; an entry
    matches by class name ("Linear"), by "re:" regular expression (from the name's start) or by the exact name."""
    if not any(_ct_matches(target, module) for target in targets):
        return "no config group targets it"
    entry = next((entry for entry in ignore if _ct_matches(entry, module)), None)
    return None if entry is None else f"quantization_config.ignore lists {entry!r}"


def _ct_matches(entry: str, module: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry.removeprefix("re:"), module) is not None
    return entry in (_LINEAR_CLASS, module)


def _fine_grained_fp8(config: Mapping[str, Any]) -> CheckpointQuantization:
    """transformers' fp8 format: float8 weights with float32 block scales (`weight_scale_inv`), dynamic
    activations."""
    if config.get("weight_block_size") is None:
        raise UnsupportedModelError("fp8 checkpoints without weight_block_size (per-tensor scales) are not supported; "
                                    "block-scaled ones (weight_block_size [128, 128]) and compressed-tensors ones are")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise UnsupportedModelError(f"fp8 checkpoints with activation_scheme {scheme!r} are not supported (dynamic)")
    element_format = config.get("fmt", "e4m3")
    if element_format != "e4m3":
        raise UnsupportedModelError(f"fp8 checkpoints with fmt {element_format!r} are not supported (e4m3)")
    scale_format = config.get("scale_fmt") or "float"
    if scale_format != "float":
        raise UnsupportedModelError(f"fp8 checkpoints with scale_fmt {scale_format!r} are not supported (float)")
    if config.get("modules_to_convert"):
        raise UnsupportedModelError("fp8 checkpoints with modules_to_convert (quantized embeddings) are not supported")
    skipped = config.get("modules_to_not_convert") or config.get("ignored_layers") or ()
    return CheckpointQuantization(
        method=FINE_GRAINED_FP8, strategy="block", block=_block_size(config["weight_block_size"], "weight_block_size"),
        scale_name="weight_scale_inv", activations=None, kv_cache_scales=False,
        unquantized_reason=functools.partial(_fp8_unquantized, tuple(skipped)))


def _fp8_unquantized(skipped: tuple[str, ...], module: str) -> str | None:
    """transformers' rule for modules_to_not_convert: an entry matches a module name as a regular expression from
    its start up to a module boundary ("layers.1" matches "layers.1.mlp", not "layers.11.mlp"), or as its suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    entry = next((entry for entry in skipped
                  if re.match(rf"(?:{entry}){boundary}", module) or module.endswith(entry)), None)
    return None if entry is None else f"quantization_config.modules_to_not_convert lists {entry!r}"


def _block_size(value: Any, key: str) -> tuple[int, int]:
    """(rows, columns) of a block scale from a config list of two positive integers."""
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(size, int) and size > 0 for size in value)):
        raise ModelLoadError(f"quantization_config.{key} must be two positive integers, got {value!r}")
    return int(value[0]), int(value[1])


def kv_cache_scales(model_dir: Path, num_layers: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(K scales, V scales) per layer of a checkpoint whose config has a kv_cache_scheme, under either naming;
    ModelLoadError naming the first tensor missing."""
    candidates = [f"model.layers.{layer}{suffix}" for layer in range(num_layers) for suffix in KV_CACHE_SCALE_SUFFIXES]
    found = read_scalars(model_dir, candidates)
    for k_suffix, v_suffix in KV_CACHE_SCALE_NAMES:
        names = [(f"model.layers.{layer}{k_suffix}", f"model.layers.{layer}{v_suffix}") for layer in range(num_layers)]
        if any(k in found for k, _ in names):
            missing = [name for pair in names for name in pair if name not in found]
            if missing:
                raise ModelLoadError(f"config.json has a kv_cache_scheme but {model_dir} lacks tensor {missing[0]}")
            return tuple(found[k] for k, _ in names), tuple(found[v] for _, v in names)
    raise ModelLoadError(f"config.json has a kv_cache_scheme but {model_dir} lacks tensor "
                         f"model.layers.0{KV_CACHE_SCALE_NAMES[0][0]}")
