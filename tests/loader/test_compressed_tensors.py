"""compressed-tensors pack-quantized checkpoints (llm-compressor's W4A16 and W8A16): logits against transformers
(which decompresses them with the compressed-tensors package) on the same files, kept in their groups on 1x1, 2x1
and 4x2 meshes (kept by default, a CPU included) or dequantized at load, and the schemes jaxserve refuses."""

import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from jaxserve.loader.compressed_tensors import CompressedTensorsSource
from jaxserve.loader.safetensors import SafetensorsSource
from tests.helpers import kept_formats, small_engine, write_compressed_tensors
from tests.models.test_parity import PROMPTS, check_parity

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False)
SCHEMES = {
    "w4a16-group32-symmetric": dict(bits=4, group_size=32, symmetric=True),
    "w4a16-group32-asymmetric": dict(bits=4, group_size=32, symmetric=False),
    "w8a16-channel-symmetric": dict(bits=8, group_size=None, symmetric=True),
    "w8a16-group64-asymmetric": dict(bits=8, group_size=64, symmetric=False),
}
# A quantized model's logits through a different order of float32 operations: (q - zero) * scale in torch,
# q * scale + offset here.
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def compressed(tiny_checkpoint, tmp_path_factory):
    """Factory: (scheme, architecture) -> (checkpoint directory, transformers' model of it, decompressed)."""
    made = {}

    def make(scheme: str, arch: str = "llama", **overrides):
        key = (scheme, arch, repr(sorted(overrides.items())))
        if key not in made:
            hf = tiny_checkpoint(arch, **(TINY | overrides))
            out = write_compressed_tensors(hf, tmp_path_factory.mktemp(scheme) / "model", **SCHEMES[scheme])
            reference = AutoModelForCausalLM.from_pretrained(
                out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)).eval()
            made[key] = out, reference
        return made[key]

    return make


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_kept_groups_match_transformers(scheme, compressed):
    path, reference = compressed(scheme)
    check_parity(small_engine(path, quantization="compressed-tensors"), reference, PROMPTS, tol=TOLERANCE)


def test_kept_groups_split_over_a_mesh(compressed):
    mesh = "4x2"  # tp 4 and pp 2 (2x1: the Qwen3 tests below)
    path, reference = compressed("w4a16-group32-asymmetric")
    check_parity(small_engine(path, mesh, quantization="compressed-tensors"), reference, PROMPTS, tol=TOLERANCE)


@pytest.mark.parametrize("arch, overrides", [
    ("qwen3", {}),
    # the experts kept in their groups too, each expert's width split over tp
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)),
], ids=["qwen3", "qwen3-moe"])
def test_other_families_match_transformers(arch, overrides, compressed):
    path, reference = compressed("w4a16-group32-symmetric", arch, **overrides)
    check_parity(small_engine(path, "2x1", quantization="compressed-tensors"), reference, PROMPTS, tol=TOLERANCE)


def test_activation_ordered_groups_dequantize_by_their_columns(tiny_checkpoint, tmp_path):
    """GPTQ's act-order as older llm-compressor releases wrote it (`actorder: group`, a `weight_g_idx` per input
    column; transformers no longer reads it): each column dequantized with its own group's scale and zero point,
    at load, the groups not being contiguous. Unpacked by compressed-tensors itself for the expectation."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.numpy import load_file

    hf = tiny_checkpoint("llama", **TINY)
    path = write_compressed_tensors(hf, tmp_path / "actorder", bits=4, group_size=32, symmetric=False, actorder=True)
    source = CompressedTensorsSource(SafetensorsSource(path), json.loads((path / "config.json").read_text()))
    stored, original = load_file(path / "model.safetensors"), load_file(hf / "model.safetensors")
    name = "model.layers.0.mlp.down_proj."
    rows, columns = stored[name + "weight_shape"]
    scale = stored[name + "weight_scale"]
    q = unpack_from_int32(torch.from_numpy(stored[name + "weight_packed"]), 4, torch.Size([rows, columns])).numpy()
    zero = unpack_from_int32(torch.from_numpy(stored[name + "weight_zero_point"]), 4, torch.Size(scale.shape),
                             packed_dim=0).numpy()
    groups = stored[name + "weight_g_idx"]
    assert not np.array_equal(groups, np.arange(columns) // 32)  # shuffled
    expected = (q.astype(np.float32) - zero[:, groups]) * scale[:, groups]
    np.testing.assert_allclose(source.get(name + "weight"), expected, rtol=1e-6, atol=1e-7)
    assert source.block_format(name + "weight") is None  # not kept: its groups are not contiguous
    step = scale[:, groups].max()
    assert np.abs(expected - original[name + "weight"]).max() <= step  # the helper quantized the real weights


def test_the_cpu_default_keeps_integer_groups(compressed, caplog):
    """Dequantized in each matmul, 4-bit groups beat float32 weights on a CPU too (runner/weights.py)."""
    path, reference = compressed("w4a16-group32-symmetric")
    with caplog.at_level("INFO", logger="jaxserve.runner.weights"):
        served = small_engine(path)
    assert kept_formats(caplog)["wq, wk, wv, wo, w_gate, w_up, w_down"] == "4-bit in groups of 32 with offsets"
    assert served.runner.layer_loop == "scan"  # integer groups scan on a CPU at the unrolled layers' speed
    check_parity(served, reference, PROMPTS, tol=TOLERANCE)


def _rewritten(path, tmp_path, change) -> str:
    copy = tmp_path / "changed"
    shutil.copytree(path, copy)
    config = json.loads((copy / "config.json").read_text())
    change(config["quantization_config"])
    (copy / "config.json").write_text(json.dumps(config))
    return str(copy)


def _activations_too(q):
    q["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token"}


def _float_weights(q):
    q["format"] = q["config_groups"]["group_0"]["format"] = "float-quantized"
    q["config_groups"]["group_0"]["weights"] |= {"type": "float", "num_bits": 8}


def _two_schemes(q):
    q["config_groups"]["group_1"] = {**q["config_groups"]["group_0"], "targets": ["re:.*down_proj"],
                                     "input_activations": {"num_bits": 8, "type": "int", "strategy": "token"}}
    q["config_groups"]["group_0"]["targets"] = ["re:.*(q|k|v|o|gate|up)_proj"]


@pytest.mark.parametrize("change, message", [
    (_activations_too, "holds pack-quantized int4 weights by group, activations quantized too, which jaxserve cannot "
                       "read yet; supported: pack-quantized"),
    (_float_weights, "holds float-quantized float8 weights by group, which jaxserve cannot read yet; supported: "
                     "pack-quantized"),
    # the same weights, one group's activations quantized: each weight's own matmul would differ (it took the
    # first group's for all)
    (_two_schemes, r"uses 2 weight schemes \(pack-quantized int4 weights by group; pack-quantized int4 weights by "
                   r"group, activations quantized too\), and jaxserve reads checkpoints of one"),
    (lambda q: q.update(sparsity_config={"format": "sparse-24-bitmask"}),
     r"stores its weights sparse \(sparse-24-bitmask\), which jaxserve cannot read yet; supported: dense storage"),
    (lambda q: q.update(transform_config={"config_groups": {}}), r"weights are rotated \(transform_config"),
], ids=["w4a8", "fp8", "two-schemes", "sparse", "transforms"])
def test_unsupported_schemes_are_refused_by_name(change, message, compressed, tmp_path):
    path, _ = compressed("w4a16-group32-symmetric")
    with pytest.raises(ValueError, match=message):
        small_engine(_rewritten(path, tmp_path, change))


def test_dense_sparsity_and_a_kv_cache_scheme_change_nothing_but_a_warning(compressed, tmp_path, caplog):
    """compressed-tensors' "dense" sparsity format is weights stored as they are (it was refused as a sparse
    checkpoint); calibrated KV-cache scales are not used, which the log says."""
    path, reference = compressed("w4a16-group32-symmetric")
    kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    changed = _rewritten(path, tmp_path, lambda q: q.update(sparsity_config={"format": "dense"}, kv_cache_scheme=kv))
    with caplog.at_level("WARNING", logger="jaxserve.loader.compressed_tensors"):
        served = small_engine(changed, quantization="compressed-tensors")
    assert "calibrated KV-cache scales (kv_cache_scheme) are not used" in caplog.text
    check_parity(served, reference, PROMPTS, tol=TOLERANCE)


def test_a_checkpoint_quantizing_only_its_kv_cache_serves_its_float_weights(tiny_checkpoint, tmp_path):
    """No config_groups, a kv_cache_scheme: float weights (it was refused as "0 weight schemes")."""
    hf = tiny_checkpoint("llama", **TINY)
    copy = tmp_path / "kv-only"
    shutil.copytree(hf, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
                                     "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
    (copy / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    check_parity(small_engine(copy), reference, PROMPTS, tol=1e-5)


def test_scales_that_do_not_fit_the_group_size_are_refused(compressed, tmp_path):
    """Groups are counted rounding up (the last may be shorter): 4 scales a row of 128 columns are no groups of 48
    (3 would be). The group was guessed from the count before (128 / 4), which for a last group shorter than the
    others (96 columns in groups of 64: 2 scales) put columns under the wrong scale."""
    path, _ = compressed("w4a16-group32-symmetric")
    def group_size_48(q):
        q["config_groups"]["group_0"]["weights"]["group_size"] = 48
    with pytest.raises(ValueError, match="has 4 groups of scales for 128 input columns in groups of 48: the "
                                         "checkpoint is not what its quantization_config describes"):
        small_engine(_rewritten(path, tmp_path, group_size_48))


@pytest.mark.parametrize("columns, groups, group_size, uneven", [
    (256, 2, 128, False), (256, 3, 96, True), (256, 1, None, False),
    (64, 1, 128, False),  # a group wider than the row: one whole group, kept (not dequantized by its columns)
])
def test_groups_are_counted_rounding_up(columns, groups, group_size, uneven):
    from jaxserve.loader.grouped import uneven_groups

    found = uneven_groups("w", columns, groups, group_size)
    assert (found is not None) == uneven
    if uneven:
        assert found.tolist() == [c // group_size for c in range(columns)]


def test_a_quantization_for_another_checkpoint_kind_is_refused(compressed):
    path, _ = compressed("w4a16-group32-symmetric")
    with pytest.raises(ValueError, match="quantization='gguf' keeps a gguf checkpoint's quantized weights in their "
                                         "blocks, and this model is a compressed-tensors checkpoint: drop the option "
                                         "or pass quantization='compressed-tensors'"):
        small_engine(path, quantization="gguf")
