"""Paged attention in plain XLA for the engine's CPU path: a loop over kv blocks with an online softmax.

Unlike `paged_attention_reference` (which gathers every token's whole context at once), the loop runs only
as many blocks as the longest context in this step needs (a dynamic trip count), so the block table can always
be as wide as max_model_len allows without costing compute, and its width is not a compile bucket.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.models.layers import soft_cap
from jaxserve.runner.attention import AttentionMetadata, layer_window, write_kv
from jaxserve.runner.kv_cache import KVCache, cache_values


def blockwise_paged_attention(q, k_cache, v_cache, layer, meta: AttentionMetadata, *, scale: float,
                              sliding_window: int | jax.Array | None = None, softcap: float | None = None,
                              values_dtype=None, sinks: jax.Array | None = None) -> jax.Array:
    """Attention over `layer` of the whole cache [L, K, NB, bs, d]. The pages are gathered straight from the
    whole cache: slicing the layer out first would copy that layer's every page, i.e. the whole cache per step.
    `values_dtype`: what a cache held as bytes holds (kv_cache.storage_dtype). `sinks` [H] (gpt-oss): each
    head's extra logit, which joins the denominator and attends to nothing: the online softmax starts from it
    (running max the sink, normaliser exp(0) = 1, output 0)."""
    T, H, d = q.shape
    _, K, _, bs, _ = k_cache.shape
    G = H // K
    qg = q.reshape(T, K, G, d).astype(jnp.float32) * scale
    rows = meta.block_tables[meta.token_seq]  # [T, MB]
    num_blocks = jnp.max(meta.positions) // bs + 1  # blocks the longest context of this step spans

    def body(j, carry):
        m, l, acc = carry  # running max [T,K,G], normaliser [T,K,G], output [T,K,G,d]
        k = cache_values(k_cache[layer, :, rows[:, j]], values_dtype).astype(jnp.float32)  # [T, K, bs, d]
        v = cache_values(v_cache[layer, :, rows[:, j]], values_dtype).astype(jnp.float32)
        s = soft_cap(jnp.einsum("TKGd,TKSd->TKGS", qg, k), softcap)
        kv_pos = j * bs + jnp.arange(bs)
        visible = kv_pos[None, :] <= meta.positions[:, None]
        if sliding_window is not None:
            visible &= kv_pos[None, :] > meta.positions[:, None] - sliding_window
        s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])  # fully masked blocks give exp(-inf) = 0
        correction = jnp.exp(m - m_new)
        l = l * correction + jnp.sum(p, axis=-1)
        acc = acc * correction[..., None] + jnp.einsum("TKGS,TKSd->TKGd", p, v)
        return m_new, l, acc

    if sinks is None:
        init = (jnp.full((T, K, G), -1e30, jnp.float32), jnp.zeros((T, K, G), jnp.float32))
    else:
        init = (jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, G), (T, K, G)),
                jnp.ones((T, K, G), jnp.float32))
    init += (jnp.zeros((T, K, G, d), jnp.float32),)
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    return (acc / l[..., None]).reshape(T, H, d).astype(q.dtype)


def blockwise_attention_fn(q, k, v, kv: KVCache, layer, meta: AttentionMetadata, kind=None, *, scale,
                           windows=(None,), softcap=None, values_dtype=None, sinks=None):
    kv = write_kv(kv, layer, k, v, meta.slot_mapping, values_dtype)
    out = blockwise_paged_attention(q, kv.k, kv.v, layer, meta, scale=scale,
                                    sliding_window=layer_window(windows, kind), softcap=softcap,
                                    values_dtype=values_dtype, sinks=sinks)
    return out, kv
