"""`LoRARequest`: which LoRA adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`) under a name.

    `lora_int_id` is vLLM's unique id per adapter; here the name is the key (a request naming a known adapter runs
    with the engine's own LoRARequest for it) and the id tells apart two loads under one name. The engine loads the
    adapter into a free slot the first time a request names it."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not self.lora_name:
            raise ValueError("LoRARequest needs a non-empty lora_name")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1 (vLLM's convention), got {self.lora_int_id!r}")

    @cached_property  # read at every step of every sequence that uses the adapter
    def cache_root(self) -> bytes:
        """The prefix cache's root hash for this adapter's requests: equal tokens give different KV under
        another adapter, so their blocks must never match across adapters (or with the base model, root b""). The id
        is in it so that an adapter unloaded and loaded again (a new id; its files may have changed) matches nothing
        computed before."""
        return hashlib.sha256(f"lora\0{self.lora_name}\0{self.lora_int_id}\0{self.lora_path}".encode()).digest()
