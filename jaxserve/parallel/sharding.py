"""The one table from logical axis names to mesh axes, the mesh itself, and weight placement.

Model code names logical axes only ("embed", "q_heads", ...); this file alone knows the mesh axes `tp`
(tensor parallel, innermost) and `pp` (pipeline stages).
"""

from __future__ import annotations

import re
from typing import Iterable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Logical axis -> mesh axis (None: replicated). Megatron-style tensor parallelism: heads, MLP and vocabulary
# are split over `tp`; the stacked `layers` axis is split over `pp`.
LOGICAL_RULES: dict[str, str | None] = {
    "layers": "pp",
    "embed": None,
    "vocab": "tp",
    "q_heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "experts": "tp",
}

MESH_AXES = ("pp", "tp")


def parse_mesh(mesh: str | tuple[int, int] | None) -> tuple[int, int]:
    """`"8x2"` -> (tp=8, pp=2). None means one device."""
    if mesh is None:
        return 1, 1
    if isinstance(mesh, tuple):
        tp, pp = mesh
    else:
        m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", str(mesh))
        if not m:
            raise ValueError(f"mesh {mesh!r} is not of the form TPxPP, e.g. '4x2' for tp=4, pp=2")
        tp, pp = int(m.group(1)), int(m.group(2))
    if tp < 1 or pp < 1:
        raise ValueError(f"mesh {mesh!r} needs tp >= 1 and pp >= 1")
    return tp, pp


def make_mesh(tp: int, pp: int, devices: Iterable[jax.Device] | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    if tp * pp > len(devices):
        raise ValueError(
            f"mesh {tp}x{pp} needs {tp * pp} devices but only {len(devices)} are available; choose a smaller mesh"
        )
    # `tp` innermost so a tensor-parallel group sits on neighbouring devices (one node).
    grid = np.array(devices[: tp * pp]).reshape(pp, tp)
    return Mesh(grid, MESH_AXES)


def partition_spec(logical: tuple[str | None, ...]) -> PartitionSpec:
    return PartitionSpec(*(LOGICAL_RULES.get(name) if name else None for name in logical))


def named_sharding(mesh: Mesh, logical: tuple[str | None, ...]) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(logical))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
