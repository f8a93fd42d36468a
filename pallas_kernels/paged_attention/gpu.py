"""Paged decode attention on GPUs: Pallas on Triton.

Grid (B, K, S): one program per (sequence, kv head, context split). A program holds the G query heads that share
kv head h as R = max(16, next_pow2(G)) rows (Triton needs power-of-two tiles and dots at least 16 wide), walks
its split of the sequence's pages P at a time (one gathered load of P pages of [bs, d] each), and keeps an
online softmax in float32. Splitting the context (flash-decoding) keeps the GPU busy when B * K is small; the
splits' partial outputs and log-sum-exps are merged in plain jnp afterwards.

The whole cache [L, K, NB, bs, d] is passed as one pointer and indexed by (layer, h, page) inside the kernel,
so no per-layer copy of the cache is ever made.
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
    page_range,
)
from pallas_kernels.gpu_pages import attend_pages, block_count, check_gpu_tiles, choose_block_pages

TARGET_PROGRAMS = 512  # enough (sequence, head, split) programs to fill a GPU's SMs a few times over


def _decode_kernel(layer_ref, lens_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, pages_per_block,
                   pages_per_split, scale, window, softcap, precision, prefetch):
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    P, bs = pages_per_block, k_ref.shape[-2]
    q_pos = lens_ref[b] - 1
    lo, hi = page_range(q_pos, q_pos, bs, window)
    split_lo = split * pages_per_split
    lo = jnp.maximum(jax.lax.div(lo, P) * P, split_lo)  # block-aligned so a P-page load never leaves the split
    hi = jnp.minimum(hi, split_lo + pages_per_split)
    m, l, acc = attend_pages(q_ref[...], q_pos, k_ref, v_ref, tables_ref, b, layer_ref[0], h, lo,
                             block_count(lo, hi, P), pages_per_block=P, scale=scale, window=window,
                             softcap=softcap, precision=precision, prefetch=prefetch)
    o_ref[...] = normalise(l, acc)
    lse_ref[...] = log_sum_exp(m, l)


def merge_splits(o: jax.Array, lse: jax.Array) -> jax.Array:
    """o [..., S, R, d], lse [..., S, R] (normalised partial outputs per split) -> [..., R, d]."""
    w = jnp.exp(lse - jnp.max(lse, axis=-2, keepdims=True))  # empty splits carry lse = MASK: weight 0
    return jnp.sum(o * w[..., None], axis=-3) / jnp.sum(w, axis=-2)[..., None]


def default_splits(B: int, K: int, num_page_blocks: int, target_programs: int = TARGET_PROGRAMS) -> int:
    # Split only while B * K programs leave SMs idle; a split's fixed cost (q load, merge) is a few loads.
    return max(1, min(cdiv(target_programs, B * K), num_page_blocks))


@functools.partial(jax.jit, static_argnames=("scale", "sliding_window", "softcap", "pages_per_block", "num_splits",
                                             "num_warps", "num_stages", "prefetch", "target_programs",
                                             "interpret", "return_lse"))
def paged_decode_gpu(q, k_cache, v_cache, block_tables, context_lens, *, layer=0, scale: float,
                     sliding_window: int | None = None, softcap: float | None = None,
                     pages_per_block: int = 4, num_splits: int | None = None,
                     num_warps: int = 2, num_stages: int = 1, prefetch: str = "pages",
                     target_programs: int = TARGET_PROGRAMS, interpret: bool = False, return_lse: bool = False):
    """q [B, H, d]; caches [L, K, NB, bs, d] (or one layer's [K, NB, bs, d]); block_tables [B, MB];
    context_lens [B] (including this step's token, whose K/V is already in the cache) -> [B, H, d].

    num_splits (flash-decoding) defaults to as many as bring the programs up to target_programs; prefetch is
    gpu_pages.attend_pages's.

    The defaults were the fastest of sweeps (bf16, 32 q / 8 kv heads, head_dim 128, 16-token pages;
    BENCHMARKS.md): 4 pages a load and no software pipelining on an H100 and an H200 (num_stages 1: the tiles take
    ~220 registers a thread, so few programs fit an SM, and more of them hide the gathered loads' latency better
    than a pipeline within one); 2 warps and the next block's page ids loaded a step ahead on the H200.

    `return_lse`: also return each head's log-sum-exp of its scores [B, H] (float32), from which a caller adds
    what the kernel does not see (gpt-oss's attention sinks)."""
    k_cache, v_cache = as_layered(k_cache), as_layered(v_cache)
    K, G = check_shapes(q, k_cache, v_cache)
    B, H, d = q.shape
    bs = k_cache.shape[3]
    check_gpu_tiles(bs, d)
    MB = block_tables.shape[1]
    P = choose_block_pages(pages_per_block, MB, bs)
    S = num_splits or default_splits(B, K, cdiv(MB, P), target_programs)
    pages_per_split = cdiv(cdiv(MB, P), S) * P
    tables = pad_axis(block_tables.astype(jnp.int32), 1, pages_per_split * S)  # pad pages: the null block
    R = max(16, next_pow2(G))
    qg = pad_axis(q.reshape(B, K, G, d), 2, R)
    kernel = functools.partial(_decode_kernel, pages_per_block=P, pages_per_split=pages_per_split, scale=scale,
                               window=sliding_window, softcap=softcap,
                               precision=dot_precision(q.dtype), prefetch=prefetch)
    whole = pl.BlockSpec()
    o, lse = pl.pallas_call(
        kernel,
        grid=(B, K, S),
        in_specs=[whole, whole, whole, pl.BlockSpec((None, None, R, d), lambda b, h, s: (b, h, 0, 0)), whole, whole],
        out_specs=[pl.BlockSpec((None, None, None, R, d), lambda b, h, s: (b, h, s, 0, 0)),
                   pl.BlockSpec((None, None, None, R), lambda b, h, s: (b, h, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, K, S, R, d), jnp.float32),
                   jax.ShapeDtypeStruct((B, K, S, R), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(jnp.asarray(layer, jnp.int32).reshape(1), context_lens.astype(jnp.int32), tables, qg, k_cache, v_cache)
    out = (o[:, :, 0] if S == 1 else merge_splits(o, lse))[:, :, :G]  # one split: already normalised
    out = out.reshape(B, H, d).astype(q.dtype)
    if not return_lse:
        return out
    top = jnp.max(lse, axis=2)  # the splits' log-sum-exps combined: [B, K, R]
    total = top + jnp.log(jnp.sum(jnp.exp(lse - top[:, :, None]), axis=2))
    return out, total[:, :, :G].reshape(B, H)
