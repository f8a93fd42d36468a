"""The paged KV cache: fixed-size blocks of `block_size` tokens, addressed through per-sequence block tables.

Layout per tensor: [L, K, num_blocks, block_size, d]. Block 0 is the null block: padding tokens write there and
the block manager never hands it out. Heads come before blocks so that one kv head's page is a contiguous
[block_size, d] tile: what a GPU kernel loads in one go, what a TPU DMA copies, and (block_size, d) are the two
minor dims a TPU tiles in memory (with K minor, a TPU would pad K up to 8 or 16 rows). The cache is donated to the step, so its writes happen in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig

KV_LOGICAL_AXES = ("layers", "kv_heads", None, None, "head_dim")


@jax.tree_util.register_dataclass
@dataclass
class KVCache:
    k: jax.Array
    v: jax.Array

    @property
    def num_blocks(self) -> int:
        return self.k.shape[2]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype) -> int:
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize
    return per_token * block_size


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype, sharding=None) -> KVCache:
    shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)

    @jax.jit
    def zeros():
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    if sharding is not None:
        zeros = jax.jit(zeros, out_shardings=KVCache(sharding, sharding))
    return zeros()
