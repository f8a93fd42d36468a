"""Tiny random Llama, Qwen2/Qwen3, Mixtral, Qwen3-MoE, SmolLM3 and Gemma 3 on 2x2 or 4x2 meshes: logits within 1e-4 of transformers, and proof
from the arrays and the compiled program that the work is really split.

The Llama is deliberately awkward: 6 q / 3 kv heads, MLP width 100, a vocabulary of 1029 (odd, and 5 more ids than
its tokenizer has, as real checkpoints pad theirs), 5 layers (stages of 3 and 2, so stage 1 ends in a zero layer) and
biases on every projection (the MLP's split and padded with its width): every padding path runs."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxserve import Engine
from jaxserve.runner.plan import empty_inputs
from tests.models.test_parity import GEMMA3_ROPE, PROMPTS, check_parity

MODELS = {
    "llama-odd-sizes": ("llama", dict(num_attention_heads=6, num_key_value_heads=3, intermediate_size=100,
                                      vocab_size=1029, num_hidden_layers=5, hidden_size=48,
                                      tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=True)),
    # each expert's MLP width split over tp (expert tensor parallelism, the default)
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
    # whole experts split over tp (expert parallelism): 6 experts padded to 8 on tp=4, 5 to 6 on tp=2, top-1
    "qwen3-moe-expert-parallel": ("qwen3_moe", dict(head_dim=32, num_experts=6, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, norm_topk_prob=True)),
    "mixtral-top1-expert-parallel": ("mixtral", dict(num_local_experts=5, num_experts_per_tok=1)),
    # 5 experts padded to 8 on tp=4, top-4, the shared expert's width 40 split 10 a device
    "qwen2-moe-shared-expert-parallel": ("qwen2_moe", dict(num_experts=5, num_experts_per_tok=4,
                                                           moe_intermediate_size=24,
                                                           shared_expert_intermediate_size=40)),
    # sinks split with their q heads; each expert's width (24: 6 a device) with its gate/up biases, the down
    # biases added once after the devices' sum; sliding and full layers on both stages
    "gpt-oss": ("gpt_oss", dict(head_dim=16, num_hidden_layers=4, num_local_experts=5, num_experts_per_tok=2,
                                intermediate_size=24, sliding_window=8, swiglu_limit=0.5)),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=32)),  # 4 q / 2 kv heads: replicated kv heads on tp=4
    # NoPE layers 1 and 3 of 5: kinds past the window kinds, carried onto stages like any layer's
    "smollm3-nope-layers": ("smollm3", dict(num_hidden_layers=5, no_rope_layer_interval=2, pad_token_id=0)),
    # sliding and full layers alternating over 5 layers: each stage's slots carry their own layers' kinds
    "gemma3-mixed-windows": ("gemma3_text", dict(head_dim=32, num_hidden_layers=5, sliding_window=12,
                                                 sliding_window_pattern=2, query_pre_attn_scalar=24,
                                                 rope_parameters=GEMMA3_ROPE)),
}
# Each model on the mesh its padding needs (tp=4: experts 6 -> 8, kv heads replicated), the others on 2x2, the
# awkward Llama on both: every model's sharding on a 2D mesh once, every padding path, one engine each.
CASES = [("llama-odd-sizes", "2x2"), ("llama-odd-sizes", "4x2"), ("qwen2-bias", "2x2"), ("mixtral", "4x2"),
         ("mixtral", "2x1"), ("mixtral", "4x1"),
         ("qwen3-moe-expert-parallel", "4x2"), ("mixtral-top1-expert-parallel", "2x1"),
         ("qwen2-moe-shared-expert-parallel", "4x1"), ("gpt-oss", "4x2"), ("qwen3-qk-norm", "4x2"), ("smollm3-nope-layers", "2x2"),
         ("gemma3-mixed-windows", "4x2")]


@pytest.fixture(scope="module")
def engines(tiny_checkpoint, shared_checkpoints):
    """(model name, mesh) -> (engine, reference): built on first use, kept for the module."""
    built = {}

    def get(name: str, mesh: str):
        if (name, mesh) not in built:
            arch, overrides = MODELS[name]
            path = tiny_checkpoint(arch, **overrides)
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()
            engine = Engine(str(path), mesh=mesh, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
                            warmup=False, enable_expert_parallel=name.endswith("-expert-parallel"))
            built[name, mesh] = engine, reference
        return built[name, mesh]

    return get


def test_every_model_has_a_case():
    assert {name for name, _ in CASES} == set(MODELS)


@pytest.mark.parametrize("name, mesh", CASES, ids=[f"{name}-{mesh}" for name, mesh in CASES])
def test_logits_match_transformers(name, mesh, engines):
    engine, reference = engines(name, mesh)
    check_parity(engine, reference, PROMPTS)


def _stage_of(mesh, device) -> int:
    return int(np.argwhere(mesh.devices == device)[0][0])  # the grid is [pp, tp]


def test_column_parallel_weight_holds_a_tp_share_of_its_stage(engines):
    engine, _ = engines("llama-odd-sizes", "4x2")
    runner, wq = engine.runner, engine.runner.params["layers"]["wq"][...]
    L, D, H, d = wq.shape
    assert (L, H) == (6, 8)  # 5 layers in 2 stages of 3 slots; 6 q heads padded to 8 (3 kv heads -> 4)
    slots = runner.layout.slots
    for shard in wq.addressable_shards:
        stage = _stage_of(runner.mesh, shard.device)
        assert shard.data.shape == (slots, D, H // 4, d)
        assert shard.index[0] == slice(stage * slots, (stage + 1) * slots)
    # Stage 1 holds layers 3 and 4 and then its zero layer.
    assert not np.any(np.asarray(wq[5])) and np.any(np.asarray(wq[4]))


def test_layer_kinds_travel_with_their_layers_onto_stages(engines):
    """Layers S F S F S on stages of 3 and 2: stage 1's slots hold layers 3 and 4 (F, S), then its zero layer."""
    engine, _ = engines("gemma3-mixed-windows", "4x2")
    kinds = engine.runner.params["layers"]["attn_kind"][...]
    assert np.asarray(kinds).tolist() == [1, 0, 1, 0, 1, 0]
    for shard in kinds.addressable_shards:
        stage = _stage_of(engine.runner.mesh, shard.device)
        assert np.asarray(shard.data).tolist() == [[1, 0, 1], [0, 1, 0]][stage]


def test_kv_cache_split_by_kv_heads_and_by_stage(engines):
    engine, _ = engines("llama-odd-sizes", "4x2")
    runner, k = engine.runner, engine.runner.kv.k
    L, K = k.shape[:2]
    for shard in k.addressable_shards:
        stage = _stage_of(runner.mesh, shard.device)
        assert shard.data.shape[:2] == (L // 2, K // 4)
        assert shard.index[0] == slice(stage * L // 2, (stage + 1) * L // 2)


def test_each_expert_width_split_over_tp_by_default(engines):
    engine, _ = engines("mixtral", "4x2")
    w_gate = engine.runner.params["layers"]["w_gate"][0]  # unrolled: layer slot 0 of each stage [pp, E, D, F]
    assert {s.data.shape[1] for s in w_gate.addressable_shards} == {8}  # every device holds every expert
    assert {s.data.shape[3] for s in w_gate.addressable_shards} == {w_gate.shape[3] // 4}


def test_whole_experts_split_over_tp_with_expert_parallelism(engines):
    engine, _ = engines("qwen3-moe-expert-parallel", "4x2")
    w_down = engine.runner.params["layers"]["w_down"][0]  # [pp, E, F, D]
    assert w_down.shape[1] == 8  # 6 experts and 2 never chosen
    assert {s.data.shape[1] for s in w_down.addressable_shards} == {2}
    assert {s.data.shape[2] for s in w_down.addressable_shards} == {32}  # each expert whole


def test_compiled_step_has_tp_reductions_and_stage_hand_offs(engines):
    engine, _ = engines("llama-odd-sizes", "4x2")
    program, args = engine.runner.forward_program(empty_inputs(16, 4, engine.plan_shape))
    assert program is engine.runner.fns.forward_tick  # the stages stay busy across steps
    text = program.lower(*args).compile().as_text()
    assert "all-reduce" in text  # row-parallel o / down projections and the vocab-parallel embedding
    assert "collective-permute" in text  # activations handed from stage to stage


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
def test_pallas_kernels_run_inside_pipeline_stages(layer_loop, tiny_checkpoint, shared_checkpoints, monkeypatch):
    """The kernels' own shard_map over heads nests inside the pipeline's map over stages (interpret mode here):
    the ragged kernel on prefill, the decode kernel on decode steps, whose micro-batches take their own rows of
    the block table; under the scan and unrolled alike."""
    from jaxserve.runner import pallas_attention

    decode_calls = []
    kernels = dict(pallas_attention.DECODE_KERNELS)
    monkeypatch.setattr(pallas_attention, "DECODE_KERNELS", {
        backend: lambda q, *a, _k=kernel, **kw: decode_calls.append(q.shape) or _k(q, *a, **kw)
        for backend, kernel in kernels.items()})
    arch, overrides = MODELS["qwen2-bias"]
    path = tiny_checkpoint(arch, **overrides)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    engine = Engine(str(path), mesh="2x2", num_kv_blocks=16, max_num_batched_tokens=64, max_num_seqs=4, warmup=False,
                    attention_impl="pallas-interpret", layer_loop=layer_loop)
    assert engine.plan_shape.decode_kernel
    check_parity(engine, reference, [PROMPTS[0], PROMPTS[2]], max_tokens=3)
    assert decode_calls  # traced into the decode steps' stage programs
