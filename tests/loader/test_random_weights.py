"""`load_format="dummy"`: random weights for a config, through the real loading path.

The reference is transformers on a checkpoint whose every tensor is replaced by the one the dummy loader makes
for that name, so a wrong shape, name or layout in the dummy loader fails here (as a shape error while writing
the copy, or as a logit difference).
"""

import json
import shutil

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from jaxserve import Engine, SamplingParams
from jaxserve.loader.checkpoint import open_checkpoint
from jaxserve.loader.hf_config import model_config_from_hf
from jaxserve.loader.random_weights import RandomWeights
from jaxserve.parallel.layout import plan_layout
from jaxserve.parallel.sharding import make_mesh
from jaxserve.runner.weights import load_weights
from tests.models.test_parity import PROMPTS, check_parity
from tests.parallel.test_tiny_meshes import MODELS


def config_only_copy(src, dst):
    """The HF directory without its weight files: all the dummy loader needs."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    return dst


def random_weights_copy(src, dst):
    """The HF directory with every tensor replaced by the dummy loader's tensor of the same name."""
    shutil.copytree(src, dst)
    source = RandomWeights(model_config_from_hf(json.loads((src / "config.json").read_text())))
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        for name, w in tensors.items():
            made = source.get(name)
            assert made.shape == tuple(w.shape), (name, made.shape, tuple(w.shape))
            tensors[name] = torch.from_numpy(np.array(made))
        save_file(tensors, file, metadata={"format": "pt"})
    return dst


def dummy_engine(path, mesh=None):
    return Engine(str(path), load_format="dummy", mesh=mesh, num_kv_blocks=64, max_num_batched_tokens=64,
                  max_num_seqs=4, warmup=False)


def flat_params(cfg, tensors, mesh, layout, quantization=None, per_layer=False, on_devices=None) -> dict:
    params = load_weights(cfg, tensors, np.float32, mesh, layout, quantization, per_layer, on_devices)[1]
    return dict(nnx.to_flat_state(params))


# Every tensor name and layout the dummy loader makes: an untied LM head and odd sizes, biases, Mixtral's and Qwen3's
# experts (with q/k norms), Qwen2-MoE's shared expert, Gemma 3's extra norms stored as w for 1 + w. (SmolLM3's and
# Qwen3's dense layers add no tensor name these lack.)
@pytest.mark.parametrize("name", ["llama-odd-sizes", "qwen2-bias", "mixtral", "qwen3-moe-expert-parallel",
                                  "qwen2-moe-shared-expert-parallel", "gemma3-mixed-windows"])
def test_dummy_weights_are_the_named_tensors_the_checkpoint_holds(name, tiny_checkpoint, tmp_path):
    """Each weight the dummy loader makes equals the one loaded from the checkpoint transformers wrote with every
    tensor replaced by the dummy tensor of its name: the names, shapes and layouts are a real checkpoint's. (That
    loading a checkpoint gives transformers' logits is tests/models/test_parity.py's; the test below runs dummy
    weights against transformers end to end.)"""
    arch, overrides = MODELS[name]
    replaced = open_checkpoint(str(random_weights_copy(tiny_checkpoint(arch, **overrides), tmp_path / "random")))
    cfg, mesh = replaced.config, make_mesh(1, 1)
    layout = plan_layout(cfg, 1, 1)
    dummy, read = (flat_params(cfg, source, mesh, layout) for source in (RandomWeights(cfg), replaced.tensors))
    assert dummy.keys() == read.keys()
    for path, var in dummy.items():
        for a, b in zip(jax.tree.leaves(var.get_value()), jax.tree.leaves(read[path].get_value()), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def test_dummy_weights_give_transformers_logits_and_the_same_tokens_on_every_mesh(tiny_checkpoint, tmp_path):
    """Dummy weights end to end: one device against transformers on the replaced checkpoint, then a second load, on
    4x2 (heads and vocab padded), generates the same tokens: the same weights on every mesh and every load."""
    arch, overrides = MODELS["llama-odd-sizes"]
    path = tiny_checkpoint(arch, **overrides)
    config_only = config_only_copy(path, tmp_path / "config-only")
    reference = AutoModelForCausalLM.from_pretrained(random_weights_copy(path, tmp_path / "random"),
                                                     dtype=torch.float32, attn_implementation="eager").eval()
    one_device = dummy_engine(config_only)
    check_parity(one_device, reference, PROMPTS[:2])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in engine.generate(PROMPTS, params, use_tqdm=False)]
              for engine in (one_device, dummy_engine(config_only, "4x2"))]
    assert tokens[0] == tokens[1]
    assert len({tuple(t) for t in tokens[0]}) > 1  # not one degenerate token stream for every prompt


# As users compile it: unoptimised, the vmapped draw rounds apart from the host's.
@pytest.mark.xla_optimised
@pytest.mark.parametrize("name, tp, pp, quantization, per_layer", [("llama-odd-sizes", 4, 2, None, True),
                                                                   ("mixtral", 2, 1, "int8", False)])
def test_weights_made_on_the_devices_are_the_host_path_s(name, tp, pp, quantization, per_layer, tiny_checkpoint):
    """The dummy load makes, pads, quantizes and splits each weight on the mesh's devices (runner/weights.py; what
    a GPU or TPU runs, the CPU draws on the host): every array equals the host path's from the same named tensors, padding (heads, vocab, layers on 4x2), stacked
    experts and int8 values included."""
    arch, overrides = MODELS[name]
    cfg = model_config_from_hf(json.loads((tiny_checkpoint(arch, **overrides) / "config.json").read_text()))
    mesh, layout = make_mesh(tp, pp), plan_layout(cfg, tp, pp)
    on_devices, on_host = (flat_params(cfg, RandomWeights(cfg), mesh, layout, quantization, per_layer, where)
                           for where in (True, False))
    assert on_devices.keys() == on_host.keys() and ("layers", "wq") in on_devices
    for path, var in on_devices.items():
        made, read = jax.tree.leaves(var.get_value()), jax.tree.leaves(on_host[path].get_value())
        assert len(made) == len(read) == (layout.slots if per_layer and path[0] == "layers" else 1)  # a slot's pp layers
        for a, b in zip(made, read):
            assert a.sharding == b.sharding and a.dtype == b.dtype, path
            a, b = np.asarray(a), np.asarray(b)
            if a.dtype == np.int8:  # a scale an ulp apart (below) can round a value on a .5 boundary the other way
                assert np.abs(a.astype(int) - b).max() <= 1 and (a != b).mean() < 1e-4, path
            else:  # one float32 ulp: XLA's division by 127 is not numpy's to the last bit
                np.testing.assert_allclose(a, b, rtol=1.2e-7, atol=0, err_msg=str(path))


def test_random_tensors_look_like_an_initialised_model():
    cfg = model_config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
                                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                "num_key_value_heads": 2})
    src = RandomWeights(cfg, seed=0)
    w = src.get("model.layers.1.mlp.down_proj.weight")
    assert w.shape == (64, 128) and w.dtype == np.float32 and 0.015 < w.std() < 0.025
    assert not np.array_equal(w, src.get("model.layers.0.mlp.down_proj.weight"))  # each name its own stream
    assert not np.array_equal(w, RandomWeights(cfg, seed=1).get("model.layers.1.mlp.down_proj.weight"))
    assert (src.get("model.layers.0.input_layernorm.weight") == 1).all()
    with pytest.raises(KeyError, match="dummy loader does not know"):
        src.get("model.layers.0.mlp.shared_expert.weight")


def test_unknown_load_format_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="load_format='pt' is not one of 'auto', 'dummy'"):
        Engine(str(tiny_checkpoint("llama")), load_format="pt", warmup=False)
