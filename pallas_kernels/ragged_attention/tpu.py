"""Ragged paged attention on TPUs (Pallas Mosaic, scalar prefetch): the TPU twin of gpu.py.

Tokens are cut into single-sequence tiles (tiles.py) and gathered into [NT, K, R, d], R = TQ * G rows rounded
up to the 8-row sublane tile. Grid (NT, K): one program per (tile, kv head). The tile table (sequence, length,
first position), the layer and the flattened block tables are scalar-prefetched into SMEM; each program DMAs
the pages its tokens can see from HBM, P at a time and double-buffered (tpu_pages.attend_pages), and applies
per-row causal masks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import as_layered, cdiv, check_shapes, dot_precision, normalise, pad_axis
from pallas_kernels.ragged_attention.tiles import gather_tiles, plan_tiles, scatter_tiles, tile_pages
from pallas_kernels.tpu_pages import attend_pages, interpret_params, kv_scratch


def _ragged_kernel(layer_ref, seq_ref, len_ref, pos_ref, tables_ref, q_ref, k_hbm, v_hbm, o_ref,
                   *kv_scratch_refs, group, table_width, scale, window, softcap, precision):
    i, h = pl.program_id(0), pl.program_id(1)
    _, P, bs, _ = kv_scratch_refs[0].shape
    n, first = len_ref[i], pos_ref[i]
    lo, hi = tile_pages(first, n, bs, window)
    # Row r holds token r // G of the tile; padding rows repeat the last token so no row is ever fully masked.
    rows = jax.lax.broadcasted_iota(jnp.int32, (q_ref.shape[0], 1), 0)
    q_pos = first + jnp.minimum(jax.lax.div(rows, group), jnp.maximum(n - 1, 0))
    m, l, acc = attend_pages(q_ref[...], q_pos, (k_hbm, v_hbm, *kv_scratch_refs), tables_ref,
                             seq_ref[i] * table_width, layer_ref[0], h, jax.lax.div(lo, P),
                             jax.lax.div(hi + P - 1, P), scale=scale, window=window, softcap=softcap,
                             precision=precision)
    o_ref[...] = normalise(l, acc).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "softcap", "rows_per_tile", "pages_per_block",
                                             "interpret"))
def ragged_attention_tpu(q, k_cache, v_cache, block_tables, q_start, q_lens, kv_lens, *, layer=0, scale: float,
                         sliding_window: int | None = None, softcap: float | None = None,
                         rows_per_tile: int = 128, pages_per_block: int = 8,
                         interpret: bool = False) -> jax.Array:
    """Same contract as ragged_attention_gpu: q [T, H, d], caches [L, K, NB, bs, d] -> [T, H, d]."""
    k_cache, v_cache = as_layered(k_cache), as_layered(v_cache)
    K, G = check_shapes(q, k_cache, v_cache)
    T, H, d = q.shape
    bs = k_cache.shape[3]
    TQ = max(1, rows_per_tile // G)
    R = cdiv(TQ * G, 8) * 8
    plan = plan_tiles(q_start, q_lens, kv_lens, T, TQ)
    NT = plan.token.shape[0]
    MB = block_tables.shape[1]
    P = min(pages_per_block, MB)
    width = cdiv(MB, P) * P  # whole chunks, so a chunk's DMAs never read past its row
    tables = pad_axis(block_tables.astype(jnp.int32), 1, width).reshape(-1)
    kernel = functools.partial(_ragged_kernel, group=G, table_width=width, scale=scale, window=sliding_window, softcap=softcap,
                               precision=dot_precision(q.dtype))
    tile_spec = pl.BlockSpec((None, None, R, d), lambda i, h, *_: (i, h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(NT, K),
        in_specs=[tile_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=tile_spec,
        scratch_shapes=kv_scratch(k_cache.dtype, P, bs, d),
    )
    o = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((NT, K, R, d), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret_params(interpret),
        name="ragged_paged_attention",
    )(jnp.asarray(layer, jnp.int32).reshape(1), plan.seq, plan.length, plan.first_pos, tables,
      gather_tiles(q, plan, K, R), k_cache, v_cache)
    return scatter_tiles(o, plan, T, G)
