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

from jaxserve.config import KV_CACHE_DTYPES, ModelConfig

KV_LOGICAL_AXES = ("layers", "kv_heads", None, None, "head_dim")
FP8_DTYPES = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


def check_kv_cache_dtype(choice: str) -> None:
    if choice not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {choice!r}")


def resolve_kv_cache_dtype(choice: str, model_dtype) -> jnp.dtype:
    """The dtype K/V are stored in: the model's ("auto"), bfloat16, or a float8 (vLLM's fp8 cache names).

    float8 values are stored unscaled (a scale of 1, vLLM's default when a checkpoint has no calibrated scales):
    e4m3 keeps 3 mantissa bits up to +-448, e5m2 2 bits up to +-57344. Attention reads them back in the compute
    dtype. Half the bytes of a bf16 cache: twice the tokens in the same memory, and half the bytes each decode
    step reads."""
    check_kv_cache_dtype(choice)
    if choice == "auto":
        return jnp.dtype(model_dtype)
    return jnp.dtype(FP8_DTYPES.get(choice, choice))


def to_cache_dtype(x: jax.Array, dtype) -> jax.Array:
    """Cast K/V for storing. A narrower cache saturates at its largest finite value, as vLLM's fp8 cache does: a
    plain cast would turn an out-of-range value into NaN (e4m3 has no infinity) or inf, and poison every later
    step's attention."""
    dtype = jnp.dtype(dtype)
    if jnp.finfo(dtype).max < jnp.finfo(x.dtype).max:
        largest = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -largest, largest)
    return x.astype(dtype)


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


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype, head_dim: int | None = None) -> int:
    """`head_dim`: the head size the cache stores (None: the model's; attention_impl.cache_head_dim)."""
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * (head_dim or cfg.head_dim) * jnp.dtype(dtype).itemsize
    return per_token * block_size


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype, sharding=None,
                      head_dim: int | None = None) -> KVCache:
    shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, head_dim or cfg.head_dim)

    @jax.jit
    def zeros():
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    if sharding is not None:
        zeros = jax.jit(zeros, out_shardings=KVCache(sharding, sharding))
    return zeros()
