"""`load_model`: a model folder (or the built-in model) -> config, graph definition and device-resident parameters.

A folder holding a converted Orbax checkpoint (`orbax/`) restores from it, reading all tensors concurrently straight
into their target sharding; otherwise its HF safetensors weights are streamed in one tensor at a time.
`convert_hf_to_orbax` produces such a folder; `benchmarks/load_time.py` compares the two paths.

Loading is two steps, so that start-up can compile while the weights are read: `plan_model` reads the config, lays
the parameters out and checks the checkpoint's names and shapes (seconds at most), giving a `ModelPlan` whose
abstract parameters (shapes, dtypes, shardings) are all a compile needs; `ModelPlan.load` then reads the weights.

A checkpoint whose config.json has a `quantization_config` (pre-quantized FP8, checkpoint/quantized_checkpoint.py;
4-bit AWQ, GPTQ or compressed-tensors, checkpoint/int4_checkpoint.py), or an older GPTQ repository's
`quantize_config.json`, decides the weight format itself and is read as stored; `--quantization` quantizes an
unquantized one after reading.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.checkpoint.builtin import BUILTIN_MODEL_DIR, builtin_params
from jaxserve.checkpoint.model_files import (
    CONFIG_FILE,
    SIDECAR_FILES,
    check_model_dir,
    has_orbax_checkpoint,
    orbax_dir,
)
from jaxserve.checkpoint.orbax_io import plan_orbax_restore, save_orbax
from jaxserve.checkpoint.param_tree import (AbstractParams, TensorTarget, abstract_params, checkpoint_tensors,
                                            fill_params, flat_arrays, tensor_targets, unchanged_targets)
from jaxserve.checkpoint.quantize import online_quantization_name, quantized_arrays
from jaxserve.checkpoint.int4_checkpoint import int4_quantization, int4_targets, is_int4_checkpoint
from jaxserve.checkpoint.int4_checkpoint import unread_tensors as int4_unread_tensors
from jaxserve.checkpoint.int4_layout import Int4Quantization, group_orders
from jaxserve.checkpoint.quantized_checkpoint import (CheckpointQuantization, check_requested, checkpoint_quantization,
                                                      kv_cache_scales, quantized_targets, unread_tensors)
from jaxserve.checkpoint.safetensors_loader import load_safetensors, plan_safetensors_load
from jaxserve.errors import ModelLoadError
from jaxserve.model.config import LlamaConfig, read_config_json
from jaxserve.model.dtypes import resolve_dtype
from jaxserve.model.quantization import SCALE_SUFFIX
from jaxserve.parallel import TensorParallelLayout, plan_tensor_parallel


QUANTIZE_CONFIG_FILE = "quantize_config.json"  # an older GPTQ repository's scheme, beside config.json


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: `nnx.merge(graphdef, params)` rebuilds the `LlamaForCausalLM`."""

    # Architecture hyper-parameters from config.json, as the model runs: with tensor parallelism over more devices
    # than the model has KV heads, num_key_value_heads is the number of devices (each KV head repeated)
    config: LlamaConfig
    graphdef: nnx.GraphDef  # module structure without weights
    params: nnx.State  # every nnx.Param in `dtype`, sharded over `mesh` as the sharding rules say
    dtype: np.dtype  # dtype of weights and activations
    model_dir: Path  # folder holding config and tokenizer files (BUILTIN_MODEL_DIR for the built-in model)
    source: str  # where the weights came from: "safetensors", "orbax" or "builtin"
    mesh: Mesh | None = None  # the tensor-parallel mesh the weights are split over; None: all on the first device
    # The decoder projections' weight format as it runs, in words (e.g. "fp8 (compressed-tensors, per-channel
    # scales)", "int8 (quantized at load, per-channel scales)"); None: unquantized
    quantization: str | None = None
    # The checkpoint's calibrated KV-cache scales, (K per layer, V per layer), which a float8 KV pool uses; None:
    # the checkpoint has none
    kv_cache_scales: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    # The model as its checkpoint stores it (KV heads not repeated), what its LoRA adapters were trained on;
    # None: the same as `config`
    checkpoint_config: LlamaConfig | None = None

    @property
    def stored_config(self) -> LlamaConfig:
        return self.checkpoint_config or self.config


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """A model laid out and its checkpoint checked, before any weight is read."""

    config: LlamaConfig  # as it runs (see LoadedModel.config)
    graphdef: nnx.GraphDef  # module structure without weights
    abstract_params: nnx.State  # every nnx.Param as a jax.ShapeDtypeStruct of its dtype and sharding
    dtype: np.dtype  # dtype of weights and activations
    model_dir: Path  # folder holding config and tokenizer files
    source: str  # where the weights will come from: "safetensors", "orbax" or "builtin"
    mesh: Mesh | None  # the tensor-parallel mesh the weights are split over
    read_params: Callable[[bool], nnx.State]  # reads the weights (its argument: show progress), as laid out here
    quantization: str | None = None  # the weight format as it runs, in words (see LoadedModel.quantization)
    kv_cache_scales: tuple[tuple[float, ...], tuple[float, ...]] | None = None  # see LoadedModel.kv_cache_scales
    checkpoint_config: LlamaConfig | None = None  # see LoadedModel.checkpoint_config

    @property
    def stored_config(self) -> LlamaConfig:
        return self.checkpoint_config or self.config

    def load(self, progress: bool = True) -> LoadedModel:
        """Reads the weights onto the devices."""
        return LoadedModel(self.config, self.graphdef, self.read_params(progress), self.dtype, self.model_dir,
                           self.source, self.mesh, self.quantization, self.kv_cache_scales, self.checkpoint_config)

    def weight_bytes_per_device(self) -> int:
        """Bytes of the weight shards each device will hold (the largest share, where they differ)."""
        return weight_bytes_per_device(self.abstract_params)


def weight_bytes_per_device(params: nnx.State) -> int:
    """Bytes of the shards of `params` (arrays or their abstract specs) on the most loaded device."""
    shard_bytes = collections.Counter()
    for spec in jax.tree.leaves(params):
        for device, index in spec.sharding.devices_indices_map(spec.shape).items():
            shard_bytes[device] += math.prod(len(range(*s.indices(n))) for s, n in zip(index, spec.shape)) * (
                spec.dtype.itemsize)
    return max(shard_bytes.values(), default=0)


def load_model(model_dir: Path | None, dtype: str = "auto", progress: bool = True,
               tensor_parallel_size: int = 1, quantization: str | None = None) -> LoadedModel:
    """Load the model in `model_dir`, or the built-in model when it is None, split over `tensor_parallel_size` devices.

    `dtype` is `auto` or a name `resolve_dtype` accepts. `progress` shows a progress bar while streaming
    safetensors. Each device receives only its shard of each tensor. `quantization` ("int8" or "fp8") quantizes the
    decoder's projections as they arrive; a pre-quantized FP8 checkpoint runs in its own format (`quantization`
    may then only be None or "fp8"). Raises `ModelLoadError` (naming the file or tensor at fault) on anything wrong
    with the folder, `ConfigError` when the model cannot be split so or `quantization` contradicts the checkpoint.
    """
    return plan_model(model_dir, dtype, tensor_parallel_size, quantization).load(progress)


def plan_model(model_dir: Path | None, dtype: str = "auto", tensor_parallel_size: int = 1,
               quantization: str | None = None) -> ModelPlan:
    """`load_model`'s checks and layout without reading weights; the same errors, raised here."""
    if model_dir is None:
        return _plan_builtin(dtype, tensor_parallel_size, quantization)
    model_dir = Path(model_dir)
    check_model_dir(model_dir)
    raw_config = read_config_json(model_dir / CONFIG_FILE)
    cfg = LlamaConfig.from_hf_dict(raw_config)
    stored_quantization = quantization_scheme(_quantization_config(raw_config, model_dir))
    check_requested(stored_quantization, quantization)
    layout = plan_tensor_parallel(cfg, tensor_parallel_size)
    target_dtype = resolve_dtype(dtype, cfg.checkpoint_dtype, jax.default_backend())
    if stored_quantization is not None:
        return _plan_quantized_checkpoint(layout, target_dtype, model_dir, stored_quantization)
    read = abstract_params(layout.model_config, target_dtype, layout.param_sharding)
    stored = abstract_params(cfg, target_dtype, layout.param_sharding)
    targets = tensor_targets(stored, read, layout.stored_rows)
    if has_orbax_checkpoint(model_dir):
        source, read_arrays = "orbax", _ignoring_progress(plan_orbax_restore(orbax_dir(model_dir), targets))
    else:
        source, read_arrays = "safetensors", plan_safetensors_load(model_dir, targets)
    return _plan(layout, target_dtype, quantization, model_dir, source, read_arrays)


def _plan(layout: TensorParallelLayout, dtype: np.dtype, quantization: str | None, model_dir: Path, source: str,
          read_arrays: Callable[[bool], dict[str, jax.Array]]) -> ModelPlan:
    """The plan of a model whose unquantized arrays `read_arrays` (its argument: show progress) reads, quantized
    after reading when asked."""
    placed = abstract_params(layout.model_config, dtype, layout.param_sharding, quantization)

    def read_params(progress: bool) -> nnx.State:
        arrays = read_arrays(progress)
        return fill_params(placed, arrays if quantization is None else quantized_arrays(arrays, placed.specs,
                                                                                        quantization))

    return ModelPlan(layout.model_config, placed.graphdef, fill_params(placed, placed.specs), dtype, model_dir, source,
                     layout.mesh, read_params, online_quantization_name(quantization),
                     checkpoint_config=layout.checkpoint_config)


def _quantization_config(raw_config: dict, model_dir: Path):
    """config.json's quantization_config, or the quantize_config.json older GPTQ repositories keep beside it."""
    if raw_config.get("quantization_config") is not None:
        return raw_config["quantization_config"]
    path = model_dir / QUANTIZE_CONFIG_FILE
    return {"quant_method": "gptq", **read_config_json(path)} if path.is_file() else None


def quantization_scheme(config) -> CheckpointQuantization | Int4Quantization | None:
    """The scheme of a quantization_config: 4-bit (AWQ, GPTQ, pack-quantized) or FP8; None: unquantized.
    UnsupportedModelError naming what jaxserve does not run."""
    return int4_quantization(config) if is_int4_checkpoint(config) else checkpoint_quantization(config)


def _plan_quantized_checkpoint(layout: TensorParallelLayout, dtype: np.dtype, model_dir: Path,
                               quantization: CheckpointQuantization | Int4Quantization) -> ModelPlan:
    """The plan of a pre-quantized checkpoint: float8 or packed 4-bit weights and their scales read as stored, in the
    format the checkpoint's config names (safetensors only: `convert_hf_to_orbax` refuses such folders)."""
    if has_orbax_checkpoint(model_dir):
        raise ModelLoadError(f"{orbax_dir(model_dir)} holds an Orbax checkpoint but config.json describes a "
                             f"pre-quantized one ({quantization.name}); jaxserve reads pre-quantized weights from "
                             f"safetensors only")
    orders = {}
    if isinstance(quantization, Int4Quantization):
        dense = abstract_params(layout.checkpoint_config, dtype, lambda *_: None)
        orders = group_orders(model_dir, _dense_weight_targets(dense), quantization)
        quantization = dataclasses.replace(quantization, act_order=any(o is not None for o in orders.values()))
    fmt = quantization.weight_format
    placed = abstract_params(layout.model_config, dtype, layout.param_sharding, fmt)
    stored = abstract_params(layout.checkpoint_config, dtype, layout.param_sharding, fmt)
    targets = tensor_targets(stored, placed, layout.stored_rows)
    if isinstance(quantization, Int4Quantization):
        weights = _unpacked_weight_targets(targets, dense)
        targets = int4_targets({**targets, **weights}, quantization, orders)
        unread = int4_unread_tensors(quantization)
    else:
        targets, unread = quantized_targets(targets, quantization), unread_tensors(quantization)
    read_arrays = plan_safetensors_load(model_dir, targets, unread=unread)
    scales = kv_cache_scales(model_dir, layout.model_config.num_hidden_layers) if quantization.kv_cache_scales else None
    return ModelPlan(layout.model_config, placed.graphdef, fill_params(placed, placed.specs), dtype, model_dir,
                     "safetensors", layout.mesh, lambda progress: fill_params(placed, read_arrays(progress)),
                     quantization.name, scales, layout.checkpoint_config)


def _dense_weight_targets(dense: AbstractParams) -> dict[str, TensorTarget]:
    """The decoder projections' weight targets of an unquantized layout (sources `<module>.weight`, shape (N, K))."""
    return {name: target for name, target in unchanged_targets(dense.specs).items()
            if name.startswith("model.layers.") and name.endswith("_proj.weight")}


def _unpacked_weight_targets(targets: dict[str, TensorTarget], dense: AbstractParams) -> dict[str, TensorTarget]:
    """The quantized projections' weight targets with each source's shape as the checkpoint's config implies it,
    (out, in), rather than the packed 4-bit shape the model holds: what the 4-bit readers start from."""
    return {name.removesuffix(SCALE_SUFFIX): dataclasses.replace(
                targets[name.removesuffix(SCALE_SUFFIX)], stored_shape=dense.specs[name.removesuffix(SCALE_SUFFIX)]
                .shape[1:])
            for name in targets if name.endswith(".weight" + SCALE_SUFFIX)}


def _ignoring_progress(read: Callable[[], dict[str, jax.Array]]) -> Callable[[bool], dict[str, jax.Array]]:
    return lambda progress: read()


def convert_hf_to_orbax(hf_dir: Path, out_dir: Path, progress: bool = True) -> None:
    """Convert an HF safetensors folder into `out_dir`: an Orbax checkpoint in `orbax/` plus config and tokenizer files.

    Weights keep the dtype they have on disk; `load_model(out_dir, dtype=...)` casts while restoring. The weights
    pass through host memory (the CPU device), so converting needs no accelerator and fits any model that fits in
    RAM. The checkpoint is written last and appears atomically, so an interrupted run leaves no loadable half.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    check_model_dir(hf_dir)
    if orbax_dir(out_dir).exists():
        raise ModelLoadError(f"{orbax_dir(out_dir)} already exists; remove it or convert into another folder")
    raw_config = read_config_json(hf_dir / CONFIG_FILE)
    stored_quantization = quantization_scheme(_quantization_config(raw_config, hf_dir))
    if stored_quantization is not None:
        raise ModelLoadError(f"{hf_dir} holds a pre-quantized checkpoint ({stored_quantization.name}), which "
                             f"conversion does not keep; load the folder as it is: its quantized safetensors load "
                             f"directly")
    cfg = LlamaConfig.from_hf_dict(raw_config)
    host = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    # float32 is only a placeholder: keep_stored_dtype gives each array the dtype it has on disk.
    abstract = abstract_params(cfg, jnp.dtype(jnp.float32), lambda name, shape: host)
    arrays = load_safetensors(hf_dir, unchanged_targets(abstract.specs), progress, keep_stored_dtype=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    _copy_sidecar_files(hf_dir, out_dir)
    save_orbax(checkpoint_tensors(arrays), orbax_dir(out_dir))


def _plan_builtin(dtype: str, tensor_parallel_size: int, quantization: str | None) -> ModelPlan:
    cfg = LlamaConfig.from_json_file(BUILTIN_MODEL_DIR / CONFIG_FILE)
    layout = plan_tensor_parallel(cfg, tensor_parallel_size)
    target_dtype = resolve_dtype(dtype, cfg.checkpoint_dtype, jax.default_backend())
    return _plan(layout, target_dtype, quantization, BUILTIN_MODEL_DIR, "builtin",
                 lambda progress: flat_arrays(builtin_params(layout, target_dtype)[1]))


def _copy_sidecar_files(hf_dir: Path, out_dir: Path) -> None:
    """Copy config and tokenizer files that exist, unless converting in place."""
    for name in SIDECAR_FILES:
        source, target = hf_dir / name, out_dir / name
        if source.is_file() and source.resolve() != target.resolve():
            shutil.copy2(source, target)
