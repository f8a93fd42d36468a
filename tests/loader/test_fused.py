"""Phi-3's fused projections are split at load into the names every other path reads (safetensors and GGUF)."""

import numpy as np
import pytest

from jaxserve.loader.checkpoint import open_checkpoint
from jaxserve.loader.fused import SplitFusedSource
from jaxserve.loader.safetensors import SafetensorsSource
from tests.helpers import write_gguf


@pytest.fixture(scope="module")
def phi3(tiny_checkpoint):
    return tiny_checkpoint("phi3", sliding_window=12, tie_word_embeddings=False, pad_token_id=0)


def test_the_parts_are_the_fused_rows_in_order(phi3):
    raw = SafetensorsSource(phi3)
    assert "model.layers.0.self_attn.qkv_proj.weight" in raw.names()  # what transformers writes for Phi-3
    ckpt = open_checkpoint(str(phi3))
    names = ckpt.tensors.names()
    assert "model.layers.0.self_attn.qkv_proj.weight" not in names and "model.layers.2.mlp.up_proj.weight" in names
    qkv = raw.get("model.layers.1.self_attn.qkv_proj.weight")
    parts = [ckpt.tensors.get(f"model.layers.1.self_attn.{p}_proj.weight") for p in "qkv"]
    assert [p.shape[0] for p in parts] == [4 * 16, 2 * 16, 2 * 16]  # 4 q heads, 2 kv heads, head_dim 16
    np.testing.assert_array_equal(np.concatenate(parts), qkv)
    gate_up = raw.get("model.layers.1.mlp.gate_up_proj.weight")
    np.testing.assert_array_equal(ckpt.tensors.get("model.layers.1.mlp.gate_proj.weight"), gate_up[:128])
    np.testing.assert_array_equal(ckpt.tensors.get("model.layers.1.mlp.up_proj.weight"), gate_up[128:])


def test_a_config_that_does_not_fit_the_tensors_is_named(phi3):
    cfg = open_checkpoint(str(phi3)).config
    wrong = SplitFusedSource(SafetensorsSource(phi3), cfg.__class__(**{**cfg.__dict__, "intermediate_size": 96}))
    with pytest.raises(ValueError, match="gate_up_proj.weight has 256 rows, but the config's head and MLP sizes "
                                         "make 192"):
        wrong.get("model.layers.0.mlp.up_proj.weight")


def test_a_partial_rotary_gguf_of_another_architecture_is_refused_by_name(tiny_checkpoint, gguf_tokenizer_source,
                                                                            tmp_path):
    """Only llama.cpp's Phi-3 converter writes a rotary width below the head size; elsewhere it is the head size."""
    qwen2 = tiny_checkpoint("qwen2", tie_word_embeddings=True)
    gguf_file = write_gguf(qwen2, tmp_path / "partial.gguf", "qwen2", gguf_tokenizer_source, **{"rope.dimension_count": 8})
    with pytest.raises(ValueError, match="rotates 8 of each head's 16 dimensions .* supports for phi3 only"):
        open_checkpoint(str(gguf_file))
