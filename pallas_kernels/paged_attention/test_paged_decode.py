"""Decode kernels (GPU and TPU variants, interpret mode on CPU) against the pure-jnp reference.

Tolerances are absolute: 1e-5 for float32; 2e-3 for bfloat16, measured against the reference evaluated in
float32 on the same bf16 inputs (the exact answer the kernel rounds), with values drawn at a scale (v ~ N(0, 1/8))
that keeps outputs below 0.5, where half a bf16 ulp is under 1e-3.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import DECODE_KERNELS, paged_decode_reference
from pallas_kernels.paged_attention.gpu import default_splits
from pallas_kernels.testing import BACKENDS, GPU_ONLY, INTERPRET, max_abs_diff, random_paged_case

# One token; exactly one block; a partial last block; a block boundary; several blocks.
KV_LENS = [1, 16, 37, 64, 100]
CASES = [  # (G, d, dtype, sliding_window, softcap (Gemma 2's; scores here are ~N(0, 1), so a cap of 2 bends them))
    (1, 64, jnp.float32, None, None),
    (3, 128, jnp.bfloat16, None, None),
    (8, 64, jnp.bfloat16, 20, 2.0),
    (8, 128, jnp.float32, None, None),
    (3, 64, jnp.float32, 20, 2.0),
]
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-3}


def decode(backend, case, **kwargs):
    return DECODE_KERNELS[backend](case.q, case.k_cache, case.v_cache, case.block_tables, case.kv_lens,
                                   layer=case.layer, interpret=INTERPRET, **kwargs)


def exact(case, **kwargs):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return paged_decode_reference(f32(case.q), f32(case.k_cache), f32(case.v_cache), case.block_tables,
                                  case.kv_lens, layer=case.layer, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("G,d,dtype,window,softcap", CASES)
def test_decode_matches_reference(backend, G, d, dtype, window, softcap):
    K = 2
    case = random_paged_case(G * d, kv_lens=KV_LENS, num_tokens=len(KV_LENS), H=K * G, K=K, d=d, dtype=dtype,
                             v_scale=0.125)
    tables = np.asarray(case.block_tables)
    assert any(np.any(np.diff(t[: -(-n // 16)]) != 1) for t, n in zip(tables, KV_LENS) if n > 16)
    kw = dict(scale=d**-0.5, sliding_window=window, softcap=softcap)
    out = decode(backend, case, pages_per_block=2, **kw)
    assert out.dtype == dtype and out.shape == case.q.shape
    assert max_abs_diff(out, exact(case, **kw)) <= TOLERANCE[dtype]


@pytest.mark.parametrize("backend", GPU_ONLY)
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_gpu_context_splits_agree(backend, num_splits):
    """Flash-decoding splits (more splits than a short sequence has pages, too) merge to the same output."""
    case = random_paged_case(1, kv_lens=KV_LENS, num_tokens=len(KV_LENS), H=8, K=2, d=64)
    kw = dict(scale=0.125, sliding_window=None)
    out = decode(backend, case, pages_per_block=1, num_splits=num_splits, **kw)
    assert max_abs_diff(out, exact(case, **kw)) <= 1e-5


@pytest.mark.parametrize("backend", GPU_ONLY)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_gpu_log_sum_exp_of_the_scores(backend, num_splits):
    """return_lse: each head's log-sum-exp of its scaled scores over its context (attention sinks are added
    from it), merged over the splits."""
    case = random_paged_case(4, kv_lens=[1, 37, 100], num_tokens=3, H=4, K=2, d=64)
    out, lse = decode(backend, case, pages_per_block=1, num_splits=num_splits, scale=0.125, return_lse=True)
    assert max_abs_diff(out, exact(case, scale=0.125)) <= 1e-5
    q, k = np.asarray(case.q), np.asarray(case.k_cache[case.layer])  # [T, H, d], [K, NB, bs, d]
    for b, n in enumerate(np.asarray(case.kv_lens)):
        pages = np.asarray(case.block_tables[b])[: -(-n // 16)]
        keys = k[:, pages].reshape(2, -1, 64)[:, :n]  # [K, n, d]
        for h in range(4):
            scores = 0.125 * keys[h // 2] @ q[b, h]
            expected = scores.max() + np.log(np.exp(scores - scores.max()).sum())
            assert abs(float(lse[b, h]) - expected) <= 1e-4, (b, h)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_layer_pages_and_empty_sequences(backend):
    """A [K, NB, bs, d] cache of one layer is accepted; a sequence with no context (batch padding) gives 0."""
    case = random_paged_case(2, kv_lens=[0, 5, 33], num_tokens=3, H=4, K=4, d=64, L=1)
    out = DECODE_KERNELS[backend](case.q, case.k_cache[0], case.v_cache[0], case.block_tables, case.kv_lens,
                                  scale=0.125, interpret=INTERPRET)
    assert float(jnp.abs(out[0]).max()) == 0.0
    assert max_abs_diff(out, exact(case, scale=0.125)) <= 1e-5


@pytest.mark.parametrize("backend", GPU_ONLY)
def test_bad_shapes_are_refused(backend):
    case = random_paged_case(3, kv_lens=[5], num_tokens=1, H=3, K=2, d=64)
    with pytest.raises(ValueError, match="multiple of K"):
        decode(backend, case, scale=1.0)
    case = random_paged_case(3, kv_lens=[5], num_tokens=1, H=2, K=2, d=48)
    with pytest.raises(ValueError, match="head_dim to be a power of two"):
        decode(backend, case, scale=1.0)


@pytest.mark.parametrize("backend", GPU_ONLY)
@pytest.mark.parametrize("prefetch", ["pages", "tiles"])
@pytest.mark.parametrize("num_splits,window", [(1, None), (3, 20)])
def test_gpu_prefetch_matches_reference(backend, prefetch, num_splits, window):
    """Loading the next block's page ids or tiles ahead (in the loop carry) changes no result: splits shorter
    than a block, a window that starts mid-context, empty splits."""
    case = random_paged_case(5, kv_lens=KV_LENS, num_tokens=len(KV_LENS), H=8, K=2, d=64)
    kw = dict(scale=0.125, sliding_window=window)
    out = decode(backend, case, pages_per_block=2, num_splits=num_splits, prefetch=prefetch, **kw)
    assert max_abs_diff(out, exact(case, **kw)) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_a_float8_cache_is_read_in_the_queries_dtype(backend, cache_dtype):
    """An fp8 KV cache (Engine(kv_cache_dtype="fp8")): the kernel widens the pages it loads, giving the reference
    over the same values held in float32."""
    if not INTERPRET and cache_dtype == jnp.float8_e4m3fn and jax.devices()[0].platform == "gpu" and \
            float(jax.devices()[0].compute_capability) < 8.9:
        pytest.skip("Triton widens e4m3 on compute capability 8.9+ only (the engine refuses it below)")
    case = random_paged_case(7, kv_lens=KV_LENS, num_tokens=len(KV_LENS), H=4, K=2, d=64)
    fp8 = dataclasses.replace(case, k_cache=case.k_cache.astype(cache_dtype), v_cache=case.v_cache.astype(cache_dtype))
    out = decode(backend, fp8, scale=0.125, pages_per_block=2)
    assert out.dtype == jnp.float32
    assert max_abs_diff(out, exact(fp8, scale=0.125)) <= 1e-5


@pytest.mark.parametrize("backend", GPU_ONLY)
def test_gpu_target_programs_sets_the_splits(backend):
    """target_programs only changes how the context is split (one split for 2 x 2 programs at a target of 1;
    as many as the pages allow at 64), never the answer; an unknown prefetch mode is refused by name."""
    case = random_paged_case(6, kv_lens=KV_LENS, num_tokens=len(KV_LENS), H=8, K=2, d=64)
    kw = dict(scale=0.125, sliding_window=None)
    assert default_splits(5, 2, 7, target_programs=1) == 1 and default_splits(5, 2, 7, target_programs=64) == 7
    assert default_splits(5, 2, 7, target_programs=40) == 4  # ceil(40 / 10) splits: 40 programs
    want = exact(case, **kw)
    for target in (1, 64):
        assert max_abs_diff(decode(backend, case, pages_per_block=1, target_programs=target, **kw), want) <= 1e-5
    with pytest.raises(ValueError, match="prefetch must be one of"):
        decode(backend, case, prefetch="blocks", **kw)
