"""gpt-oss's MXFP4 expert checkpoints (loader/mxfp4.py): decoded as transformers decodes them, and served with
transformers' logits on the same (dequantized) weights, dequantized at load or kept as int8 groups."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from jaxserve import Engine
from jaxserve.loader.mxfp4 import E2M1_VALUES, dequantize, grouped
from tests.helpers import kept_formats
from tests.models.test_parity import ARCHITECTURES, PROMPTS, check_parity


def mxfp4_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An [E, in, out] float tensor as the published format's (blocks [E, out, in/32, 16], scales [E, out, in/32]):
    per block of 32 inputs, the power of two that brings its largest value within E2M1's 6, and each value's
    nearest code."""
    t = np.swapaxes(w, 1, 2)
    groups = t.reshape(t.shape[:-1] + (t.shape[-1] // 32, 32))
    amax = np.maximum(np.abs(groups).max(axis=-1), 1e-30)
    exponent = np.ceil(np.log2(amax / 6.0)).astype(np.int32)
    scaled = groups / np.ldexp(1.0, exponent)[..., None]
    codes = np.abs(scaled[..., None] - E2M1_VALUES).argmin(axis=-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    # C order: safetensors writes an array's memory as it lies, strides ignored
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exponent + 127, np.uint8)


def test_dequantize_reads_codes_as_transformers_does():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(3, 5, 2, 16), dtype=np.uint8)
    scales = rng.integers(120, 134, size=(3, 5, 2), dtype=np.uint8)
    expected = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(dequantize(blocks, scales), expected.numpy())
    with pytest.raises(ValueError, match="do not match"):
        dequantize(blocks, scales[:, :, :1])


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tiny_checkpoint, tmp_path_factory):
    """(a gpt-oss checkpoint whose experts are MXFP4, transformers on a float copy holding what its own decoder
    makes of them)."""
    arch, overrides = ARCHITECTURES["gpt-oss"]
    src = tiny_checkpoint(arch, **(overrides | {"intermediate_size": 32}))  # in-widths of 64 and 32: whole blocks
    tmp_path = tmp_path_factory.mktemp("mxfp4")
    packed, decoded = tmp_path / "mxfp4", tmp_path / "decoded"
    for out in (packed, decoded):
        shutil.copytree(src, out)
    tensors = load_file(src / "model.safetensors")
    packed_tensors, decoded_tensors = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_encode(w)
            del packed_tensors[name]
            packed_tensors |= {name + "_blocks": blocks, name + "_scales": scales}
            decoded_tensors[name] = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                               dtype=torch.float32).numpy()
            assert np.abs(decoded_tensors[name] - w).max() > 0  # the rounding is real, so the file's values matter
    save_file(packed_tensors, packed / "model.safetensors", metadata={"format": "pt"})
    save_file(decoded_tensors, decoded / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((packed / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (packed / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(decoded, dtype=torch.float32, attn_implementation="eager").eval()
    return packed, reference


def test_mxfp4_gpt_oss_checkpoint_serves_transformers_logits(mxfp4_gpt_oss, caplog):
    """The CPU default: the experts dequantized at load give transformers' logits on the float copy."""
    packed, reference = mxfp4_gpt_oss
    with caplog.at_level("INFO", logger="jaxserve"):
        engine = Engine(str(packed), num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4, warmup=False)
    assert "experts are MXFP4" in caplog.text and "weights in float" in caplog.text
    check_parity(engine, reference, PROMPTS)


@pytest.mark.parametrize("mesh, options", [("1x1", {}), ("2x1", {}), ("2x1", {"enable_expert_parallel": True})])
def test_mxfp4_experts_kept_in_float4(mesh, options, mxfp4_gpt_oss, caplog):
    """quantization="mxfp4" (the GPU/TPU default): the experts kept as float4 e2m1 in groups of 32 (narrowed where
    tp splits w_down's contracted width), exactly the checkpoint's weights, so transformers' logits again."""
    packed, reference = mxfp4_gpt_oss
    with caplog.at_level("INFO", logger="jaxserve.runner.weights"):
        engine = Engine(str(packed), quantization="mxfp4", mesh=mesh, num_kv_blocks=64, max_num_batched_tokens=64,
                        max_num_seqs=4, warmup=False, **options)
    split = mesh == "2x1" and not options  # each device holds half of every expert's 32-wide MLP
    assert kept_formats(caplog) == ({"w_gate, w_up": "float4 e2m1 in groups of 32",
                                     "w_down": "float4 e2m1 in groups of 16"}
                                    if split else {"w_gate, w_up, w_down": "float4 e2m1 in groups of 32"})
    check_parity(engine, reference, PROMPTS)
    w_gate = jax.tree.leaves(engine.runner.params["layers"]["w_gate"].get_value())
    assert {w.dtype for w in w_gate} == {jnp.dtype(jnp.float4_e2m1fn)}  # XLA's 4-bit type, stored two a byte


def test_kept_groups_are_the_dequantized_weights():
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(2, 3, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, size=(2, 3, 4), dtype=np.uint8)
    kept = grouped(blocks, scales)
    assert kept.values.dtype.name == "float4_e2m1fn" and kept.group == 32 and kept.shape == (2, 128, 3)
    np.testing.assert_array_equal(kept.dequantize(), dequantize(blocks, scales))
    np.testing.assert_array_equal(kept[..., ::2].dequantize(), dequantize(blocks, scales)[..., ::2])
    with pytest.raises(ValueError, match="cuts the group axis"):
        kept[:, :16]


def test_mxfp4_of_another_architecture_is_refused(tiny_checkpoint, tmp_path):
    shutil.copytree(tiny_checkpoint("llama"), tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(ValueError, match="describes a mxfp4 checkpoint, whose weights jaxserve cannot read"):
        Engine(str(tmp_path / "m"), num_kv_blocks=8, warmup=False)
