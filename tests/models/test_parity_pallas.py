"""Engine logit parity with transformers when attention runs through the Pallas kernels (interpret mode on CPU;
compiled on a GPU with PALLAS_COMPILED=1, pallas_kernels/testing.py): prefills and mixed steps through the ragged
kernel, decode-only steps through the decode kernel, on a tiny Llama in float32."""

import contextlib

import jax
import torch
from transformers import AutoModelForCausalLM

from jaxserve import Engine
from pallas_kernels.paged_attention import DECODE_KERNELS
from pallas_kernels.ragged_attention import RAGGED_KERNELS
from pallas_kernels.testing import COMPILED
from tests.models.test_parity import ARCHITECTURES, PROMPTS, check_parity

IMPL = "pallas" if COMPILED else "pallas-interpret"


def spy(monkeypatch, kernels: dict) -> list:
    """Record each trace of the GPU kernel (the one "pallas-interpret" runs on CPU)."""
    traced, kernel = [], kernels["gpu"]
    monkeypatch.setitem(kernels, "gpu", lambda *a, **kw: traced.append(a[0].shape) or kernel(*a, **kw))
    return traced


def test_pallas_interpret_attention_keeps_parity(tiny_checkpoint, monkeypatch):
    ragged, decode = spy(monkeypatch, RAGGED_KERNELS), spy(monkeypatch, DECODE_KERNELS)
    path = tiny_checkpoint("llama", tie_word_embeddings=False)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
                    attention_impl=IMPL, warmup=False)
    assert engine.plan_shape.decode_kernel
    # A GPU's float32 matmuls default to TF32 (10-bit mantissa); parity at 1e-4 needs them in full float32.
    with jax.default_matmul_precision("highest") if COMPILED else contextlib.nullcontext():
        check_parity(engine, reference, PROMPTS)
    assert ragged, "no step ran the ragged kernel"
    assert decode, "no decode-only step ran the decode kernel"
    assert all(q_shape[0] == 4 for q_shape in decode)  # 3 prompts decode together in the 4-sequence bucket


def test_pallas_attention_keeps_parity_on_gemma2(tiny_checkpoint, monkeypatch):
    """Sliding and full layers alternating (the kernel's window picked per layer at run time) and the scores'
    soft cap, through both kernels."""
    ragged, decode = spy(monkeypatch, RAGGED_KERNELS), spy(monkeypatch, DECODE_KERNELS)
    arch, overrides = ARCHITECTURES["gemma2-softcap-mixed-windows"]
    path = tiny_checkpoint(arch, **overrides)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    engine = Engine(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
                    attention_impl=IMPL, warmup=False)
    with jax.default_matmul_precision("highest") if COMPILED else contextlib.nullcontext():
        check_parity(engine, reference, PROMPTS)
    assert ragged and decode


def test_a_head_size_the_kernels_cannot_tile_runs_padded(tiny_checkpoint, monkeypatch):
    """A Phi-3-shaped model (head_dim 96, fused qkv and gate/up): the Triton kernels tile powers of two, so q, K and V
    run 128 wide, the cache stores 128, and the logits are still transformers'. Split over tp where there are
    devices to."""
    ragged, decode = spy(monkeypatch, RAGGED_KERNELS), spy(monkeypatch, DECODE_KERNELS)
    path = tiny_checkpoint("phi3", hidden_size=192, num_attention_heads=2, num_key_value_heads=2, pad_token_id=0,
                           tie_word_embeddings=False)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4,
                    attention_impl=IMPL, warmup=False, mesh=None if COMPILED else "2x1")
    assert engine.config.model.head_dim == 96 and engine.runner.kv.k.shape[-1] == 128
    with jax.default_matmul_precision("highest") if COMPILED else contextlib.nullcontext():
        check_parity(engine, reference, PROMPTS)
    assert ragged and decode and {q_shape[-1] for q_shape in ragged + decode} == {128}


def test_only_the_kernels_compile_decode_variants(smol_engine):
    """"auto" attention is the CPU reference here (no decode variants), the Pallas kernels on a GPU."""
    assert smol_engine.plan_shape.decode_kernel == (jax.devices()[0].platform != "cpu")


def test_warmup_compiles_the_decode_variants_too(tiny_checkpoint):
    """With the decode kernel, each T == B shape has a decode-only program as well: warm-up must build them, or
    the first decode step would compile while serving."""
    from jaxserve import SamplingParams

    path = tiny_checkpoint("llama", tie_word_embeddings=False)
    # One sequence at a time: the fewest programs (each a kernel compile), the decode-only one among them.
    engine = Engine(str(path), num_kv_blocks=16, max_num_batched_tokens=8, max_num_seqs=1,
                    attention_impl=IMPL, recompile_guard="error")
    engine.generate([PROMPTS[0], PROMPTS[1][:5]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert engine.compiles_after_warmup == 0


def test_attention_sinks_through_the_gpu_kernels(tiny_checkpoint, monkeypatch):
    """gpt-oss: both GPU kernels' outputs rescaled by their log-sum-exp beside each head's sink. On 2x1: the sinks
    split with their q heads."""
    ragged, decode = spy(monkeypatch, RAGGED_KERNELS), spy(monkeypatch, DECODE_KERNELS)
    arch, overrides = ARCHITECTURES["gpt-oss"]
    path = tiny_checkpoint(arch, **overrides)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    engine = Engine(str(path), dtype="float32", mesh="2x1", num_kv_blocks=64, max_num_batched_tokens=64,
                    max_num_seqs=4, attention_impl=IMPL, warmup=False)
    with jax.default_matmul_precision("highest") if COMPILED else contextlib.nullcontext():
        check_parity(engine, reference, PROMPTS)
    assert decode and ragged
