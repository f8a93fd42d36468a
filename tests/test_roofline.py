"""scripts/roofline.py: the bytes a decode step reads and the FLOPs of a prefill, checked by hand on bench_synthetic's
tiny shape (vocab 512, hidden 64, MLP 128, 2 layers, 4 q heads and 2 kv heads of 16, untied, float32)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))

from roofline import decode_step_bytes, is_matmul_weight, prefill_flops, rated_limits  # noqa: E402

F32 = 4
# One layer: two norms of 64; q and o 64 x 4 x 16 each; k and v 64 x 2 x 16 each; gate, up and down 64 x 128 each.
LAYER_MATMUL = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128  # 36,864
LAYER_PARAMS = LAYER_MATMUL + 2 * 64
KV_PER_TOKEN = 2 * 2 * 2 * 16 * F32  # K and V, 2 layers, 2 kv heads, head_dim 16: 512 bytes


def tiny_groups(tied: bool) -> dict[str, int]:
    groups = {"embed": 512 * 64 * F32, "layers": 2 * LAYER_PARAMS * F32, "final_norm": 64 * F32}
    return groups if tied else groups | {"lm_head": 64 * 512 * F32}


def test_decode_step_bytes_by_hand():
    step = decode_step_bytes(tiny_groups(tied=False), tied_embeddings=False, kv_bytes_per_token=KV_PER_TOKEN,
                             context_tokens=[112], block_size=16)
    assert step.layer_weights == 2 * 36_992 * 4 == 295_936
    assert step.final_norm == 256 and step.lm_head == 131_072
    assert step.kv == 112 * 512 == 57_344  # 112 tokens: exactly 7 blocks
    assert step.embedding_not_read == 131_072  # the input table is left out of the total...
    assert step.total == 295_936 + 256 + 131_072 + 57_344  # ...which is 484,608 bytes


def test_the_paged_cache_is_read_in_whole_blocks_and_a_tied_head_reads_the_table():
    step = decode_step_bytes(tiny_groups(tied=True), tied_embeddings=True, kv_bytes_per_token=KV_PER_TOKEN,
                             context_tokens=[1, 17], block_size=16)
    assert step.kv == (16 + 32) * 512
    assert step.lm_head == 512 * 64 * 4 and step.embedding_not_read == 0


def test_prefill_flops_by_hand():
    # Two prompts of 3 and 4 tokens: 7 tokens through 2 layers of matmuls; 6 + 10 causal (query, key) pairs per
    # layer at 2 products x 2 FLOPs x 4 heads x 16 dims; the LM head once per prompt.
    flops = prefill_flops(2 * LAYER_MATMUL, num_layers=2, num_heads=4, head_dim=16, hidden_size=64, vocab_size=512,
                          prompt_lens=[3, 4])
    assert flops == 2 * 73_728 * 7 + 4 * 2 * 4 * 16 * 16 + 2 * 2 * 64 * 512


@pytest.mark.parametrize("name, ndim, matmul", [("wq", 3, True), ("w_down", 2, True), ("attn_norm", 2, False),
                                                ("wq_scale", 2, False), ("q_bias", 2, False), ("mlp_norm", 1, False)])
def test_which_layer_parameters_multiply(name, ndim, matmul):
    assert is_matmul_weight(name, ndim) is matmul


def test_rated_limits_pick_the_longest_matching_name():
    assert rated_limits("NVIDIA H100 80GB HBM3") == (3.35e12, 989e12)
    assert rated_limits("NVIDIA H100 PCIe") == (2.0e12, 756e12)
    assert rated_limits("NVIDIA H200") == (4.8e12, 989e12)
    assert rated_limits("cpu") is None
