"""What a request's `model` may name: the served model (under any of its names) or one of its LoRA adapters.

The adapters are kept here, on the event loop, as the HTTP side's record of names: `--lora-modules` at start-up and
POST /v1/load_lora_adapter add to it once the engine has read the folder; /v1/unload_lora_adapter removes a name,
after which new requests naming it get 404 while those already running finish with the adapter.
"""

from __future__ import annotations

import dataclasses
import itertools

from jaxserve.lora_request import LoRARequest


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """A request's model, resolved."""

    name: str  # what the answer carries: the served model's first name, or the adapter's name
    lora: LoRARequest | None  # the adapter it runs with; None: the base model


class ServedAdapters:
    """The LoRA adapters requests may name, each with the engine id it was given."""

    def __init__(self):
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)  # never reused: an id names one folder for the engine's whole life
        self._loading: set[str] = set()  # names whose load the engine thread has not answered yet

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def all(self) -> list[LoRARequest]:
        """In the order they were added."""
        return list(self._by_name.values())

    def is_taken(self, name: str) -> bool:
        """Served, or being loaded."""
        return name in self._by_name or name in self._loading

    def reserve(self, name: str, path: str) -> LoRARequest:
        """The LoRARequest a new adapter is loaded under; its name is taken until `settle`."""
        lora = LoRARequest(name, next(self._ids), path)
        self._loading.add(name)
        return lora

    def settle(self, lora: LoRARequest, accepted: bool) -> None:
        """The engine accepted the reserved adapter (it is served from now on) or refused it (the name is free)."""
        self._loading.discard(lora.lora_name)
        if accepted:
            self.add(lora)

    def add(self, lora: LoRARequest) -> None:
        self._by_name[lora.lora_name] = lora

    def remove(self, name: str) -> LoRARequest | None:
        return self._by_name.pop(name, None)
