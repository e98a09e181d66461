"""The LoRA adapters an engine serves over their lifetime: added and removed by name, resolved for each request, held
in host memory by every running continuation that uses one (so a step never reads a folder), and their device slots
forgotten when they go."""

from __future__ import annotations

from jaxserve.checkpoint.lora_slots import SlotWeights
from jaxserve.engine.adapter_slots import AdapterSlots
from jaxserve.engine.lora_registry import LoraRegistry
from jaxserve.errors import InvalidRequestError, ModelNotFoundError
from jaxserve.lora_request import LoRARequest


class EngineLoras:
    """The engine's side of LoRA: the registry of served adapters and which continuation holds which."""

    def __init__(self, registry: LoraRegistry | None, slots: AdapterSlots | None):
        self._registry = registry  # the adapters served, read when added; None: enable_lora is off
        self._slots = slots  # the scheduler's device-slot bookkeeping; None: enable_lora is off
        self._held: dict[str, int] = {}  # continuation -> the adapter id it holds (absent: the base model)

    def add(self, lora_request: LoRARequest) -> bool:
        """Serves an adapter to requests from now on (vLLM's `add_lora`); False if it was served already."""
        if self._registry is None:
            raise InvalidRequestError("LoRA adapters are off: start the engine with enable_lora (--enable-lora)",
                                      param="lora_request")
        return self._registry.add(lora_request)

    def remove(self, lora_name: str) -> bool:
        """Stops serving an adapter to new requests; those queued or running with it finish with it."""
        removed = self._registry.remove(lora_name) if self._registry is not None else None
        if removed is not None:
            self._slots.forget(removed.lora_int_id)
        return removed is not None

    def served(self) -> list[LoRARequest]:
        return self._registry.served() if self._registry is not None else []

    def resolve(self, lora_request: LoRARequest | None, load: bool) -> int:
        """The adapter id a new request runs with (0: the base model), its weights read into host memory. With
        `load` (the offline API) an adapter not served is added first; without it (the server, which resolved the
        name earlier) one unloaded since is refused."""
        if lora_request is None:
            return 0
        if load or self._registry is None:
            self.add(lora_request)
        elif self._registry.get(lora_request.lora_name) != lora_request:
            raise ModelNotFoundError(f"the LoRA adapter {lora_request.lora_name!r} was unloaded before this request "
                                     "reached the engine", param="model")
        self._registry.ensure_read(lora_request.lora_int_id)  # may raise: before anything of the request is kept
        return lora_request.lora_int_id

    def hold(self, continuation: str, lora_id: int) -> None:
        """The continuation keeps its adapter in host memory until `release`."""
        if lora_id:
            self._registry.hold(lora_id)
            self._held[continuation] = lora_id

    def release(self, continuation: str) -> None:
        """The continuation ended (finished, aborted or failed); unknown ones are ignored."""
        lora_id = self._held.pop(continuation, 0)
        if lora_id:
            self._registry.release(lora_id)

    def slot_weights(self, lora_id: int) -> SlotWeights:
        """What a device slot is written with for this adapter."""
        return self._registry.slot_weights(lora_id)

    def forget_slots(self) -> None:
        """After a failed step: writing a slot may have failed after its bookkeeping gave it an adapter."""
        if self._slots is not None:
            self._slots.reset()
