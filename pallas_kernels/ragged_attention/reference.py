"""Pure-jnp ragged paged attention: the ground truth for the ragged kernels.

Sequence b owns query tokens q[q_start[b] : q_start[b] + q_lens[b]], the last q_lens[b] of its kv_lens[b]
positions (their K/V already written to its pages). Each attends causally to its own sequence's keys; tokens
owned by no sequence (step padding) get 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.reference import attend_tokens


def token_owners(q_start, q_lens, kv_lens, num_tokens: int):
    """(sequence [T], position [T]) of each token; position -1 for tokens no sequence owns."""
    t = jnp.arange(num_tokens)[:, None]
    owns = (t >= q_start[None, :]) & (t < (q_start + q_lens)[None, :])  # [T, B]
    seq = jnp.argmax(owns, axis=1)
    pos = kv_lens[seq] - q_lens[seq] + (t[:, 0] - q_start[seq])
    return seq, jnp.where(owns.any(axis=1), pos, -1)


def ragged_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                     q_start: jax.Array, q_lens: jax.Array, kv_lens: jax.Array, *, layer=0, scale: float,
                     sliding_window: int | None = None, softcap: float | None = None) -> jax.Array:
    seq, pos = token_owners(q_start, q_lens, kv_lens, q.shape[0])
    return attend_tokens(q, k_cache, v_cache, block_tables[seq], pos, layer=layer, scale=scale,
                         sliding_window=sliding_window, softcap=softcap)
