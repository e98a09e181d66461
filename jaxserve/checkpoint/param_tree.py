"""The model's parameters as a flat mapping from HF tensor name to array, and back into an `nnx.State`.

Both checkpoint formats speak in flat names (`model.layers.0.mlp.up_proj.weight`); the model's parameter paths joined
with "." are exactly those names, so no renaming table exists anywhere.
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

MAX_NAMES_IN_MESSAGE = 5


@dataclasses.dataclass(frozen=True)
class AbstractParams:
    """The parameter layout a config implies, before any weight is read."""

    graphdef: nnx.GraphDef  # module structure; nnx.merge(graphdef, params) rebuilds the model
    state: nnx.State  # nnx.Param variables whose values are jax.ShapeDtypeStruct placeholders
    specs: dict[str, jax.ShapeDtypeStruct]  # tensor name -> shape, target dtype and sharding


@dataclasses.dataclass(frozen=True)
class TensorTarget:
    """Where one checkpoint tensor goes: what the checkpoint must hold, and the array it becomes."""

    stored_shape: tuple[int, ...]  # the shape the checkpoint's config implies (checked before any data is read)
    placed: jax.ShapeDtypeStruct  # shape the model runs with, target dtype and sharding
    # i64[placed.shape[0]]: the stored row each placed row copies (KV heads repeated for tensor parallelism);
    # None: the placed tensor is the stored one
    stored_rows: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class FoundTensor:
    """A tensor as a checkpoint describes it, for checking against the config before reading data."""

    shape: tuple[int, ...]  # as stored
    location: str  # file or folder that holds it, for error messages


ShardingOf = Callable[[str, tuple[int, ...]], jax.sharding.Sharding]  # (tensor name, shape) -> its sharding


def abstract_params(cfg: LlamaConfig, dtype: np.dtype, sharding_of: ShardingOf) -> AbstractParams:
    """Shapes and names of every parameter, each with the sharding `sharding_of` gives, without allocating any."""
    abstract_model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=dtype))
    graphdef, state = nnx.split(abstract_model, nnx.Param)
    specs = {}
    for path, var in nnx.to_flat_state(state):
        name, shape = tensor_name(path), var.get_value().shape
        specs[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding_of(name, shape))
    return AbstractParams(graphdef=graphdef, state=state, specs=specs)


def tensor_targets(stored: AbstractParams, placed: AbstractParams,
                   stored_rows: Callable[[str], np.ndarray | None]) -> dict[str, TensorTarget]:
    """Tensor name -> its target, from the checkpoint's layout, the running model's, and the row copies between."""
    return {name: TensorTarget(stored.specs[name].shape, spec, stored_rows(name))
            for name, spec in placed.specs.items()}


def unchanged_targets(specs: Mapping[str, jax.ShapeDtypeStruct]) -> dict[str, TensorTarget]:
    """Targets that place each tensor as stored (one device, or conversion through the host)."""
    return {name: TensorTarget(spec.shape, spec) for name, spec in specs.items()}


def tensor_name(path: tuple) -> str:
    """`("model", "layers", 0, "mlp", "up_proj", "weight")` -> `"model.layers.0.mlp.up_proj.weight"`."""
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
    expected: Mapping[str, TensorTarget],
    where: str,
) -> None:
    """Raise `ModelLoadError` unless the checkpoint holds exactly the tensors the config implies, in their shapes.

    `found` must already exclude tensors the loader deliberately ignores. `where` names the checkpoint folder.
    """
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
        f"{name} in {found[name].location} has shape {found[name].shape} but config implies {target.stored_shape}"
        for name, target in expected.items()
        if found[name].shape != target.stored_shape
    ]
    if wrong_shapes:
        raise ModelLoadError("; ".join(wrong_shapes[:MAX_NAMES_IN_MESSAGE]))


def _some(names: Iterable[str]) -> str:
    """A comma-separated list cut after a few names, so a wholly wrong config gives a readable message."""
    names = list(names)
    shown = ", ".join(names[:MAX_NAMES_IN_MESSAGE])
    hidden = len(names) - MAX_NAMES_IN_MESSAGE
    return shown if hidden <= 0 else f"{shown} and {hidden} more"
