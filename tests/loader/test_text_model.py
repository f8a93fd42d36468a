"""Gemma 3's multimodal checkpoints (4B and up) served text-only: the nested text_config with transformers'
defaults filled in, and the language model's tensors in either layout, giving transformers' logits."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from jaxserve import Engine
from jaxserve.loader.hf_config import model_config_from_hf
from jaxserve.loader.text_model import text_model_config
from tests.models.test_parity import GEMMA3_ROPE, PROMPTS, check_parity


def test_a_sparse_text_config_gets_transformers_defaults():
    """gemma-3-4b-it's config.json lists five text fields; heads, head size, query scale, RoPE bases and the
    5:1 layer pattern are Gemma3TextConfig's defaults."""
    raw = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024}}
    cfg = model_config_from_hf(text_model_config(raw))
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.eos_token_ids == (1, 106)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_scale) == (8, 4, 256, 256**-0.5)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling.factor) == (1e6, 1e4, 8.0)
    assert cfg.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",) and len(cfg.layer_types) == 34
    assert model_config_from_hf(text_model_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 10,
                                                   "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
                                                   "num_attention_heads": 1})).architecture == "LlamaForCausalLM"


@pytest.fixture(scope="module")
def gemma3_multimodal(tmp_path_factory, smol_tokenizer):
    """A tiny Gemma3ForConditionalGeneration (a one-layer vision tower) saved by transformers."""

    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = smol_tokenizer
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=len(tokenizer), sliding_window=12,
                sliding_window_pattern=2, query_pre_attn_scalar=24, rope_parameters=GEMMA3_ROPE,
                initializer_range=0.08, bos_token_id=1, eos_token_id=2, max_position_embeddings=512)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, eos_token_id=2)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "language_model" in name and name.endswith("norm.weight"):
                weight.uniform_(-0.5, 0.5)
    out = tmp_path_factory.mktemp("gemma3-mm")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, model


def test_the_language_model_of_a_multimodal_checkpoint_matches_transformers(gemma3_multimodal, tmp_path):
    out, reference = gemma3_multimodal
    names = load_file(out / "model.safetensors")
    assert any(n.startswith("language_model.model.") for n in names)  # the hub's layout, as transformers saves
    # transformers 4.5x's in-memory names, which some checkpoints were saved with.
    hub = tmp_path / "module-layout"
    hub.mkdir()
    for f in out.iterdir():
        if f.name != "model.safetensors":
            (hub / f.name).write_bytes(f.read_bytes())
    save_file({n.replace("language_model.model.", "model.language_model."): t for n, t in names.items()},
              hub / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((hub / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]
    for path in (out, hub):
        engine = Engine(str(path), num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4, warmup=False)
        check_parity(engine, reference, PROMPTS)


def test_mistral3_serves_its_language_model_with_its_own_lm_head(smol_tokenizer, tmp_path):
    """Mistral Small 3.1/3.2 (`Mistral3ForConditionalGeneration`, a Pixtral vision tower): a Mistral language
    model with untied embeddings, whose LM head sits beside the language model's tensors."""

    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = smol_tokenizer
    text = dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=len(tokenizer),
                initializer_range=0.08, max_position_embeddings=512, tie_word_embeddings=False)
    vision = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=8, image_size=28, patch_size=14)
    config = Mistral3Config(text_config=text, vision_config=vision, vision_feature_layer=-1,
                            tie_word_embeddings=False)  # transformers ties by the top level's word
    config.architectures = ["Mistral3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Mistral3ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    names = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" in names or "language_model.lm_head.weight" in names
    engine = Engine(str(tmp_path), num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4, warmup=False)
    assert engine.config.model.architecture == "MistralForCausalLM" and not engine.config.model.tie_word_embeddings
    check_parity(engine, model, PROMPTS)


def test_a_quantized_language_model_keeps_its_groups_under_the_text_names():
    """The quantized source beneath (ScaledSource, a GGUF, ...) is asked for the prefixed names: kept weights,
    their method and whether activations are quantized reach the loader through the renaming."""
    import numpy as np

    from jaxserve.loader.text_model import TextModelSource

    class Quantized:  # a BlockSource holding one quantized weight under the multimodal prefix
        method, activations = "compressed-tensors", "int8"
        asked: list[str] = []

        def names(self):
            return {"language_model.model.embed_tokens.weight", "language_model.model.layers.0.mlp.up_proj.weight"}

        def block_format(self, name):
            self.asked.append(name)
            return "format of " + name

        def get_grouped(self, name):
            self.asked.append(name)
            return np.zeros(1)

    source = TextModelSource(Quantized())
    assert (source.method, source.activations) == ("compressed-tensors", "int8")
    assert source.block_format("model.layers.0.mlp.up_proj.weight") == \
        "format of language_model.model.layers.0.mlp.up_proj.weight"
    source.get_grouped("model.embed_tokens.weight")
    assert Quantized.asked[-1] == "language_model.model.embed_tokens.weight"
