"""Pure-jnp paged attention: the ground truth the kernels are tested against.

`attend_tokens` is the general form (each token attends to its own sequence's pages at positions <= its own);
decode is the case of one token per sequence at position context_len - 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import as_layered, cap_scores


def attend_tokens(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, rows: jax.Array, positions: jax.Array,
                  *, layer=0, scale: float, sliding_window: int | None = None,
                  softcap: float | None = None) -> jax.Array:
    """q [T, H, d]; rows [T, MB] the block-table row of each token; positions [T] (-1: no context, output 0)."""
    T, H, d = q.shape
    k_pages, v_pages = as_layered(k_cache)[layer], as_layered(v_cache)[layer]  # [K, NB, bs, d]
    K, _, bs, _ = k_pages.shape
    S = rows.shape[1] * bs
    k = k_pages[:, rows].reshape(K, T, S, d).astype(q.dtype)  # a float8 cache is read in the compute dtype
    v = v_pages[:, rows].reshape(K, T, S, d).astype(q.dtype)
    qg = q.reshape(T, K, H // K, d)
    scores = cap_scores(jnp.einsum("TKGd,KTSd->TKGS", qg, k, preferred_element_type=jnp.float32,
                                   precision=jax.lax.Precision.HIGHEST) * scale, softcap)
    kv_pos = jnp.arange(S)[None, :]
    seen = kv_pos <= positions[:, None]
    if sliding_window is not None:
        seen &= kv_pos > positions[:, None] - sliding_window
    scores = jnp.where(seen[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(seen.any(axis=1)[:, None, None, None], probs, 0.0)  # no context: 0 rather than NaN
    out = jnp.einsum("TKGS,KTSd->TKGd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32,
                     precision=jax.lax.Precision.HIGHEST)
    return out.reshape(T, H, d).astype(q.dtype)


def paged_decode_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                           context_lens: jax.Array, *, layer=0, scale: float,
                           sliding_window: int | None = None, softcap: float | None = None) -> jax.Array:
    """q [B, H, d]: sequence b's one new token, at position context_lens[b] - 1 (its K/V already cached)."""
    return attend_tokens(q, k_cache, v_cache, block_tables, context_lens - 1, layer=layer, scale=scale,
                         sliding_window=sliding_window, softcap=softcap)
