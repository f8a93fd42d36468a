"""Paged decode attention on TPUs: Pallas Mosaic with scalar prefetch.

Grid (B, K): one program per (sequence, kv head). The layer index, context lengths and flattened block tables
are scalar-prefetched into SMEM, so a program can issue its own page DMAs: the cache stays in HBM (memory space
ANY) and the sequence's pages come into VMEM P at a time, double-buffered (tpu_pages.attend_pages), only those
the query can see (up to its position, from the sliding window's start). The G query heads of kv head h are
the R = G rows of one matmul per chunk, accumulated in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import as_layered, cdiv, check_shapes, dot_precision, normalise, pad_axis, page_range
from pallas_kernels.tpu_pages import attend_pages, interpret_params, kv_scratch


def _decode_kernel(layer_ref, lens_ref, tables_ref, q_ref, k_hbm, v_hbm, o_ref, *kv_scratch_refs, table_width,
                   scale, window, softcap, precision):
    b, h = pl.program_id(0), pl.program_id(1)
    _, P, bs, _ = kv_scratch_refs[0].shape
    q_pos = lens_ref[b] - 1
    lo, hi = page_range(q_pos, q_pos, bs, window)
    m, l, acc = attend_pages(q_ref[...], q_pos, (k_hbm, v_hbm, *kv_scratch_refs), tables_ref, b * table_width,
                             layer_ref[0], h, jax.lax.div(lo, P), jax.lax.div(hi + P - 1, P), scale=scale,
                             window=window, softcap=softcap, precision=precision)
    o_ref[...] = normalise(l, acc).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "softcap", "pages_per_block", "interpret"))
def paged_decode_tpu(q, k_cache, v_cache, block_tables, context_lens, *, layer=0, scale: float,
                     sliding_window: int | None = None, softcap: float | None = None, pages_per_block: int = 8,
                     interpret: bool = False) -> jax.Array:
    """Same contract as paged_decode_gpu: q [B, H, d], caches [L, K, NB, bs, d] -> [B, H, d]."""
    k_cache, v_cache = as_layered(k_cache), as_layered(v_cache)
    K, G = check_shapes(q, k_cache, v_cache)
    B, H, d = q.shape
    bs = k_cache.shape[3]
    MB = block_tables.shape[1]
    P = min(pages_per_block, MB)
    width = cdiv(MB, P) * P  # whole chunks, so a chunk's DMAs never read past its row
    tables = pad_axis(block_tables.astype(jnp.int32), 1, width).reshape(-1)  # 1-D: SMEM pads 2-D arrays
    kernel = functools.partial(_decode_kernel, table_width=width, scale=scale, window=sliding_window,
                               softcap=softcap, precision=dot_precision(q.dtype))
    q_spec = pl.BlockSpec((None, None, G, d), lambda b, h, *_: (b, h, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(B, K),
        in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=q_spec,
        scratch_shapes=kv_scratch(k_cache.dtype, P, bs, d),
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((B, K, G, d), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret_params(interpret),
        name="paged_decode_attention",
    )(jnp.asarray(layer, jnp.int32).reshape(1), context_lens.astype(jnp.int32), tables,
      q.reshape(B, K, G, d), k_cache, v_cache)
    return out.reshape(B, H, d)
