"""Checkpoints of 8-bit weights beside their scales (float8 e4m3, or int8), presented under the float weight
names and kept in groups (loader/grouped.py) as 8-bit values with float32 scales.

Three formats:
- `quant_method: fp8` (transformers' FineGrainedFP8, the Qwen3-FP8 and DeepSeek releases): `X.weight` float8 and
  `X.weight_scale_inv` [ceil(out / 128), ceil(in / 128)], one scale per 128x128 block (`weight_block_size`); the
  weight is weight * scale_inv, whatever the name says. Without `weight_block_size` (AutoFP8's and vLLM's own
  serialized FP8): `X.weight_scale`, one per tensor.
- compressed-tensors `float-quantized` (llm-compressor's FP8 and FP8-dynamic): `X.weight` float8 and
  `X.weight_scale`, per tensor, per output channel or per block; static activation scales (`X.input_scale`) may
  come beside them;
- compressed-tensors `int-quantized` (llm-compressor's W8A8 int8): `X.weight` int8 and `X.weight_scale` per
  tensor or output channel.
All become per-group scales along the input axis: a block's scale repeated for each of its output rows (exact;
the scales stay a few percent of the float8 bytes). Activations stay in the model's dtype: each weight is
dequantized in its matmul, as on every device without FP8 matmuls (docs/quantization.md).
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from jaxserve.loader.grouped import GroupedArray
from jaxserve.loader.weights import TensorSource
from jaxserve.models.layers import Grouped

FLOAT8 = np.dtype(ml_dtypes.float8_e4m3fn)


def fp8_scale_suffix(config: dict[str, Any]) -> str | None:
    """The scale tensors' suffix of the FP8 checkpoint whose quantization_config is `config` (quant_method fp8),
    None for any other; a ValueError naming an FP8 scheme jaxserve cannot read."""
    if config.get("quant_method") == "fp8":
        if config.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"this fp8 checkpoint's activation_scheme is {config.get('activation_scheme')!r}; "
                             "supported: dynamic (activations are not quantized here)")
        return ".weight_scale_inv" if config.get("weight_block_size") else ".weight_scale"
    return None


class ScaledSource:
    """A TensorSource over a checkpoint of 8-bit weights (`values`: float8 e4m3 or int8) and their scales: each
    weight dequantized by `get`, kept in groups by `get_grouped`; scale tensors hidden; every other tensor as it
    is."""

    def __init__(self, source: TensorSource, scale_suffix: str, method: str,
                 block: tuple[int, int] | None = None, values=FLOAT8, activations: str | None = None):
        self._source, self._suffix, self.method = source, scale_suffix, method
        # "int8": the checkpoint's matmuls quantize their inputs per token too (W8A8), kept as ModelConfig says
        self.activations = activations
        self._values = np.dtype(values)
        self._block = block
        names = source.names()
        self._quantized = {n[: -len(scale_suffix)] + ".weight" for n in names if n.endswith(scale_suffix)}
        if not self._quantized:
            raise ValueError(f"the checkpoint's quantization_config describes {method} 8-bit weights, but it holds "
                             f"no weight scales (*{scale_suffix}): it is not the checkpoint its config describes")
        hidden = {n for n in names if n.endswith((scale_suffix, ".input_scale"))}
        self._names = names - hidden

    @property
    def float_values(self) -> bool:
        return self._values == FLOAT8

    def names(self) -> set[str]:
        return self._names

    def get(self, name: str) -> np.ndarray:
        return self.get_grouped(name).dequantize() if name in self._quantized else self._source.get(name)

    def block_format(self, name: str) -> Grouped | None:
        if name not in self._quantized:
            return None
        return Grouped(bits=8, group=self._group(self._source.shape(name)[1]), offset=False,
                       float8=self._values == FLOAT8, channel=self._block is None)

    def get_grouped(self, name: str) -> GroupedArray:
        values = self._source.get(name)
        if values.dtype != self._values:
            raise ValueError(f"{name} is {values.dtype}, not {self._values}: the checkpoint's quantization_config "
                             "does not describe its tensors")
        rows, columns = values.shape
        group = self._group(columns)
        scale = self._source.get(name[: -len(".weight")] + self._suffix).astype(np.float32)
        # Blocks [ceil(rows / b0), ceil(columns / b1)]: [n, 1] too where a row is one block wide, which is no
        # per-channel scale.
        if self._block or (scale.ndim == 2 and scale.shape[1] > 1):
            b0, b1 = self._block or (math.ceil(rows / scale.shape[0]), math.ceil(columns / scale.shape[1]))
            scale = np.repeat(np.repeat(scale, b0, 0)[:rows], b1 // group, 1)[:, : columns // group]
        else:  # per tensor ([] or [1]) or per output channel ([rows] or [rows, 1])
            scale = np.broadcast_to(scale.reshape(-1, 1), (rows, columns // group)).copy()
        return GroupedArray(values, np.ascontiguousarray(scale), None, 1, 8)

    def _group(self, columns: int) -> int:
        """The input columns a scale covers: the block's width (or what of it divides the row), else the row
        (loader/weights.keep_blocks narrows it)."""
        return math.gcd(self._block[1], columns) if self._block else columns
