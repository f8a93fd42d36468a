"""The unrolled layer loop (runner/layer_loop.py, GPU's default): per-layer weight arrays give the same logits as
transformers, on one device and tensor-parallel, and each array keeps its stacked weight's sharding."""

import jax
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxserve import Engine
from jaxserve.runner.layer_loop import resolve_layer_loop
from tests.models.test_parity import ARCHITECTURES, PROMPTS, check_parity


def engine_and_reference(tiny_checkpoint, name: str, **engine_options):
    arch, overrides = ARCHITECTURES[name]
    path = tiny_checkpoint(arch, **overrides)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    engine = Engine(str(path), num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4, warmup=False,
                    layer_loop="unrolled", **engine_options)
    return engine, reference


@pytest.mark.parametrize("name", ["llama-untied-llama3-rope", "gemma2-softcap-mixed-windows"])
def test_unrolled_layers_match_transformers(name, tiny_checkpoint):
    """Gemma 2's layers alternate sliding and full attention: each layer's kind comes from its own array."""
    engine, reference = engine_and_reference(tiny_checkpoint, name)
    wq = engine.runner.params["layers"]["wq"].get_value()
    assert isinstance(wq, tuple) and len(wq) == engine.runner.cfg.num_layers
    check_parity(engine, reference, PROMPTS)


def test_unrolled_layers_keep_their_tensor_parallel_sharding(tiny_checkpoint):
    engine, reference = engine_and_reference(tiny_checkpoint, "llama-tied", mesh="2x1")
    for name in ("wq", "w_down"):
        for array in engine.runner.params["layers"][name].get_value():
            assert "tp" in jax.tree.leaves(tuple(array.sharding.spec)), (name, array.sharding)
            assert len(array.sharding.spec) <= array.ndim
    check_parity(engine, reference, PROMPTS)


def test_layer_loop_choice():
    assert resolve_layer_loop("auto", "gpu", pp=1) == "unrolled"
    assert resolve_layer_loop("auto", "cpu", pp=1) == "scan"
    assert resolve_layer_loop("unrolled", "cpu", pp=2) == "scan"  # pipeline stages split the stacked axis
    with pytest.raises(ValueError, match="layer_loop must be one of auto, scan, unrolled, got 'unroll'"):
        resolve_layer_loop("unroll", "cpu", pp=1)
