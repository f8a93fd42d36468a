"""Weight-only int8 (`quantization="int8"`): exact against transformers on the dequantized weights.

The int8 engine must compute exactly the model whose weights are `round(w / s) * s` (s = max |w| / 127 per output
channel): a checkpoint is quantized and dequantized here with torch, independently of the engine's code, and
transformers runs it. Any error in the engine's scales, their axes, padding or sharding shows up as a logit
difference far above the tolerance. SmolLM2's accuracy against the float model is tests/test_eval_quantization.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from jaxserve import Engine
from tests.models.test_parity import PROMPTS, check_parity
from tests.parallel.test_tiny_meshes import MODELS

# Only the decoder layers' matmuls are quantized: norms, embedding, LM head, the routers (Mixtral's, Qwen's,
# gpt-oss's), the shared expert's gate, attention sinks and biases stay float.
NOT_QUANTIZED = ("norm", "embed_tokens", "lm_head", "block_sparse_moe.gate.", "mlp.gate.", "mlp.router.",
                 "shared_expert_gate.", "bias")


def int8_rounded(t):
    """`t` rounded to int8 steps per row (scale: the row's max |t| / 127), back in float: a weight's per output
    channel, an activation's per token."""
    amax = t.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.clamp(torch.round(t / scale), -127, 127) * scale


def fp8_rounded(t):
    """`t` rounded per row to float8 e4m3 (torch's cast) after scaling the row's max |t| to 448, back in float."""
    amax = t.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    return (t / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale


def dequantized_reference(path, directory, rounded=int8_rounded):
    """transformers on a copy of `path` with `rounded` layer weights (written under `directory`)."""
    copy = dequantized_copy(path, directory / "model", rounded)
    return AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32, attn_implementation="eager").eval()


def dequantized_copy(src, dst, rounded=int8_rounded):
    """A copy of the HF checkpoint `src` whose layer matmul weights are rounded (int8 by default) per output
    channel (per row of the [out, in] matrices; per column of the experts gpt-oss stacks [E, in, out])."""
    import shutil

    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        for name, w in tensors.items():
            if w.ndim == 2 and not any(part in name for part in NOT_QUANTIZED):
                tensors[name] = rounded(w)
            elif w.ndim == 3:
                tensors[name] = rounded(w.transpose(1, 2)).transpose(1, 2).contiguous()
        save_file(tensors, file, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def int8_case(tiny_checkpoint, tmp_path_factory):
    """name -> (checkpoint path, transformers on its dequantized copy)."""
    built = {}

    def get(name: str):
        if name not in built:
            arch, overrides = MODELS[name]
            path = tiny_checkpoint(arch, **overrides)
            built[name] = path, dequantized_reference(path, tmp_path_factory.mktemp(f"int8-{name}"))
        return built[name]

    return get


def int8_engine(path, mesh=None, layer_loop="auto"):
    return Engine(str(path), quantization="int8", mesh=mesh, num_kv_blocks=64, max_num_batched_tokens=64,
                  max_num_seqs=4, warmup=False, layer_loop=layer_loop)


# On one device expert parallelism changes nothing: those models' experts are Mixtral's and Qwen's, already here.
@pytest.mark.parametrize("name", [name for name in MODELS if not name.endswith("-expert-parallel")
                                  or name.startswith("qwen2-moe")])
def test_int8_logits_match_transformers_on_dequantized_weights(name, int8_case):
    path, reference = int8_case(name)
    check_parity(int8_engine(path), reference, PROMPTS)


@pytest.mark.parametrize("mesh", [None, "2x2"])
def test_int8_with_unrolled_layers_matches_too(mesh, int8_case):
    """Unrolled (GPU's default): the int8 weights and their scales are both split per layer (per stage slot on
    two pipeline stages)."""
    path, reference = int8_case("llama-odd-sizes")
    engine = int8_engine(path, mesh=mesh, layer_loop="unrolled")
    assert isinstance(engine.runner.params["layers"]["wq_scale"].get_value(), tuple)
    check_parity(engine, reference, PROMPTS)


def test_int8_on_a_padded_2d_mesh_matches_too(int8_case):
    """4x2: padded heads, MLP, vocabulary and layer slots (zero channels get a harmless scale), and weights split
    over devices after the host quantized them whole."""
    path, reference = int8_case("llama-odd-sizes")
    check_parity(int8_engine(path, mesh="4x2"), reference, PROMPTS)


def test_int8_weights_are_stored_as_int8(int8_case):
    path, _ = int8_case("llama-odd-sizes")
    float_engine = Engine(str(path), num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=64, warmup=False)
    engine = int8_engine(path)
    layers = engine.runner.params["layers"]
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        assert layers[name][...].dtype == np.int8, name
    assert engine.runner.params["lm_head"][...].dtype == np.float32
    assert layers["wq_scale"][...].shape == layers["wq"][...].shape[:1] + layers["wq"][...].shape[2:]
    assert layers["attn_norm"][...].dtype == np.float32

    def layer_bytes(e):
        return sum(x.nbytes for x in jax.tree.leaves(e.runner.params["layers"]))

    assert layer_bytes(engine) < 0.3 * layer_bytes(float_engine)  # a quarter, plus float norms and scales


@pytest.mark.parametrize("name, mesh", [("llama-odd-sizes", None), ("mixtral", "2x2")])
def test_fp8_logits_match_transformers_on_fp8_rounded_weights(name, mesh, tiny_checkpoint, tmp_path):
    """quantization="fp8": float8 e4m3 weights with per-channel scales (rounded by numpy's ml_dtypes on the host
    here, by torch's cast in the reference), dequantized in the matmul; on a padded 2x2 mesh with experts too."""
    arch, overrides = MODELS[name]
    path = tiny_checkpoint(arch, **overrides)
    reference = dequantized_reference(path, tmp_path, fp8_rounded)
    engine = Engine(str(path), quantization="fp8", mesh=mesh, num_kv_blocks=64, max_num_batched_tokens=64,
                    max_num_seqs=4, warmup=False)
    assert {w.dtype for w in jax.tree.leaves(engine.runner.params["layers"]["wq"].get_value())} == {jnp.dtype(jnp.float8_e4m3fn)}
    check_parity(engine, reference, PROMPTS)


def test_unknown_quantization_is_refused_before_loading():
    with pytest.raises(ValueError, match="quantization must be one of int8, w8a8, fp8, gguf, compressed-tensors, gptq, awq, mxfp4, none, got 'int4'"):
        Engine("/nonexistent/model", quantization="int4")
