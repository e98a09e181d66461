"""Adapters laid out as the device's LoRA slots: per projection, A f32[layers, slots, r, in] and B
f32[layers, slots, out, r], layer-leading so the decoder's scan hands each layer its slice (model/lora.py).

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
class LoraSlotArrays:
    """Host arrays of every slot of every decoder projection."""

    a: Mapping[str, np.ndarray]  # projection -> f32[layers, slots, max_rank, in]
    b: Mapping[str, np.ndarray]  # projection -> f32[layers, slots, out, max_rank], scaling folded in

    @classmethod
    def zeros(cls, config: LlamaConfig, num_slots: int, max_rank: int) -> LoraSlotArrays:
        """Every slot empty; `num_slots` counts slot 0 (max_loras + 1)."""
        layers = config.num_hidden_layers
        shapes = {p: projection_shape(config, p) for p in PROJECTIONS}
        return cls(a={p: np.zeros((layers, num_slots, max_rank, i), np.float32) for p, (_, i) in shapes.items()},
                   b={p: np.zeros((layers, num_slots, o, max_rank), np.float32) for p, (o, _) in shapes.items()})

    def write(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Puts `adapter` (None: no adapter) into `slot`, replacing what the slot held; slot 0 is never written."""
        if slot == 0:
            raise ValueError("slot 0 is the base model's (no adapter) and stays zero")
        for projection in PROJECTIONS:
            self.a[projection][:, slot] = 0.0
            self.b[projection][:, slot] = 0.0
            weights = adapter.weights.get(projection) if adapter is not None else None
            if weights is not None:
                rank = adapter.rank
                self.a[projection][:, slot, :rank] = weights.a
                self.b[projection][:, slot, :, :rank] = np.float32(adapter.scaling) * weights.b
