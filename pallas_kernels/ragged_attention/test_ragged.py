"""Ragged kernels (GPU and TPU variants, interpret mode on CPU) against the pure-jnp reference, and the tiling.

Tolerances as in test_paged_decode.py: 1e-5 for float32; 2e-3 for bfloat16 against the reference evaluated in
float32 on the same bf16 inputs, values drawn so outputs stay below 0.5.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_decode_reference
from pallas_kernels.ragged_attention import RAGGED_KERNELS, ragged_reference
from pallas_kernels.ragged_attention.tiles import plan_tiles
from pallas_kernels.testing import BACKENDS, GPU_ONLY, INTERPRET, max_abs_diff, random_paged_case

# (tokens this step, context length after it): a decode with context 1; a whole first block of prefill; a chunk
# ending mid-block of a longer context; a decode at a block boundary; a prefill spanning several tiles and
# blocks; a batch-padding row with nothing.
SEQS = [(1, 1), (16, 16), (5, 37), (1, 64), (30, 45), (0, 0)]
CASES = [  # (G, d, dtype, sliding_window, softcap (Gemma 2's; scores here are ~N(0, 1), so a cap of 2 bends them))
    (1, 64, jnp.float32, None, None),
    (3, 128, jnp.bfloat16, None, 2.0),
    (8, 64, jnp.float32, 20, 2.0),
    (8, 128, jnp.bfloat16, 7, None),
]
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-3}
PAD_TOKENS = 5  # step padding after the last sequence's tokens: owned by no sequence


def ragged_case(seed, seqs, **kwargs):
    q_lens = np.array([n for n, _ in seqs], np.int32)
    kv_lens = np.array([c for _, c in seqs], np.int32)
    q_start = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    case = random_paged_case(seed, kv_lens=kv_lens, num_tokens=int(q_lens.sum()) + PAD_TOKENS, **kwargs)
    return case, (jnp.asarray(q_start), jnp.asarray(q_lens), jnp.asarray(kv_lens))


def exact(case, seq_args, **kwargs):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    return ragged_reference(f32(case.q), f32(case.k_cache), f32(case.v_cache), case.block_tables, *seq_args,
                            layer=case.layer, **kwargs)


def ragged(backend, case, seq_args, **kwargs):
    return RAGGED_KERNELS[backend](case.q, case.k_cache, case.v_cache, case.block_tables, *seq_args,
                                   layer=case.layer, interpret=INTERPRET, **kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("G,d,dtype,window,softcap", CASES)
def test_ragged_matches_reference(backend, G, d, dtype, window, softcap):
    K = 2
    case, seq_args = ragged_case(G + d, SEQS, H=K * G, K=K, d=d, dtype=dtype, v_scale=0.125)
    kw = dict(scale=d**-0.5, sliding_window=window, softcap=softcap)
    # 16 rows a tile: the 30-token prefill spans several tiles at every G.
    out = ragged(backend, case, seq_args, rows_per_tile=16, pages_per_block=2, **kw)
    assert out.dtype == dtype and out.shape == case.q.shape
    assert max_abs_diff(out, exact(case, seq_args, **kw)) <= TOLERANCE[dtype]
    assert float(jnp.abs(out[-PAD_TOKENS:].astype(jnp.float32)).max()) == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_only_batch_matches_decode_reference(backend):
    """A step of decodes only (one token per sequence) is the decode kernel's problem, solved by this kernel."""
    kv_lens = [1, 16, 17, 40]
    case = random_paged_case(7, kv_lens=kv_lens, num_tokens=4, H=8, K=2, d=64)
    n = len(kv_lens)
    seq_args = (jnp.arange(n, dtype=jnp.int32), jnp.ones(n, jnp.int32), case.kv_lens)
    out = ragged(backend, case, seq_args, scale=0.125)
    ref = paged_decode_reference(case.q, case.k_cache, case.v_cache, case.block_tables, case.kv_lens,
                                 layer=case.layer, scale=0.125)
    assert max_abs_diff(out, ref) <= 1e-5


def test_tile_plan_covers_each_token_once():
    q_lens = jnp.array([3, 0, 9, 1], jnp.int32)
    q_start = jnp.array([0, 3, 3, 12], jnp.int32)
    kv_lens = jnp.array([3, 0, 20, 8], jnp.int32)
    plan = plan_tiles(q_start, q_lens, kv_lens, num_tokens=16, tokens_per_tile=4)
    real = np.asarray(plan.length) > 0
    assert list(np.asarray(plan.seq)[real]) == [0, 2, 2, 2, 3]
    assert list(np.asarray(plan.length)[real]) == [3, 4, 4, 1, 1]
    assert list(np.asarray(plan.first_pos)[real]) == [0, 11, 15, 19, 7]
    tokens = np.asarray(plan.token).reshape(-1)
    assert sorted(tokens[tokens < 16]) == list(range(13))


@pytest.mark.parametrize("backend", GPU_ONLY)
def test_gpu_log_sum_exp_of_each_token_scores(backend):
    """return_lse: each token's and head's log-sum-exp of its scaled, causally visible scores (attention sinks
    are added from it)."""
    case, seq_args = ragged_case(6, [(5, 37), (1, 1), (20, 20)], H=4, K=2, d=64)
    out, lse = RAGGED_KERNELS[backend](case.q, case.k_cache, case.v_cache, case.block_tables, *seq_args,
                                       layer=case.layer, scale=0.125, interpret=INTERPRET, return_lse=True)
    assert max_abs_diff(out, exact(case, seq_args, scale=0.125)) <= 1e-5
    q, k = np.asarray(case.q), np.asarray(case.k_cache[case.layer])
    for b, (start, n, context) in enumerate(zip(*(np.asarray(a) for a in seq_args))):
        pages = np.asarray(case.block_tables[b])[: -(-context // 16)]
        keys = k[:, pages].reshape(2, -1, 64)
        for i in range(n):
            visible = context - n + i + 1
            for h in range(4):
                scores = 0.125 * keys[h // 2, :visible] @ q[start + i, h]
                expected = scores.max() + np.log(np.exp(scores - scores.max()).sum())
                assert abs(float(lse[start + i, h]) - expected) <= 1e-4, (b, i, h)
