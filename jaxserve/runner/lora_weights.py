"""Write a LoRA adapter's factors (loader/lora.py) into one slot of the placed adapter weights (models/lora.py).

The slot's factors are padded for the mesh like the weights they change (heads, layer slots of pipeline
stages) and written with a jitted update whose slot index is traced, so loading another adapter into another
slot compiles nothing new. The step programs see the new arrays from their next dispatch; a step already in
flight keeps the arrays it was given.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.parallel.layout import ParallelLayout
from jaxserve.parallel.padding import pad_weight
from jaxserve.parallel.sharding import named_sharding


def _set_slot(stacked: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(stacked, value.astype(stacked.dtype), slot, axis=1)


def write_adapter(params, factors: dict[str, np.ndarray], slot: int, mesh: Mesh, layout: ParallelLayout,
                  num_kv_heads: int):
    """`params` with `factors` ({"wq_lora_a": [L, ...], ...}, real sizes) in adapter slot `slot`."""
    flat = dict(nnx.to_flat_state(params))
    for name, array in factors.items():
        var = flat[("layers", name)]
        logical = var.get_metadata()["logical"]
        padded = pad_weight(array[:, None], logical, layout, num_kv_heads)  # [L, 1, ...] as [L, N, ...] pads
        value = jax.device_put(padded, named_sharding(mesh, logical))
        stacked = var[...]
        flat[("layers", name)] = var.replace(jax.jit(_set_slot, out_shardings=stacked.sharding)(stacked, slot, value))
    return nnx.from_flat_state(list(flat.items()))
