"""The model's parameters as a flat mapping from parameter name to array, and back into an `nnx.State`.

Both checkpoint formats speak in HF's flat names (`model.layers.0.mlp.up_proj.weight`). The model's parameter paths
joined with "." are those names, except that the decoder layers are stacked (`model.layers.mlp.up_proj.weight`,
f[num_layers, ...]): each parameter's `TensorTarget` lists the checkpoint tensors it is made of
(`jaxserve/model/param_names.py` has the rule), so no renaming table exists anywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import jax
import numpy as np
from flax import nnx

from jaxserve.errors import ModelLoadError
from jaxserve.model.config import LlamaConfig
from jaxserve.model.llama import LlamaForCausalLM
from jaxserve.model.param_names import is_stacked, layer_tensor_names, stacked_parameter

MAX_NAMES_IN_MESSAGE = 5


@dataclasses.dataclass(frozen=True)
class AbstractParams:
    """The parameter layout a config implies, before any weight is read."""

    graphdef: nnx.GraphDef  # module structure; nnx.merge(graphdef, params) rebuilds the model
    state: nnx.State  # nnx.Param variables whose values are jax.ShapeDtypeStruct placeholders
    specs: dict[str, jax.ShapeDtypeStruct]  # tensor name -> shape, target dtype and sharding


@dataclasses.dataclass(frozen=True)
class TensorTarget:
    """Where checkpoint tensors go: which ones the checkpoint must hold, and the parameter array they become."""

    # The checkpoint tensors making the parameter: one per layer, in order, for a stacked parameter (stacked on a
    # new leading axis), else the one tensor of the parameter's own name
    sources: tuple[str, ...]
    stored_shape: tuple[int, ...]  # each source's shape as the checkpoint's config implies it (checked before reading)
    placed: jax.ShapeDtypeStruct  # shape the model runs with, target dtype and sharding
    # i64[rows]: the stored row each placed row copies (KV heads repeated for tensor parallelism), rows being axis 0
    # of each source; None: the placed tensor is the stored one
    stored_rows: np.ndarray | None = None
    # A host transform of each source, read whole, into the layout `stored_rows` and the placed shape index (a
    # pre-quantized checkpoint's scales: f32[1] per tensor or f32[out, 1] become f32[out]); None: sources are read
    # shard by shard as they are. Only for small tensors, since each is read whole.
    convert: Callable[[np.ndarray], np.ndarray] | None = None
    # One transform per source where they differ (an act-order weight's columns, each layer its own permutation);
    # replaces `convert`
    source_converts: tuple[Callable[[np.ndarray], np.ndarray], ...] | None = None
    # The dtype each source must be stored in where it is not a float: a 4-bit checkpoint's int32 words, which
    # `convert` unpacks; None: a float tensor, cast to the placed dtype
    stored_dtype: np.dtype | None = None

    @property
    def stacked(self) -> bool:
        """The parameter stacks its sources (per-layer tensors) on a leading layer axis."""
        return stacked_parameter(self.sources[0]) is not None


@dataclasses.dataclass(frozen=True)
class UnreadTensors:
    """Checkpoint tensors that no parameter is made of, which the checks must still know about."""

    # Tensor name -> shape: must be present in that shape, though never read (a pre-quantized checkpoint's static
    # activation scales)
    required: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    dropped_suffixes: tuple[str, ...] = ()  # tensors whose names end so are left out where present (KV-cache scales)


@dataclasses.dataclass(frozen=True)
class FoundTensor:
    """A tensor as a checkpoint describes it, for checking against the config before reading data."""

    shape: tuple[int, ...]  # as stored
    location: str  # file or folder that holds it, for error messages


ShardingOf = Callable[[str, tuple[int, ...]], jax.sharding.Sharding]  # (tensor name, shape) -> its sharding


def abstract_params(cfg: LlamaConfig, dtype: np.dtype, sharding_of: ShardingOf,
                    quantization: str | None = None) -> AbstractParams:
    """Shapes, dtypes (`dtype`, or the quantized weights' and scales' own) and names of every parameter, each with
    the sharding `sharding_of` gives, without allocating any."""
    abstract_model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=dtype, quantization=quantization))
    graphdef, state = nnx.split(abstract_model, nnx.Param)
    specs = {}
    for path, var in nnx.to_flat_state(state):
        name, value = tensor_name(path), var.get_value()
        specs[name] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding_of(name, value.shape))
    return AbstractParams(graphdef=graphdef, state=state, specs=specs)


def tensor_targets(stored: AbstractParams, placed: AbstractParams,
                   stored_rows: Callable[[str], np.ndarray | None]) -> dict[str, TensorTarget]:
    """Parameter name -> its target, from the checkpoint's layout, the running model's, and the row copies between."""
    return {name: _target(name, stored.specs[name].shape, spec, stored_rows(name))
            for name, spec in placed.specs.items()}


def unchanged_targets(specs: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, TensorTarget]:
    """Targets that place each parameter as stored (one device, or conversion through the host)."""
    return {name: _target(name, spec.shape, spec) for name, spec in specs.items()}


def _target(name: str, stored_shape: tuple[int, ...], placed: jax.ShapeDtypeStruct,
            stored_rows: np.ndarray | None = None) -> TensorTarget:
    """A stacked parameter's sources are its layers, each of the stored shape without the layer axis."""
    if not is_stacked(name):
        return TensorTarget((name,), stored_shape, placed, stored_rows)
    return TensorTarget(layer_tensor_names(name, stored_shape[0]), stored_shape[1:], placed, stored_rows)


def checkpoint_shapes(targets: Mapping[str, TensorTarget]) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> the shape the config implies for it: what a checkpoint must hold, exactly."""
    return {source: target.stored_shape for target in targets.values() for source in target.sources}


def checkpoint_tensors(arrays: Mapping[str, jax.Array]) -> dict[str, np.ndarray]:
    """Checkpoint tensor name -> host array: stacked parameters split back into HF's per-layer tensors (views)."""
    tensors = {}
    for name, array in arrays.items():
        host = np.asarray(array)
        layers = layer_tensor_names(name, host.shape[0]) if is_stacked(name) else (name,)
        tensors.update(zip(layers, host if is_stacked(name) else (host,)))
    return tensors


def tensor_name(path: tuple) -> str:
    """`("model", "layers", "mlp", "up_proj", "weight")` -> `"model.layers.mlp.up_proj.weight"`."""
    return ".".join(str(part) for part in path)


def fill_params(abstract: AbstractParams, arrays: Mapping[str, jax.Array]) -> nnx.State:
    """The abstract state with each placeholder replaced by the loaded array of the same name."""
    flat = [(path, var.replace(arrays[tensor_name(path)])) for path, var in nnx.to_flat_state(abstract.state)]
    return nnx.from_flat_state(flat)


def flat_arrays(params: nnx.State) -> dict[str, jax.Array]:
    """Tensor name -> array, the inverse of `fill_params`."""
    return {tensor_name(path): var.get_value() for path, var in nnx.to_flat_state(params)}


def check_tensors_match(
    found: Mapping[str, FoundTensor],
    targets: Mapping[str, TensorTarget],
    where: str,
    unread: UnreadTensors = UnreadTensors(),
) -> None:
    """Raise `ModelLoadError` unless the checkpoint holds exactly the tensors the config implies, in their shapes:
    those `targets` read and those `unread` requires.

    `found` must already exclude tensors the loader deliberately ignores. `where` names the checkpoint folder.
    """
    expected = {**checkpoint_shapes(targets), **unread.required}
    missing = [name for name in expected if name not in found]
    if missing:
        raise ModelLoadError(
            f"checkpoint in {where} lacks {len(missing)} tensor(s) that config.json implies: {_some(missing)}"
        )
    unexpected = [f"{name} (in {found[name].location})" for name in found if name not in expected]
    if unexpected:
        raise ModelLoadError(
            f"checkpoint in {where} has {len(unexpected)} tensor(s) this Llama model does not use: "
            f"{_some(unexpected)}; does config.json belong to these weights?"
        )
    wrong_shapes = [
        f"{name} in {found[name].location} has shape {found[name].shape} but config implies {shape}"
        for name, shape in expected.items()
        if found[name].shape != shape
    ]
    if wrong_shapes:
        raise ModelLoadError("; ".join(wrong_shapes[:MAX_NAMES_IN_MESSAGE]))


def _some(names: Iterable[str]) -> str:
    """A comma-separated list cut after a few names, so a wholly wrong config gives a readable message."""
    names = list(names)
    shown = ", ".join(names[:MAX_NAMES_IN_MESSAGE])
    hidden = len(names) - MAX_NAMES_IN_MESSAGE
    return shown if hidden <= 0 else f"{shown} and {hidden} more"
