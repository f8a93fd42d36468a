"""Paged attention in pure JAX: the reference the Pallas kernels are checked against, and the CPU path.

A step is a flat batch of T tokens from B sequences (prefill chunks and decodes mixed). Each token carries its
position and the index of its sequence; each sequence has a row of the block table. A token attends causally
to its own sequence's cached keys, which include the ones written by this very step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jaxserve.models.layers import soft_cap
from jaxserve.runner.kv_cache import KVCache, cache_values, to_cache_dtype


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    positions: jax.Array  # [T] int32, position of each token in its sequence
    slot_mapping: jax.Array  # [T] int32, flat cache slot (block * block_size + offset) to write each token's K/V
    token_seq: jax.Array  # [T] int32, which row of block_tables each token belongs to
    block_tables: jax.Array  # [B, MB] int32, physical blocks of each sequence (0 = null block)
    # [T] int32, each token's LoRA adapter slot, -1 for the base model (None: no adapters, in hand-built
    # metadata). Not attention's, but per token like the fields above, which the pipeline splits into micro-batches.
    lora_slots: jax.Array | None = None
    # Static (part of the compiled shape): every sequence has exactly one token here, token i being row i's, so
    # a decode kernel can run instead of the ragged one. Set only where the attention has one (see plan.py).
    decode_only: bool = field(default=False, metadata=dict(static=True))


# A window no context reaches: a full-attention layer's when the window is chosen per layer (traced).
NO_WINDOW = 2**30


def layer_window(windows: tuple[int | None, ...], kind: int | jax.Array | None):
    """The window of a layer of attention kind `kind` (an index into `windows`): static when every layer
    attends alike (kind None) or the kind is known while tracing (an int: unrolled layers), else a traced int32
    (NO_WINDOW for full attention)."""
    if kind is None or isinstance(kind, int):
        return windows[kind or 0]
    return jnp.asarray([NO_WINDOW if w is None else w for w in windows], jnp.int32)[kind]


def write_kv(kv: KVCache, layer: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
             values_dtype=None) -> KVCache:
    """Scatter this step's K/V [T, K, d] into their pages of `layer`, in place on the donated cache, as values of
    `values_dtype` (None: the cache's own dtype; a float8 cache may be held as bytes, kv_cache.storage_dtype)."""
    block_size = kv.block_size
    values = values_dtype or kv.k.dtype
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    # Index arrays split by a slice: numpy puts their [T] dim first, so the update is [T, K, d], like k.
    return KVCache(
        kv.k.at[layer, :, blocks, offsets].set(to_cache_dtype(k, values, kv.k.dtype)),
        kv.v.at[layer, :, blocks, offsets].set(to_cache_dtype(v, values, kv.v.dtype)),
    )


def paged_attention_reference(
    q: jax.Array,  # [T, H, d]
    k_pages: jax.Array,  # [K, NB, bs, d] one layer
    v_pages: jax.Array,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | jax.Array | None = None,
    softcap: float | None = None,
    values_dtype=None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """`sinks` [H]: each head's extra logit in the softmax's denominator, attending to nothing (gpt-oss)."""
    T, H, d = q.shape
    K, _, bs, _ = k_pages.shape
    rows = meta.block_tables[meta.token_seq]  # [T, MB]
    S = rows.shape[1] * bs
    # A float8 cache is read in the compute dtype.
    k = cache_values(k_pages[:, rows], values_dtype).reshape(K, T, S, d).astype(q.dtype)
    v = cache_values(v_pages[:, rows], values_dtype).reshape(K, T, S, d).astype(q.dtype)
    qg = q.reshape(T, K, H // K, d)
    scores = soft_cap(jnp.einsum("TKGd,KTSd->TKGS", qg, k, preferred_element_type=jnp.float32) * scale, softcap)
    kv_pos = jnp.arange(S)[None, :]
    visible = kv_pos <= meta.positions[:, None]
    if sliding_window is not None:
        visible &= kv_pos > meta.positions[:, None] - sliding_window
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, H // K, 1), (T, K, H // K, 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("TKGS,KTSd->TKGd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(T, H, d).astype(q.dtype)


def reference_attention_fn(q, k, v, kv: KVCache, layer, meta: AttentionMetadata, kind=None, *, scale,
                           windows=(None,), softcap=None, values_dtype=None, sinks=None):
    """Write this step's K/V, then attend over the pages: the signature every attention implementation shares.
    `windows`: the sliding window of each attention kind; `kind`: this layer's (None when there is one kind);
    `values_dtype`: what a cache held as bytes holds (kv_cache.storage_dtype)."""
    kv = write_kv(kv, layer, k, v, meta.slot_mapping, values_dtype)
    out = paged_attention_reference(q, kv.k[layer], kv.v[layer], meta, scale=scale,
                                    sliding_window=layer_window(windows, kind), softcap=softcap,
                                    values_dtype=values_dtype, sinks=sinks)
    return out, kv
