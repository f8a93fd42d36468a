"""Without a GPU or TPU, still lower every kernel for both (Triton IR for "cuda", Mosaic for "tpu"): this catches
the primitives, shapes and dtypes the real compilers refuse, which interpret mode does not."""

import contextlib
from functools import partial

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.paged_attention import DECODE_KERNELS
from pallas_kernels.ragged_attention import RAGGED_KERNELS
from pallas_kernels.testing import random_paged_case

PLATFORMS = {"gpu": "cuda", "tpu": "tpu"}

# With no GPU present, jax <= 0.10 lowered Triton kernels for compute capability 9.0; jax >= 0.11 refuses unless
# the target GPU is named through an abstract device on the abstract mesh (it reads it at lowering time). Name
# the same target (an H100, CC 9.0) explicitly; jax 0.10 ignores it and falls back to 9.0 as before.
_GPU_TARGET = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
    device_kind="NVIDIA H100", num_cores=None, platform="gpu"))


def _lowering_target(backend):
    return jax.sharding.use_abstract_mesh(_GPU_TARGET) if backend == "gpu" else contextlib.nullcontext()


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("dtype,window", [(jnp.bfloat16, None), (jnp.float32, 24)])
def test_kernels_lower_for_their_platform(backend, dtype, window):
    case = random_paged_case(0, kv_lens=[5, 40], num_tokens=4, H=8, K=2, d=128, dtype=dtype)
    kw = dict(layer=1, scale=0.1, sliding_window=window)
    lower = dict(lowering_platforms=(PLATFORMS[backend],))
    decode = jax.jit(partial(DECODE_KERNELS[backend], **kw))
    seqs = (jnp.array([0, 3], jnp.int32), jnp.array([3, 1], jnp.int32), case.kv_lens)
    ragged = jax.jit(partial(RAGGED_KERNELS[backend], **kw))
    with _lowering_target(backend):
        decode.trace(case.q[:2], case.k_cache, case.v_cache, case.block_tables, case.kv_lens).lower(**lower)
        ragged.trace(case.q, case.k_cache, case.v_cache, case.block_tables, *seqs).lower(**lower)
