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


def check_lora_options(enable_lora: bool, max_loras: int, max_lora_rank: int,
                       lora_modules: dict[str, str] | None) -> tuple[bool, int]:
    """-> (enable_lora, max_loras): named adapters turn LoRA on, and get a slot each (they stay resident)."""
    for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    modules = lora_modules or {}
    if not isinstance(modules, dict) or not all(isinstance(k, str) and k and isinstance(v, str) for k, v in modules.items()):
        raise ValueError("lora_modules must map adapter names to adapter directories, e.g. {'sql': '/adapters/sql'}")
    if len(modules) > max_loras:
        log.info("max_loras raised from %d to %d: one slot for each named adapter", max_loras, len(modules))
    return bool(enable_lora or modules), max(max_loras, len(modules))


class EngineAdapters:
    def __init__(self, runner, cfg, max_loras: int, max_lora_rank: int, enabled: bool):
        self.enabled = enabled
        self.max_lora_rank = max_lora_rank
        self.slots = AdapterSlots(max_loras if enabled else 0)
        self._runner = runner
        self._cfg = cfg  # the checkpoint's real sizes (the runner pads to the mesh)
        self._known: dict[str, LoRARequest] = {}
        self._factors: dict[str, dict] = {}  # name -> host factors, read once (requests are prepared off-thread)
        self.preloaded: dict[str, LoRARequest] = {}  # loaded at start and kept (the server's named adapters)
        self._lock = threading.Lock()

    def check(self, lora: LoRARequest | None) -> LoRARequest | None:
        """Validate a request's adapter and read it from disk if new (safe from any thread); ValueError if bad."""
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
                self._factors[lora.lora_name] = read_adapter(lora.lora_path, self._cfg, self.max_lora_rank,
                                                             self._runner.dtype)
                self._known[lora.lora_name] = lora
        if not self.slots.can_hold(lora):
            raise ValueError(f"all max_loras={self.slots.num_slots} adapter slots hold the server's own adapters, so "
                             f"{lora.lora_name!r} cannot be loaded; raise max_loras")
        return lora

    def preload(self, name: str, path: str) -> None:
        """Load an adapter at start and keep it resident (serve's --lora-modules)."""
        lora = self.check(LoRARequest(name, len(self._known) + 1, path))
        self.slots.pin(lora)
        self.preloaded[name] = lora
        self.write_pending()

    def write_pending(self) -> None:
        """Write the factors of adapters just given a slot onto the devices (before the step that uses them)."""
        for slot, lora in self.slots.pending_loads:
            self._runner.params = write_adapter(self._runner.params, self._factors[lora.lora_name], slot,
                                                self._runner.mesh, self._runner.layout, self._cfg.num_kv_heads)
            log.info("LoRA adapter %s (%s) loaded into slot %d", lora.lora_name, lora.lora_path, slot)
        self.slots.pending_loads.clear()
