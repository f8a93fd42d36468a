"""Choosing the attention implementation: `Engine(attention_impl=...)`."""

from __future__ import annotations

import logging

import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.config import ATTENTION_IMPLS, ModelConfig

log = logging.getLogger(__name__)

KERNEL_PLATFORMS = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def kernel_supports(backend: str, cfg: ModelConfig) -> bool:
    """Whether the Pallas kernel handles this model (Triton tiles need a power-of-two head_dim >= 16)."""
    if backend == "gpu" and (cfg.head_dim & (cfg.head_dim - 1) or cfg.head_dim < 16):
        log.info("head_dim %d does not suit the Triton kernel: using the reference attention", cfg.head_dim)
        return False
    return True


def resolve_attention_impl(impl: str, platform: str, cfg: ModelConfig) -> str:
    """"reference": paged attention in plain XLA (the CPU path); "pallas": the Pallas kernels compiled for this
    platform's GPU or TPU; "pallas-interpret": the same kernels run by Pallas's interpreter (any platform; slow,
    for tests); "auto" -> "pallas" on GPU/TPU (where the kernel suits the model), "reference" elsewhere."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r} is not one of {', '.join(map(repr, ATTENTION_IMPLS))}")
    backend = KERNEL_PLATFORMS.get(platform)
    if impl == "auto":
        return "pallas" if backend and kernel_supports(backend, cfg) else "reference"
    return impl


def make_attention_fn(impl: str, platform: str, cfg: ModelConfig, mesh: Mesh | None = None, kv_dtype=None):
    """-> fn(q, k, v, kv, layer, meta, *, scale, sliding_window) -> (out, kv), like reference_attention_fn, for
    the implementation `resolve_attention_impl` names. `kv_dtype`: the cache's, checked against the kernel."""
    impl = resolve_attention_impl(impl, platform, cfg)
    backend = KERNEL_PLATFORMS.get(platform)
    if impl == "reference":
        from jaxserve.runner.paged_attention_xla import blockwise_attention_fn

        return blockwise_attention_fn
    if impl == "pallas" and backend is None:
        raise ValueError(f"attention_impl='pallas' needs a GPU or TPU, but the platform is {platform!r}; use "
                         "'pallas-interpret' to run the kernels' interpreter here, or 'reference'")
    kernel = backend or "gpu"  # the interpreter runs the TPU kernel on a TPU, the (quicker) GPU one elsewhere
    if kernel == "tpu" and impl == "pallas" and kv_dtype is not None and jnp.dtype(kv_dtype).itemsize == 1:
        # TPUs tile 8-bit arrays 32 rows deep: 16-token pages would be padded (no memory saved, sizing wrong),
        # and the kernels' fp8 loads have never run on a TPU.
        raise ValueError("an fp8 KV cache is not supported by the TPU attention kernels yet: use kv_cache_dtype "
                         "(--kv-cache-dtype) auto or bfloat16, or attention_impl (--attention-impl) reference")
    if kernel == "gpu":  # fail at start-up, not inside the first compile
        from pallas_kernels.gpu_pages import check_gpu_cache_dtype, check_gpu_tiles

        check_gpu_tiles(16, cfg.head_dim)
        if impl == "pallas" and kv_dtype is not None and mesh is not None:
            check_gpu_cache_dtype(kv_dtype, getattr(mesh.devices.flat[0], "compute_capability", None))
    from jaxserve.runner.pallas_attention import pallas_attention_fn

    return pallas_attention_fn(kernel, interpret=impl == "pallas-interpret", mesh=mesh)
