"""Random paged-attention inputs for the kernels' tests and the benchmark's --tiny run."""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

# `PALLAS_COMPILED=1 python -m pytest pallas_kernels` on a GPU (or TPU) machine: the kernels of that platform
# compiled, instead of both platforms' kernels interpreted on CPU (the default, and CI's).
COMPILED = os.environ.get("PALLAS_COMPILED") == "1"
INTERPRET = not COMPILED
KERNEL_OF_PLATFORM = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def kernel_backends() -> list[str]:
    """The kernel variants the tests run: ["gpu", "tpu"] interpreted, or this machine's own compiled."""
    if not COMPILED:
        return ["gpu", "tpu"]
    platform = jax.devices()[0].platform
    if platform not in KERNEL_OF_PLATFORM:
        raise RuntimeError(f"PALLAS_COMPILED=1 compiles the kernels for this machine's GPU or TPU, but jax sees "
                           f"{platform!r}: unset it to interpret them on CPU")
    return [KERNEL_OF_PLATFORM[platform]]


BACKENDS = kernel_backends()
GPU_ONLY = [b for b in BACKENDS if b == "gpu"]  # tests of the GPU variant's own options


@dataclass
class PagedCase:
    q: jax.Array  # [T, H, d]
    k_cache: jax.Array  # [L, K, NB, bs, d]
    v_cache: jax.Array
    block_tables: jax.Array  # [B, MB], pages shuffled so no table is contiguous; unused entries 0
    kv_lens: jax.Array  # [B] context length of each sequence (after this step)
    layer: int


def random_paged_case(seed: int, *, kv_lens, num_tokens: int, H: int, K: int, d: int, bs: int = 16, L: int = 2,
                      dtype=jnp.float32, extra_table_width: int = 1, v_scale: float = 1.0) -> PagedCase:
    rng = np.random.default_rng(seed)
    kv_lens = np.asarray(kv_lens, np.int32)
    pages_needed = -(-kv_lens // bs)
    NB = 1 + int(pages_needed.sum()) + 3  # block 0 is the null block; a few spare pages stay unused
    MB = int(pages_needed.max()) + extra_table_width
    free = rng.permutation(np.arange(1, NB))
    tables = np.zeros((len(kv_lens), MB), np.int32)
    used = 0
    for b, n in enumerate(pages_needed):
        tables[b, :n] = free[used : used + n]
        used += n
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (L, K, NB, bs, d)
    return PagedCase(
        q=jax.random.normal(keys[0], (num_tokens, H, d), jnp.float32).astype(dtype),
        k_cache=jax.random.normal(keys[1], shape, jnp.float32).astype(dtype),
        v_cache=(v_scale * jax.random.normal(keys[2], shape, jnp.float32)).astype(dtype),
        block_tables=jnp.asarray(tables),
        kv_lens=jnp.asarray(kv_lens),
        layer=L - 1,
    )


def max_abs_diff(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
