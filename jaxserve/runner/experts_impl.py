"""How a mixture-of-experts layer's grouped matmuls run on the mesh (models/experts.py does the math).

Activations are replicated over tensor-parallel devices between layers, so no token needs sending anywhere: each
device runs its share of the experts' work on every pair routed to it and one all-reduce (`psum` over tp) sums
the shares, the same collective a dense MLP's down projection ends in.
- Expert tensor parallelism (default): each device holds a slice of every expert's MLP width and runs every pair.
- Expert parallelism (`enable_expert_parallel`): each device holds E/tp whole experts and runs only their pairs.
An all-to-all dispatch would pay off only if tokens were split over devices (data-parallel attention), which
jaxserve's tensor parallelism does not do: here it would add a second collective and save none.

The grouped matmul scheme is chosen per platform: the expert loop on CPU, gathered blocks on GPU and TPU.
"""

from __future__ import annotations

from functools import partial

import jax
from jax.sharding import Mesh

from jaxserve.config import ModelConfig
from jaxserve.models.experts import EXPERT_CONTRACTS, expert_axes, local_experts
from jaxserve.models.layers import stored_name
from jaxserve.parallel.sharding import TENSOR_AXIS, nested_map_mesh, partition_spec


def expert_impl(platform: str) -> str:
    """The grouped-matmul scheme for `platform` (models/experts.py says what each does and why)."""
    return "looped" if platform == "cpu" else "gathered"


def make_experts_fn(cfg: ModelConfig, platform: str, mesh: Mesh):
    """-> fn(cfg, x, weights, experts, expert_weights) -> [T, D] float32, the experts' part of models/experts.py's
    `moe_mlp`, run per device and summed over tp."""
    impl = expert_impl(platform)
    tp = mesh.shape[TENSOR_AXIS]
    if tp == 1:
        return partial(local_experts, impl=impl)
    axes = expert_axes(cfg.expert_parallel)

    def spec(name: str, w: dict):
        """A weight's axes; its per-channel scale's lack the contracted ones (a checkpoint's group scales have all)."""
        base = stored_name(name)
        grouped = w[name].ndim == w[base].ndim
        logical = axes[base] if grouped else tuple(a for a in axes[base] if a not in EXPERT_CONTRACTS[base])
        return partition_spec(logical)

    def sharded(cfg: ModelConfig, x, weights, experts, w):
        def share(x, weights, experts, w):
            num_local = w["w_gate"].shape[0]
            first = jax.lax.axis_index(TENSOR_AXIS) * num_local if cfg.expert_parallel else 0
            out = local_experts(cfg, x, weights, experts, w, first=first, impl=impl)
            return jax.lax.psum(out, TENSOR_AXIS)

        everywhere = partition_spec(())
        outer, manual = nested_map_mesh(mesh)  # inside a pipeline stage, pp is manual already
        specs = (everywhere, everywhere, everywhere, {name: spec(name, w) for name in w})
        # check_vma=False: the expert loop's carry starts replicated and becomes per-device; the psum makes the
        # result replicated again, which is all out_specs claims.
        return jax.shard_map(share, mesh=outer, in_specs=specs, out_specs=everywhere,
                             axis_names=frozenset({TENSOR_AXIS}) - manual, check_vma=False)(x, weights, experts, w)

    return sharded
