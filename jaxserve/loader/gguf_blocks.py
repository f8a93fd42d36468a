"""GGUF's quantized blocks decoded into values and per-group scales and offsets (loader/grouped.py), exactly: the
float32 weights q * scale + offset are llama.cpp's own dequantization (the `gguf` package's, tested bit for bit).

Each type's block is 32 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or a 256-value super-block of sub-blocks with their
own 6-bit or 8-bit scales (Q4_K and Q5_K: 8 of 32 with mins; Q6_K: 16 of 16), which become the groups here: a
sub-block's scale is d * its scale, computed in float32 as llama.cpp computes it. Q4 types keep 4-bit values
(half a byte each on the devices); the others int8.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from jaxserve.loader.grouped import GroupedArray
from jaxserve.models.layers import Grouped

# The types kept in their blocks, and how: (bits on the devices, group, offset).
KEPT_TYPES = {
    Q.Q4_0: Grouped(4, 32, True), Q.Q4_1: Grouped(4, 32, True), Q.Q4_K: Grouped(4, 32, True),
    Q.Q5_0: Grouped(8, 32, False), Q.Q5_1: Grouped(8, 32, True), Q.Q5_K: Grouped(8, 32, True),
    Q.Q6_K: Grouped(8, 16, False), Q.Q8_0: Grouped(8, 32, False),
}


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field at byte `start` of each block, as float32 [n, 1]."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """[n, chunks * half] bytes -> [n, chunks * 2 * half] values: each chunk's low nibbles, then its high ones."""
    n = qs.shape[0]
    chunks = qs.reshape(n, -1, 1, half) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (chunks & np.uint8(0x0F)).reshape(n, -1)


def _bits(packed: np.ndarray, count: int) -> np.ndarray:
    """Bit i of each little-endian 32-bit word [n, 4 bytes] -> [n, 32] values 0/1 (Q5_0/Q5_1's fifth bits)."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    return ((words >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=1)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1).reshape(n, 8)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1).reshape(n, 8)
    return sc, mins


def _decode(blocks: np.ndarray, kind: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """[n, block bytes] -> (values [n, block], scales [n, groups], offsets or None)."""
    if kind == Q.Q8_0:
        return blocks[:, 2:].view(np.int8), _f16(blocks, 0), None
    if kind == Q.Q4_0:
        d = _f16(blocks, 0)
        return _nibbles(blocks[:, 2:], 16), d, -8 * d  # d * (q - 8), exactly: both terms are exact products
    if kind == Q.Q4_1:
        return _nibbles(blocks[:, 4:], 16), _f16(blocks, 0), _f16(blocks, 2)
    if kind in (Q.Q5_0, Q.Q5_1):
        start = 2 if kind == Q.Q5_0 else 4
        q = _nibbles(blocks[:, start + 4:], 16) | (_bits(blocks[:, start:start + 4], 32) << 4)
        if kind == Q.Q5_0:
            return (q.astype(np.int8) - np.int8(16)), _f16(blocks, 0), None
        return q.astype(np.int8), _f16(blocks, 0), _f16(blocks, 2)
    if kind in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mins = _k_scales(blocks[:, 4:16])
        scale, offset = d * sc.astype(np.float32), -(dmin * mins.astype(np.float32))
        if kind == Q.Q4_K:
            return _nibbles(blocks[:, 16:], 32), scale, offset
        high = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = _nibbles(blocks[:, 48:], 32) | ((high & 1).reshape(blocks.shape[0], -1) << 4)
        return q.astype(np.int8), scale, offset
    if kind == Q.Q6_K:
        n = blocks.shape[0]
        low = _nibbles(blocks[:, :128], 64).reshape(n, -1, 32)
        high = blocks[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        q = (low | ((high & 3).reshape(n, -1, 32) << 4)).astype(np.int8) - np.int8(32)
        scale = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
        return q.reshape(n, -1), scale, None
    raise ValueError(f"GGUF type {kind.name} is not kept in its blocks; kept: "
                     f"{', '.join(k.name for k in KEPT_TYPES)}")


def decode_blocks(data: np.ndarray, kind: Q) -> GroupedArray:
    """A tensor's raw bytes [..., row bytes] (rows of whole blocks) -> GroupedArray grouped along the last axis."""
    block, block_bytes = GGML_QUANT_SIZES[kind]
    rows = data.shape[:-1]
    values, scale, offset = _decode(np.asarray(data).reshape(-1, block_bytes), kind)
    shape, groups = rows + (data.shape[-1] // block_bytes * block,), rows + (-1,)
    return GroupedArray(values.reshape(shape), scale.reshape(groups),
                        None if offset is None else offset.reshape(groups), len(rows), KEPT_TYPES[kind].bits)
