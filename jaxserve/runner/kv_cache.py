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


def to_cache_dtype(x: jax.Array, dtype, stored=None) -> jax.Array:
    """Cast K/V for storing as `dtype` values, held as `stored` (None: `dtype`; see `storage_dtype`). A narrower
    cache saturates at its largest finite value, as vLLM's fp8 cache does: a plain cast would turn an
    out-of-range value into NaN (e4m3 has no infinity) or inf, and poison every later step's attention."""
    dtype = jnp.dtype(dtype)
    if jnp.finfo(dtype).max < jnp.finfo(x.dtype).max:
        largest = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -largest, largest)
    x = x.astype(dtype)
    return x if stored is None or jnp.dtype(stored) == dtype else jax.lax.bitcast_convert_type(x, stored)


def storage_dtype(dtype, platform: str, xla_attention: bool) -> jnp.dtype:
    """The dtype the cache arrays hold for values of `dtype`: the same, except for a float8 cache read by the XLA
    attention on a CPU, which holds its values' bytes (uint8) and is read back through `cache_values`. XLA:CPU
    converts a float8 array whole on every scatter into it: 180 ms a step for a cache of SmolLM2's 30 layers
    and 512 blocks, against 0.02 ms for the same bytes as uint8 (measured 2026-11-28 on the 2-core CI machine).
    The Pallas kernels read float8 pages themselves, so their cache stays float8."""
    dtype = jnp.dtype(dtype)
    if platform == "cpu" and xla_attention and dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating):
        return jnp.dtype(jnp.uint8)
    return dtype


def cache_values(pages: jax.Array, dtype=None) -> jax.Array:
    """Pages read from the cache as the `dtype` values they hold (None: as stored): bytes of a float8 cache
    (`storage_dtype`) are reinterpreted, which costs nothing beside the gather that read them."""
    if dtype is None or pages.dtype == jnp.dtype(dtype):
        return pages
    return jax.lax.bitcast_convert_type(pages, dtype)


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
