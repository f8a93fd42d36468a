"""Engine logit parity with transformers when attention runs through the Pallas ragged kernel (interpret mode
on CPU): prefills, a chunk boundary inside a block, and decode steps, on a tiny Llama."""

import torch
from transformers import AutoModelForCausalLM

from jaxserve import Engine
from pallas_kernels.ragged_attention import RAGGED_KERNELS
from tests.models.test_parity import PROMPTS, check_parity


def test_pallas_interpret_attention_keeps_parity(tiny_checkpoint, monkeypatch):
    traced = []
    kernel = RAGGED_KERNELS["gpu"]  # what "pallas-interpret" runs on CPU
    monkeypatch.setitem(RAGGED_KERNELS, "gpu", lambda *a, **kw: traced.append(1) or kernel(*a, **kw))
    path = tiny_checkpoint("llama", tie_word_embeddings=False)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(str(path), num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
                    attention_impl="pallas-interpret", warmup=False)
    check_parity(engine, reference, PROMPTS)
    assert traced, "the engine's step never called the Pallas kernel"
