"""Choosing the attention implementation: `Engine(attention_impl=...)`."""

from __future__ import annotations

import logging
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.config import ATTENTION_IMPLS, ModelConfig

log = logging.getLogger(__name__)

KERNEL_PLATFORMS = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


# The widest head the Triton kernels tile: a [pages x block_size, head] tile of K and of V per program, in registers.
MAX_GPU_KERNEL_HEAD_DIM = 256


def gpu_kernel_head_dim(head_dim: int) -> int:
    """The head size the Triton kernels run at: tiles are powers of two and a dot's contraction is at least 16
    wide, so a head of 96 (Phi-3) is stored and attended as 128, its extra dims zero in q, K and V. Zeros add
    nothing to q.k, and the output's extra dims (zero-weighted sums of zero V dims) are cut off."""
    return max(16, 1 << (head_dim - 1).bit_length())


def kernel_supports(backend: str, cfg: ModelConfig) -> bool:
    """Whether the Pallas kernel handles this model (any head size up to 256 on GPU, padded as above)."""
    if cfg.attention_sinks and backend == "tpu":
        log.info("the TPU kernels do not take attention sinks yet: using the reference attention")
        return False
    if backend == "gpu" and gpu_kernel_head_dim(cfg.head_dim) > MAX_GPU_KERNEL_HEAD_DIM:
        log.info("head_dim %d is wider than the Triton kernels tile: using the reference attention", cfg.head_dim)
        return False
    return True


def triton_targets_this_gpu() -> bool:
    """Whether Pallas's Triton backend can compile for the GPU this process runs on. From jax 0.11 it looks the GPU
    up by name (`pallas.triton.get_gpu_info`) and refuses one it does not list (an L40S, an A10G), inside the
    first compile; jax 0.10 compiled for any GPU by its compute capability. True where the process runs on no GPU
    (an ahead-of-time target names its own) and where jax has no such list."""
    if KERNEL_PLATFORMS.get(jax.default_backend()) != "gpu":
        return True
    from jax.experimental.pallas import triton as plgpu

    lookup = getattr(plgpu, "get_gpu_info", None)
    if lookup is None:
        return True
    try:
        lookup()
    except ValueError:
        return False
    return True


def this_gpu() -> str:
    """The GPU and jax, for a message: the list a GPU must be on is jax's and changes with its version."""
    return f"{jax.devices()[0].device_kind} (jax {jax.__version__})"


def kernel_backend(impl: str, platform: str) -> str | None:
    """Which Pallas kernel a resolved implementation runs ("gpu" or "tpu"), None for the reference. The
    interpreter runs the TPU kernel on a TPU and the (quicker) GPU one anywhere else."""
    if impl == "reference":
        return None
    return KERNEL_PLATFORMS.get(platform) or "gpu"


def cache_head_dim(impl: str, platform: str, cfg: ModelConfig) -> int:
    """The head size the KV cache stores: the model's, or the Triton kernels' padded one (gpu_kernel_head_dim),
    which costs cache memory in proportion (96 -> 128: a third more bytes per token, counted when the cache is
    sized)."""
    if kernel_backend(resolve_attention_impl(impl, platform, cfg), platform) == "gpu":
        return gpu_kernel_head_dim(cfg.head_dim)
    return cfg.head_dim


def resolve_attention_impl(impl: str, platform: str, cfg: ModelConfig) -> str:
    """"reference": paged attention in plain XLA (the CPU path); "pallas": the Pallas kernels compiled for this
    platform's GPU or TPU; "pallas-interpret": the same kernels run by Pallas's interpreter (any platform; slow,
    for tests); "auto" -> "pallas" on GPU/TPU (where the kernel suits the model), "reference" elsewhere."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r} is not one of {', '.join(map(repr, ATTENTION_IMPLS))}")
    backend = KERNEL_PLATFORMS.get(platform)
    if impl == "auto":
        if backend == "gpu" and not triton_targets_this_gpu():
            log.warning("Pallas's Triton backend does not know this GPU, %s: using the XLA attention, which is "
                        "slower", this_gpu())
            return "reference"
        return "pallas" if backend and kernel_supports(backend, cfg) else "reference"
    if cfg.attention_sinks and kernel_backend(impl, platform) == "tpu":
        raise ValueError(f"{cfg.architecture}'s attention sinks need the GPU decode kernel or the XLA attention; "
                         f"the TPU kernels do not take them: use attention_impl (--attention-impl) reference or auto")
    return impl


def make_attention_fn(impl: str, platform: str, cfg: ModelConfig, mesh: Mesh | None = None, kv_dtype=None):
    """-> fn(q, k, v, kv, layer, meta, *, scale, sliding_window) -> (out, kv), like reference_attention_fn, for
    the implementation `resolve_attention_impl` names. `kv_dtype`: the cache's, checked against the kernel."""
    impl = resolve_attention_impl(impl, platform, cfg)
    if impl == "reference":
        from jaxserve.runner.paged_attention_xla import blockwise_attention_fn

        # The values the cache holds, whatever it stores them as (a float8 cache on a CPU: bytes, storage_dtype).
        return blockwise_attention_fn if kv_dtype is None else partial(blockwise_attention_fn,
                                                                       values_dtype=jnp.dtype(kv_dtype))
    if impl == "pallas" and KERNEL_PLATFORMS.get(platform) is None:
        raise ValueError(f"attention_impl='pallas' needs a GPU or TPU, but the platform is {platform!r}; use "
                         "'pallas-interpret' to run the kernels' interpreter here, or 'reference'")
    kernel = kernel_backend(impl, platform)
    if kernel == "tpu" and impl == "pallas" and kv_dtype is not None and jnp.dtype(kv_dtype).itemsize == 1:
        # TPUs tile 8-bit arrays 32 rows deep: 16-token pages would be padded (no memory saved, sizing wrong),
        # and the kernels' fp8 loads have never run on a TPU.
        raise ValueError("an fp8 KV cache is not supported by the TPU attention kernels yet: use kv_cache_dtype "
                         "(--kv-cache-dtype) auto or bfloat16, or attention_impl (--attention-impl) reference")
    if kernel == "gpu":  # fail at start-up, not inside the first compile
        from pallas_kernels.gpu_pages import check_gpu_cache_dtype

        if not kernel_supports(kernel, cfg):
            raise ValueError(f"the Triton attention kernels tile heads of at most {MAX_GPU_KERNEL_HEAD_DIM}, and this "
                             f"model's head_dim is {cfg.head_dim}: use attention_impl (--attention-impl) reference")
        if impl == "pallas" and not triton_targets_this_gpu():
            raise ValueError(f"Pallas's Triton backend cannot compile the attention kernels for this GPU, {this_gpu()}: "
                             "use attention_impl (--attention-impl) auto or reference")
        if impl == "pallas" and kv_dtype is not None and mesh is not None:
            check_gpu_cache_dtype(kv_dtype, getattr(mesh.devices.flat[0], "compute_capability", None))
    from jaxserve.runner.pallas_attention import pallas_attention_fn

    return pallas_attention_fn(kernel, interpret=impl == "pallas-interpret", mesh=mesh)
