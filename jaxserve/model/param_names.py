"""How the model's parameter names relate to HF's checkpoint tensor names.

Parameters outside the decoder stack are named exactly as HF names them (`model.embed_tokens.weight`). The decoder
layers are one stacked module, `model.layers`, so its parameters carry a leading layer axis and drop HF's layer
number: `model.layers.mlp.up_proj.weight` f[num_layers, out, in] stacks HF's `model.layers.0.mlp.up_proj.weight`,
`model.layers.1.mlp.up_proj.weight`, ... in order. Checkpoints (safetensors and the Orbax ones `jaxserve convert`
writes) keep HF's per-layer names; only the running model stacks them.
"""

from __future__ import annotations

import re

STACKED_PREFIX = "model.layers."  # parameters under it have a leading layer axis
_LAYER_TENSOR = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def is_stacked(name: str) -> bool:
    """Whether parameter `name` holds every layer's copy on a leading axis."""
    return name.startswith(STACKED_PREFIX)


def layer_tensor_names(name: str, num_layers: int) -> tuple[str, ...]:
    """The checkpoint tensors parameter `name` is made of: one per layer for a stacked parameter, else itself."""
    if not is_stacked(name):
        return (name,)
    suffix = name[len(STACKED_PREFIX):]
    return tuple(f"{STACKED_PREFIX}{layer}.{suffix}" for layer in range(num_layers))


def stacked_parameter(tensor_name: str) -> tuple[str, int] | None:
    """(parameter name, layer) of an HF per-layer tensor name; None for a tensor outside the decoder stack."""
    match = _LAYER_TENSOR.match(tensor_name)
    return None if match is None else (STACKED_PREFIX + match.group(2), int(match.group(1)))
