"""The inner loop both Triton kernels share: walk a sequence's pages P at a time with an online softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import (
    MASK_VALUE,
    cap_scores,
    cdiv,
    dot_nt,
    next_pow2,
    online_softmax_step,
    softmax_init,
    visible,
)

PREFETCH_MODES = ("none", "pages", "tiles")


def attend_pages(q, q_pos, k_ref, v_ref, tables_ref, row, layer, h, lo, num_blocks, *, pages_per_block: int,
                 scale: float, window: int | None, precision, softcap: float | None = None, prefetch: str = "none"):
    """Attend queries q [R, d] at positions q_pos [R, 1] (or a scalar) to the keys of pages
    [lo, lo + num_blocks * P) of block-table row `row`; returns the online-softmax state (m, l, acc).

    k_ref/v_ref are the whole cache [L, K, NB, bs, d]; the P pages of a block come in one gathered load, whose
    addresses depend on a load of the block's P page ids from the table: two memory latencies in a row.
    `prefetch` moves loads one step ahead, riding in the loop carry:
      "none"   each step loads its page ids, then its tiles;
      "pages"  the next block's page ids are loaded during this step (P ints of carry), so a step waits for one
               latency, not two;
      "tiles"  the next block's tiles themselves are loaded before this block's math (2 tiles of carry), so a
               program's memory latency overlaps its own compute rather than only other programs'.
    A prefetching last step reloads its own block. Block 0 is loaded even when num_blocks is 0, so the caller
    must keep [lo, lo + P) inside the table (the decode kernel pads it to whole splits).
    """
    if prefetch not in PREFETCH_MODES:
        raise ValueError(f"prefetch must be one of {PREFETCH_MODES}, got {prefetch!r}")
    P = pages_per_block
    bs, d = k_ref.shape[-2:]
    last = jnp.maximum(num_blocks - 1, 0)

    def page_ids(i):
        return tables_ref[row, pl.ds(lo + jnp.minimum(i, last) * P, P)]

    def load(pages):  # in the compute dtype: a float8 cache is widened as it is read
        return (k_ref[layer, h, pages].reshape(P * bs, d).astype(q.dtype),
                v_ref[layer, h, pages].reshape(P * bs, d).astype(q.dtype))

    def attend(i, state, k, v):
        s = cap_scores(dot_nt(q, k, precision) * scale, softcap)
        k_pos = (lo + i * P) * bs + jnp.arange(P * bs)[None, :]
        s = jnp.where(visible(q_pos, k_pos, window), s, MASK_VALUE)
        return online_softmax_step(state, s, v, precision)

    init = softmax_init(q.shape[0], d)
    if prefetch == "none":
        return jax.lax.fori_loop(0, num_blocks, lambda i, state: attend(i, state, *load(page_ids(i))), init)

    if prefetch == "pages":
        def body(i, carry):
            state, pages = carry
            upcoming = page_ids(i + 1)
            return attend(i, state, *load(pages)), upcoming

        state, _ = jax.lax.fori_loop(0, num_blocks, body, (init, page_ids(0)))
        return state

    def body(i, carry):
        state, k, v = carry
        upcoming = load(page_ids(i + 1))
        return (attend(i, state, k, v), *upcoming)

    state, _, _ = jax.lax.fori_loop(0, num_blocks, body, (init, *load(page_ids(0))))
    return state


def block_count(lo, hi, pages_per_block: int):
    """Number of P-page blocks from page lo (a multiple of P) up to page hi."""
    return jax.lax.div(jnp.maximum(hi - lo, 0) + pages_per_block - 1, pages_per_block)


def choose_block_pages(requested: int, table_width: int, block_size: int) -> int:
    """P: a power of two (it is the leading dim of a gathered load), no wider than the table needs, and wide
    enough that a block's P * bs keys make a dot at least 16 wide."""
    return max(next_pow2(min(requested, table_width)), next_pow2(cdiv(16, block_size)))


def check_gpu_tiles(block_size: int, head_dim: int):
    """Triton tiles are powers of two, and a dot's contraction at least 16 wide."""
    for name, n, least in (("block_size", block_size, 1), ("head_dim", head_dim, 16)):
        if n & (n - 1) or n < least:
            raise ValueError(f"the Triton paged-attention kernels need {name} to be a power of two >= {least}, "
                             f"got {n}")


def check_gpu_cache_dtype(dtype, compute_capability: str | None):
    """Triton widens float8_e4m3fn (an fp8 KV cache's pages) with an instruction of compute capability 8.9 (Ada,
    Hopper) and later; Pallas refuses the cast below that, inside the first compile."""
    if jnp.dtype(dtype) == jnp.float8_e4m3fn and compute_capability and float(compute_capability) < 8.9:
        raise ValueError(f"an fp8 (e4m3) KV cache needs compute capability 8.9 or later for the Triton attention "
                         f"kernels, and this GPU has {compute_capability}: use kv_cache_dtype (--kv-cache-dtype) "
                         "fp8_e5m2, or attention_impl (--attention-impl) reference")
