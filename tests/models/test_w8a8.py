"""W8A8 (`quantization="w8a8"`): int8 weights times int8 activations, against transformers computing the same
arithmetic in float.

The engine must compute exactly the model whose layer matmuls take `round(x / a) * a` (a = each token's max |x| /
127 over the input features) times the int8-rounded weights of test_int8.py. Here transformers runs the
dequantized checkpoint with a hook that fake-quantizes each such matmul's input the same way, written
independently of the engine's code: a wrong scale axis, a scale applied twice or not at all, or padding that
changes a row's maximum shows up far above the tolerance (logits off by more than 1).

The tolerance is looser than float parity's: float noise from earlier layers (1e-6) can tip an activation that
lies on a rounding boundary to the next int8 step on one side only, which moved these logits by up to 0.04, and
every later step of that sequence with them. Which sequences tip depends on the CPU's summation order (the 4x2
case tipped one of three prompts on one machine, two of three on an AVX2-only AMD EPYC), so the tests run six
prompts and ask that none be off by more than TOL and at least one sequence's worth of steps agree to float noise
(exact_but_where_a_value_tipped): a wrong scale or padding moves every step.

FP8 GEMMs (float8 weights times float8 activations, on GPUs that have them) are held to the same standard with
activations rounded per token to float8 e4m3.
"""

TOL = 6e-2
# float8 e4m3 steps are 1/8 to 1/16 of a value (int8's are 1/127 of a row's max), and wider models sum more tipped
# products: a tipped activation moved the logits by up to ~0.06 (int8, tests/loader/test_scaled_8bit.py's model) or
# ~0.14 (float8). Those tests bound the logits by TIPPED and ask most steps to agree to float noise
# (exact_but_where_a_value_tipped); without the activations' rounding every step is off by 0.1-0.25.
TIPPED = 0.3

import logging

import jax
import numpy as np
import pytest
import torch

from jaxserve import Engine
from jaxserve.models.layers import quantized_matmul
from tests.models.test_int8 import NOT_QUANTIZED, dequantized_reference, fp8_rounded, int8_rounded
from tests.models.test_parity import PROMPTS, check_parity
from tests.parallel.test_tiny_meshes import MODELS

# The parity prompts and three more of their lengths: a tipped value spoils only its own sequence's steps.
TIP_PROMPTS = PROMPTS + [list(range(400, 403)), list(range(500, 516)), list(range(600, 641))]

# 6 q / 2 kv heads on tp=4: each kv head is copied to two devices and each copy's group gets a padded q head,
# which attends (uniformly) unlike a padded kv head's zeros.
CASES = {**MODELS, "llama-padded-q-groups": ("llama", dict(num_attention_heads=6, num_key_value_heads=2,
                                                            hidden_size=48))}


def fake_quantized_input(module, args):
    return (int8_rounded(args[0]),)


@pytest.fixture(scope="module")
def w8a8_case(tiny_checkpoint, tmp_path_factory):
    """name -> (checkpoint path, transformers with int8-rounded weights and fake-quantized layer inputs)."""
    built = {}

    def get(name: str):
        if name not in built:
            arch, overrides = CASES[name]
            path = tiny_checkpoint(arch, **overrides)
            reference = dequantized_reference(path, tmp_path_factory.mktemp(f"w8a8-{name}"))
            hooked = [module.register_forward_pre_hook(fake_quantized_input)
                      for module_name, module in reference.named_modules()
                      if isinstance(module, torch.nn.Linear) and ".layers." in module_name
                      and not any(part in module_name + "." for part in NOT_QUANTIZED)]
            assert len(hooked) == 7 * reference.config.num_hidden_layers  # q, k, v, o, gate, up, down
            built[name] = path, reference
        return built[name]

    return get


def w8a8_engine(path, mesh=None):
    return Engine(str(path), quantization="w8a8", mesh=mesh, num_kv_blocks=64, max_num_batched_tokens=64,
                  max_num_seqs=4, warmup=False)


@pytest.mark.parametrize("name", ["llama-odd-sizes", "qwen2-bias", "qwen3-qk-norm"])
def test_w8a8_logits_match_transformers_on_fake_quantized_activations(name, w8a8_case):
    path, reference = w8a8_case(name)
    exact_but_where_a_value_tipped(check_parity(w8a8_engine(path), reference, TIP_PROMPTS, tol=TOL))


@pytest.mark.parametrize("name, mesh", [("llama-odd-sizes", "4x2"), ("llama-padded-q-groups", "4x1")])
def test_w8a8_on_padded_meshes_matches_too(w8a8_case, name, mesh):
    """A token's scale is the max over all its features, which tp splits over devices and pads: padded features
    must not change the max; the int32 partial sums are added across devices."""
    path, reference = w8a8_case(name)
    exact_but_where_a_value_tipped(check_parity(w8a8_engine(path, mesh=mesh), reference, TIP_PROMPTS, tol=TOL))


def test_int8_matmul_quantizes_each_token_over_the_contracted_axes():
    """The output projection's spec contracts two axes (heads and head_dim) and the MoE down projection keeps an
    expert axis: a per-token scale must span exactly the contracted ones."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 5)).astype(np.float32) * np.array([1, 10, 100])[:, None, None]
    w = rng.integers(-127, 128, (4, 5, 6)).astype(np.int8)
    got = np.asarray(quantized_matmul("THd,HdD->TD", x, w, "int8"))
    scale = np.abs(x).max(axis=(1, 2), keepdims=True) / 127
    want = np.einsum("THd,HdD->TD", np.clip(np.rint(x / scale), -127, 127) * scale, w.astype(np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    experts = np.asarray(quantized_matmul("TEF,EFD->TED", x, w, "int8"))
    scale = np.abs(x).max(axis=2, keepdims=True) / 127
    want = np.einsum("TEF,EFD->TED", np.clip(np.rint(x / scale), -127, 127) * scale, w.astype(np.float32))
    np.testing.assert_allclose(experts, want, rtol=1e-5)


def fake_fp8_input(module, args):
    return (fp8_rounded(args[0]),)


@pytest.mark.parametrize("name, mesh", [("llama-odd-sizes", None), ("llama-padded-q-groups", "4x1")])
def test_fp8_gemms_match_transformers_on_fp8_rounded_weights_and_activations(name, mesh, tiny_checkpoint, tmp_path,
                                                                             monkeypatch, caplog):
    """quantization="fp8" where FP8 GEMMs run (GPUs of compute capability >= 8.9; forced here on the CPU, whose
    XLA multiplies float8 operands exactly): each layer matmul's input rounded per token to float8 e4m3 (scaled
    to 448) times the float8 weights, as transformers computes with both fake-quantized."""
    arch, overrides = CASES[name]
    path = tiny_checkpoint(arch, **overrides)
    reference = dequantized_reference(path, tmp_path, fp8_rounded)
    hooked = [module.register_forward_pre_hook(fake_fp8_input) for module_name, module in reference.named_modules()
              if isinstance(module, torch.nn.Linear) and ".layers." in module_name
              and not any(part in module_name + "." for part in NOT_QUANTIZED)]
    assert len(hooked) == 7 * reference.config.num_hidden_layers
    monkeypatch.setenv("JAXSERVE_FP8_GEMM", "1")
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        engine = Engine(str(path), quantization="fp8", mesh=mesh, num_kv_blocks=64, max_num_batched_tokens=64,
                        max_num_seqs=4, warmup=False)
    assert "float8 weights multiply float8 activations" in caplog.text
    exact_but_where_a_value_tipped(check_parity(engine, reference, TIP_PROMPTS, tol=TIPPED))


def exact_but_where_a_value_tipped(differences: list[float]) -> None:
    """`differences`: check_parity's, over TIP_PROMPTS. A tip moves its own sequence from that step on; a wrong
    scale, axis or padded maximum moves every step."""
    assert sum(d < 1e-3 for d in differences) >= len(differences) / len(TIP_PROMPTS), differences


def test_fp8_gemms_only_where_the_gpu_has_them(monkeypatch):
    from types import SimpleNamespace

    from jaxserve.runner.weights import fp8_gemms

    def gpu(capability):
        return SimpleNamespace(platform="gpu", compute_capability=capability)

    monkeypatch.delenv("JAXSERVE_FP8_GEMM", raising=False)
    assert fp8_gemms([gpu("9.0"), gpu("9.0")]) and fp8_gemms([gpu("8.9")]) and fp8_gemms([gpu("10.0")])
    assert not fp8_gemms([gpu("8.0")]) and not fp8_gemms([gpu("9.0"), gpu("8.6")])
    assert not fp8_gemms([SimpleNamespace(platform="tpu")]) and not fp8_gemms(jax.devices())
    monkeypatch.setenv("JAXSERVE_FP8_GEMM", "0")
    assert not fp8_gemms([gpu("9.0")])


def test_float8_matmul_quantizes_each_token_to_e4m3():
    import ml_dtypes

    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 5)).astype(np.float32) * np.array([1, 10, 1000])[:, None, None]
    w = (rng.standard_normal((4, 5, 6)) * 50).astype(ml_dtypes.float8_e4m3fn)
    got = np.asarray(quantized_matmul("THd,HdD->TD", x, w, "float8"))
    scale = np.abs(x).max(axis=(1, 2), keepdims=True) / 448
    rounded = (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale
    want = np.einsum("THd,HdD->TD", rounded, w.astype(np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert not np.allclose(got, np.einsum("THd,HdD->TD", x, w.astype(np.float32)), rtol=1e-3)  # it did round x
