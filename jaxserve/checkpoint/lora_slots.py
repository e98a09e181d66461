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
        """`adapter` laid out for a slot (None: an empty slot); a projection it does not adapt stays zero."""
        layers = config.num_hidden_layers
        shapes = {p: projection_shape(config, p) for p in PROJECTIONS}
        a = {p: np.zeros((layers, max_rank, i), np.float32) for p, (_, i) in shapes.items()}
        b = {p: np.zeros((layers, o, max_rank), np.float32) for p, (o, _) in shapes.items()}
        for projection, weights in (adapter.weights.items() if adapter is not None else ()):
            a[projection][:, :adapter.rank] = weights.a
            b[projection][:, :, :adapter.rank] = np.float32(adapter.scaling) * weights.b
        return cls(a=a, b=b)
