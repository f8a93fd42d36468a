"""Ragged paged attention for prefill and mixed steps (GPU: Triton, TPU: Mosaic)."""

from pallas_kernels.ragged_attention.gpu import ragged_attention_gpu
from pallas_kernels.ragged_attention.reference import ragged_reference
from pallas_kernels.ragged_attention.tpu import ragged_attention_tpu

RAGGED_KERNELS = {"gpu": ragged_attention_gpu, "tpu": ragged_attention_tpu}

__all__ = ["RAGGED_KERNELS", "ragged_attention_gpu", "ragged_attention_tpu", "ragged_reference"]
