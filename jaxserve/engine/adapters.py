"""The engine's LoRA adapters: which requests may name which adapter, their factors read on the host, and the
writes of newly assigned slots onto the devices before the step that first uses them."""

from __future__ import annotations

import logging
import threading

from jaxserve.core.adapter_slots import AdapterSlots
from jaxserve.loader.lora import read_adapter
from jaxserve.lora_request import LoRARequest
from jaxserve.runner.lora_weights import write_adapter

log = logging.getLogger(__name__)


def lora_slots(enable_lora: bool, max_loras: int, lora_modules: dict[str, str] | None) -> tuple[bool, int]:
    """-> (enable_lora, max_loras): named adapters turn LoRA on, and get a slot each (they all start resident;
    adapters loaded later take the least recently used slot no request runs with)."""
    modules = lora_modules or {}
    if len(modules) > max_loras:
        log.info("max_loras raised from %d to %d: one slot for each named adapter", max_loras, len(modules))
    return bool(enable_lora or modules), max(max_loras, len(modules))


class EngineAdapters:
    """Adapters by name: `check` (any thread) reads a new one once and gives every request naming it the same
    `LoRARequest`; `remove` (any thread) takes the name away, and the host factors and device slot of a removed
    adapter are dropped by `purge_removed` (the thread that steps the engine) once no request uses them."""

    def __init__(self, runner, cfg, max_loras: int, max_lora_rank: int, enabled: bool):
        self.enabled = enabled
        self.max_lora_rank = max_lora_rank
        self.slots = AdapterSlots(max_loras if enabled else 0)
        self._runner = runner
        self._cfg = cfg  # the checkpoint's real sizes (the runner pads to the mesh)
        self._known: dict[str, LoRARequest] = {}  # name -> the adapter requests naming it run with
        self._factors: dict[LoRARequest, dict] = {}  # host factors, read once (requests are prepared off-thread)
        self._removed: set[LoRARequest] = set()  # unloaded; purged once no request runs with them
        self.preloaded: dict[str, LoRARequest] = {}  # loaded at start (the server's named adapters)
        # Called with (slot, factors) before each device write: a multi-process leader sends them to the followers.
        self.before_write = None
        self._lock = threading.Lock()

    def check(self, lora: LoRARequest | None) -> LoRARequest | None:
        """Validate a request's adapter and read it from disk if new (safe from any thread); ValueError if bad.
        Returns the engine's own LoRARequest for that name."""
        if lora is None:
            return None
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        if not self.enabled:
            raise ValueError(f"adapter {lora.lora_name!r} was requested but LoRA is off: create the engine with "
                             "enable_lora=True (serve: --enable-lora)")
        with self._lock:
            known = self._known.get(lora.lora_name)
            if known is not None and known.lora_path != lora.lora_path:
                raise ValueError(f"adapter name {lora.lora_name!r} is already in use for {known.lora_path}; give the "
                                 f"adapter at {lora.lora_path} another name")
            if known is None:
                self._removed.discard(lora)  # removed, not yet purged, and named again: it stays
                self._factors[lora] = read_adapter(lora.lora_path, self._cfg, self.max_lora_rank, self._runner.dtype)
                self._known[lora.lora_name] = known = lora
        return known

    def replace(self, lora: LoRARequest) -> LoRARequest:
        """Serve name `lora.lora_name` with these files from now on (vLLM's load_inplace; any thread). The files are
        read first, so a directory that cannot be served leaves the adapter of that name serving. Requests already
        running finish with the old adapter, as after `remove`; the new one is loaded on demand (not pinned)."""
        if not self.enabled:
            return self.check(lora)  # the error that says LoRA is off
        with self._lock:
            old = self._known.get(lora.lora_name)
        if old is not None and old.lora_int_id == lora.lora_int_id:
            raise ValueError(f"adapter {lora.lora_name!r} already has lora_int_id {lora.lora_int_id}; a replacement "
                             "needs a new id, so that no KV cached for the old files is reused")
        factors = read_adapter(lora.lora_path, self._cfg, self.max_lora_rank, self._runner.dtype)
        with self._lock:
            old = self._known.pop(lora.lora_name, None)
            if old is not None:
                self._retire(old)
            self._removed.discard(lora)
            self._factors[lora] = factors
            self._known[lora.lora_name] = lora
        return lora

    def preload(self, name: str, path: str) -> None:
        """Load an adapter at start, onto the devices too (serve's --lora-modules)."""
        lora = self.check(LoRARequest(name, len(self._known) + 1, path))
        self.slots.place(lora)
        self.preloaded[name] = lora
        self.write_pending()

    def is_current(self, lora: LoRARequest) -> bool:
        """Whether requests may still start with this adapter (it was not removed since they were prepared)."""
        with self._lock:
            return self._known.get(lora.lora_name) is lora

    def known(self) -> list[LoRARequest]:
        with self._lock:
            return list(self._known.values())

    def remove(self, name: str) -> LoRARequest | None:
        """Unload adapter `name` (None if unknown): no request may start with it from now on; those running
        finish with it."""
        with self._lock:
            lora = self._known.pop(name, None)
            if lora is not None:
                self._retire(lora)
        return lora

    def _retire(self, lora: LoRARequest) -> None:
        """No request may start with `lora` now (callers hold the lock); its slot is freed once nothing runs with
        it (purge_removed)."""
        self._removed.add(lora)
        self.preloaded.pop(lora.lora_name, None)

    def purge_removed(self, in_use: set[LoRARequest]) -> None:
        """Free the slots and host factors of removed adapters that no request in `in_use` runs with."""
        with self._lock:
            for lora in self._removed - in_use:
                self.slots.forget(lora)
                del self._factors[lora]
                self._removed.discard(lora)
                log.info("LoRA adapter %s (%s) unloaded", lora.lora_name, lora.lora_path)

    @property
    def has_removed(self) -> bool:
        return bool(self._removed)

    def write_pending(self) -> None:
        """Write the factors of adapters just given a slot onto the devices (before the step that uses them)."""
        for slot, lora in self.slots.pending_loads:
            self.write_factors(slot, self._factors[lora])
            log.info("LoRA adapter %s (%s) loaded into slot %d", lora.lora_name, lora.lora_path, slot)
        self.slots.pending_loads.clear()

    def write_factors(self, slot: int, factors: dict) -> None:
        if self.before_write is not None:
            self.before_write(slot, factors)
        self._runner.params = write_adapter(self._runner.params, factors, slot, self._runner.mesh,
                                            self._runner.layout, self._cfg.num_kv_heads)

    def remove_named(self, lora: str | int) -> bool:
        """Take an adapter away by name or `lora_int_id` (False if none has it)."""
        name = lora if isinstance(lora, str) else next(
            (known.lora_name for known in self.known() if known.lora_int_id == lora), None)
        return name is not None and self.remove(name) is not None

    def usage(self, running, waiting) -> dict:
        """Which adapters running and waiting sequences use (vLLM's lora_requests_info); nothing with LoRA off."""
        if not self.enabled:
            return {}

        def names(seqs) -> list[str]:
            return sorted({seq.lora_request.lora_name for seq in seqs if seq.lora_request is not None})

        return {"max_loras": self.slots.num_slots, "running_lora_adapters": names(running),
                "waiting_lora_adapters": names(waiting)}
