"""Reading config.json: which layers use a sliding window, decided as transformers decides it."""

import math

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


PHI35_ROPE = {"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 3.0, 4.0, 5.0]}


def test_longrope_takes_transformers_defaults_from_the_config():
    """Phi-3.5's config.json: the original length at the top level, no factor or attention_factor (both follow from
    the two lengths)."""
    cfg = config("Phi3ForCausalLM", max_position_embeddings=4096, original_max_position_embeddings=256,
                 partial_rotary_factor=0.5, rope_scaling=PHI35_ROPE)
    rope = cfg.rope_scaling
    assert (rope.rope_type, rope.original_max_position_embeddings, rope.factor) == ("longrope", 256, 16.0)
    assert rope.attention_factor == pytest.approx((1 + math.log(16) / math.log(256)) ** 0.5)
    assert cfg.rotary_dim == 8 and cfg.rope_width == 8  # half of each 16-dim head
    # "su", its name in early Phi-3 configs, is the same scaling; an explicit attention_factor is kept.
    su = config("Phi3ForCausalLM", max_position_embeddings=4096, original_max_position_embeddings=256,
                partial_rotary_factor=0.5, rope_scaling={**PHI35_ROPE, "type": "su", "attention_factor": 1.5})
    assert su.rope_scaling.rope_type == "longrope" and su.rope_scaling.attention_factor == 1.5


def test_longrope_factor_set_is_chosen_once_by_max_model_len():
    rope = config("Phi3ForCausalLM", max_position_embeddings=4096, original_max_position_embeddings=256,
                  partial_rotary_factor=0.5, rope_scaling=PHI35_ROPE).rope_scaling
    short, long = rope.for_context(256), rope.for_context(257)
    assert short.rope_type == long.rope_type == "frequency_factors"
    assert short.frequency_factors == (1.0, 1.1, 1.2, 1.3) and long.frequency_factors == (2.0, 3.0, 4.0, 5.0)
    assert short.attention_factor == long.attention_factor == rope.attention_factor  # at every length, as in HF


@pytest.mark.parametrize("fields, message", [
    (dict(partial_rotary_factor=0.2), "partial_rotary_factor 0.2 turns 3 of each head's 16 dims; RoPE needs an even"),
    (dict(partial_rotary_factor=0.75, rope_scaling=PHI35_ROPE), "short_factor has 4 entries; RoPE turns 12 dims"),
])
def test_rotary_widths_that_cannot_work_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        config("Phi3ForCausalLM", original_max_position_embeddings=256, **fields)


def test_yarn_reads_its_optional_fields():
    """The logit scale from mscale / mscale_all_dim where given (DeepSeek's spelling), else 0.1 ln(factor) + 1;
    beta_fast / beta_slow move the band of blended frequencies."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    plain = config("Qwen2ForCausalLM", rope_scaling=yarn).rope_scaling
    assert plain.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    assert plain.frequency_factors == pytest.approx((1.0, 4 / 3, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0))
    scaled = config("Qwen2ForCausalLM", rope_scaling={**yarn, "mscale": 1.0, "mscale_all_dim": 0.5}).rope_scaling
    assert scaled.attention_factor == pytest.approx((0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1))
    narrow = config("Qwen2ForCausalLM", rope_scaling={**yarn, "beta_fast": 8, "beta_slow": 2}).rope_scaling
    assert narrow.frequency_factors != plain.frequency_factors


def test_qwen3_moe_reads_its_expert_fields():
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128)
    cfg = config("Qwen3MoeForCausalLM", **moe, norm_topk_prob=False)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (8, 2, 32)  # each expert's width
    assert not cfg.moe_renormalize and cfg.qk_norm
    assert config("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2).moe_renormalize
    with pytest.raises(ValueError, match=r"dense MLP layers between the mixture-of-experts ones \(mlp_only_layers "
                                         r"\[0\]"):
        config("Qwen3MoeForCausalLM", **moe, mlp_only_layers=[0])


def test_qwen_moe_defaults_and_shared_expert_and_router_scoring():
    moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128)
    assert not config("Qwen3MoeForCausalLM", **moe).moe_renormalize  # transformers' default for a missing key
    qwen2 = config("Qwen2MoeForCausalLM", **moe, shared_expert_intermediate_size=96)
    assert qwen2.shared_expert_size == 96 and qwen2.qkv_bias and not qwen2.moe_renormalize
    assert config("Qwen3MoeForCausalLM", **moe).shared_expert_size == 0
    assert config("Qwen3MoeForCausalLM", **moe, scoring_func="sigmoid").router_scoring == "sigmoid"
    with pytest.raises(ValueError, match="router scoring 'noaux_tc' is not supported"):
        config("Qwen3MoeForCausalLM", **moe, scoring_func="noaux_tc")


def test_smollm3_nope_layers_become_kinds_without_rope():
    """transformers' no_rope_layers marks the layers that DO rotate; by default every 4th layer does not."""
    cfg = config("SmolLM3ForCausalLM", num_hidden_layers=8)
    assert cfg.rope_layers == (1, 1, 1, 0, 1, 1, 1, 0) and cfg.layers_differ
    assert cfg.attention_windows == (None, None) and cfg.layer_kinds() == [0, 0, 0, 1, 0, 0, 0, 1]
    assert config("SmolLM3ForCausalLM", no_rope_layers=[1, 1, 1]).rope_layers == ()  # all rotate: one kind
    # With sliding layers too: kinds 0 full, 1 sliding, then the same two without RoPE.
    mixed = config("SmolLM3ForCausalLM", sliding_window=12, use_sliding_window=True, no_rope_layers=[1, 0, 1],
                   layer_types=[F, S, S])
    assert mixed.attention_windows == (None, 12, None, 12) and mixed.layer_kinds() == [0, 3, 1]


def layer_kinds(cfg) -> list[str]:
    if cfg.layer_types:
        return list(cfg.layer_types)
    return [S if cfg.sliding_window else F] * cfg.num_layers


@pytest.mark.parametrize("model_type, arch", [
    ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM"), ("qwen2_moe", "Qwen2MoeForCausalLM"),
    ("qwen3_moe", "Qwen3MoeForCausalLM"), ("smollm3", "SmolLM3ForCausalLM"), ("mistral", "MistralForCausalLM"),
])
def test_which_layers_slide_without_layer_types_is_transformers_rule(model_type, arch):
    """Each architecture's own rule when config.json lists no layer_types: Qwen2/Qwen3 slide the layers from
    max_window_layers on, Qwen2-MoE every other one before it, Qwen3-MoE and Mistral all, SmolLM3 its NoPE ones."""
    from transformers import AutoConfig

    fields = dict(BASE, num_hidden_layers=8, use_sliding_window=True, sliding_window=12, max_window_layers=5)
    reference = AutoConfig.for_model(model_type, **fields)
    ours = layer_kinds(config(arch, **fields))
    # Qwen3-MoE's and Mistral's configs have no layer_types: their attention slides wherever sliding_window is set.
    expected = getattr(reference, "layer_types", None) or [S if reference.sliding_window else F] * 8
    assert ours == list(expected)
    assert len(set(ours)) == (1 if arch in ("Qwen3MoeForCausalLM", "MistralForCausalLM") else 2)


def test_defaults_a_config_leaves_out_are_its_architectures():
    """transformers' per-architecture defaults: the RoPE base, Gemma 3's sliding layers' own base, GELU exact
    but for Gemma 1's legacy "gelu", and no attention soft cap in Gemma 3 (its attention never reads the key)."""
    assert config("LlamaForCausalLM").rope_theta == 10000.0
    assert config("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2).rope_theta == 1e6
    assert config("SmolLM3ForCausalLM").rope_theta == 2e6
    gemma3 = config("Gemma3ForCausalLM", sliding_window=12, attn_logit_softcapping=50.0)
    assert (gemma3.rope_theta, gemma3.rope_local_theta, gemma3.attn_logit_softcap) == (1e6, 1e4, None)
    assert config("Gemma2ForCausalLM", hidden_activation="gelu").hidden_act == "gelu"
    assert config("LlamaForCausalLM", hidden_act="gelu").hidden_act == "gelu"


def test_mlp_biases_where_the_architecture_has_them():
    """Llama, Granite and SmolLM3 read mlp_bias; the others' MLPs have no biases whatever the config says."""
    for arch in ("LlamaForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM"):
        assert config(arch, mlp_bias=True).mlp_bias and not config(arch).mlp_bias
    assert not config("MistralForCausalLM", mlp_bias=True).mlp_bias
    assert not config("Qwen2ForCausalLM", mlp_bias=True).mlp_bias
