"""Engine logit parity with transformers when attention runs through the Pallas kernels (interpret mode on CPU):
prefills and mixed steps through the ragged kernel, decode-only steps through the decode kernel, on a tiny
Llama."""

import torch
from transformers import AutoModelForCausalLM

from jaxserve import Engine
from pallas_kernels.paged_attention import DECODE_KERNELS
from pallas_kernels.ragged_attention import RAGGED_KERNELS
from tests.models.test_parity import PROMPTS, check_parity


def spy(monkeypatch, kernels: dict) -> list:
    """Record each trace of the kernel "pallas-interpret" runs on CPU (the GPU one)."""
    traced, kernel = [], kernels["gpu"]
    monkeypatch.setitem(kernels, "gpu", lambda *a, **kw: traced.append(a[0].shape) or kernel(*a, **kw))
    return traced


def test_pallas_interpret_attention_keeps_parity(tiny_checkpoint, monkeypatch):
    ragged, decode = spy(monkeypatch, RAGGED_KERNELS), spy(monkeypatch, DECODE_KERNELS)
    path = tiny_checkpoint("llama", tie_word_embeddings=False)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(str(path), num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
                    attention_impl="pallas-interpret", warmup=False)
    assert engine.plan_shape.decode_kernel
    check_parity(engine, reference, PROMPTS)
    assert ragged, "no step ran the ragged kernel"
    assert decode, "no decode-only step ran the decode kernel"
    assert all(q_shape[0] == 4 for q_shape in decode)  # 3 prompts decode together in the 4-sequence bucket


def test_the_cpu_attention_compiles_no_decode_variants(smol_engine):
    assert not smol_engine.plan_shape.decode_kernel


def test_warmup_compiles_the_decode_variants_too(tiny_checkpoint):
    """With the decode kernel, each T == B shape has a decode-only program as well: warm-up must build them, or
    the first decode step would compile while serving."""
    from jaxserve import SamplingParams

    path = tiny_checkpoint("llama", tie_word_embeddings=False)
    engine = Engine(str(path), num_kv_blocks=16, max_num_batched_tokens=8, max_num_seqs=2,
                    attention_impl="pallas-interpret", recompile_guard="error")
    engine.generate([PROMPTS[0], PROMPTS[1][:5]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert engine.compiles_after_warmup == 0
