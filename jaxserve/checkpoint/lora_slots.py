"""An adapter laid out as one of the device's LoRA slots (model/lora.py's LoraStack holds them all: per projection,
A f[layers, slots, r, in] and B f[layers, slots, out, r], layer-leading so the decoder's scan hands each layer its
slice).

Slot 0 stays zero (no adapter). An adapter of rank r < max_rank fills the first r rows of A and columns of B, the
rest zero, and its scaling is folded into B, so every slot computes exactly scaling · B @ A of its adapter. A
projection an adapter does not adapt stays zero in its slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from jaxserve.checkpoint.lora_adapter import LoraAdapter, projection_shape
from jaxserve.checkpoint.lora_config import PROJECTIONS
from jaxserve.model.config import LlamaConfig


@dataclasses.dataclass(frozen=True)
class SlotWeights:
    """One slot's contents: an adapter's A and B for every projection, padded to the maximum rank, scaling in B."""

    a: Mapping[str, np.ndarray]  # projection -> f32[layers, max_rank, in]
    b: Mapping[str, np.ndarray]  # projection -> f32[layers, out, max_rank], scaling folded in

    @classmethod
    def of(cls, adapter: LoraAdapter | None, config: LlamaConfig, max_rank: int) -> SlotWeights:
        """`adapter` laid out for a slot of a model running as `config` (None: an empty slot); a projection it does
        not adapt stays zero. Where the model runs its KV heads repeated (tensor parallelism over more devices than
        KV heads), k_proj's and v_proj's B rows are repeated with them, as their weights' rows are."""
        layers = config.num_hidden_layers
        shapes = {p: projection_shape(config, p) for p in PROJECTIONS}
        a = {p: np.zeros((layers, max_rank, i), np.float32) for p, (_, i) in shapes.items()}
        b = {p: np.zeros((layers, o, max_rank), np.float32) for p, (o, _) in shapes.items()}
        for projection, weights in (adapter.weights.items() if adapter is not None else ()):
            a[projection][:, :adapter.rank] = weights.a
            stored_b = _repeated_heads(weights.b, shapes[projection][0], config.head_dim)
            b[projection][:, :, :adapter.rank] = np.float32(adapter.scaling) * stored_b
        return cls(a=a, b=b)


def _repeated_heads(b: np.ndarray, out: int, head_dim: int) -> np.ndarray:  # f32[layers, out, r]
    """b f32[layers, stored_out, r] with each head's rows repeated out // stored_out times (copy c of head h
    becomes head h * copies + c, as parallel/sharding_rules.py's stored_rows lays out the KV weights)."""
    layers, stored_out, rank = b.shape
    if stored_out == out:
        return b
    heads = b.reshape(layers, stored_out // head_dim, head_dim, rank)
    return np.repeat(heads, out // stored_out, axis=1).reshape(layers, out, rank)
