"""GPTQ (`quant_method: gptq`, AutoGPTQ/GPTQModel's format) and AWQ (`quant_method: awq`, AutoAWQ's GEMM
format) checkpoints: 4-bit (or GPTQ's 8-bit) weights with per-group scales and zero points, presented under the
float weight names and kept in their groups (loader/grouped.py).

Both store a Linear's weight transposed, [in, out], in int32 words:
- GPTQ: `qweight` [in / (32 / bits), out], consecutive input rows in each word (the first in the lowest bits);
  `qzeros` [groups, out / (32 / bits)], consecutive output columns in each word; `scales` [groups, out]; `g_idx`
  [in], each input row's group (GPTQ's act-order when it is not row // group_size). The weight is
  (q - zero) * scale, where the stored zero is one less than the zero in the original ("gptq", v1) format and
  the zero itself in "gptq_v2".
- AWQ (GEMM): `qweight` [in, out / 8] and `qzeros` [groups, out / 8], 8 output columns in each word in the order
  0, 2, 4, 6, 1, 3, 5, 7 (from the lowest bits); `scales` [groups, out]; the weight is (q - zero) * scale, group =
  row // group_size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.loader.grouped import GroupedArray, shuffled_groups, uneven_groups
from jaxserve.loader.weights import TensorSource
from jaxserve.models.layers import Grouped

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column of each nibble of an AWQ word, from the lowest bits


def packed_int_method(config: dict[str, Any]) -> str | None:
    """"gptq" or "awq" for a checkpoint jaxserve reads in those formats, None for any other; a ValueError naming
    a variant it cannot read."""
    method = config.get("quant_method")
    if method not in ("gptq", "awq"):
        return None
    bits, version = config.get("bits"), str(config.get("version", "gemm")).lower()
    problem = None
    if method == "gptq" and bits not in (4, 8):
        problem = f"{bits}-bit weights (supported: 4 and 8)"
    elif method == "gptq" and config.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        problem = f"checkpoint_format {config.get('checkpoint_format')!r} (supported: gptq, gptq_v2)"
    elif method == "awq" and (bits != 4 or version != "gemm"):
        problem = f"{bits}-bit {version} weights (supported: 4-bit GEMM)"
    elif method == "awq" and not config.get("zero_point", True):
        problem = "weights without zero points (supported: with)"
    if problem:
        raise ValueError(f"this {method} checkpoint holds {problem}, which jaxserve cannot read yet")
    return method


class PackedIntSource:
    """A TensorSource over a GPTQ or AWQ checkpoint: `X.weight` for each packed `X.qweight` (dequantized by `get`,
    kept in its groups by `get_grouped`), every other tensor as it is."""

    def __init__(self, source: TensorSource, config: dict[str, Any]):
        self._source = source
        self.method = packed_int_method(config)
        self._bits = int(config["bits"])
        self._group_size = config.get("group_size")  # -1: one group a row (per channel)
        # GPTQ's original format stores each zero point minus one
        self._zero_offset = 1 if self.method == "gptq" and config.get("checkpoint_format", "gptq") == "gptq" else 0
        names = source.names()
        self._packed = {n[: -len(".qweight")] + ".weight" for n in names if n.endswith(".qweight")}
        if not self._packed:
            raise ValueError(f"the checkpoint's quantization_config describes {self.method} weights, but it holds no "
                             "*.qweight tensors: it is not the checkpoint its config describes")
        parts = (".qweight", ".qzeros", ".scales", ".g_idx")
        self._names = {n for n in names if not n.endswith(parts)} | self._packed

    def names(self) -> set[str]:
        return self._names

    def get(self, name: str) -> np.ndarray:
        if name not in self._packed:
            return self._source.get(name)
        grouped, rows_group = self._decoded(name)
        return grouped.dequantize() if rows_group is None else grouped.dequantize_by_columns(rows_group)

    def block_format(self, name: str) -> Grouped | None:
        if name not in self._packed or self._rows_group(name) is not None:
            return None
        base = name[: -len(".weight")]
        return Grouped(bits=self._bits, group=self._rows(base) // self._source.shape(base + ".scales")[0],
                       offset=True)

    def get_grouped(self, name: str) -> GroupedArray:
        grouped, rows_group = self._decoded(name)
        assert rows_group is None, f"{name}'s groups are not contiguous and even: it is dequantized at load"
        return grouped

    def _rows(self, base: str) -> int:
        """The weight's input width (the packed tensors' rows)."""
        packed_rows = self._source.shape(base + ".qweight")[0]
        return packed_rows if self.method == "awq" else packed_rows * 32 // self._bits

    def _rows_group(self, name: str) -> np.ndarray | None:
        """Each input row's group where GPTQ's act-order shuffled them or the last group is shorter, else None."""
        base = name[: -len(".weight")]
        groups = self._source.shape(base + ".scales")[0]
        if self.method == "gptq" and base + ".g_idx" in self._source.names():
            return shuffled_groups(self._source.get(base + ".g_idx"), groups)
        return uneven_groups(name, self._rows(base), groups, self._group_size)

    def _decoded(self, name: str) -> tuple[GroupedArray, np.ndarray | None]:
        """(the weight in HF's [out, in] layout: values q, per-group scales and offsets -zero * scale; each input
        row's group under act-order)."""
        base = name[: -len(".weight")]
        qweight, qzeros = self._source.get(base + ".qweight"), self._source.get(base + ".qzeros")
        scale = self._source.get(base + ".scales").astype(np.float32)  # [groups, out]
        if self.method == "awq":
            q, zero = _unpack_awq(qweight), _unpack_awq(qzeros)
        else:
            q, zero = _unpack(qweight, self._bits, axis=0), _unpack(qzeros, self._bits, axis=1)
        zero = zero[:, : scale.shape[1]].astype(np.float32) + self._zero_offset
        values = q.T if self._bits == 4 else (q.T.astype(np.int16) - 128).astype(np.int8)
        shift = 0 if self._bits == 4 else 128  # 8-bit values stored as int8: q - 128
        offset = (-(zero - shift) * scale).T
        return GroupedArray(np.ascontiguousarray(values), np.ascontiguousarray(scale.T), np.ascontiguousarray(offset),
                            1, self._bits), self._rows_group(name)


def _unpack(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words holding 32 / bits unsigned values each along `axis` (the first in the lowest bits) -> uint8."""
    per_word = 32 // bits
    words = np.ascontiguousarray(words).view(np.uint32)
    shifts = np.arange(per_word, dtype=np.uint32) * bits
    if axis == 0:
        values = (words[:, None, :] >> shifts[:, None]) & ((1 << bits) - 1)
        return values.reshape(-1, words.shape[1]).astype(np.uint8)
    values = (words[:, :, None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(words.shape[0], -1).astype(np.uint8)


def _unpack_awq(words: np.ndarray) -> np.ndarray:
    """AWQ's [rows, out / 8] words -> [rows, out] 4-bit values, its interleaved column order undone."""
    nibbles = _unpack(words, 4, axis=1).reshape(words.shape[0], -1, 8)
    values = np.empty_like(nibbles)
    values[:, :, list(AWQ_ORDER)] = nibbles
    return values.reshape(words.shape[0], -1)
