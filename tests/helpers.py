"""Test helpers: tiny random-weight checkpoints written by transformers, and reference logits."""

from __future__ import annotations

import os
from pathlib import Path

# Small but not trivial: GQA (4 q heads on 2 kv heads), 3 layers, weights large enough that logits spread.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.08)


def make_tiny_checkpoint(arch: str, out: Path, gguf_path: str, **overrides) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    settings = dict(TINY, vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2) | overrides
    config = AutoConfig.for_model(arch, **settings)
    config.architectures = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                             "mixtral": "MixtralForCausalLM"}[arch]]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # RMSNorm gains start at 1: made distinct, so a norm loaded into the wrong place shows
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def hf_logits(model, token_ids: list[int]):
    """Reference logits [len, V] for one sequence."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().numpy()
