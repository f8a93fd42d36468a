"""Mixture-of-experts MLPs with sparse dispatch: each token runs through the k experts its router chose, not
through every expert.

One layer's work:
1. **Route** (`route`): router scores (softmax or sigmoid over the experts), the top k per token, renormalised
   where the model says so. T tokens make P = T*k (token, expert) pairs.
2. **Sort** (`sort_pairs`): the pairs by expert, so each expert's rows are contiguous; a device that holds only some
   experts (expert parallelism) sorts the pairs of the others after its own and never runs them.
3. **Grouped matmuls**: gate, up and down of each expert over its own rows, by one of two schemes of fixed shapes
   (group sizes are data, so nothing recompiles per batch):
   - `looped_experts` (CPU): a loop over the experts that have rows, each slicing its weights once and running
     its rows in chunks. XLA:CPU reads a sliced expert in place and each expert's bytes once per step;
     measured faster than gathering weights per block (2-10x) and than running every expert on every token
     (3-17x at 1-512 tokens; docs/architecture.md, "Mixture of experts").
   - `gathered_experts` (GPU, TPU): the sorted rows padded to blocks of `block` rows, each block's expert weights
     gathered, and one batched matmul over the blocks: no sequential loop, which a GPU would run kernel by
     kernel. (`jax.lax.ragged_dot` is the natural op, but jax's CUDA and CPU backends lower it to a dense matmul
     over every expert.)
4. **Combine**: each pair's output scaled by its routing weight and added back to its token, in float32.

The expert weights' logical axes are `expert_axes`'s: split over tensor-parallel devices by each expert's MLP
width (expert tensor parallelism, the default) or by whole experts (expert parallelism); the runner runs step 3
per device and sums the devices' outputs (runner/experts_impl.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.layers import ACTIVATIONS, dense, gated_mlp, stored_name

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down", "b_gate", "b_up")  # what the grouped matmuls read (gpt-oss: biases)
EXPERT_IMPLS = ("looped", "gathered")


def expert_axes(expert_parallel: bool) -> dict[str, tuple[str, ...]]:
    """Logical axes of one layer's expert weights (the stacked ones add "layers" first). By default each expert's
    MLP width is split as a dense MLP's ("mlp") and every device holds a slice of every expert; with expert
    parallelism whole experts are split ("parallel_experts") and each keeps its width whole ("expert_mlp")."""
    experts, width = ("parallel_experts", "expert_mlp") if expert_parallel else ("experts", "mlp")
    return {"w_gate": (experts, "embed", width), "w_up": (experts, "embed", width),
            "w_down": (experts, width, "embed"), "b_gate": (experts, width), "b_up": (experts, width),
            "b_down": (experts, "embed")}


# What each weight's matmul sums over (its int8 scale keeps the other axes).
EXPERT_CONTRACTS = {"w_gate": ("embed",), "w_up": ("embed",), "w_down": ("mlp", "expert_mlp")}


def route(cfg: ModelConfig, h: jax.Array, router: jax.Array, bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array]:
    """(weights [T, k] float32, experts [T, k] int32): each token's top-k experts by router score and the weight
    its output gets. Scores are a softmax over the experts (Mixtral, Qwen) or each expert's sigmoid
    (`cfg.router_scoring`); renormalised to sum to 1 where `cfg.moe_renormalize`. (gpt-oss's softmax over its
    top-k logits is the softmax over all of them renormalised over the top k.) Padded experts have no router
    column, so they are never chosen."""
    logits = jnp.einsum("TD,DE->TE", h, router, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if cfg.router_scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(scores, cfg.num_experts_per_tok)
    if cfg.moe_renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


class Pairs(NamedTuple):
    """The P = T*k (token, expert) pairs sorted by expert. Rows of a local expert e are
    [starts[e], starts[e] + counts[e]); pairs of experts held elsewhere come after every local one."""
    tokens: jax.Array  # [P] the token of each sorted pair
    weights: jax.Array  # [P] float32 routing weight (0 for the pairs of experts held elsewhere)
    experts: jax.Array  # [P] local expert of each sorted pair (num_local for those held elsewhere)
    counts: jax.Array  # [num_local] rows of each local expert
    starts: jax.Array  # [num_local] first row of each local expert


def sort_pairs(weights: jax.Array, experts: jax.Array, first: jax.Array | int, num_local: int) -> Pairs:
    """Sort the pairs by expert, keeping only the experts [first, first + num_local) this device holds."""
    k = experts.shape[1]
    local = experts.reshape(-1) - first
    mine = (local >= 0) & (local < num_local)
    key = jnp.where(mine, local, num_local)
    order = jnp.argsort(key, stable=True)
    counts = jnp.bincount(key, length=num_local + 1)[:num_local]
    return Pairs(tokens=(order // k).astype(jnp.int32),
                 weights=jnp.where(mine, weights.reshape(-1), 0.0)[order],
                 experts=key[order], counts=counts, starts=jnp.cumsum(counts) - counts)


def rows_per_chunk(pairs: int, experts: int, cap: int) -> int:
    """Rows one matmul of an expert takes: about half an expert's expected rows (pairs / experts), a power of two
    in [1, cap]. Smaller chunks waste less on padding, larger ones run fewer, better-shaped matmuls (measured on
    CPU: docs/architecture.md)."""
    size = 1
    while size * 2 <= min(cap, pairs / (2 * experts)):
        size *= 2
    return size


def gated(cfg: ModelConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
    """act(gate) * up; gpt-oss's clamped SwiGLU where the model has a limit."""
    if cfg.swiglu_limit is None:
        return ACTIVATIONS[cfg.hidden_act](gate) * up
    gate = jnp.minimum(gate, cfg.swiglu_limit)
    up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha)


def expert_mlp(cfg: ModelConfig, x: jax.Array, w: dict[str, jax.Array], batched: bool = False) -> jax.Array:
    """down(act(gate(x)) * up(x)) with one expert's weights: x [R, D] (or [N, R, D] with each block's weights
    [N, ...] when `batched`); quantized weights carry their scales (`<name>_scale`, and a checkpoint's groups their
    `<name>_offset`); gate and up their biases where
    the model has them (the down projection's is added once, after the experts: `moe_mlp`)."""
    n = "N" if batched else ""
    gate = dense(f"{n}RD,{n}DF->{n}RF", x, w, "w_gate", **cfg.matmul)
    up = dense(f"{n}RD,{n}DF->{n}RF", x, w, "w_up", **cfg.matmul)
    if "b_gate" in w:
        gate, up = gate + w["b_gate"], up + w["b_up"]
    return dense(f"{n}RF,{n}FD->{n}RD", gated(cfg, gate, up), w, "w_down", **cfg.matmul)


def looped_experts(cfg: ModelConfig, x: jax.Array, pairs: Pairs, w: dict[str, jax.Array],
                   chunk: int | None = None) -> jax.Array:
    """Each pair's expert output [P, D] (sorted order; zero rows for the pairs of experts held elsewhere): a loop
    over the local experts that have rows, each running its rows `chunk` at a time with its weights sliced once.

    A chunk may run past its expert's rows into the next expert's; the loop goes in expert order, so the next
    expert with rows (which starts right there) writes over them, and past the last one they meet zero routing
    weights or the padding rows."""
    num_local = w["w_gate"].shape[0]
    P, D = pairs.tokens.shape[0], x.shape[-1]
    chunk = chunk or rows_per_chunk(P, num_local, cap=32)
    rows = jnp.concatenate([x[pairs.tokens], jnp.zeros((chunk, D), x.dtype)])
    active = jnp.nonzero(pairs.counts, size=num_local, fill_value=0)[0]

    def run_expert(a, out):
        e = active[a]
        we = {name: jax.lax.dynamic_index_in_dim(value, e, keepdims=False) for name, value in w.items()}
        start = pairs.starts[e]

        def run_chunk(j, out):
            row = start + j * chunk
            y = expert_mlp(cfg, jax.lax.dynamic_slice_in_dim(rows, row, chunk), we)
            return jax.lax.dynamic_update_slice_in_dim(out, y, row, 0)

        return jax.lax.fori_loop(0, (pairs.counts[e] + chunk - 1) // chunk, run_chunk, out)

    out = jnp.zeros((P + chunk, D), x.dtype)
    return jax.lax.fori_loop(0, jnp.count_nonzero(pairs.counts), run_expert, out)[:P]


def gathered_experts(cfg: ModelConfig, x: jax.Array, pairs: Pairs, w: dict[str, jax.Array],
                     block: int | None = None) -> jax.Array:
    """Each pair's expert output [P, D] (sorted order), as `looped_experts`, by blocks: each local expert's rows
    padded to whole blocks of `block` rows, each block's expert weights gathered, one batched matmul over the
    blocks. Sized for the worst case (every local expert with rows wastes up to block - 1 of them)."""
    num_local = w["w_gate"].shape[0]
    P = pairs.tokens.shape[0]
    block = block or rows_per_chunk(P, num_local, cap=64)
    num_blocks = (P + min(num_local, P) * (block - 1)) // block
    blocks_of = (pairs.counts + block - 1) // block
    block_end = jnp.cumsum(blocks_of)
    mine = pairs.experts < num_local
    expert = jnp.minimum(pairs.experts, num_local - 1)
    slot = (block_end - blocks_of)[expert] * block + jnp.arange(P) - pairs.starts[expert]
    slot = jnp.where(mine, slot, num_blocks * block)
    pair_of_row = jnp.full((num_blocks * block,), P, jnp.int32).at[slot].set(jnp.arange(P, dtype=jnp.int32),
                                                                              mode="drop")
    block_expert = jnp.minimum(jnp.searchsorted(block_end, jnp.arange(num_blocks), side="right"), num_local - 1)
    token_of_row = jnp.concatenate([pairs.tokens, jnp.zeros((1,), jnp.int32)])[pair_of_row]
    blocks = x[token_of_row].reshape(num_blocks, block, x.shape[-1])
    # Each block's weights (and a checkpoint's group scales, shaped like them); a per-channel scale or a bias
    # [N, out] gains a row axis so it meets the batched [N, R, out] product.
    wb = {name: value[block_expert] if value.ndim == 3 else value[block_expert][:, None] for name, value in w.items()}
    y = expert_mlp(cfg, blocks, wb, batched=True).reshape(num_blocks * block, -1)
    return jnp.zeros((P + 1, y.shape[-1]), y.dtype).at[pair_of_row].set(y)[:P]  # back to sorted pair order


GROUPED = {"looped": looped_experts, "gathered": gathered_experts}


def local_experts(cfg: ModelConfig, x: jax.Array, weights: jax.Array, experts: jax.Array, w: dict[str, jax.Array],
                  first: jax.Array | int = 0, impl: str = "looped") -> jax.Array:
    """The MoE output [T, D] in float32 of the experts [first, first + len) held in `w` (all of them on one
    device; a device's share under expert parallelism, whose outputs the caller sums)."""
    pairs = sort_pairs(weights, experts, first, w["w_gate"].shape[0])
    out = GROUPED[impl](cfg, x, pairs, w)
    # Selected, not multiplied: rows of experts held elsewhere hold whatever a chunk left there, which 0 * inf
    # would turn into NaN.
    combined = jnp.where(pairs.weights[:, None] != 0, out.astype(jnp.float32) * pairs.weights[:, None], 0.0)
    return jnp.zeros(x.shape, jnp.float32).at[pairs.tokens].add(combined)


def moe_mlp(cfg: ModelConfig, w: dict[str, jax.Array], h: jax.Array, adapters: jax.Array | None = None,
            experts_fn=None) -> jax.Array:
    """The MoE block: route, then the chosen experts (`experts_fn(cfg, h, weights, experts, expert_weights)` ->
    [T, D] float32, the runner's sharded `local_experts`; on one device `local_experts` itself), plus the shared
    expert where the model has one. (LoRA adapters change only the attention of these models: `adapters` is
    unused.)"""
    weights, experts = route(cfg, h, w["router"], w.get("router_bias"))
    ew = {name: value for name, value in w.items() if stored_name(name) in EXPERT_WEIGHTS}
    out = (experts_fn or local_experts)(cfg, h, weights, experts, ew)
    if cfg.expert_bias:  # each chosen expert's down-projection bias, by its routing weight: once, not per device
        out = out + jnp.einsum("Tk,TkD->TD", weights, w["b_down"][experts].astype(jnp.float32))
    if cfg.shared_expert_size:
        out = out + shared_expert(cfg, h, w)
    return out.astype(h.dtype)


def shared_expert(cfg: ModelConfig, h: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
    """Qwen2-MoE's shared expert [T, D] float32: a gated MLP every token runs (split over tp as a dense MLP),
    scaled per token by sigmoid(h . shared_expert_gate)."""
    # Its weights (and int8 scales) under the names a dense MLP's have.
    mlp_weights = {"w_" + name.removeprefix("shared_"): value for name, value in w.items()
                   if name.startswith(("shared_gate", "shared_up", "shared_down"))}
    out = gated_mlp(h, mlp_weights, cfg.hidden_act, **cfg.matmul)
    scale = jax.nn.sigmoid(jnp.einsum("TD,DO->TO", h, w["shared_expert_gate"], preferred_element_type=jnp.float32))
    return out.astype(jnp.float32) * scale
