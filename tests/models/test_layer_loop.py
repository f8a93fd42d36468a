"""The unrolled layer loop (runner/layer_loop.py, GPU's default): per-layer weight arrays give the same logits as
transformers, on one device and tensor-parallel, and each array keeps its stacked weight's sharding."""

import jax
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxserve import Engine
from jaxserve.runner import paged_attention_xla
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
def test_unrolled_layers_match_transformers(name, tiny_checkpoint, monkeypatch):
    """Gemma 2's layers alternate sliding and full attention: unrolled, each layer's window is fixed while
    tracing (its kind a Python int from the config), not looked up at run time."""
    windows_seen = []
    layer_window = paged_attention_xla.layer_window  # CPU's attention (make_attention_fn's "auto")
    monkeypatch.setattr(paged_attention_xla, "layer_window", lambda windows, kind: windows_seen.append(
        (windows, kind)) or layer_window(windows, kind))
    engine, reference = engine_and_reference(tiny_checkpoint, name)
    wq = engine.runner.params["layers"]["wq"].get_value()
    assert isinstance(wq, tuple) and len(wq) == engine.runner.cfg.num_layers
    check_parity(engine, reference, PROMPTS)
    cfg = engine.runner.cfg
    if cfg.layers_differ:
        assert all(isinstance(kind, int) for _, kind in windows_seen), windows_seen
        assert [kind for _, kind in windows_seen[: cfg.num_layers]] == cfg.layer_kinds()


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



def test_per_layer_weights_are_placed_from_the_host(tiny_checkpoint, monkeypatch):
    """Unrolled, no stacked layer weight reaches the device: each arrives as its per-layer arrays (the KV cache
    sizing reads the peak device memory, which a stacked copy split on the device would inflate)."""
    placed, device_put = [], jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **kw: placed.append(getattr(x, "shape", None))
                        or device_put(x, *a, **kw))
    engine, _ = engine_and_reference(tiny_checkpoint, "llama-tied")
    cfg = engine.runner.cfg
    per_layer = (cfg.hidden_size, cfg.num_heads, cfg.head_dim)
    assert placed.count(per_layer) == cfg.num_layers  # wq, one layer at a time
    assert (cfg.num_layers, *per_layer) not in placed


def test_stacked_weights_are_split_on_their_mesh(tiny_checkpoint):
    """What arrives stacked (a `jaxserve convert` checkpoint restores so) is split on the devices: the same values,
    each layer's array with the stack's sharding less its `layers` axis, the stack freed."""
    import numpy as np

    from jaxserve.loader.checkpoint import open_checkpoint
    from jaxserve.parallel.layout import plan_layout
    from jaxserve.parallel.sharding import make_mesh
    from jaxserve.runner.layer_loop import unstack_layers
    from jaxserve.runner.weights import load_weights

    ckpt = open_checkpoint(str(tiny_checkpoint("llama", tie_word_embeddings=True)))
    layout = plan_layout(ckpt.config, 2, 1)
    _, params = load_weights(ckpt.config, ckpt.tensors, "float32", make_mesh(2, 1), layout)
    stacked = params["layers"]["w_down"].get_value()
    want, spec = np.asarray(stacked), stacked.sharding.spec
    split = unstack_layers(params)["layers"]["w_down"].get_value()
    assert stacked.is_deleted()
    assert len(split) == len(want)
    for i, layer in enumerate(split):
        np.testing.assert_array_equal(np.asarray(layer), want[i])
        assert tuple(layer.sharding.spec) == tuple(spec)[1:] and "tp" in jax.tree.leaves(tuple(spec))
