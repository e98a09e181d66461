"""`DeviceLoraSlots`: the LoRA adapter slots on the devices, and the one compiled program that writes a slot.

The slots (model/lora.py's LoraStack) are every step program's non-donated argument. Under tensor parallelism each
projection's A and B split as its weight does (parallel/sharding_rules.py's lora_partition_specs), so each device's
delta is its share of the projection's output. Writing a slot makes new arrays with the same shardings: a step in
flight keeps the slots it was dispatched with, and the step programs never see a new sharding (no recompile).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.checkpoint.lora_adapter import projection_shape
from jaxserve.checkpoint.lora_config import PROJECTIONS, module_name
from jaxserve.checkpoint.lora_slots import SlotWeights
from jaxserve.model.config import LlamaConfig
from jaxserve.model.lora import LoraStack, empty_lora_stack, with_slot
from jaxserve.model.param_names import stacked_parameter
from jaxserve.parallel import TP_AXIS
from jaxserve.parallel.sharding_rules import lora_partition_specs
from jaxserve.runner.compile_guard import CompileGuard


class DeviceLoraSlots:
    """`max_loras` adapter slots plus slot 0 (none), each `max_rank` wide, in the model's dtype."""

    def __init__(self, model_config: LlamaConfig, mesh: Mesh, max_loras: int, max_rank: int, dtype,
                 placed: bool = True):
        """`placed=False`: the stack's shapes, dtypes and shardings only, for a mesh of devices not at hand whose
        programs are compiled but never run (ModelRunner's compile_only)."""
        self._model_config, self._mesh = model_config, mesh
        self.max_loras, self.max_rank = max_loras, max_rank
        make = functools.partial(empty_lora_stack, {p: projection_shape(model_config, p) for p in PROJECTIONS},
                                 model_config.num_hidden_layers, max_loras + 1, max_rank, dtype)
        # Made on the devices already split: no device ever holds a whole copy.
        made = jax.jit(make, out_shardings=self._shardings(slot_axis=True))
        self.stack: LoraStack = made() if placed else made.trace().out_info
        self._writer: jax.stages.Compiled | None = None  # compiled by `compile_writer`, at warm-up

    def compile_writer(self, guard: CompileGuard) -> None:
        """The slot writer, its output sharded as the stack it replaces, each slot's host arrays sent to the devices
        already split."""
        empty = SlotWeights.of(None, self._model_config, self.max_rank)
        stack, slot = self._shardings(slot_axis=True), self._shardings(slot_axis=False)
        replicated = NamedSharding(self._mesh, P())
        with guard.watch():
            self._writer = jax.jit(with_slot, in_shardings=(stack, replicated, slot.a, slot.b),
                                   out_shardings=stack).lower(
                self.stack, np.int32(1), dict(empty.a), dict(empty.b)).compile()

    def write(self, slot: int, weights: SlotWeights) -> None:
        """Puts one adapter (or an empty slot's zeros) into `slot` for the steps dispatched from now on."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} is not in 1..{self.max_loras}")
        self.stack = self._writer(self.stack, np.int32(slot), dict(weights.a), dict(weights.b))

    def _shardings(self, slot_axis: bool) -> LoraStack:
        """Each projection's A and B sharded as its weight is: the stack's leaves, or without `slot_axis` one slot's
        weights (checkpoint/lora_slots.py's SlotWeights)."""
        cfg, size = self._model_config, self._mesh.shape[TP_AXIS]
        specs = {p: lora_partition_specs(_stacked_weight_name(p), (cfg.num_hidden_layers, *projection_shape(cfg, p)),
                                         size, slot_axis) for p in PROJECTIONS}
        return LoraStack(a={p: NamedSharding(self._mesh, a) for p, (a, _) in specs.items()},
                         b={p: NamedSharding(self._mesh, b) for p, (_, b) in specs.items()})


def _stacked_weight_name(projection: str) -> str:
    """The decoder's stacked weight of a LoRA-adapted projection: `model.layers.self_attn.q_proj.weight`."""
    name, _ = stacked_parameter(f"{module_name(projection, 0)}.weight")
    return name
