"""Pieces shared by the paged-attention kernels: the cache layout, masks, the online-softmax step.

Shape letters follow jaxserve/models/layers.py: B sequences, T tokens, H q heads, K kv heads, G = H // K,
d head dim, L layers. Kernel-only letters: NB cache blocks (pages), bs tokens per page, MB block-table width,
R query rows a program holds (tokens x G, padded), P pages a program loads at once.

KV cache layout (each of K and V): [L, K, NB, bs, d]. A page of one kv head is a contiguous [bs, d] tile, which
is what a GPU program or a TPU DMA wants to fetch, and (bs, d) are the two minor dims a TPU tiles in memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Finite "minus infinity": a fully masked block then gives exp(MASK - MASK) = 1 instead of NaN, and that
# garbage is wiped (multiplied by exp(MASK - real) = 0) as soon as a row sees its first visible key.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def as_layered(cache: jax.Array) -> jax.Array:
    """Accept one layer's pages [K, NB, bs, d] as well as the whole cache [L, K, NB, bs, d]."""
    if cache.ndim == 4:
        return cache[None]
    if cache.ndim != 5:
        raise ValueError(f"KV cache must be [L, K, NB, bs, d] or [K, NB, bs, d], got shape {cache.shape}")
    return cache


def check_shapes(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array) -> tuple[int, int]:
    """Validate q [., H, d] against the cache; returns (K, G)."""
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k and v caches differ in shape: {k_cache.shape} vs {v_cache.shape}")
    H, d = q.shape[-2:]
    _, K, _, _, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) differs from the cache's ({dk})")
    if H % K:
        raise ValueError(f"{H} query heads cannot be grouped over {K} kv heads; H must be a multiple of K")
    return K, H // K


def dot_precision(dtype) -> jax.lax.Precision:
    # float32 inputs must not be rounded to tf32 (GPU) or bf16 passes (TPU): the tests demand 1e-5.
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def dot_nt(a: jax.Array, b: jax.Array, precision) -> jax.Array:
    """a [R, d] @ b[N, d].T -> [R, N] in float32."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def dot_nn(a: jax.Array, b: jax.Array, precision) -> jax.Array:
    """a [R, N] @ b [N, d] -> [R, d] in float32."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def visible(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """Causal (and sliding-window) visibility of keys at k_pos [1, N] from queries at q_pos [R, 1]."""
    ok = k_pos <= q_pos
    if window is not None:
        ok &= k_pos > q_pos - window
    return ok


def cap_scores(s: jax.Array, softcap: float | None) -> jax.Array:
    """Gemma 2's soft cap on attention scores, softcap * tanh(s / softcap); identity when softcap is None."""
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def online_softmax_step(carry, s: jax.Array, v: jax.Array, precision):
    """Fold one block of masked scores s [R, N] and values v [N, d] into (m [R,1], l [R,1], acc [R,d])."""
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    # Probabilities go to the value matmul in v's dtype (the compute dtype: bf16 on accelerators; pages of an fp8
    # cache are widened to it as they load), accumulating in f32.
    acc = alpha * acc + dot_nn(p.astype(v.dtype), v, precision)
    return m_new, l, acc


def softmax_init(rows: int, d: int):
    return (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, d), jnp.float32))


def normalise(l: jax.Array, acc: jax.Array) -> jax.Array:
    # A row that saw no key at all (an empty sequence) has l == 0: give 0, not NaN.
    return acc / jnp.where(l > 0, l, 1.0)


def log_sum_exp(m: jax.Array, l: jax.Array) -> jax.Array:
    """Each row's log-sum-exp of its scores from the online softmax's running max and sum ([R]); MASK_VALUE for a
    row that saw no key."""
    return jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), MASK_VALUE).reshape(l.shape[0])


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad `axis` of x up to `size`."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def page_range(first_pos, last_pos, block_size: int, window: int | None):
    """Pages [lo, hi) holding the keys visible to queries at positions first_pos..last_pos (traced scalars).

    lax.div on non-negative operands only: it lowers to a plain integer division on Triton and Mosaic, where
    Python's floor division would need sign fix-ups. An empty range (last_pos < 0) gives hi = 0.
    """
    hi = jnp.where(last_pos >= 0, jax.lax.div(jnp.maximum(last_pos, 0), block_size) + 1, 0)
    if window is None:
        return jnp.zeros_like(hi), hi
    return jax.lax.div(jnp.maximum(first_pos - window + 1, 0), block_size), hi
