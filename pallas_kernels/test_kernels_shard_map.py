"""The kernels under a tensor-parallel mesh: shard_map over heads (4 fake CPU devices, or as many of a compiled
run's GPUs as there are, up to 4), each device attending with its own q heads and its own kv heads' slice of the
cache, equals the unsharded reference."""

from functools import partial

import jax
import jax.numpy as jnp
import pytest

from jaxserve.parallel.sharding import make_mesh, mesh_axes, partition_spec
from pallas_kernels.paged_attention import DECODE_KERNELS, paged_decode_reference
from pallas_kernels.ragged_attention import RAGGED_KERNELS, ragged_reference
from pallas_kernels.testing import BACKENDS, INTERPRET, max_abs_diff, random_paged_case

CACHE = (None, "kv_heads", None, None, "head_dim")
HEADS = (None, "q_heads", None)


def over_heads(kernel, mesh, num_seq_args, backend):
    rep = partition_spec(())
    # The TPU interpreter's callbacks need every mesh axis manual; compiled kernels need only the head axis.
    axes = frozenset(mesh.axis_names) if backend == "tpu" else mesh_axes(CACHE)
    return jax.shard_map(kernel, mesh=mesh, in_specs=(partition_spec(HEADS), partition_spec(CACHE),
                                                      partition_spec(CACHE), rep) + (rep,) * num_seq_args,
                         out_specs=partition_spec(HEADS), axis_names=axes, check_vma=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernels_run_sharded_over_heads(backend):
    mesh = make_mesh(min(4, len(jax.devices())), 1)
    kv_lens = [3, 16, 29]
    case = random_paged_case(5, kv_lens=kv_lens, num_tokens=3, H=8, K=4, d=64)
    kw = dict(layer=case.layer, scale=0.125, sliding_window=None)

    decode = over_heads(partial(DECODE_KERNELS[backend], interpret=INTERPRET, **kw), mesh, 1, backend)
    out = jax.jit(decode)(case.q, case.k_cache, case.v_cache, case.block_tables, case.kv_lens)
    ref = paged_decode_reference(case.q, case.k_cache, case.v_cache, case.block_tables, case.kv_lens, **kw)
    assert max_abs_diff(out, ref) <= 1e-5

    # The same contexts as one ragged step: a 3-token prefill, a 2-token chunk, one decode.
    q_lens = jnp.array([3, 2, 1], jnp.int32)
    seq_args = (jnp.array([0, 3, 5], jnp.int32), q_lens, case.kv_lens)
    q = jnp.tile(case.q, (2, 1, 1))
    ragged = over_heads(partial(RAGGED_KERNELS[backend], interpret=INTERPRET, **kw), mesh, 3, backend)
    out = jax.jit(ragged)(q, case.k_cache, case.v_cache, case.block_tables, *seq_args)
    ref = ragged_reference(q, case.k_cache, case.v_cache, case.block_tables, *seq_args, **kw)
    assert max_abs_diff(out, ref) <= 1e-5
