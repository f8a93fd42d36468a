"""The sort-free top-k/top-p/min-p filter keeps exactly what the sorted reference keeps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.top_filter import filter_top, filter_top_sorted, order_keys


def test_order_keys_sort_like_the_floats():
    x = np.array([-np.inf, -3e38, -1.5, -1e-30, 0.0, 1e-30, 2.0, 3e38, np.inf], np.float32)
    keys = np.asarray(order_keys(jnp.asarray(x)))
    assert list(np.argsort(keys, kind="stable")) == list(range(len(x)))


@pytest.mark.parametrize("seed", range(6))
def test_the_kept_tokens_are_the_sorted_references(seed):
    rng = np.random.default_rng(seed)
    B, V = 16, 3000
    x = (rng.standard_normal((B, V)) * rng.choice([0.5, 2.0, 8.0])).astype(np.float32)
    x[0, :50] = x[0, 0]  # a tie across the thresholds
    x[1, rng.integers(0, V, 40)] = x[1].max()  # many tokens share the top value
    x[2, 10:] = -np.inf  # a grammar left ten tokens
    top_k = rng.choice([0, 1, 2, 7, 300], B).astype(np.int32)
    top_p = rng.choice([1.0, 0.95, 0.5, 0.1, 1e-30], B).astype(np.float32)  # 1e-30: greedy
    min_p = rng.choice([0.0, 0.01, 0.3], B).astype(np.float32)
    args = [jnp.asarray(a) for a in (x, top_k, top_p, min_p)]
    got, want = (np.asarray(jax.jit(f)(*args)) for f in (filter_top, filter_top_sorted))
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).sum(-1).min() >= 1  # never an empty row


@pytest.mark.parametrize("f", [filter_top, filter_top_sorted])
def test_min_p_comes_before_the_nucleus_as_in_vllm(f):
    """vLLM applies min_p, then top-k, then top-p over what is left renormalised: with probabilities 0.5, 0.3,
    0.2, min_p 0.5 leaves the first two (0.5 and 0.3 >= 0.25), renormalised 0.625 and 0.375, and top_p 0.6 then
    keeps the first alone (its mass reaches 0.6). top_p over the whole row kept two."""
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.2]], jnp.float32))
    kept = np.isfinite(np.asarray(f(logits, jnp.asarray([0]), jnp.asarray([0.6], jnp.float32),
                                    jnp.asarray([0.5], jnp.float32))))
    assert kept.tolist() == [[True, False, False]]
    # and top-k before top-p: k=2 leaves 0.625/0.375, top_p 0.7 keeps both
    kept = np.isfinite(np.asarray(f(logits, jnp.asarray([2]), jnp.asarray([0.7], jnp.float32),
                                    jnp.asarray([0.0], jnp.float32))))
    assert kept.tolist() == [[True, True, False]]
