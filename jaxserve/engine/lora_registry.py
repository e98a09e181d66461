"""`LoraRegistry`: the LoRA adapters an engine serves, and those read into host memory.

An adapter is read and checked against the base model when it is added (a bad folder is refused then, changing
nothing), kept in host memory among the `max_cpu_loras` most recently used, and read again from its folder when a
request needs it after it was dropped. A request holds its adapter in host memory from the moment it is added until
it ends (`hold` / `release`), so a step, which writes adapters into device slots, never reads a folder: a folder
gone bad fails only the request being added, never a step and the other requests in it. Removing an adapter takes
its name away from new requests; requests already queued or running with it keep their id and finish with it. An id
names one adapter for the engine's whole life: it is never given to another folder or name.
"""

from __future__ import annotations

import collections
from pathlib import Path

from jaxserve.checkpoint.lora_adapter import LoraAdapter, load_lora_adapter
from jaxserve.checkpoint.lora_slots import SlotWeights
from jaxserve.errors import LoraNameTakenError
from jaxserve.lora_request import LoRARequest
from jaxserve.model.config import LlamaConfig


class LoraRegistry:
    """Adapters by name and id, and an LRU of those read."""

    def __init__(self, stored_config: LlamaConfig, running_config: LlamaConfig, max_lora_rank: int,
                 max_cpu_loras: int):
        """`stored_config`: the model as its checkpoint stores it, which adapters are checked against;
        `running_config`: as it runs (KV heads repeated under tensor parallelism), which slots are shaped for."""
        self._stored_config = stored_config
        self._running_config = running_config
        self._max_rank = max_lora_rank
        self._max_cpu_loras = max_cpu_loras
        self._served: dict[str, LoRARequest] = {}  # name -> adapter, for new requests
        self._of_id: dict[int, LoRARequest] = {}  # id -> adapter, removed ones included (queued requests use them)
        self._read: collections.OrderedDict[int, LoraAdapter] = collections.OrderedDict()  # least recent first
        self._holders: collections.Counter[int] = collections.Counter()  # id -> live requests holding it

    def add(self, request: LoRARequest) -> bool:
        """Serves the adapter from now on; False if it is served already (same name, id and folder). Raises
        LoraAdapterError, changing nothing, for a folder that cannot serve, LoraNameTakenError for a name served as
        another adapter or an id ever given to another."""
        served = self._served.get(request.lora_name)
        if served == request:
            return False
        if served is not None:
            raise LoraNameTakenError(f"a LoRA adapter named {request.lora_name!r} is already loaded "
                                     f"(id {served.lora_int_id}, {served.lora_path}); unload it first")
        earlier = self._of_id.get(request.lora_int_id)
        if earlier is not None and earlier != request:
            raise LoraNameTakenError(f"LoRA id {request.lora_int_id} already belongs to adapter "
                                     f"{earlier.lora_name!r} ({earlier.lora_path}); give this one another id")
        adapter = self._read_adapter(request)
        self._served[request.lora_name] = self._of_id[request.lora_int_id] = request
        self._remember(request.lora_int_id, adapter)
        return True

    def remove(self, name: str) -> LoRARequest | None:
        """Stops serving the adapter named `name` to new requests; the removed one, or None if none had the name."""
        return self._served.pop(name, None)

    def get(self, name: str) -> LoRARequest | None:
        return self._served.get(name)

    def served(self) -> list[LoRARequest]:
        """The adapters new requests may name, in the order they were added."""
        return list(self._served.values())

    def ensure_read(self, lora_id: int) -> None:
        """Reads adapter `lora_id` into host memory again if it was dropped (LoraAdapterError if its folder no longer
        reads); call right before `hold`."""
        if lora_id not in self._read:
            self._remember(lora_id, self._read_adapter(self._of_id[lora_id]))

    def hold(self, lora_id: int) -> None:
        """A request of adapter `lora_id` (read: `ensure_read`) was added: keep the adapter in host memory until
        `release`."""
        self._holders[lora_id] += 1
        self._read.move_to_end(lora_id)

    def release(self, lora_id: int) -> None:
        """A request that held `lora_id` ended."""
        self._holders[lora_id] -= 1
        if self._holders[lora_id] <= 0:
            del self._holders[lora_id]

    def slot_weights(self, lora_id: int) -> SlotWeights:
        """Adapter `lora_id` laid out for a device slot, from host memory (a held adapter is never dropped)."""
        adapter = self._read[lora_id]
        self._read.move_to_end(lora_id)
        return SlotWeights.of(adapter, self._running_config, self._max_rank)

    def _read_adapter(self, request: LoRARequest) -> LoraAdapter:
        return load_lora_adapter(Path(request.lora_path), self._stored_config, self._max_rank, request.lora_name)

    def _remember(self, lora_id: int, adapter: LoraAdapter) -> None:
        """Keeps `adapter`, dropping the least recently used others no live request holds beyond max_cpu_loras
        (held ones stay, even beyond it)."""
        self._read[lora_id] = adapter
        self._read.move_to_end(lora_id)
        droppable = [other for other in self._read if other != lora_id and other not in self._holders]
        for dropped in droppable[:max(len(self._read) - self._max_cpu_loras, 0)]:
            del self._read[dropped]
