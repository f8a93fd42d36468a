"""Which LoRA adapter each of the engine's `max_loras` device slots holds (pure Python; no jax).

A sequence takes a reference on its adapter's slot when the scheduler admits it and gives it back when it
finishes. An adapter not resident is loaded into a free slot, or into the least recently used slot no
sequence references; when every slot is referenced, sequences of other adapters wait (later requests whose
adapter is resident go first, as in vLLM). The engine writes the weights of `pending_loads` into the device
slots before the step that first uses them is dispatched.

Slots are keyed by the `LoRARequest` itself (name, id and path), not the name alone: an adapter unloaded and
loaded again under its name is another adapter, and requests still running with the first keep its slot.
"""

from __future__ import annotations

from collections import OrderedDict

from ..lora_request import LoRARequest
from .request import Sequence


class AdapterSlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._resident: OrderedDict[LoRARequest, int] = OrderedDict()  # adapter -> slot, least recently used first
        self._refs = [0] * num_slots
        self.pending_loads: list[tuple[int, LoRARequest]] = []  # (slot, adapter) to write before the next step

    def admit(self, seq: Sequence) -> bool:
        """Give the sequence its adapter's slot (loading it if needed); False if no slot can take it now."""
        lora = seq.lora_request
        if lora is None or seq.lora_slot >= 0:
            return True
        slot = self._resident.get(lora)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            self._resident[lora] = slot
            self.pending_loads.append((slot, lora))
        self._resident.move_to_end(lora)
        self._refs[slot] += 1
        seq.lora_slot = slot
        return True

    def place(self, lora: LoRARequest) -> int | None:
        """Load the adapter now, into a free slot (the server's named adapters, so their first requests wait for no
        load); None when none is free. It is evicted as any other when the slots are wanted (as in vLLM)."""
        slot = self._unused_slot()
        if slot is not None:
            self._resident[lora] = slot
            self.pending_loads.append((slot, lora))
        return slot

    def forget(self, lora: LoRARequest) -> None:
        """The adapter was unloaded: free its slot (at once, or when its last sequence releases it)."""
        self._resident.pop(lora, None)

    def hold(self, slots: tuple[int, ...]) -> None:
        """References of a step inside a pipeline's stages on the slots its sequences run with: its later stages
        read the adapters' weights ticks after it entered, so no slot of theirs goes to another adapter before it
        leaves (`drop`), though its sequences finish or are aborted meanwhile."""
        for slot in slots:
            self._refs[slot] += 1

    def drop(self, slots: tuple[int, ...]) -> None:
        for slot in slots:
            self._refs[slot] -= 1

    def release(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self._refs[seq.lora_slot] -= 1
            seq.lora_slot = -1

    def resident(self) -> dict[str, int]:
        """Adapter name -> slot."""
        return {lora.lora_name: slot for lora, slot in self._resident.items()}

    def _free_slot(self) -> int | None:
        """A slot no adapter holds, else the least recently used one no sequence references (its adapter
        evicted), else None."""
        slot = self._unused_slot()
        if slot is not None:
            return slot
        for lora, slot in self._resident.items():  # least recently used first
            if self._refs[slot] == 0:
                del self._resident[lora]
                return slot
        return None

    def _unused_slot(self) -> int | None:
        # A forgotten adapter's slot stays taken while sequences still run with it.
        used = set(self._resident.values()) | {slot for slot, refs in enumerate(self._refs) if refs}
        return next((slot for slot in range(self.num_slots) if slot not in used), None)
