"""Checkpoints that store several projections in one tensor (Phi-3: `qkv_proj`, `gate_up_proj`), presented under
the separate HF names every other loader path expects (`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`).

Each split name reads the fused tensor and keeps its rows: weights are [out, in], the parts stacked on `out` in
the order listed. A quantized fused tensor (a Phi-3 GGUF's blocks, a GPTQ Phi-3's groups) splits the same way,
its groups kept.
"""

from __future__ import annotations

import re

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.loader.weights import RenamingSource, TensorSource

FUSED_ARCHITECTURES = ("Phi3ForCausalLM",)  # those whose checkpoints store fused projections


def fused_parts(cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """Fused tensor suffix -> [(part suffix, rows)] in stacking order."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "self_attn.qkv_proj.weight": [("self_attn.q_proj.weight", q), ("self_attn.k_proj.weight", kv),
                                      ("self_attn.v_proj.weight", kv)],
        "mlp.gate_up_proj.weight": [("mlp.gate_proj.weight", cfg.intermediate_size),
                                    ("mlp.up_proj.weight", cfg.intermediate_size)],
    }


class SplitFusedSource(RenamingSource):
    """A TensorSource whose fused tensors appear as their parts (any other name passes through)."""

    def __init__(self, source: TensorSource, cfg: ModelConfig):
        self._source = source
        self._parts: dict[str, tuple[str, int, int]] = {}  # part name -> (fused name, first row, end row)
        self._rows: dict[str, int] = {}  # fused name -> the rows its parts add up to
        layout = fused_parts(cfg)
        for name in source.names():
            prefix, suffix = _split_layer_name(name)
            if suffix not in layout:
                continue
            start = 0
            for part, rows in layout[suffix]:
                self._parts[prefix + part] = (name, start, start + rows)
                start += rows
            self._rows[name] = start
        fused = {fused_name for fused_name, _, _ in self._parts.values()}
        self._names = (set(source.names()) - fused) | set(self._parts)

    def names(self) -> set[str]:
        return self._names

    def get(self, name: str) -> np.ndarray:
        if name not in self._parts:
            return self._source.get(name)
        fused, start, end = self._parts[name]
        if hasattr(self._source, "get_rows"):  # reads only the part: a fused tensor is not read three times
            self._check_rows(fused, self._source.shape(fused)[0])
            return self._source.get_rows(fused, start, end)
        tensor = self._source.get(fused)
        self._check_rows(fused, tensor.shape[0])
        return np.ascontiguousarray(tensor[start:end])  # a copy: the loader holds every layer's part, not the whole

    # A quantized checkpoint's fused tensors keep their groups too (loader/weights.BlockSource): a part is its rows
    # of the fused tensor's values and scales, which run along the input axis.
    def block_format(self, name: str):
        fused = self._parts[name][0] if name in self._parts else name
        return self._source.block_format(fused)

    def get_grouped(self, name: str):
        if name not in self._parts:
            return self._source.get_grouped(name)
        fused, start, end = self._parts[name]
        grouped = self._source.get_grouped(fused)
        self._check_rows(fused, grouped.shape[0])
        return grouped.map_rows(lambda a: np.ascontiguousarray(a[start:end]))

    def _check_rows(self, fused: str, rows: int) -> None:
        if rows != self._rows[fused]:
            raise ValueError(f"{fused} has {rows} rows, but the config's head and MLP sizes make "
                             f"{self._rows[fused]}: config.json does not describe this checkpoint")


def _split_layer_name(name: str) -> tuple[str, str]:
    """("model.layers.3.", "self_attn.qkv_proj.weight") for a layer tensor; ("", name) otherwise."""
    match = re.match(r"(model\.layers\.\d+\.)(.*)", name)
    return (match.group(1), match.group(2)) if match else ("", name)
