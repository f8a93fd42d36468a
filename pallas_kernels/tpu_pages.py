"""The inner loop both Mosaic TPU kernels share: DMA a sequence's pages from HBM, P at a time, double-buffered,
and fold them into an online softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import MASK_VALUE, cap_scores, dot_nt, online_softmax_step, softmax_init, visible


def attend_pages(q, q_pos, kv_refs, tables_ref, table_base, layer, h, c_lo, c_hi, *, scale: float,
                 window: int | None, precision, softcap: float | None = None):
    """Attend q [R, d] at positions q_pos [R, 1] to chunks [c_lo, c_hi) of P pages each, the pages of chunk c
    being tables_ref[table_base + c*P + j] (tables flattened in SMEM); returns (m, l, acc).

    kv_refs = (k_hbm, v_hbm, k_buf, v_buf, sems): the caches [L, K, NB, bs, d] left in HBM, two VMEM slots
    [2, P, bs, d] for each, and DMA semaphores [2 (k/v), 2 (slot)]. While chunk c is computed, chunk c+1's
    copies are already in flight into the other slot.
    """
    k_hbm, v_hbm, k_buf, v_buf, sems = kv_refs
    _, P, bs, d = k_buf.shape

    def copies(chunk, slot):
        out = []
        for j in range(P):
            page = tables_ref[table_base + chunk * P + j]
            out.append(pltpu.make_async_copy(k_hbm.at[layer, h, page], k_buf.at[slot, j], sems.at[0, slot]))
            out.append(pltpu.make_async_copy(v_hbm.at[layer, h, page], v_buf.at[slot, j], sems.at[1, slot]))
        return out

    @pl.when(c_lo < c_hi)
    def _first():
        for cp in copies(c_lo, 0):
            cp.start()

    def body(c, carry):
        slot = jax.lax.rem(c - c_lo, 2)

        @pl.when(c + 1 < c_hi)
        def _prefetch():
            for cp in copies(c + 1, 1 - slot):
                cp.start()

        for cp in copies(c, slot):
            cp.wait()
        k = k_buf[slot].reshape(P * bs, d).astype(q.dtype)  # a float8 cache is widened as it is read
        v = v_buf[slot].reshape(P * bs, d).astype(q.dtype)
        s = cap_scores(dot_nt(q, k, precision) * scale, softcap)
        k_pos = c * (P * bs) + jax.lax.broadcasted_iota(jnp.int32, (1, P * bs), 1)
        s = jnp.where(visible(q_pos, k_pos, window), s, MASK_VALUE)
        return online_softmax_step(carry, s, v, precision)

    return jax.lax.fori_loop(c_lo, c_hi, body, softmax_init(q.shape[0], d))


def kv_scratch(dtype, pages_per_block: int, block_size: int, head_dim: int):
    """VMEM slots for two chunks of K and of V pages, and their DMA semaphores."""
    buf = pltpu.VMEM((2, pages_per_block, block_size, head_dim), dtype)
    return [buf, buf, pltpu.SemaphoreType.DMA((2, 2))]


def interpret_params(interpret: bool):
    """TPU kernels run on CPU under the Mosaic interpreter, which models DMAs and semaphores."""
    return pltpu.InterpretParams() if interpret else False
