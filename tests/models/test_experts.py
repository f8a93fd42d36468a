"""Sparse mixture-of-experts dispatch (models/experts.py): both grouped-matmul schemes against every expert run
on every token (the old dense path, kept here as the reference), the FLOPs a layer compiles to, and the refusals.

Whole models against transformers: tests/models/test_parity.py (one device) and tests/parallel/test_tiny_meshes.py
(expert tensor parallelism and expert parallelism on 2x1 and 4x2 meshes)."""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import Engine
from jaxserve.config import ModelConfig
from jaxserve.models.experts import local_experts, moe_mlp, route, rows_per_chunk
from jaxserve.parallel.layout import plan_layout


def moe_config(experts: int, k: int, **overrides) -> ModelConfig:
    fields = dict(architecture="MixtralForCausalLM", vocab_size=64, hidden_size=16, intermediate_size=24,
                  num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, num_experts=experts, num_experts_per_tok=k)
    return ModelConfig(**(fields | overrides))


def every_expert_on_every_token(cfg, x, w):
    """The reference: every expert's output for every token, zeroed where the router did not choose it."""
    weights, experts = route(cfg, x, w["router"])
    combine = jnp.einsum("Tk,TkE->TE", weights, jax.nn.one_hot(experts, w["w_gate"].shape[0]))
    gate = jnp.einsum("TD,EDF->TEF", x, w["w_gate"])
    up = jnp.einsum("TD,EDF->TEF", x, w["w_up"])
    out = jnp.einsum("TEF,EFD->TED", jax.nn.silu(gate) * up, w["w_down"])
    return jnp.einsum("TE,TED->TD", combine, out)


def random_weights(cfg, seed=0):
    rng = np.random.default_rng(seed)
    E, D, F = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape).astype(np.float32))  # noqa: E731
    return {"router": normal(D, E), "w_gate": normal(E, D, F) * 0.3, "w_up": normal(E, D, F) * 0.3,
            "w_down": normal(E, F, D) * 0.3}


# Odd expert counts, top-1/2/4, a token count whose pairs leave some experts empty and some crowded.
SHAPES = [(5, 1, 7), (8, 2, 16), (6, 4, 3), (3, 2, 40)]


@pytest.mark.parametrize("impl", ["looped", "gathered"])
@pytest.mark.parametrize("experts, k, tokens", SHAPES)
def test_grouped_schemes_match_every_expert_on_every_token(impl, experts, k, tokens):
    cfg = moe_config(experts, k)
    w = random_weights(cfg)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(tokens, cfg.hidden_size)).astype(np.float32))
    expected = every_expert_on_every_token(cfg, x, w)
    got = moe_mlp(cfg, w, x, experts_fn=partial(local_experts, impl=impl))
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["looped", "gathered"])
@pytest.mark.parametrize("chunk", [1, 2, 8])
def test_expert_parallel_shares_sum_to_the_whole(impl, chunk):
    """Each device of expert parallelism runs only its own experts' pairs; the shares add up to the layer's
    output, whatever the chunk size (a chunk running past its expert's rows must not leak into the result)."""
    cfg = moe_config(6, 2)
    w = random_weights(cfg, seed=2)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(11, cfg.hidden_size)).astype(np.float32))
    weights, experts = route(cfg, x, w["router"])
    experts_w = {name: w[name] for name in ("w_gate", "w_up", "w_down")}
    scheme = {"looped": "chunk", "gathered": "block"}[impl]
    shares = []
    for device in range(3):
        share = {name: value[2 * device: 2 * device + 2] for name, value in experts_w.items()}
        with pytest.MonkeyPatch.context() as patch:
            from jaxserve.models import experts as module
            patch.setitem(module.GROUPED, impl, partial(module.GROUPED[impl], **{scheme: chunk}))
            shares.append(local_experts(cfg, x, weights, experts, share, first=2 * device, impl=impl))
    np.testing.assert_allclose(sum(shares), every_expert_on_every_token(cfg, x, w), atol=1e-5, rtol=1e-5)


def test_int8_expert_weights_are_scaled_per_output_channel():
    cfg = moe_config(4, 2)
    w = random_weights(cfg, seed=4)
    quantized, dequantized = dict(w), dict(w)
    for name, contracted in (("w_gate", 1), ("w_up", 1), ("w_down", 1)):
        scale = jnp.max(jnp.abs(w[name]), axis=contracted) / 127  # [E, out]
        q = jnp.round(w[name] / jnp.expand_dims(scale, contracted)).astype(jnp.int8)
        quantized[name], quantized[name + "_scale"] = q, scale
        dequantized[name] = q.astype(jnp.float32) * jnp.expand_dims(scale, contracted)
    x = jnp.asarray(np.random.default_rng(5).normal(size=(9, cfg.hidden_size)).astype(np.float32))
    for impl in ("looped", "gathered"):
        got = moe_mlp(cfg, quantized, x, experts_fn=partial(local_experts, impl=impl))
        np.testing.assert_allclose(got, every_expert_on_every_token(cfg, x, dequantized), atol=1e-4, rtol=1e-4)


def test_sigmoid_router_scores_each_expert_alone():
    cfg = moe_config(4, 2, router_scoring="sigmoid", moe_renormalize=False)
    w = random_weights(cfg)
    x = jnp.asarray(np.random.default_rng(6).normal(size=(5, cfg.hidden_size)).astype(np.float32))
    weights, experts = route(cfg, x, w["router"])
    scores = jax.nn.sigmoid(x @ w["router"])
    np.testing.assert_allclose(weights, jnp.take_along_axis(scores, experts, axis=1), rtol=1e-6)
    assert np.all(np.asarray(weights) < 1) and not np.allclose(np.asarray(weights).sum(-1), 1)


def _layer_flops(cfg, impl):
    w = random_weights(cfg)
    x = jnp.zeros((8, cfg.hidden_size), jnp.float32)
    if impl == "dense":
        fn = partial(every_expert_on_every_token, cfg)
    else:
        fn = partial(moe_mlp, cfg, experts_fn=partial(local_experts, impl=impl))
    return jax.jit(lambda x, w: fn(x, w) if impl == "dense" else fn(w, x)).lower(x, w).compile() \
        .cost_analysis()["flops"]


def test_compiled_layer_flops_grow_with_k_not_with_the_number_of_experts():
    """The gathered scheme (GPU/TPU) in one program XLA can count: 8 tokens, so one row per block. Its FLOPs
    barely move from 8 to 64 experts (the router's columns) and double with k; every expert on every token grows
    with E. (The CPU's expert loop is a while loop, whose body XLA's cost analysis counts once.)"""
    size = dict(hidden_size=64, intermediate_size=128)  # the experts' matmuls, not the routing, dominate
    sparse = {(E, k): _layer_flops(moe_config(E, k, **size), "gathered") for E, k in [(8, 2), (64, 2), (64, 4)]}
    assert sparse[64, 2] < 1.2 * sparse[8, 2]
    assert 1.8 < sparse[64, 4] / sparse[64, 2] < 2.2
    dense = {E: _layer_flops(moe_config(E, 2, **size), "dense") for E in (8, 64)}
    assert dense[64] > 6 * dense[8]
    assert dense[64] > 10 * sparse[64, 2]


@pytest.mark.parametrize("impl", ["looped", "gathered"])
def test_routing_is_data_nothing_recompiles(impl):
    """Group sizes are data: inputs routed to different experts (all to one, spread out) run one compiled
    program."""
    cfg = moe_config(6, 2)
    w = random_weights(cfg, seed=7)
    traces = []

    def layer(x, w):
        traces.append(1)
        return moe_mlp(cfg, w, x, experts_fn=partial(local_experts, impl=impl))

    fn = jax.jit(layer)
    rng = np.random.default_rng(8)
    spread = jnp.asarray(rng.normal(size=(12, cfg.hidden_size)).astype(np.float32))
    crowded = jnp.tile(spread[:1], (12, 1))  # every token the same: every pair on the same two experts
    for x in (spread, crowded):
        np.testing.assert_allclose(fn(x, w), every_expert_on_every_token(cfg, x, w), atol=1e-5, rtol=1e-5)
    assert len(traces) == 1


def test_rows_per_chunk_follows_the_rows_each_expert_expects():
    assert rows_per_chunk(8, 128, cap=32) == 1  # decode: most experts get no row
    assert rows_per_chunk(512, 128, cap=32) == 2
    assert rows_per_chunk(4096, 128, cap=32) == 16
    assert rows_per_chunk(1 << 20, 8, cap=32) == 32


def test_expert_parallelism_refusals():
    dense = dataclasses.replace(moe_config(0, 0), architecture="LlamaForCausalLM", expert_parallel=True)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model; LlamaForCausalLM has a dense MLP"):
        plan_layout(dense, 2, 1)
    with pytest.raises(ValueError, match="only 3 experts; use tp <= 3 or drop --enable-expert-parallel"):
        plan_layout(moe_config(3, 2, expert_parallel=True), 4, 1)
    with pytest.raises(ValueError, match="router scoring 'softmax_topk' is not supported"):
        moe_config(4, 2, router_scoring="softmax_topk")


def test_engine_refuses_expert_parallelism_on_a_dense_model(tiny_checkpoint):
    with pytest.raises(ValueError, match="drop the flag"):
        Engine(str(tiny_checkpoint("llama")), enable_expert_parallel=True, num_kv_blocks=8, warmup=False)


def test_gpu_scheme_serves_transformers_logits_on_a_mesh(tiny_checkpoint, monkeypatch):
    """The gathered blocks GPUs and TPUs run, through the engine here on CPU: expert parallelism on 2x2 (inside
    pipeline stages), a shared expert, top-4 of 5 experts."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve.runner import experts_impl
    from tests.models.test_parity import PROMPTS, check_parity
    from tests.parallel.test_tiny_meshes import MODELS

    monkeypatch.setattr(experts_impl, "expert_impl", lambda platform: "gathered")
    arch, overrides = MODELS["qwen2-moe-shared-expert-parallel"]
    path = tiny_checkpoint(arch, **overrides)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    engine = Engine(str(path), mesh="2x2", enable_expert_parallel=True, num_kv_blocks=64, max_num_batched_tokens=64,
                    max_num_seqs=4, warmup=False)
    check_parity(engine, reference, PROMPTS)
