"""Paged decode attention: one query token per sequence over its pages (GPU: Triton, TPU: Mosaic)."""

from pallas_kernels.paged_attention.gpu import paged_decode_gpu
from pallas_kernels.paged_attention.reference import attend_tokens, paged_decode_reference
from pallas_kernels.paged_attention.tpu import paged_decode_tpu

DECODE_KERNELS = {"gpu": paged_decode_gpu, "tpu": paged_decode_tpu}

__all__ = ["DECODE_KERNELS", "attend_tokens", "paged_decode_gpu", "paged_decode_reference", "paged_decode_tpu"]
