"""How many KV blocks fit: from device memory on accelerators, from host memory on CPU."""

from __future__ import annotations

import jax
import psutil

from jaxserve.config import ModelConfig
from jaxserve.runner.kv_cache import kv_bytes_per_block

CPU_KV_FRACTION = 0.25  # of available host memory: leaves room for weights, activations and the rest of the machine
CPU_KV_CAP_BYTES = 4 << 30


def default_num_blocks(cfg: ModelConfig, block_size: int, dtype, memory_fraction: float = 0.9) -> int:
    per_block = kv_bytes_per_block(cfg, block_size, dtype)
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        free = memory_fraction * stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    else:
        free = min(CPU_KV_FRACTION * psutil.virtual_memory().available, CPU_KV_CAP_BYTES)
    return max(2, int(free // per_block))
