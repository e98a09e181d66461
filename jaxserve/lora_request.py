"""`LoRARequest`: which LoRA adapter a request runs with, as vLLM names it (`vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

import dataclasses

from jaxserve.errors import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder under a name and an integer id, both unique among an engine's adapters."""

    lora_name: str  # what requests call it by (the server's `model` field)
    lora_int_id: int  # its id, at least 1 (0 stands for the base model)
    lora_path: str  # the folder: adapter_config.json and adapter_model.safetensors

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise InvalidRequestError(f"lora_int_id must be an integer of at least 1, got {self.lora_int_id!r}",
                                      param="lora_int_id")
        if not self.lora_name:
            raise InvalidRequestError("lora_name must not be empty", param="lora_name")
        object.__setattr__(self, "lora_path", str(self.lora_path))
