"""Reading config.json: which layers use a sliding window, decided as transformers decides it."""

import pytest

from jaxserve.loader.hf_config import model_config_from_hf

BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def window(arch: str, **config):
    return model_config_from_hf({"architectures": [arch], **BASE, **config}).sliding_window


def test_every_layer_alike_gives_one_window_or_none():
    assert window("MistralForCausalLM", sliding_window=12) == 12
    assert window("MistralForCausalLM") is None
    assert window("Qwen2ForCausalLM", sliding_window=12) is None  # off unless use_sliding_window
    assert window("Qwen2ForCausalLM", sliding_window=12, use_sliding_window=True, max_window_layers=0) == 12
    # Qwen's first max_window_layers layers attend to everything (28 when left out): here all 3 of them.
    assert window("Qwen3ForCausalLM", sliding_window=12, use_sliding_window=True) is None
    assert window("Qwen2ForCausalLM", sliding_window=12, use_sliding_window=True,
                  layer_types=["full_attention"] * 3) is None


def config(arch: str, **fields):
    return model_config_from_hf({"architectures": [arch], **BASE, **fields})


S, F = "sliding_attention", "full_attention"


@pytest.mark.parametrize("arch, fields, kinds", [
    ("Qwen2ForCausalLM", dict(sliding_window=12, use_sliding_window=True, max_window_layers=1), (F, S, S)),
    ("MistralForCausalLM", dict(sliding_window=12, layer_types=[S, F, S]), (S, F, S)),
    ("Gemma2ForCausalLM", dict(sliding_window=12), (S, F, S)),  # every other layer, the first one sliding
    ("Gemma3ForCausalLM", dict(sliding_window=12, num_hidden_layers=7), (S, S, S, S, S, F, S)),  # 5 : 1
    ("Gemma3ForCausalLM", dict(sliding_window=12, sliding_window_pattern=2), (S, F, S)),
])
def test_a_mix_of_sliding_and_full_layers_keeps_each_layers_kind(arch, fields, kinds):
    cfg = config(arch, **fields)
    assert cfg.layer_types == kinds and cfg.sliding_window == 12
    assert cfg.attention_windows == (None, 12)
    assert cfg.layer_kinds() == [int(k == S) for k in kinds]


def test_unknown_layer_kinds_are_refused_by_name():
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not supported"):
        config("MistralForCausalLM", sliding_window=12, layer_types=[S, F, "chunked_attention"])


def test_gemma3_rope_per_layer_kind_in_both_spellings():
    """transformers 5 writes rope_parameters per layer kind; older Gemma 3 configs rope_theta,
    rope_local_base_freq and rope_scaling (linear, for the full layers)."""
    new = config("Gemma3ForCausalLM", sliding_window=12, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    old = config("Gemma3ForCausalLM", sliding_window=12, rope_theta=1e6, rope_local_base_freq=1e4,
                 rope_scaling={"rope_type": "linear", "factor": 8.0})
    for cfg in (new, old):
        assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
        assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("linear", 8.0)
    with pytest.raises(ValueError, match="scaled RoPE on sliding-window layers"):
        config("Gemma3ForCausalLM", rope_parameters={"full_attention": {"rope_theta": 1e6},
                                                     "sliding_attention": {"rope_type": "linear", "factor": 2.0}})


def test_gemma_defaults_differ_from_llamas():
    gemma = config("GemmaForCausalLM", hidden_act="gelu", head_dim=16)  # Gemma 1's configs say "gelu"
    assert gemma.hidden_act == "gelu_tanh" and gemma.tie_word_embeddings and gemma.norm_weight_offset == 1.0
    assert not gemma.post_norms and gemma.attention_scale is None
    gemma2 = config("Gemma2ForCausalLM", query_pre_attn_scalar=144, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh")
    assert gemma2.post_norms and gemma2.attention_scale == 144**-0.5
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    assert config("Gemma3ForCausalLM").qk_norm
    llama = config("LlamaForCausalLM")
    assert llama.hidden_act == "silu" and not llama.tie_word_embeddings and llama.norm_weight_offset == 0.0
    with pytest.raises(ValueError, match="hidden activation 'relu' is not supported"):
        config("LlamaForCausalLM", hidden_act="relu")
