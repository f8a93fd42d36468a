"""The layout arithmetic (no devices): vLLM's layer partition, head padding that keeps attention exact, layer
padding, and the pipeline schedule."""

import numpy as np
import pytest

from jaxserve.config import ModelConfig
from jaxserve.parallel.layout import check_partition, default_partition, plan_heads, plan_layout
from jaxserve.parallel.padding import pad_layers, pad_weight
from jaxserve.parallel.pipeline import num_microbatches, schedule


def config(**changes) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=16, intermediate_size=24, num_layers=30,
                num_heads=9, num_kv_heads=3, head_dim=4)
    return ModelConfig(**(base | changes))


@pytest.mark.parametrize("layers, pp, expected", [
    (30, 4, (7, 8, 8, 7)),  # remainder 2: the two stages before the last
    (30, 8, (3, 4, 4, 4, 4, 4, 4, 3)),
    (32, 4, (8, 8, 8, 8)),
    (5, 3, (2, 2, 1)),  # remainder 2 reaches back to the first stage
    (3, 2, (2, 1)),
    (7, 1, (7,)),
])
def test_default_partition_follows_vllm(layers, pp, expected):
    assert default_partition(layers, pp) == expected


@pytest.mark.parametrize("width, tp, padded", [
    (24, 2, 24), (24, 3, 24), (14336, 8, 14336),  # tp divides it: as it is
    (256, 3, 384), (14336, 3, 14592), (11008, 3, 11136),  # each device's share a multiple of 128
])
def test_an_mlp_width_tp_does_not_divide_pads_to_whole_128_column_shares(width, tp, padded):
    layout = plan_layout(config(intermediate_size=width, shared_expert_size=width), tp, 1)
    assert layout.mlp == layout.shared_mlp == padded
    assert width % tp == 0 or (padded // tp) % 128 == 0


@pytest.mark.parametrize("partition, message", [
    ([8, 8, 7, 6], "sums to 29 but the model has 30 layers"),
    ([15, 15], "has 2 stages but the mesh has pp=4"),
    ([10, 10, 10, 0], "gives a stage no layers"),
])
def test_bad_partitions_are_refused_in_one_sentence(partition, message):
    with pytest.raises(ValueError, match=message):
        check_partition(partition, 30, 4)


def test_pp_larger_than_the_layer_count_is_refused():
    with pytest.raises(ValueError, match="pp=4 is more pipeline stages than the model's 3 layers"):
        plan_layout(config(num_layers=3), 1, 4)


@pytest.mark.parametrize("tp, kv_heads, replicas, group", [
    (1, 3, 1, 3),
    (2, 4, 1, 3),  # one zero kv head (and its 3 q heads)
    (4, 4, 1, 3),
    (8, 4, 2, 4),  # 4 kv heads (3 real) each on 2 devices; 4 q heads per kv head, 2 per device
])
def test_smollm2_heads_split_over_tp(tp, kv_heads, replicas, group):
    plan = plan_heads(9, 3, tp)
    assert (plan.kv_heads, plan.replicas, plan.group) == (kv_heads, replicas, group)
    eff = plan_layout(config(), tp, 1).effective_config(config())
    assert eff.num_heads % tp == 0 and eff.num_kv_heads % tp == 0
    assert eff.num_heads // eff.num_kv_heads == group // replicas


def _gqa(x, wq, wk, wv, wo):
    """Plain grouped-query attention (causal) of one sequence x [T, D]: q head h reads kv head h // (H/K)."""
    q, k, v = (np.einsum("TD,DHd->THd", x, w) for w in (wq, wk, wv))
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = np.einsum("THd,SHd->HTS", q, k) + np.triu(np.full((len(x), len(x)), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("HTS,SHd,HdD->TD", p, v, wo)


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 2), (6, 6), (8, 1)])
@pytest.mark.parametrize("tp", [2, 3, 4, 8])
def test_padded_heads_give_the_same_attention(heads, kv_heads, tp):
    rng = np.random.default_rng(0)
    D, d = 16, 4
    cfg = config(num_heads=heads, num_kv_heads=kv_heads)
    layout = plan_layout(cfg, tp, 1)
    x = rng.normal(size=(5, D))
    wq, wk, wv = rng.normal(size=(D, heads, d)), rng.normal(size=(D, kv_heads, d)), rng.normal(size=(D, kv_heads, d))
    wo = rng.normal(size=(heads, d, D))
    pad = lambda a, logical: pad_weight(a, logical, layout, kv_heads)  # noqa: E731
    padded = (pad(wq, ("embed", "q_heads", "head_dim")), pad(wk, ("embed", "kv_heads", "head_dim")),
              pad(wv, ("embed", "kv_heads", "head_dim")), pad(wo, ("q_heads", "head_dim", "embed")))
    assert padded[0].shape[1] % tp == 0 and padded[1].shape[1] % tp == 0
    np.testing.assert_allclose(_gqa(x, *padded), _gqa(x, wq, wk, wv, wo), rtol=1e-10, atol=1e-10)


def test_uneven_stages_end_in_zero_layers():
    layout = plan_layout(config(num_layers=5), 1, 2, [3, 2])
    stacked = np.arange(1, 6, dtype=np.float32)[:, None] * np.ones((5, 2), np.float32)
    padded = pad_layers(stacked, 0, layout)
    assert layout.slots == 3 and padded.shape == (6, 2)
    assert padded[:, 0].tolist() == [1, 2, 3, 4, 5, 0]  # stage 1 holds layers 3, 4 and one zero layer


def test_schedule_keeps_stages_busy_at_once():
    table = schedule(num_stages=4, num_micro=4)  # [ticks, stages]
    assert table.shape == (7, 4)
    assert table[3].tolist() == [3, 2, 1, 0]  # tick 3: all four stages, each on a different micro-batch
    for s in range(4):  # each stage runs every micro-batch once, in order, one tick after the stage before it
        assert table[:, s][table[:, s] >= 0].tolist() == [0, 1, 2, 3]
        assert np.flatnonzero(table[:, s] >= 0).tolist() == list(range(s, s + 4))


@pytest.mark.parametrize("tokens, stages, micro", [(16, 4, 4), (16, 3, 2), (1, 4, 1), (4, 8, 4), (12, 8, 6)])
def test_micro_batches_cut_tokens_evenly(tokens, stages, micro):
    assert num_microbatches(tokens, stages) == micro
