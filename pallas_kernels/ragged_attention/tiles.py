"""Cut a ragged batch of query tokens into fixed-size tiles, each holding tokens of one sequence only.

Sequence b owns the TQ-token tiles covering q[q_start[b] : q_start[b] + q_lens[b]]. Tiles are numbered
sequence by sequence; their count is bounded statically by NT = min(T, ceil(T / TQ) + B), and the tiles past the
real count are empty (length 0). Gathering q into [NT, K, R, d] tiles (the TQ tokens x G heads of kv head h as
R rows) gives the kernels aligned blocks with plain BlockSpecs; the outputs are scattered back the same way.
All of this is a few small jnp ops on [B] / [NT] / [T] arrays inside the jitted step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.common import cdiv, pad_axis, page_range


class TilePlan(NamedTuple):
    seq: jax.Array  # [NT] block-table row of each tile (clamped into range for empty tiles)
    length: jax.Array  # [NT] tokens in the tile, 0 for an empty tile
    first_pos: jax.Array  # [NT] position of the tile's first token in its sequence
    token: jax.Array  # [NT, TQ] flat index of each slot's token; T (out of range) for unused slots


def max_tiles(num_tokens: int, num_seqs: int, tokens_per_tile: int) -> int:
    # Each non-empty sequence wastes less than one tile, and a tile holds at least one token.
    return max(1, min(num_tokens, cdiv(num_tokens, tokens_per_tile) + num_seqs))


def plan_tiles(q_start, q_lens, kv_lens, num_tokens: int, tokens_per_tile: int) -> TilePlan:
    TQ, B = tokens_per_tile, q_lens.shape[0]
    NT = max_tiles(num_tokens, B, TQ)
    per_seq = (q_lens + TQ - 1) // TQ
    ends = jnp.cumsum(per_seq)
    i = jnp.arange(NT)
    seq = jnp.searchsorted(ends, i, side="right")  # B for tiles past the last real one
    real = seq < B
    seq = jnp.minimum(seq, B - 1).astype(jnp.int32)
    j = i - (ends[seq] - per_seq[seq])  # tile index within its sequence
    length = jnp.where(real, jnp.clip(q_lens[seq] - j * TQ, 0, TQ), 0).astype(jnp.int32)
    first_pos = (kv_lens[seq] - q_lens[seq] + j * TQ).astype(jnp.int32)
    slot = jnp.arange(TQ)[None, :]
    token = jnp.where(slot < length[:, None], q_start[seq][:, None] + j[:, None] * TQ + slot, num_tokens)
    return TilePlan(seq, length, first_pos, token.astype(jnp.int32))


def gather_tiles(q: jax.Array, plan: TilePlan, num_kv_heads: int, rows: int) -> jax.Array:
    """q [T, H, d] -> [NT, K, R, d]: row r of tile i, head h is token r // G, q head h * G + r % G."""
    T, H, d = q.shape
    NT, TQ = plan.token.shape
    G = H // num_kv_heads
    x = jnp.concatenate([q, jnp.zeros((1, H, d), q.dtype)])[plan.token]  # unused slots read the zero row
    x = x.reshape(NT, TQ, num_kv_heads, G, d).transpose(0, 2, 1, 3, 4).reshape(NT, num_kv_heads, TQ * G, d)
    return pad_axis(x, 2, rows)


def scatter_tiles(o: jax.Array, plan: TilePlan, num_tokens: int, group: int) -> jax.Array:
    """The inverse of gather_tiles: [NT, K, R, d] -> [T, H, d]; tokens in no tile get 0."""
    NT, K, _, d = o.shape
    TQ, G = plan.token.shape[1], group
    x = o[:, :, : TQ * G].reshape(NT, K, TQ, G, d).transpose(0, 2, 1, 3, 4).reshape(NT * TQ, K * G, d)
    out = jnp.zeros((num_tokens, K * G, d), o.dtype)
    return out.at[plan.token.reshape(-1)].set(x, mode="drop")  # unused slots point past the end: dropped


def tile_pages(first_pos, length, block_size: int, window: int | None):
    """Pages [lo, hi) visible to a tile's tokens at first_pos .. first_pos + length - 1; empty if length == 0."""
    lo, hi = page_range(first_pos, first_pos + length - 1, block_size, window)
    return lo, jnp.where(length > 0, hi, 0)
