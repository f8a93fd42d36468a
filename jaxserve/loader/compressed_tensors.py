"""Checkpoints written by llm-compressor in the compressed-tensors format (`quant_method: compressed-tensors`),
pack-quantized weights (W4A16, W8A16): presented under the float weight names, and kept in their groups
(loader/grouped.py) like a GGUF file's blocks. Its float-quantized (FP8) checkpoints are loader/scaled.py's.

The format: `<linear>.weight_packed` int32 [out, in / (32 / bits)], each int32 holding consecutive values of a row,
the first in the lowest bits, each value stored as q + 2^(bits-1); `weight_scale` [out, groups] (one group: per
channel); asymmetric schemes add `weight_zero_point`, packed the same way along the output axis [out / (32 / bits),
groups]; `weight_shape` the float weight's shape. The weight is (q - zero_point) * scale, group g covering input
columns g*G .. g*G+G-1, or, with activation ordering, the columns `weight_g_idx` assigns it (then the weight is
dequantized at load: its groups are not contiguous).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from jaxserve.loader.grouped import GroupedArray, shuffled_groups, uneven_groups
from jaxserve.loader.scaled import ScaledSource
from jaxserve.loader.weights import TensorSource
from jaxserve.models.layers import Grouped

log = logging.getLogger(__name__)

PACKED = ".weight_packed"
PARTS = ("_packed", "_scale", "_zero_point", "_shape", "_g_idx")


def quantization_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A config.json's quantization config: `quantization_config`, or `compression_config` (the name older
    llm-compressor and sparseml releases wrote, read by vLLM too), at the top or in a multimodal model's
    text_config."""
    for config in (raw, raw.get("text_config") or {}):
        for key in ("quantization_config", "compression_config"):
            if config.get(key):
                return config[key]
    return {}


def is_compressed_tensors(raw: dict[str, Any]) -> bool:
    return quantization_config(raw).get("quant_method") == "compressed-tensors"


SUPPORTED = ("supported: pack-quantized int4/int8 weights by group or channel, activations in float (W4A16, "
             "W8A16); float-quantized float8 weights by tensor, channel or block, activations in float or dynamic "
             "per token (FP8, FP8-dynamic); int-quantized int8 weights by tensor or channel, activations in float or "
             "dynamic per token (W8A8)")


def weight_scheme(raw: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any] | None] | None:
    """(format, the one weight scheme, its input activations' scheme or None) of a checkpoint jaxserve reads; None
    for one that quantizes no weights (its KV cache only); a ValueError naming what it uses instead."""
    config = quantization_config(raw)
    if config.get("transform_config"):
        raise ValueError("this compressed-tensors checkpoint's weights are rotated (transform_config: QuIP or "
                         "SpinQuant Hadamard transforms), which needs each layer's activations rotated too; "
                         "jaxserve cannot serve it yet")
    sparsity = (config.get("sparsity_config") or {}).get("format", "dense")
    if sparsity != "dense":  # "dense": compressed-tensors' name for weights stored as they are
        raise ValueError(f"this compressed-tensors checkpoint stores its weights sparse ({sparsity}), which jaxserve "
                         f"cannot read yet; supported: dense storage, and {SUPPORTED.removeprefix('supported: ')}")
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        return None
    if len({repr((g.get("weights"), g.get("format"), g.get("input_activations"))) for g in groups}) > 1:
        described = "; ".join(sorted({_described(g, config) for g in groups}))
        raise ValueError(f"this compressed-tensors checkpoint uses {len(groups)} weight schemes ({described}), and "
                         f"jaxserve reads checkpoints of one; {SUPPORTED}")
    group = groups[0]
    weights, activations = group.get("weights") or {}, group.get("input_activations")
    kind = group.get("format") or config.get("format")
    if kind == "naive-quantized":  # 8-bit values stored in their own dtype, as the int and float formats store them
        kind = {"int": "int-quantized", "float": "float-quantized"}.get(weights.get("type"), kind)
    packed = (kind == "pack-quantized" and weights.get("type") == "int" and weights.get("num_bits") in (4, 8)
              and weights.get("strategy") in ("group", "channel") and not activations)
    def dynamic(kind: str) -> bool:  # activations in float, or quantized per token as a step runs
        return not activations or (activations.get("type") == kind and activations.get("dynamic") is True)

    fp8 = (kind == "float-quantized" and weights.get("type") == "float" and weights.get("num_bits") == 8
           and weights.get("strategy") in ("tensor", "channel", "block") and dynamic("float"))
    int8 = (kind == "int-quantized" and weights.get("type") == "int" and weights.get("num_bits") == 8
            and weights.get("strategy") in ("tensor", "channel") and weights.get("symmetric", True)
            and dynamic("int"))
    if not (packed or fp8 or int8):
        raise ValueError(f"this compressed-tensors checkpoint holds {_described(group, config)}, which jaxserve "
                         f"cannot read yet; {SUPPORTED}")
    return kind, weights, activations


def _described(group: dict[str, Any], config: dict[str, Any]) -> str:
    """A config group's scheme in words: "pack-quantized int4 weights by group, activations quantized too"."""
    weights = group.get("weights") or {}
    described = (f"{group.get('format') or config.get('format')} {weights.get('type')}{weights.get('num_bits')} "
                 f"weights by {weights.get('strategy')}")
    return described + (", activations quantized too" if group.get("input_activations") else "")


def compressed_tensors_source(source: TensorSource, raw: dict[str, Any]) -> TensorSource:
    """The source presenting a compressed-tensors checkpoint's weights under their float names."""
    if quantization_config(raw).get("kv_cache_scheme"):
        log.warning("the checkpoint's calibrated KV-cache scales (kv_cache_scheme) are not used: the KV cache holds "
                    "the model's dtype, or float8 unscaled with --kv-cache-dtype fp8")
    scheme = weight_scheme(raw)
    if scheme is None:  # its KV cache quantized only: float weights
        return source
    kind, weights, activations = scheme
    if kind == "float-quantized":
        block = weights.get("block_structure")
        return ScaledSource(source, ".weight_scale", "compressed-tensors", tuple(block) if block else None)
    if kind == "int-quantized":  # W8A8 when its activations are quantized (dynamically, per token) too
        return ScaledSource(source, ".weight_scale", "compressed-tensors", values=np.int8,
                            activations="int8" if activations else None)
    return CompressedTensorsSource(source, raw)


class CompressedTensorsSource:
    """A TensorSource over a pack-quantized checkpoint's tensors: `X.weight` for each packed weight (dequantized
    by `get`, kept in its groups by `get_grouped`), every other tensor as it is."""

    method = "compressed-tensors"

    def __init__(self, source: TensorSource, raw: dict[str, Any]):
        self._source = source
        _, scheme, _ = weight_scheme(raw)
        self._bits = int(scheme["num_bits"])
        self._symmetric = bool(scheme.get("symmetric", True))
        self._group_size = scheme.get("group_size") if scheme.get("strategy") == "group" else None
        names = source.names()
        self._packed = {n[: -len(PACKED)] + ".weight" for n in names if n.endswith(PACKED)}
        if not self._packed:
            raise ValueError("the checkpoint's quantization_config describes pack-quantized weights, but it holds no "
                             "*.weight_packed tensors: it is not the checkpoint its config describes")
        parts = {n for n in names if any(n.endswith(".weight" + p) for p in PARTS)}
        self._names = (names - parts) | self._packed

    def names(self) -> set[str]:
        return self._names

    def get(self, name: str) -> np.ndarray:
        if name not in self._packed:
            return self._source.get(name)
        grouped, columns = self._decoded(name)
        return grouped.dequantize() if columns is None else grouped.dequantize_by_columns(columns)

    def block_format(self, name: str) -> Grouped | None:
        if name not in self._packed or self._decoded_columns(name) is not None:
            return None
        groups = self._source.get(name + "_scale").shape[-1]  # 1: per channel, a group of the whole row
        columns = int(self._source.get(name + "_shape")[1])
        return Grouped(bits=self._bits, group=columns // groups, offset=self._bits == 4 or not self._symmetric)

    def get_grouped(self, name: str) -> GroupedArray:
        grouped, columns = self._decoded(name)
        assert columns is None, f"{name} is ordered by activation: its groups are not contiguous"
        return grouped

    def _decoded_columns(self, name: str) -> np.ndarray | None:
        """Each input column's group where the checkpoint orders them by activation (GPTQ's act-order) or the last
        group is shorter, else None."""
        groups = self._source.shape(name + "_scale")[-1]
        if name + "_g_idx" in self._source.names():
            return shuffled_groups(self._source.get(name + "_g_idx"), groups)
        columns = int(self._source.get(name + "_shape")[1])
        return uneven_groups(name, columns, groups, self._group_size)

    def _decoded(self, name: str) -> tuple[GroupedArray, np.ndarray | None]:
        """(the weight as values 0..2^bits-1 for 4 bits or signed int8 for 8, scales and offsets; the columns'
        groups where they are ordered by activation)."""
        rows, columns = (int(n) for n in self._source.get(name + "_shape"))
        half = 1 << (self._bits - 1)
        stored = unpack_int32(self._source.get(name + "_packed"), self._bits, columns, axis=1)  # q + half
        scale = self._source.get(name + "_scale").astype(np.float32).reshape(rows, -1)
        if self._symmetric:
            zero = np.zeros_like(scale)
        else:
            zero = unpack_int32(self._source.get(name + "_zero_point"), self._bits, rows, axis=0).astype(np.float32)
            zero = zero.reshape(rows, -1) - half
        if self._bits == 4:  # unsigned values, (q - zero) * scale = stored * scale - (zero + half) * scale
            values, offset = stored.astype(np.uint8), -(zero + half) * scale
        else:
            values = (stored.astype(np.int16) - half).astype(np.int8)
            offset = None if self._symmetric else -zero * scale
        return GroupedArray(values, scale, offset, 1, self._bits), self._decoded_columns(name)


def unpack_int32(packed: np.ndarray, bits: int, size: int, axis: int) -> np.ndarray:
    """int32 words along `axis`, each holding 32 / bits values (the first in the lowest bits) -> the `size`
    unsigned values, as uint8."""
    per_word = 32 // bits
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)
    if axis == 1:
        values = (words[:, :, None] >> shifts) & ((1 << bits) - 1)
        return values.reshape(words.shape[0], -1)[:, :size].astype(np.uint8)
    values = (words[:, None, :] >> shifts[:, None]) & ((1 << bits) - 1)
    return values.reshape(-1, words.shape[1])[:size].astype(np.uint8)
