"""The unrolled layer loop (runner/layer_loop.py, GPU's default): per-layer weight arrays give the same logits as
transformers, on one device, tensor-parallel and inside pipeline stages, and each array keeps its stacked weight's
sharding."""

import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxserve import Engine
from jaxserve.models.layers import dequantized
from jaxserve.runner import paged_attention_xla
from jaxserve.runner.layer_loop import resolve_layer_loop
from jaxserve.runner.plan import empty_inputs
from jaxserve.runner.weights import low_bit_float_weights
from tests.models.test_parity import ARCHITECTURES, PROMPTS, check_parity


def engine_and_reference(tiny_checkpoint, name: str, num_layers: int | None = None, **engine_options):
    arch, overrides = ARCHITECTURES[name]
    path = tiny_checkpoint(arch, **overrides, **({} if num_layers is None else dict(num_hidden_layers=num_layers)))
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


@pytest.mark.parametrize("name, mesh, num_layers", [("llama-untied-llama3-rope", "1x2", None),
                                                    ("gemma2-softcap-mixed-windows", "2x2", None),
                                                    ("gemma2-softcap-mixed-windows", "1x2", 5)])
def test_unrolled_pipeline_stages_match_transformers(name, mesh, num_layers, tiny_checkpoint, monkeypatch):
    """A stage runs its own layers unrolled: one array [pp, ...] per stage slot, split over the stages, each
    stage's row its own layer (3 layers on 2 stages: the second stage's other slot is padding). Gemma 2's kinds
    alternate: a slot whose layers agree on both stages takes its kind while tracing (3 layers: both slots), one
    whose layers differ keeps it traced (5 layers on stages of 3 and 2: slots 0 and 1 hold one sliding and one
    full layer each, slot 2 one real layer)."""
    windows_seen = []
    layer_window = paged_attention_xla.layer_window
    monkeypatch.setattr(paged_attention_xla, "layer_window", lambda windows, kind: windows_seen.append(
        kind) or layer_window(windows, kind))
    engine, reference = engine_and_reference(tiny_checkpoint, name, num_layers, mesh=mesh)
    runner, pp = engine.runner, engine.runner.layout.pp
    assert runner.layer_loop == "unrolled" and pp == 2
    for array in runner.params["layers"]["wq"].get_value():
        assert array.shape[0] == pp and "pp" in jax.tree.leaves(tuple(array.sharding.spec))
        assert {shard.data.shape[0] for shard in array.addressable_shards} == {1}
    assert len(runner.params["layers"]["wq"].get_value()) == runner.cfg.num_layers // pp
    check_parity(engine, reference, PROMPTS)
    if runner.cfg.layers_differ:
        static = [isinstance(kind, int) for kind in windows_seen[: runner.layout.slots]]
        assert static == ([True, True] if num_layers is None else [False, False, True]), windows_seen


def test_slot_kinds_are_static_where_every_stage_agrees():
    from jaxserve.runner.layer_loop import slot_kinds

    assert slot_kinds([0, 1, 0], [0, 1, 2], 2) == [0, 1]  # 3 layers on (2, 1): slot 1 of stage 1 is padding
    assert slot_kinds([0, 1, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5], 3) == [None, None, None]
    assert slot_kinds([0, 1, 0, 1, 0], [0, 1, 2, 3, 4], 3) == [None, None, 0]  # (3, 2): slot 2 of stage 1 pads
    assert slot_kinds([0, 1, 0, 1], [0, 1, 2, 3], 2) == [0, 1]


def stage_program_text(engine) -> str:
    """The compiled program of a step at the largest token bucket: a tick of the pipeline whose stages stay busy
    across steps."""
    assert engine.stage_ticks
    shape = engine.plan_shape
    program, args = engine.runner.forward_program(empty_inputs(shape.buckets.tokens[-1], 4, shape))
    return program.lower(*args).compile().as_text()


def test_unrolled_stages_slice_no_layer_out_of_a_stack(tiny_checkpoint):
    """Scanned, a stage's program dynamic-slices each layer's weights out of its share of the stacks (what
    XLA:GPU copies before every matmul); unrolled over per-slot arrays, no weight is sliced at run time."""
    path = str(tiny_checkpoint("llama", tie_word_embeddings=False))
    options = dict(mesh="1x2", num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=4, warmup=False)
    scanned = Engine(path, layer_loop="scan", **options)
    # One layer's slice of each stacked weight [L, ...] as the compiled HLO names its type: f32[1,...].
    layer_types = {"f32[" + ",".join(map(str, (1, *var.get_value().shape[1:]))) + "]"
                   for var in jax.tree.leaves(scanned.runner.params["layers"], is_leaf=lambda v: hasattr(v, "get_value"))}

    def sliced(text: str) -> set[str]:
        return {t for t in layer_types if re.search(re.escape(f"= {t}") + r"\{[\d,]*\} dynamic-slice\(", text)}

    assert sliced(stage_program_text(scanned)) == layer_types  # the check sees every weight the scan slices
    del scanned
    assert not sliced(stage_program_text(Engine(path, layer_loop="unrolled", **options)))


def test_layer_loop_choice():
    assert resolve_layer_loop("auto", "gpu") == "unrolled"
    assert resolve_layer_loop("auto", "cpu") == "scan"
    assert resolve_layer_loop("auto", "cpu", experts=True) == "unrolled"
    assert resolve_layer_loop("auto", "cpu", low_bit_floats=True) == "unrolled"
    assert resolve_layer_loop("scan", "cpu", low_bit_floats=True) == "scan"  # asked for: as asked
    assert resolve_layer_loop("unrolled", "cpu") == "unrolled"
    with pytest.raises(ValueError, match="layer_loop must be one of auto, scan, unrolled, got 'unroll'"):
        resolve_layer_loop("unroll", "cpu")


def test_a_scan_unpacks_4_bit_groups_in_one_elementwise_pass():
    """Two 4-bit values a byte (the first in the low nibble) unpack by shifting a broadcast of the bytes: stacked
    instead, XLA:CPU copied each layer's slice through a concatenate inside the scan, 5.4x the unrolled layers'
    time at SmolLM2's shape (scripts/bench_layer_loop.py --weights int4), which is why a CPU can scan kept 4-bit
    groups."""
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (3, 64, 8)).astype(np.uint8)  # 3 layers of [64 in, 8 out], groups of 32 along "in"
    scale, offset = rng.random((3, 2, 8), np.float32), rng.random((3, 2, 8), np.float32)
    stack = {"w": jnp.asarray(q[:, 0::2] | (q[:, 1::2] << 4)), "w_scale": jnp.asarray(scale),
             "w_offset": jnp.asarray(offset)}

    def scanned(stack):
        return jax.lax.scan(lambda _, w: (None, dequantized(w, "w", jnp.float32)), None, stack)[1]

    expected = q * np.repeat(scale, 32, axis=1) + np.repeat(offset, 32, axis=1)
    np.testing.assert_array_equal(jax.jit(scanned)(stack), expected)
    assert "concatenate(" not in jax.jit(scanned).lower(stack).compile().as_text()


def test_only_float8_and_float4_weights_count_as_low_bit_floats():
    """A CPU unrolls layers whose weights are float8 or float4 values (fp8 at load, an FP8 or MXFP4 checkpoint's
    groups kept); integer groups (GGUF's blocks) scan. Blocks dequantized at load (quantization None) are floats.
    Elsewhere the choice is the platform's."""
    gguf = SimpleNamespace(method="gguf")  # a source without float values says nothing of them
    fp8 = SimpleNamespace(method="compressed-tensors", float_values=True)
    assert low_bit_float_weights("compressed-tensors", fp8)
    assert low_bit_float_weights("fp8", None)  # a float checkpoint quantized to fp8 at load
    assert not low_bit_float_weights("gguf", gguf)
    assert not low_bit_float_weights(None, fp8) and not low_bit_float_weights("int8", None)
    assert resolve_layer_loop("auto", "tpu", low_bit_floats=True) == "scan"


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


@pytest.mark.parametrize("tp, pp", [(2, 1), (2, 2)])
def test_stacked_weights_are_split_on_their_mesh(tp, pp, tiny_checkpoint):
    """What arrives stacked (a `jaxserve convert` checkpoint restores so) is split on the devices: the same values,
    each array with the stack's sharding (less its `layers` axis on one stage; on several, one array per stage
    slot, its rows the stages' layers), the stack freed."""
    import numpy as np

    from jaxserve.loader.checkpoint import open_checkpoint
    from jaxserve.parallel.layout import plan_layout
    from jaxserve.parallel.sharding import make_mesh
    from jaxserve.runner.layer_loop import unstack_layers
    from jaxserve.runner.weights import load_weights

    ckpt = open_checkpoint(str(tiny_checkpoint("llama", tie_word_embeddings=True, num_hidden_layers=4)))
    layout = plan_layout(ckpt.config, tp, pp)
    _, params = load_weights(ckpt.config, ckpt.tensors, "float32", make_mesh(tp, pp), layout)
    stacked = params["layers"]["w_down"].get_value()
    want, spec = np.asarray(stacked), tuple(stacked.sharding.spec)
    split = unstack_layers(params, pp)["layers"]["w_down"].get_value()
    assert stacked.is_deleted()
    assert len(split) == len(want) // pp
    for j, array in enumerate(split):
        np.testing.assert_array_equal(np.asarray(array), want[j] if pp == 1 else want[j::len(split)])
        assert tuple(array.sharding.spec) == (spec[1:] if pp == 1 else spec) and "tp" in jax.tree.leaves(spec)
