"""Without a GPU or TPU, still lower every kernel for both (Triton IR for "cuda", Mosaic for "tpu"): this catches
the primitives, shapes and dtypes the real compilers refuse, which interpret mode does not."""

from functools import partial

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.paged_attention import DECODE_KERNELS
from pallas_kernels.ragged_attention import RAGGED_KERNELS
from pallas_kernels.testing import random_paged_case

PLATFORMS = {"gpu": "cuda", "tpu": "tpu"}


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("dtype,window", [(jnp.bfloat16, None), (jnp.float32, 24)])
def test_kernels_lower_for_their_platform(backend, dtype, window):
    case = random_paged_case(0, kv_lens=[5, 40], num_tokens=4, H=8, K=2, d=128, dtype=dtype)
    kw = dict(layer=1, scale=0.1, sliding_window=window)
    lower = dict(lowering_platforms=(PLATFORMS[backend],))
    decode = jax.jit(partial(DECODE_KERNELS[backend], **kw))
    decode.trace(case.q[:2], case.k_cache, case.v_cache, case.block_tables, case.kv_lens).lower(**lower)
    ragged = jax.jit(partial(RAGGED_KERNELS[backend], **kw))
    seqs = (jnp.array([0, 3], jnp.int32), jnp.array([3, 1], jnp.int32), case.kv_lens)
    ragged.trace(case.q, case.k_cache, case.v_cache, case.block_tables, *seqs).lower(**lower)
