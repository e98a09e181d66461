"""The model's parameters as a flat mapping from HF tensor name to array, and back into an `nnx.State`.

Both checkpoint formats speak in flat names (`model.layers.0.mlp.up_proj.weight`); the model's parameter paths joined
with "." are exactly those names, so no renaming table exists anywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

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
class FoundTensor:
    """A tensor as a checkpoint describes it, for checking against the config before reading data."""

    shape: tuple[int, ...]  # as stored
    location: str  # file or folder that holds it, for error messages


def abstract_params(cfg: LlamaConfig, dtype: np.dtype, sharding: jax.sharding.Sharding) -> AbstractParams:
    """Shapes and names of every parameter, computed without allocating any weight."""
    abstract_model = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, dtype=dtype))
    graphdef, state = nnx.split(abstract_model, nnx.Param)
    specs = {
        tensor_name(path): jax.ShapeDtypeStruct(var.get_value().shape, dtype, sharding=sharding)
        for path, var in nnx.to_flat_state(state)
    }
    return AbstractParams(graphdef=graphdef, state=state, specs=specs)


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


def default_sharding() -> jax.sharding.Sharding:
    """Every weight on the first device; the one place to change when weights get sharded across devices."""
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def check_tensors_match(
    found: Mapping[str, FoundTensor],
    expected: Mapping[str, jax.ShapeDtypeStruct],
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
        f"{name} in {found[name].location} has shape {found[name].shape} but config implies {spec.shape}"
        for name, spec in expected.items()
        if found[name].shape != spec.shape
    ]
    if wrong_shapes:
        raise ModelLoadError("; ".join(wrong_shapes[:MAX_NAMES_IN_MESSAGE]))


def _some(names: Iterable[str]) -> str:
    """A comma-separated list cut after a few names, so a wholly wrong config gives a readable message."""
    names = list(names)
    shown = ", ".join(names[:MAX_NAMES_IN_MESSAGE])
    hidden = len(names) - MAX_NAMES_IN_MESSAGE
    return shown if hidden <= 0 else f"{shown} and {hidden} more"
