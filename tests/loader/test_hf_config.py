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


@pytest.mark.parametrize("arch, config", [
    ("Qwen2ForCausalLM", dict(sliding_window=12, use_sliding_window=True, max_window_layers=1)),
    ("MistralForCausalLM", dict(sliding_window=12, layer_types=["sliding_attention", "full_attention",
                                                                "sliding_attention"])),
])
def test_a_mix_of_sliding_and_full_layers_is_refused(arch, config):
    with pytest.raises(ValueError, match="mixes sliding-window and full-attention layers"):
        window(arch, **config)
