"""The inner loop both Triton kernels share: walk a sequence's pages P at a time with an online softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.common import (MASK_VALUE, cap_scores, cdiv, dot_nt, next_pow2, online_softmax_step, softmax_init,
                                   visible)


def attend_pages(q, q_pos, k_ref, v_ref, tables_ref, row, layer, h, lo, num_blocks, *, pages_per_block: int,
                 scale: float, window: int | None, precision, softcap: float | None = None):
    """Attend queries q [R, d] at positions q_pos [R, 1] (or a scalar) to the keys of pages
    [lo, lo + num_blocks * P) of block-table row `row`; returns the online-softmax state (m, l, acc).

    k_ref/v_ref are the whole cache [L, K, NB, bs, d]; the P pages of a block come in one gathered load.
    """
    P = pages_per_block
    bs, d = k_ref.shape[-2:]

    def body(i, carry):
        first = lo + i * P
        pages = tables_ref[row, pl.ds(first, P)]
        k = k_ref[layer, h, pages].reshape(P * bs, d)
        v = v_ref[layer, h, pages].reshape(P * bs, d)
        s = cap_scores(dot_nt(q, k, precision) * scale, softcap)
        k_pos = first * bs + jnp.arange(P * bs)[None, :]
        s = jnp.where(visible(q_pos, k_pos, window), s, MASK_VALUE)
        return online_softmax_step(carry, s, v, precision)

    return jax.lax.fori_loop(0, num_blocks, body, softmax_init(q.shape[0], d))


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
