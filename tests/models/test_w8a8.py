"""W8A8 (`quantization="w8a8"`): int8 weights times int8 activations, against transformers computing the same
arithmetic in float.

The engine must compute exactly the model whose layer matmuls take `round(x / a) * a` (a = each token's max |x| /
127 over the input features) times the int8-rounded weights of test_int8.py. Here transformers runs the
dequantized checkpoint with a hook that fake-quantizes each such matmul's input the same way, written
independently of the engine's code: a wrong scale axis, a scale applied twice or not at all, or padding that
changes a row's maximum shows up far above the tolerance (logits off by more than 1).

The tolerance is looser than float parity's: float noise from earlier layers (1e-6) can tip an activation that
lies on a rounding boundary to the next int8 step on one side only, which moves these logits by up to ~5e-3.
"""

TOL = 2e-2

import numpy as np
import pytest
import torch

from jaxserve import Engine
from jaxserve.models.layers import int8_matmul
from tests.models.test_int8 import NOT_QUANTIZED, dequantized_reference, int8_rounded
from tests.models.test_parity import PROMPTS, check_parity
from tests.parallel.test_tiny_meshes import MODELS

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
    check_parity(w8a8_engine(path), reference, PROMPTS, tol=TOL)


@pytest.mark.parametrize("name, mesh", [("llama-odd-sizes", "4x2"), ("llama-padded-q-groups", "4x1")])
def test_w8a8_on_padded_meshes_matches_too(w8a8_case, name, mesh):
    """A token's scale is the max over all its features, which tp splits over devices and pads: padded features
    must not change the max; the int32 partial sums are added across devices."""
    path, reference = w8a8_case(name)
    check_parity(w8a8_engine(path, mesh=mesh), reference, PROMPTS, tol=TOL)


def test_int8_matmul_quantizes_each_token_over_the_contracted_axes():
    """The output projection's spec contracts two axes (heads and head_dim) and the MoE down projection keeps an
    expert axis: a per-token scale must span exactly the contracted ones."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 5)).astype(np.float32) * np.array([1, 10, 100])[:, None, None]
    w = rng.integers(-127, 128, (4, 5, 6)).astype(np.int8)
    got = np.asarray(int8_matmul("THd,HdD->TD", x, w))
    scale = np.abs(x).max(axis=(1, 2), keepdims=True) / 127
    want = np.einsum("THd,HdD->TD", np.clip(np.rint(x / scale), -127, 127) * scale, w.astype(np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    experts = np.asarray(int8_matmul("TEF,EFD->TED", x, w))
    scale = np.abs(x).max(axis=2, keepdims=True) / 127
    want = np.einsum("TEF,EFD->TED", np.clip(np.rint(x / scale), -127, 127) * scale, w.astype(np.float32))
    np.testing.assert_allclose(experts, want, rtol=1e-5)
