"""The one table from logical axis names to mesh axes, the mesh itself, and weight placement.

Model code names logical axes only ("embed", "q_heads", ...); this file alone knows the mesh axes `tp`
(tensor parallel, innermost) and `pp` (pipeline stages).
"""

from __future__ import annotations

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
    # Mixture of experts. By default every device holds a slice of every expert: its MLP width splits as a dense
    # MLP's ("mlp"). With expert parallelism whole experts split over tp instead, each keeping its width whole.
    "experts": None,
    "parallel_experts": "tp",
    "expert_mlp": None,
    "shared_mlp": "tp",  # a shared expert (every token runs it) splits as a dense MLP does
    "lora_slots": None,  # LoRA factors: every device holds every adapter, split like the weight they change
    "lora_rank": None,
}

PIPELINE_AXIS, TENSOR_AXIS = "pp", "tp"
MESH_AXES = (PIPELINE_AXIS, TENSOR_AXIS)


def make_mesh(tp: int, pp: int, devices: Iterable[jax.Device] | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    if tp * pp > len(devices):
        advice = "choose a smaller mesh"
        if all(d.platform == "cpu" for d in devices):  # fake CPU devices are how a mesh is tried without accelerators
            processes = jax.process_count()
            advice += (f", or make more CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count="
                       f"{-(-tp * pp // processes)} in the environment before the process starts"
                       + (f" (each of the {processes} processes)" if processes > 1 else ""))
        are = "is" if len(devices) == 1 else "are"
        raise ValueError(f"mesh {tp}x{pp} needs {tp * pp} devices but only {len(devices)} {are} available; {advice}")
    # `tp` innermost so a tensor-parallel group sits on neighbouring devices (one node).
    grid = np.array(devices[: tp * pp]).reshape(pp, tp)
    return Mesh(grid, MESH_AXES)


def replica_device_groups(tp: int, pp: int, dp: int, devices: Iterable[jax.Device] | None = None
                          ) -> list[list[jax.Device]]:
    """The devices of each of `dp` data-parallel replicas, tp x pp apiece and disjoint: replica r takes the r-th run
    of neighbouring devices, so each keeps its tensor-parallel groups on one node as `make_mesh` does."""
    devices = list(jax.devices() if devices is None else devices)
    per_replica = tp * pp
    if dp < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {dp}")
    if dp * per_replica > len(devices):
        raise ValueError(f"{dp} data-parallel replicas of mesh {tp}x{pp} need {dp * per_replica} devices but only "
                         f"{len(devices)} are available; lower --data-parallel-size or the mesh")
    return [devices[r * per_replica:(r + 1) * per_replica] for r in range(dp)]


def mesh_axis(name: str | None) -> str | None:
    """The mesh axis a logical axis name maps onto (None: replicated, as is an unnamed axis). A name missing from
    the table is a mistake, not a replicated axis: it raises, naming the table."""
    if name is None:
        return None
    try:
        return LOGICAL_RULES[name]
    except KeyError:
        raise ValueError(f"unknown logical axis name {name!r}: the sharding table (parallel/sharding.py "
                         f"LOGICAL_RULES) knows {', '.join(LOGICAL_RULES)}") from None


def partition_spec(logical: tuple[str | None, ...]) -> PartitionSpec:
    return PartitionSpec(*(mesh_axis(name) for name in logical))


def mesh_axes(logical: tuple[str | None, ...]) -> frozenset[str]:
    """The mesh axes that `logical` names map onto, e.g. shard_map's `axis_names` for a map over heads."""
    return frozenset(axis for name in logical if (axis := mesh_axis(name)))


def named_sharding(mesh: Mesh, logical: tuple[str | None, ...]) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(logical))


def per_device_spec() -> PartitionSpec:
    """A [pp, tp, ...] array split so that each device holds its own [1, 1, ...] slice (collective checks)."""
    return PartitionSpec(*MESH_AXES)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def nested_map_mesh(mesh: Mesh) -> tuple[Mesh, frozenset[str]]:
    """(mesh, axes already manual) for a `shard_map` that may run inside another one: inside the pipeline's
    (manual over stages) it must name the context's abstract mesh and may make only the remaining axes manual."""
    context = jax.sharding.get_abstract_mesh()
    if context.empty or not context.manual_axes:
        return mesh, frozenset()
    return context, frozenset(context.manual_axes)
