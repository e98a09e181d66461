"""PEFT LoRA adapter folders read into validated host arrays: `load_lora_adapter`.

The folder, as peft 0.21's `PeftModel.save_pretrained` writes it:
  adapter_config.json        peft_type "LORA", r, lora_alpha, use_rslora, target_modules, layers_to_transform, ...
                             (read and checked by lora_config.py)
  adapter_model.safetensors  for each adapted projection of each adapted layer, in the dtype it was trained in
                             (float32 as a rule: peft keeps adapter weights in float32 on a bf16 or fp16 model
                             unless told otherwise):
                               base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight  [r, in]
                               base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight  [out, r]
                             (mlp.gate_proj, up_proj, down_proj likewise); transformers' own adapter saving
                             (`model.add_adapter`, `save_pretrained`) writes the same names without
                             `base_model.model.`. Layers left out by layers_to_transform have no tensors.
An adapted projection computes x @ (W + scaling * B @ A).T, with W in HF's [out, in] and scaling lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora).

Refused, each with a message naming the file, tensor or setting (errors.py's LoraAdapterError and subclasses, which
the server answers with 400): a missing folder or file, unreadable JSON, a truncated or corrupt safetensors file;
pickle weights (adapter_model.bin: pickle can run code when read; convert to safetensors); what lora_config.py
refuses; a rank above max_lora_rank (LoraRankError); tensors whose shapes or layers disagree with the base model's
config (LoraBaseModelMismatchError, naming the tensor and both shapes); tensors that are no lora_A/lora_B weight of
a targeted projection (DoRA magnitudes, biases, embeddings, another adapter's modules); a targeted projection
missing a tensor; non-float tensors.

Loading is a pure function: it reads the folder and returns a new adapter, or raises and leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from safetensors import SafetensorError

from jaxserve.checkpoint.lora_config import PROJECTIONS, LoraSettings, module_name, read_lora_settings
from jaxserve.checkpoint.safetensors_loader import open_safetensors, tensor_slice
from jaxserve.errors import (ConfigError, LoraAdapterError, LoraBaseModelMismatchError, ModelLoadError,
                             UnsupportedLoraError)
from jaxserve.model.config import LlamaConfig

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # stored dtypes read (cast exactly to float32, F64 rounded)
# A LoRA weight as peft names it: optional PEFT wrapper prefix, layer, block, projection, A or B.
_LORA_TENSOR = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True)
class LoraWeights:
    """One projection's LoRA weights, stacked over the base model's layers (read-only arrays)."""

    a: np.ndarray  # f32[num_layers, r, in]: lora_A of each layer; zeros in layers the adapter leaves out
    b: np.ndarray  # f32[num_layers, out, r]: lora_B of each layer (HF's [out, in] convention); zeros likewise
    layers: tuple[int, ...]  # the layers adapted, ascending; every other layer's A and B are zero


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter read from its folder and checked against the base model it will run on."""

    name: str  # what requests call it by
    path: Path  # the folder it was read from
    rank: int  # r: rows of every A, columns of every B
    scaling: float  # multiplies B @ A: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora
    weights: Mapping[str, LoraWeights]  # adapted projection (q_proj ... down_proj, in that order) -> its weights
    base_model_name_or_path: str | None  # the model it was trained on, as adapter_config.json names it (not checked)

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The projections the adapter adapts, in the order they run."""
        return tuple(self.weights)

    def delta(self, projection: str, layer: int) -> np.ndarray:
        """f32[out, in]: what the adapter adds to `projection`'s weight in `layer`, scaling * B @ A (zeros in a layer
        it leaves alone). KeyError for a projection it does not adapt."""
        weights = self.weights[projection]
        return np.float32(self.scaling) * (weights.b[layer] @ weights.a[layer])


def projection_shape(config: LlamaConfig, projection: str) -> tuple[int, int]:
    """(out, in) of a decoder projection's weight in HF's [out, in] convention."""
    q_width = config.num_attention_heads * config.head_dim
    kv_width = config.num_key_value_heads * config.head_dim
    return {"q_proj": (q_width, config.hidden_size), "k_proj": (kv_width, config.hidden_size),
            "v_proj": (kv_width, config.hidden_size), "o_proj": (config.hidden_size, q_width),
            "gate_proj": (config.intermediate_size, config.hidden_size),
            "up_proj": (config.intermediate_size, config.hidden_size),
            "down_proj": (config.hidden_size, config.intermediate_size)}[projection]


def load_lora_adapter(path: Path, config: LlamaConfig, max_lora_rank: int, name: str | None = None) -> LoraAdapter:
    """The PEFT LoRA adapter in folder `path`, for a base model of `config`, named `name` (default: the folder's
    name). Raises what the module docstring lists; ConfigError for a max_lora_rank below 1."""
    path = Path(path)
    if max_lora_rank < 1:
        raise ConfigError(f"max_lora_rank must be at least 1, got {max_lora_rank}")
    if not path.is_dir():
        raise LoraAdapterError(f"LoRA adapter folder {path} does not exist" if not path.exists()
                               else f"LoRA adapter path {path} is not a folder")
    try:
        _check_not_nested(path)
        settings = read_lora_settings(path / ADAPTER_CONFIG_FILE, config, max_lora_rank)
        weights = _read_weights(_weights_file(path), settings, config)
    except OSError as e:  # a folder unreadable to this process, or one that vanished while read
        raise LoraAdapterError(f"cannot read LoRA adapter folder {path}: {e}") from None
    return LoraAdapter(name=name or path.resolve().name, path=path, rank=settings.rank, scaling=settings.scaling,
                       weights=types.MappingProxyType(weights),
                       base_model_name_or_path=settings.base_model_name_or_path)


def _check_not_nested(folder: Path) -> None:
    """peft saves an adapter not named "default" into a subfolder of its name: point at it rather than say only
    that adapter_config.json is missing."""
    if (folder / ADAPTER_CONFIG_FILE).exists():
        return
    nested = sorted(sub.name for sub in folder.iterdir() if (sub / ADAPTER_CONFIG_FILE).is_file())
    if nested:
        raise LoraAdapterError(f"LoRA adapter folder {folder} has no {ADAPTER_CONFIG_FILE}, but its subfolders "
                               f"{', '.join(nested)} each hold one (peft saves an adapter not named 'default' into a "
                               f"subfolder of its name): load one of those")


def _weights_file(folder: Path) -> Path:
    file = folder / ADAPTER_WEIGHTS_FILE
    if file.is_file():
        return file
    pickles = sorted(candidate.name for candidate in folder.iterdir() if candidate.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise UnsupportedLoraError(
            f"LoRA adapter folder {folder} holds {pickles[0]}, a pickle file, which jaxserve does not read (reading "
            f"pickle can run code); convert it to {ADAPTER_WEIGHTS_FILE}, e.g. safetensors.torch.save_file("
            f"torch.load('{pickles[0]}', weights_only=True), '{ADAPTER_WEIGHTS_FILE}')")
    raise LoraAdapterError(f"LoRA adapter folder {folder} has no {ADAPTER_WEIGHTS_FILE}")


# (projection, layer, "A" or "B") -> the tensor's name in the file
_Found = dict[tuple[str, int, str], str]


def _read_weights(file: Path, settings: LoraSettings, config: LlamaConfig) -> dict[str, LoraWeights]:
    """Every targeted projection's stacked A and B, after checking every tensor's name, dtype and shape."""
    try:
        with open_safetensors(file) as reader:
            found = {}
            for name in sorted(reader.keys()):
                key = _check_tensor(name, tensor_slice(reader, name, file), file, settings, config)
                if key in found:
                    raise LoraAdapterError(f"{file} holds {found[key]} and {name}, the same weight twice")
                found[key] = name
            _check_complete(found, file, settings, config)
            return {projection: _stack(reader, file, found, projection, layers, settings.rank, config)
                    for projection, layers in settings.targets.items()}
    except ModelLoadError as e:  # from open_safetensors and tensor_slice, which name the file
        raise LoraAdapterError(str(e)) from None


def _check_tensor(name: str, header, file: Path, settings: LoraSettings,
                  config: LlamaConfig) -> tuple[str, int, str]:
    """(projection, layer, "A" or "B") of a tensor that is a LoRA weight the adapter's config targets, of a float
    dtype and of the shape the base model and r give it."""
    match = _LORA_TENSOR.match(name)
    if match is None or PROJECTIONS.get(match[3]) != match[2]:
        raise UnsupportedLoraError(
            f"{file} holds tensor {name}, which is no lora_A/lora_B weight of a decoder projection "
            f"({', '.join(PROJECTIONS)}); jaxserve reads only those (a DoRA magnitude, a bias, an embedding or a "
            f"module of another architecture is not supported)")
    layer, projection, kind = int(match[1]), match[3], match[4]
    if layer >= config.num_hidden_layers:
        raise LoraBaseModelMismatchError(f"{file} holds tensor {name} of layer {layer}, but the base model has "
                                         f"{config.num_hidden_layers} layers: the adapter was made for another model")
    if layer not in settings.targets.get(projection, ()):
        raise LoraAdapterError(f"{file} holds tensor {name}, but {ADAPTER_CONFIG_FILE} does not target "
                               f"{module_name(projection, layer)} (its target_modules, exclude_modules and "
                               f"layers_to_transform leave it out)")
    dtype = header.get_dtype()
    if dtype not in _FLOAT_DTYPES:
        raise UnsupportedLoraError(f"{file}: tensor {name} has dtype {dtype}; LoRA weights must be float "
                                   f"({', '.join(_FLOAT_DTYPES)})")
    _check_shape(name, tuple(header.get_shape()), projection, kind, file, settings.rank, config)
    return projection, layer, kind


def _check_shape(name: str, shape: tuple[int, ...], projection: str, kind: str, file: Path, rank: int,
                 config: LlamaConfig) -> None:
    """lora_A is [r, in] and lora_B [out, r], with the projection's (out, in) from the base model's config."""
    out_features, in_features = projection_shape(config, projection)
    expected = (rank, in_features) if kind == "A" else (out_features, rank)
    if shape == expected:
        return
    rank_axis = 0 if kind == "A" else 1
    if len(shape) == 2 and shape[1 - rank_axis] == expected[1 - rank_axis]:
        raise LoraAdapterError(f"{file}: tensor {name} has shape {list(shape)}, rank {shape[rank_axis]}, but "
                               f"{ADAPTER_CONFIG_FILE} says r={rank}")
    raise LoraBaseModelMismatchError(
        f"{file}: tensor {name} has shape {list(shape)}, but the base model needs {list(expected)} for it (its "
        f"{projection} weight is [{out_features}, {in_features}]: hidden_size {config.hidden_size}, "
        f"intermediate_size {config.intermediate_size}, {config.num_attention_heads} attention and "
        f"{config.num_key_value_heads} KV heads of {config.head_dim}): the adapter was made for another model")


def _check_complete(found: _Found, file: Path, settings: LoraSettings, config: LlamaConfig) -> None:
    """Every targeted projection of every targeted layer has both A and B: what a missing one would stand for is
    unknown (PEFT would leave it at its initialisation, which is zero only for some adapters)."""
    last_layer = max((layer for _, layer, _ in found), default=-1)
    for projection, layers in settings.targets.items():
        for layer in layers:
            for kind in "AB":
                if (projection, layer, kind) in found:
                    continue
                if 0 <= last_layer < layer:  # every tensor stops short of it: a shallower model's adapter
                    raise LoraBaseModelMismatchError(
                        f"{file} holds weights up to layer {last_layer}, but the base model has "
                        f"{config.num_hidden_layers} layers and {ADAPTER_CONFIG_FILE} targets {projection} in "
                        f"layer {layer}: the adapter was made for a model with fewer layers")
                raise LoraAdapterError(f"{file} lacks tensor base_model.model.{module_name(projection, layer)}"
                                       f".lora_{kind}.weight, which {ADAPTER_CONFIG_FILE} targets (a damaged or "
                                       f"edited file?)")


def _stack(reader, file: Path, found: _Found, projection: str, layers: tuple[int, ...], rank: int,
           config: LlamaConfig) -> LoraWeights:
    """One projection's A f32[num_layers, r, in] and B f32[num_layers, out, r], zero outside `layers`."""
    out_features, in_features = projection_shape(config, projection)
    a = np.zeros((config.num_hidden_layers, rank, in_features), np.float32)
    b = np.zeros((config.num_hidden_layers, out_features, rank), np.float32)
    for layer in layers:
        a[layer] = _read(reader, file, found[projection, layer, "A"])
        b[layer] = _read(reader, file, found[projection, layer, "B"])
    a.flags.writeable = b.flags.writeable = False  # one adapter may be shared by many requests and slots
    return LoraWeights(a=a, b=b, layers=layers)


def _read(reader, file: Path, name: str) -> np.ndarray:
    try:
        tensor = np.asarray(tensor_slice(reader, name, file)[...], np.float32)
    except (SafetensorError, OSError, ValueError) as e:
        raise LoraAdapterError(f"cannot read tensor {name} from {file} (corrupt file?): {e}") from None
    # One NaN or inf in a slot would reach every token of a batch: the masked slots still multiply 0 by it.
    if not np.isfinite(tensor).all():
        raise LoraAdapterError(f"tensor {name} in {file} holds NaN or infinite values")
    return tensor
