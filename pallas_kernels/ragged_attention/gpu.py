"""Ragged paged attention on GPUs (Pallas on Triton): prefill chunks and decode tokens of many sequences in one
flat batch, each token attending causally to its own sequence's pages.

The tokens are first cut into tiles of TQ tokens of a single sequence (tiles.py) and gathered into
[NT, K, R, d], R = TQ * G rows (padded to a power of two >= 16). Grid (NT, K): one program per (tile, kv head)
walks the pages the tile's tokens can see (the first token's window start to the last token's position), P at a
time, with per-row causal masks. Keys are loaded once per tile for its R rows, not once per token, which is what
makes long prefills cheap.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import (
    as_layered,
    cdiv,
    check_shapes,
    dot_precision,
    log_sum_exp,
    next_pow2,
    normalise,
    pad_axis,
)
from pallas_kernels.gpu_pages import attend_pages, block_count, check_gpu_tiles, choose_block_pages
from pallas_kernels.ragged_attention.tiles import gather_tiles, plan_tiles, scatter_tiles, tile_pages


def _ragged_kernel(layer_ref, seq_ref, len_ref, pos_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, *lse_ref, group,
                   pages_per_block, scale, window, softcap, precision):
    i, h = pl.program_id(0), pl.program_id(1)
    P, bs = pages_per_block, k_ref.shape[-2]
    n, first = len_ref[i], pos_ref[i]
    lo, hi = tile_pages(first, n, bs, window)
    lo = jax.lax.div(lo, P) * P
    # Row r holds token r // G of the tile; padding rows repeat the last token so no row is ever fully masked.
    rows = jnp.arange(q_ref.shape[0])[:, None]
    q_pos = first + jnp.minimum(jax.lax.div(rows, group), jnp.maximum(n - 1, 0))
    m, l, acc = attend_pages(q_ref[...], q_pos, k_ref, v_ref, tables_ref, seq_ref[i], layer_ref[0], h, lo,
                             block_count(lo, hi, P), pages_per_block=P, scale=scale, window=window,
                             softcap=softcap, precision=precision)
    o_ref[...] = normalise(l, acc).astype(o_ref.dtype)
    if lse_ref:  # asked for (return_lse): each row's log-sum-exp of its scores
        lse_ref[0][...] = log_sum_exp(m, l)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "softcap", "rows_per_tile", "pages_per_block",
                                             "num_warps", "num_stages", "interpret", "return_lse"))
def ragged_attention_gpu(q, k_cache, v_cache, block_tables, q_start, q_lens, kv_lens, *, layer=0, scale: float,
                         sliding_window: int | None = None, softcap: float | None = None,
                         rows_per_tile: int = 64, pages_per_block: int = 4,
                         num_warps: int = 4, num_stages: int = 2, interpret: bool = False, return_lse: bool = False):
    """q [T, H, d]; caches [L, K, NB, bs, d]; block_tables [B, MB]; q_start, q_lens, kv_lens [B] -> [T, H, d].
    `return_lse`: also each token's and head's log-sum-exp of its scores [T, H] (float32), for what the kernel
    does not see (gpt-oss's attention sinks)."""
    k_cache, v_cache = as_layered(k_cache), as_layered(v_cache)
    K, G = check_shapes(q, k_cache, v_cache)
    T, H, d = q.shape
    bs = k_cache.shape[3]
    check_gpu_tiles(bs, d)
    R = max(16, next_pow2(rows_per_tile), next_pow2(G))
    plan = plan_tiles(q_start, q_lens, kv_lens, T, R // G)
    NT = plan.token.shape[0]
    MB = block_tables.shape[1]
    P = choose_block_pages(pages_per_block, MB, bs)
    tables = pad_axis(block_tables.astype(jnp.int32), 1, cdiv(MB, P) * P)
    kernel = functools.partial(_ragged_kernel, group=G, pages_per_block=P, scale=scale, window=sliding_window, softcap=softcap,
                               precision=dot_precision(q.dtype))
    whole = pl.BlockSpec()
    tile_spec = pl.BlockSpec((None, None, R, d), lambda i, h: (i, h, 0, 0))
    out_specs, out_shape = [tile_spec], [jax.ShapeDtypeStruct((NT, K, R, d), q.dtype)]
    if return_lse:
        out_specs.append(pl.BlockSpec((None, None, R), lambda i, h: (i, h, 0)))
        out_shape.append(jax.ShapeDtypeStruct((NT, K, R), jnp.float32))
    outs = pl.pallas_call(
        kernel,
        grid=(NT, K),
        in_specs=[whole] * 5 + [tile_spec, whole, whole],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(jnp.asarray(layer, jnp.int32).reshape(1), plan.seq, plan.length, plan.first_pos, tables,
      gather_tiles(q, plan, K, R), k_cache, v_cache)
    out = scatter_tiles(outs[0], plan, T, G)
    return (out, scatter_tiles(outs[1][..., None], plan, T, G)[..., 0]) if return_lse else out
