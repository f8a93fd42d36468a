"""gpt-oss's published checkpoints store their experts in MXFP4 (`quant_method: mxfp4`): each expert matrix as
`<name>_blocks` (uint8 [E, out, in/32, 16], two 4-bit E2M1 values a byte, the low nibble first) and
`<name>_scales` (uint8 [E, out, in/32], a power of two per block of 32 values: 2 ** (scale - 127)). Presented as
the float tensor `<name>` [E, in, out] that the unquantized checkpoints hold.

Kept (`--quantization mxfp4`, the default on a GPU or TPU) as they are: float4 e2m1 values (a type XLA stores two
to a byte) in groups of 32 along the input axis, each group's scale 2 ** (scale - 127) in float32, the file's
bytes plus 3 bytes a group, a quarter of bfloat16's. Dequantized at load (the CPU default) they take 16 / 4.25 =
3.8x their file's bytes in bfloat16 (7.5x in float32), which the log says.
"""

from __future__ import annotations

import logging

import ml_dtypes
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.loader.grouped import GroupedArray
from jaxserve.loader.weights import TensorSource
from jaxserve.models.layers import Grouped

log = logging.getLogger(__name__)

# The 16 values of a 4-bit E2M1 code (sign, 2 exponent bits, 1 mantissa bit), in code order.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)
E2M1_CODES = E2M1_VALUES.astype(ml_dtypes.float4_e2m1fn)  # the same values in the type itself (exact)
BLOCK = 32  # values per scale
BITS_PER_VALUE = 4 + 8 / BLOCK  # a 4-bit code, and one 8-bit scale per 32 values
QUANT_METHOD = "mxfp4"
ARCHITECTURES = ("GptOssForCausalLM",)  # the ones whose MXFP4 checkpoints are read


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[..., out, G, 16] codes and [..., out, G] scales -> float32 [..., G * 32, out] (in before out)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match")
    values = np.empty(blocks.shape[:-1] + (32,), np.float32)
    values[..., 0::2] = E2M1_VALUES[blocks & 0x0F]
    values[..., 1::2] = E2M1_VALUES[blocks >> 4]
    values = np.ldexp(values, (scales.astype(np.int32) - 127)[..., None])
    return values.reshape(values.shape[:-2] + (-1,)).swapaxes(-1, -2)


def grouped(blocks: np.ndarray, scales: np.ndarray) -> GroupedArray:
    """[..., out, G, 16] codes and [..., out, G] scales -> float4 e2m1 [..., G * 32, out] in groups of 32 along
    `in` (the axis before `out`), each group's scale 2 ** (scale - 127): exactly `dequantize`'s weights."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match")
    values = np.empty(blocks.shape[:-1] + (BLOCK,), ml_dtypes.float4_e2m1fn)
    values[..., 0::2] = E2M1_CODES[blocks & 0x0F]
    values[..., 1::2] = E2M1_CODES[blocks >> 4]
    values = values.reshape(values.shape[:-2] + (-1,)).swapaxes(-1, -2)
    scale = np.ldexp(np.float32(1), scales.astype(np.int32) - 127).astype(np.float32).swapaxes(-1, -2)
    return GroupedArray(np.ascontiguousarray(values), np.ascontiguousarray(scale), None, values.ndim - 2, 4)


class Mxfp4Source:
    """A TensorSource whose MXFP4 tensors (`<name>_blocks` + `<name>_scales`) appear as float `<name>`, or kept
    in their groups (loader/weights.BlockSource)."""

    method = QUANT_METHOD
    float_values = True  # float4 e2m1

    def __init__(self, source: TensorSource):
        self._source = source
        names = source.names()
        self._packed = {n.removesuffix("_blocks") for n in names if n.endswith("_blocks")}
        missing = sorted(n + "_scales" for n in self._packed if n + "_scales" not in names)
        if missing:
            raise ValueError(f"MXFP4 checkpoint lacks the scales {missing[0]} of its blocks: it is damaged")
        self._names = (names - {n + s for n in self._packed for s in ("_blocks", "_scales")}) | self._packed

    def names(self) -> set[str]:
        return self._names

    def get(self, name: str) -> np.ndarray:
        if name not in self._packed:
            return self._source.get(name)
        return dequantize(self._source.get(name + "_blocks"), self._source.get(name + "_scales"))

    def block_format(self, name: str) -> Grouped | None:
        return Grouped(bits=4, group=BLOCK, offset=False, float4=True) if name in self._packed else None

    def get_grouped(self, name: str) -> GroupedArray:
        return grouped(self._source.get(name + "_blocks"), self._source.get(name + "_scales"))


def is_mxfp4(raw: dict) -> bool:
    method = raw.get("quantization_config") or {}
    return isinstance(method, dict) and method.get("quant_method") == QUANT_METHOD


def mxfp4_source(source: TensorSource, cfg: ModelConfig) -> TensorSource:
    """The dequantizing view of an MXFP4 checkpoint, with a log line of what dequantizing costs."""
    wrapped = Mxfp4Source(source)
    L, E, D, F = cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    values = L * E * 3 * D * F
    log.info("%s's experts are MXFP4 (%.2f GiB in the file): %.2f GiB kept in float4 groups (quantization=mxfp4, "
             "the default on a GPU or TPU), or dequantized at load (the CPU default) to %.2f GiB in bfloat16, %.2f "
             "GiB in float32", cfg.architecture, values * BITS_PER_VALUE / 8 / 2**30,
             values * (0.5 + 4 / BLOCK) / 2**30, values * 2 / 2**30, values * 4 / 2**30)
    return wrapped
