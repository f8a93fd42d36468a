"""A GGUF file's metadata and tensor index, read in one pass.

The `gguf` package's `GGUFReader` builds numpy views for every element of every array field: over SmolLM2's
49k-token vocabulary (tokens, token types, merges) that is 4 s per open, paid by every server start and every
process of a cluster. This reader parses the same header (format versions 2 and 3, little-endian) with `struct`
in a fraction of a second. Tensor data stays a view into a memory map, shaped as `GGUFReader` shapes it (float
types by their dimensions, quantized types as rows of bytes), so `gguf.quants.dequantize` reads it unchanged.
"""

from __future__ import annotations

import importlib.metadata
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

VT = gguf.GGUFValueType
# Little-endian struct codes of the scalar value types (numpy reads the same codes for arrays of them).
_SCALARS = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
            VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}
# Plain (not block-quantized) tensor types and the numpy type their elements are stored as.
_PLAIN_TENSORS = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
                  gguf.GGMLQuantizationType.F64: np.float64, gguf.GGMLQuantizationType.I8: np.int8,
                  gguf.GGMLQuantizationType.I16: np.int16, gguf.GGMLQuantizationType.I32: np.int32,
                  gguf.GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-moving dimension first
    data: np.ndarray  # a view into the file


@dataclass(frozen=True)
class GGUFField:
    value: Any  # a Python value: int, float, bool, str, or a list of one of them
    type: gguf.GGUFValueType
    element_type: gguf.GGUFValueType | None = None  # an array's


class UnreadableGGUF(ValueError):
    """A whole GGUF file of a kind this reader does not read (a version, big-endian): no damage to report."""


class UnknownTensorType(ValueError):
    """A tensor of a GGML type the gguf package does not know."""


class GGUFReader:
    """`fields`: key -> GGUFField; `tensors`: in file order. Raises ValueError on a file that is not GGUF or is
    cut short."""

    def __init__(self, path: str | Path):
        self.data = np.memmap(path, mode="r")
        self._buf = memoryview(self.data)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise ValueError(f"damaged header at byte {self._pos}: {e}") from None

    def _parse(self) -> None:
        if bytes(self._buf[:4]) != MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        self._pos = 4
        version = self._scalar(VT.UINT32)
        if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
            raise UnreadableGGUF("it is a big-endian GGUF (llama.cpp's --bigendian conversion), which this reader "
                                 "does not read: convert the model without --bigendian")
        if version not in SUPPORTED_VERSIONS:
            raise UnreadableGGUF(f"it is GGUF version {version}, and this reader reads versions 2 and 3")
        tensor_count, kv_count = self._scalar(VT.UINT64), self._scalar(VT.UINT64)
        self.fields: dict[str, GGUFField] = {}
        for _ in range(kv_count):
            key = self._string()
            self.fields[key] = self._field()
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.fields.get("general.alignment")
        align = DEFAULT_ALIGNMENT if alignment is None else int(alignment.value)
        if align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align} is not a power of two")
        start = -(-self._pos // align) * align
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _scalar(self, kind: gguf.GGUFValueType):
        fmt = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar(VT.UINT64)
        end = self._pos + n
        if end > len(self._buf):
            raise IndexError("a string runs past the end of the file")
        s = str(self._buf[self._pos:end], "utf-8")
        self._pos = end
        return s

    def _field(self) -> GGUFField:
        kind = VT(self._scalar(VT.UINT32))
        if kind == VT.STRING:
            return GGUFField(self._string(), kind)
        if kind != VT.ARRAY:
            return GGUFField(self._scalar(kind), kind)
        element, count = VT(self._scalar(VT.UINT32)), self._scalar(VT.UINT64)
        if element == VT.STRING:
            return GGUFField([self._string() for _ in range(count)], kind, element)
        if element == VT.ARRAY:
            raise ValueError("nested GGUF arrays are not read")
        dtype = np.dtype(_SCALARS[element])
        values = np.frombuffer(self._buf, dtype, count, self._pos)
        self._pos += count * dtype.itemsize
        return GGUFField(values.tolist(), kind, element)

    def _tensor_info(self) -> tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]:
        name = self._string()
        dims = tuple(self._scalar(VT.UINT64) for _ in range(self._scalar(VT.UINT32)))
        code = self._scalar(VT.UINT32)
        try:
            kind = gguf.GGMLQuantizationType(code)
        except ValueError:  # a type newer than the installed gguf package (the file itself may be sound)
            raise UnknownTensorType(f"tensor {name} is of GGML type {code}, which the installed gguf package "
                                    f"({importlib.metadata.version('gguf')}) does not know: upgrade it "
                                    "(pip install -U gguf) or use a file of another quantization type") from None
        return name, dims, kind, self._scalar(VT.UINT64)

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: gguf.GGMLQuantizationType,
                offset: int) -> GGUFTensor:
        shape = tuple(reversed(dims))  # numpy's order: the slowest-moving dimension first
        elements = int(np.prod(dims))
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        begin = start + offset
        if kind in _PLAIN_TENSORS:
            dtype = np.dtype(_PLAIN_TENSORS[kind])
            count = elements
        else:
            dtype, count = np.dtype(np.uint8), elements * block_bytes // block
            shape = gguf.quant_shape_to_byte_shape(shape, kind)
        if begin + count * dtype.itemsize > len(self.data):
            raise ValueError(f"tensor {name} runs past the end of the file: the file is truncated")
        data = np.frombuffer(self.data, dtype, count, begin).reshape(shape)
        return GGUFTensor(name, kind, dims, data)
