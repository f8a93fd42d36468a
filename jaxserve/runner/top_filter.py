"""Top-k, top-p and min-p filtering, without sorting the vocabulary on CPU and with a sort on GPU (`filter_for`).

Sorting [B, V] logits is what a filter needs on paper, and on CPU it is slow: XLA:CPU takes 0.5 s for 64 rows of
SmolLM2's 49152 logits (BENCHMARKS.md). Both thresholds are found instead by a binary search per row over the
logits' float order, 32 passes of a compare-and-reduce each: the k-th largest value is the largest t with
count(x >= t) >= k, and the nucleus keeps exactly the tokens whose mass strictly above them is below top_p, which
is monotone in the value. The kept set is the one a sort would give (ties at a threshold are all kept, as there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SEARCH_STEPS = 32  # one per bit of a float32's order key


def order_keys(x: jax.Array) -> jax.Array:
    """uint32 keys in the same order as the float32 values (negative floats have their bits flipped)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def last_true(pred, rows: int) -> jax.Array:
    """Per row, the largest uint32 t with pred(t) true, for a pred that is true up to some t and false above it
    (and true at 0): a binary search over the whole key range."""
    def step(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, SEARCH_STEPS, step, (jnp.zeros(rows, jnp.uint32),
                                                       jnp.full(rows, 0xFFFFFFFF, jnp.uint32)))
    return lo


def filter_top(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """-inf below min_p x each row's top probability, outside its top_k (0: all), and outside its top_p nucleus
    of what those two leave, renormalised (vLLM's order: min_p, then top-k, then top-p). The most likely token
    always stays."""
    B, V = logits.shape
    keys = order_keys(logits)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = last_true(lambda t: jnp.sum(keys >= t[:, None], axis=-1) >= k, B)
    top = jnp.max(logits, axis=-1, keepdims=True)
    above_min_p = logits >= top + jnp.log(min_p)[:, None]  # p >= min_p * p_max, in logit space
    candidates = (keys >= kth[:, None]) & above_min_p
    probs = jax.nn.softmax(jnp.where(candidates, logits, -jnp.inf), axis=-1)
    # The largest key whose strictly-higher mass still reaches top_p: every token above it is in the nucleus.
    outside = last_true(lambda t: jnp.sum(jnp.where(keys > t[:, None], probs, 0.0), axis=-1) >= top_p, B)
    # A top_p too small for float32 (1e-300 rounds to 0) still keeps the top token; top_p = 1 keeps everything.
    in_nucleus = (keys > outside[:, None]) | (top_p >= 1.0)[:, None] | (logits == top)
    return jnp.where(candidates & in_nucleus, logits, -jnp.inf)


def filter_top_sorted(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """The same filter written plainly, over a sorted copy of each row (tests and scripts/bench_sampler.py compare
    the search against it). GPUs sort fast: this is the filter there (`filter_for`)."""
    V = logits.shape[-1]
    desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=-1)
    # min_p, then top-k: both keep a prefix of the sorted row (p >= min_p * p_max in logit space, no softmax)
    floor = jnp.maximum(kth, desc[:, :1] + jnp.log(min_p)[:, None])
    desc = jnp.where(desc >= floor, desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each candidate
    keep = (before < top_p[:, None]) | (top_p >= 1.0)[:, None] | (jnp.arange(V) == 0)[None, :]
    cut = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= jnp.maximum(floor, cut), logits, -jnp.inf)


def filter_for(platform: str):
    """The filter a platform runs: on a GPU the sort beat the search (3.3 vs 5.4 ms for 256 rows of Llama-3's
    128256 logits on an H100, BENCHMARKS.md); on CPU the search wins by far."""
    return filter_top_sorted if platform == "gpu" else filter_top
