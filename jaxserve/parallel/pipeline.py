"""Pipeline parallelism over the mesh's pipeline axis: each stage runs its own slots of the stacked layers.

The stacked layer weights and the KV cache are split over stages on their `layers` axis, so a stage holds only
its own layers and their cache. Tensor parallelism inside a stage stays automatic (GSPMD): the `shard_map` is
manual over stages only. Two schedules:

- Fill-drain within one step (`pipeline_layers`): the step's T tokens are cut into M equal micro-batches (in
  token order); at tick t, stage s works on micro-batch t - s, then hands its activations to stage s + 1 with a
  `ppermute`. A step with few sequences runs stage after stage: at pp = 4 and 4 micro-batches, each stage is
  busy on 4 of 7 ticks.
- Stages busy across steps (`pipeline_tick_layers`, vLLM's virtual engines): one program per tick, in which
  stage s works on the step planned s ticks ago, reading the activations stage s - 1 left in a carried buffer
  [pp, T_max, D] at the previous tick. The engine plans a new step every tick from the sequences no stage is
  working on (`Engine._tick`), so in steady decode every stage is busy on every tick.

Both are exact: a sequence's earlier tokens (an earlier micro-batch, or a step planned earlier) reach each stage
before its later ones, so each stage has run (and cached) them by the time the later ones need them.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.parallel.sharding import PIPELINE_AXIS, partition_spec

# AttentionMetadata fields with one entry per token (lora_slots may be None)
PER_TOKEN_META = ("positions", "slot_mapping", "token_seq", "lora_slots")


def num_microbatches(num_tokens: int, num_stages: int) -> int:
    """The most micro-batches, at most one per stage, that cut `num_tokens` into equal parts."""
    return max(m for m in range(1, min(num_stages, num_tokens) + 1) if num_tokens % m == 0)


def schedule(num_stages: int, num_micro: int) -> np.ndarray:
    """[ticks, stages]: the micro-batch each stage works on at each tick, -1 when idle (stage s: t - s)."""
    m = np.arange(num_micro + num_stages - 1)[:, None] - np.arange(num_stages)[None, :]
    return np.where((m >= 0) & (m < num_micro), m, -1)


def _micro_meta(meta, num_micro: int):
    """Per-token fields [T] -> [M, T/M]. Block tables are per sequence and shared by every micro-batch, except
    in a decode step (`decode_only`: token i is row i's only token), where each micro-batch takes its own rows
    [M, B/M, MB] and its tokens index them from 0: the decode kernel pairs query i with row i."""
    split = {name: _by_micro(getattr(meta, name), num_micro) for name in _present(meta)}
    if meta.decode_only:
        per_micro = meta.positions.shape[0] // num_micro
        split["token_seq"] = jnp.broadcast_to(jnp.arange(per_micro, dtype=jnp.int32), (num_micro, per_micro))
    return dataclasses.replace(meta, **split)


def _by_micro(x: jax.Array, num_micro: int) -> jax.Array:
    return x.reshape(num_micro, -1, *x.shape[1:])


def _pick_meta(meta, m: jax.Array, active: jax.Array):
    """Micro-batch m's metadata; on an idle tick every token is padding (position 0, written to the null
    block), so a stage's idle work never touches a real cache page."""
    picked = {name: jnp.where(active, getattr(meta, name)[m], 0) for name in _present(meta)}
    return dataclasses.replace(meta, **picked)


def _present(meta) -> list[str]:
    """The fields split into micro-batches: the per-token ones, and the block table in a decode step."""
    names = [name for name in PER_TOKEN_META if getattr(meta, name) is not None]
    return names + ["block_tables"] if meta.decode_only else names


def _stage(run_stage_layers, num_stages: int, num_micro: int, weights, x, kv, meta):
    """One stage's program (inside the shard_map): its weights and cache are its own slots."""
    stage = jax.lax.axis_index(PIPELINE_AXIS)
    T, D = x.shape
    xs = x.reshape(num_micro, T // num_micro, D)
    meta = _micro_meta(meta, num_micro)
    to_next = [(s, s + 1) for s in range(num_stages - 1)]

    def tick(carry, t):
        inbox, kv, outs = carry
        m = t - stage
        active = (m >= 0) & (m < num_micro)
        m = jnp.clip(m, 0, num_micro - 1)
        h = jnp.where(stage == 0, xs[m], inbox)  # the first stage reads the embeddings, the others their inbox
        h, kv = run_stage_layers(weights, h, kv, _pick_meta(meta, m, active))
        outs = outs.at[m].set(jnp.where(active & (stage == num_stages - 1), h, outs[m]))
        inbox = jax.lax.ppermute(h, PIPELINE_AXIS, to_next)
        return (inbox, kv, outs), jnp.where(active, m, -1)

    init = (jnp.zeros_like(xs[0]), kv, jnp.zeros_like(xs))
    (_, kv, outs), trace = jax.lax.scan(tick, init, jnp.arange(num_micro + num_stages - 1))
    # Only the last stage wrote `outs` (the others hold zeros): the sum hands its result to every stage exactly.
    return jax.lax.psum(outs, PIPELINE_AXIS).reshape(T, D), kv, trace[None]


def _tick_stage(run_stage_layers, num_stages: int, weights, x, kv, carry, stage_meta):
    """One stage's share of a tick (inside the shard_map): `stage_meta` [1, ...] is its own step's metadata,
    `carry` [1, T_max, D] the activations the previous stage handed it at the previous tick."""
    stage = jax.lax.axis_index(PIPELINE_AXIS)
    T = x.shape[0]
    meta = jax.tree.map(lambda a: a[0], stage_meta)
    h = jnp.where(stage == 0, x, carry[0, :T])  # the first stage starts a new step from its embeddings
    h, kv = run_stage_layers(weights, h, kv, meta)
    handed = jax.lax.ppermute(h, PIPELINE_AXIS, [(s, s + 1) for s in range(num_stages - 1)])
    return h[None], kv, carry.at[0, :T].set(handed)


def pipeline_tick_layers(mesh: Mesh, stage_layers):
    """-> run_layers(layer_fn, weights, x, kv_and_carry, stage_meta) -> (x, (kv, carry)): one tick of the
    pipeline that keeps stages busy across steps, in the model's `scan_layers` slot (the model hands the cache and
    the metadata to `run_layers` untouched, so the carried buffer travels with the cache). `x` [T, D]: the
    embeddings of the step entering stage 0; `stage_meta`: AttentionMetadata whose leaves are stacked [pp, ...],
    row s for the step stage s works on (padding where a stage has none); `carry` [pp, T_max, D]: row s holds what
    stage s - 1 computed at the previous tick, T <= T_max. Returns the last stage's output, the step leaving the
    pipeline this tick."""
    num_stages = mesh.shape[PIPELINE_AXIS]
    stacked, whole = partition_spec(("layers",)), partition_spec(())

    def run(layer_fn, weights, x, kv_and_carry, stage_meta):
        kv, carry = kv_and_carry
        body = partial(_tick_stage, partial(stage_layers, layer_fn), num_stages)
        outs, kv, carry = jax.shard_map(body, mesh=mesh, in_specs=(stacked, whole, stacked, stacked, stacked),
                                        out_specs=(stacked, stacked, stacked), axis_names={PIPELINE_AXIS},
                                        check_vma=False)(weights, x, kv, carry, stage_meta)
        return outs[num_stages - 1], (kv, carry)

    return run


def pipeline_layers(mesh: Mesh, stage_layers, with_trace: bool = False):
    """-> run_layers(layer_fn, weights, x, kv, meta) -> (x, kv) [, trace [pp, ticks]], the pipelined drop-in for
    the model's `scan_layers`. `stage_layers` runs a stage's own layers, with scan_layers' signature: the model's
    scan over the stage's share of the stacked weights, or runner/layer_loop.unrolled_stage_layers over its
    per-layer arrays (the leaves' `layers` axis splits over stages either way)."""
    num_stages = mesh.shape[PIPELINE_AXIS]
    stacked, whole = partition_spec(("layers",)), partition_spec(())

    def run(layer_fn, weights, x, kv, meta):
        num_micro = num_microbatches(x.shape[0], num_stages)
        run_stage_layers = partial(stage_layers, layer_fn)
        body = partial(_stage, run_stage_layers, num_stages, num_micro)
        # check_vma=False: the stage body runs code written without stages in mind (attention loops start
        # from fresh carries), so whether each value varies over stages is not tracked; the specs say it.
        x, kv, trace = jax.shard_map(body, mesh=mesh, in_specs=(stacked, whole, stacked, whole),
                                     out_specs=(whole, stacked, stacked), axis_names={PIPELINE_AXIS},
                                     check_vma=False)(weights, x, kv, meta)
        return (x, kv, trace) if with_trace else (x, kv)

    return run
