"""The pipelined layer loop itself, on toy layers over a 2x4 mesh: it computes what one scan over all layers
computes, writes each layer's cache on its own stage, and its own record of which micro-batch each stage ran at
each tick is the fill-drain schedule (stages busy at the same time)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.llama import scan_layers
from jaxserve.parallel.pipeline import pipeline_layers, pipeline_tick_layers, schedule
from jaxserve.parallel.sharding import make_mesh, named_sharding
from jaxserve.runner.attention import AttentionMetadata

T, D, L, SLOTS = 8, 4, 8, 16  # 8 tokens, 8 layers (2 per stage), a 16-slot toy "cache" per layer


def toy_layer(carry, w, layer, meta):
    """x -> x * a + b, and record the token's layer input sum at its cache slot (slot 0 is the null slot)."""
    x, cache = carry
    cache = cache.at[layer, meta.slot_mapping].set(jnp.sum(x, axis=-1))
    return x * w["a"] + w["b"], cache


def test_pipeline_matches_one_scan_and_runs_stages_concurrently():
    mesh = make_mesh(2, 4)
    rng = np.random.default_rng(0)
    weights = {"a": rng.uniform(0.5, 1.5, (L, 1)).astype(np.float32), "b": rng.normal(size=(L, D)).astype(np.float32)}
    x = rng.normal(size=(T, D)).astype(np.float32)
    meta = AttentionMetadata(positions=np.arange(T, dtype=np.int32), slot_mapping=np.arange(1, T + 1, dtype=np.int32),
                             token_seq=np.zeros(T, np.int32), block_tables=np.zeros((1, 1), np.int32))
    cache = np.zeros((L, SLOTS), np.float32)
    expected_x, expected_cache = jax.jit(lambda *a: scan_layers(toy_layer, *a))(weights, x, cache, meta)

    stacked = named_sharding(mesh, ("layers", None))
    run = jax.jit(lambda w, x, c, m: pipeline_layers(mesh, scan_layers, with_trace=True)(toy_layer, w, x, c, m))
    out, out_cache, trace = run(jax.device_put(weights, stacked), x, jax.device_put(cache, stacked), meta)

    np.testing.assert_allclose(out, expected_x, rtol=1e-6)
    # Real tokens' slots hold what one scan writes; idle ticks wrote only into the null slot 0.
    np.testing.assert_allclose(np.asarray(out_cache)[:, 1:], np.asarray(expected_cache)[:, 1:], rtol=1e-6)
    # Each stage's cache shard holds exactly its own two layers.
    for shard in out_cache.addressable_shards:
        stage = int(np.argwhere(mesh.devices == shard.device)[0][0])
        assert shard.index[0] == slice(2 * stage, 2 * stage + 2)
    # The program's own record: [stages, ticks] -> micro-batch (4 of 2 tokens), -1 when idle.
    assert np.asarray(trace).tolist() == schedule(4, 4).T.tolist()
    busy = (np.asarray(trace) >= 0).sum(axis=0)
    assert busy.max() == 4  # at tick 3 every stage works, each on a different micro-batch


def test_pipeline_hlo_hands_activations_on_with_collective_permute():
    mesh = make_mesh(1, 2)
    weights = {"a": np.ones((2, 1), np.float32), "b": np.zeros((2, D), np.float32)}
    meta = AttentionMetadata(np.zeros(T, np.int32), np.zeros(T, np.int32), np.zeros(T, np.int32),
                             np.zeros((1, 1), np.int32))
    stacked = named_sharding(mesh, ("layers", None))
    run = jax.jit(lambda w, x, c, m: pipeline_layers(mesh, scan_layers)(toy_layer, w, x, c, m))
    args = (jax.device_put(weights, stacked), np.ones((T, D), np.float32),
            jax.device_put(np.zeros((2, SLOTS), np.float32), stacked), meta)
    hlo = run.lower(*args).compile().as_text()
    assert "collective-permute" in hlo


def test_pipeline_ticks_run_each_step_through_every_stage_in_turn():
    """Ticks of the pipeline that keeps stages busy across steps: step k enters at tick k and leaves the last
    stage at tick k + 3 with what one scan over all layers computes for it (the carried activations handed on
    from stage to stage between ticks), each step's cache written by its own stage's layers."""
    mesh = make_mesh(2, 4)
    rng = np.random.default_rng(1)
    weights = {"a": rng.uniform(0.5, 1.5, (L, 1)).astype(np.float32), "b": rng.normal(size=(L, D)).astype(np.float32)}
    steps = [rng.normal(size=(T, D)).astype(np.float32) for _ in range(6)]

    def meta_of(k: int | None) -> AttentionMetadata:  # step k writes its slot k + 1 (slot 0: the null slot)
        slot = np.full(T, 0 if k is None else k + 1, np.int32)
        return AttentionMetadata(np.zeros(T, np.int32), slot, np.zeros(T, np.int32), np.zeros((1, 1), np.int32))

    expected = [jax.jit(lambda *a: scan_layers(toy_layer, *a))(weights, x, np.zeros((L, SLOTS), np.float32),
                                                                 meta_of(k)) for k, x in enumerate(steps)]
    stacked = named_sharding(mesh, ("layers", None))
    run = jax.jit(lambda w, x, c, carry, m: pipeline_tick_layers(mesh, scan_layers)(toy_layer, w, x, (c, carry), m))
    cache = jax.device_put(np.zeros((L, SLOTS), np.float32), stacked)
    carry = jax.device_put(np.zeros((4, T + 2, D), np.float32), named_sharding(mesh, ("layers",)))
    w = jax.device_put(weights, stacked)
    for tick in range(len(steps) + 3):
        in_stage = [tick - s if 0 <= tick - s < len(steps) else None for s in range(4)]
        stage_meta = jax.tree.map(lambda *rows: np.stack(rows), *(meta_of(k) for k in in_stage))
        x = steps[tick] if tick < len(steps) else np.zeros((T, D), np.float32)
        out, (cache, carry) = run(w, x, cache, carry, stage_meta)
        if in_stage[3] is not None:
            np.testing.assert_allclose(out, expected[in_stage[3]][0], rtol=1e-5)
    for k, (_, step_cache) in enumerate(expected):
        np.testing.assert_allclose(np.asarray(cache)[:, k + 1], np.asarray(step_cache)[:, k + 1], rtol=1e-5)
