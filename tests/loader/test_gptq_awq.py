"""GPTQ and AWQ checkpoints in their own formats (AutoGPTQ/GPTQModel, AutoAWQ GEMM), written here from the
published layouts (their packages build CUDA kernels and do not install on this CPU machine): logits against
transformers on the float weights the quantized ones stand for, kept in their groups and dequantized at load."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM

from jaxserve.loader.gptq import AWQ_ORDER
from tests.helpers import small_engine
from tests.models.test_parity import PROMPTS, check_parity

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False)
TOLERANCE = 2e-4  # (q - zero) * scale in torch's order against q * scale + offset here, float32


def _pack(values: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Unsigned `bits`-wide values -> int32 words of consecutive values along `axis`, the first in the lowest bits
    (AWQ: the words' columns in `order`)."""
    per_word = 32 // bits
    v = values.astype(np.uint32)
    if axis == 0:
        return np.ascontiguousarray(_pack(v.T, bits, 1, order).T)
    v = v.reshape(v.shape[0], -1, per_word)
    if order is not None:
        v = v[:, :, list(order)]  # nibble c holds column order[c]
    words = np.zeros(v.shape[:2], np.uint32)
    for c in range(per_word):
        words |= v[:, :, c] << np.uint32(bits * c)
    return words.view(np.int32)


def write_packed(hf_dir: Path, out: Path, method: str, bits: int = 4, group_size: int = 32, sym: bool = True,
                 act_order: bool = False, checkpoint_format: str = "gptq") -> Path:
    """`hf_dir` quantized (min-max per group, float16 scales) in GPTQ's or AWQ's format into `out`, and the float
    checkpoint of exactly the weights it stands for beside it (`out`-float): the reference's."""
    rng = np.random.default_rng(0)
    reference = out.parent / (out.name + "-float")
    shutil.copytree(hf_dir, out)
    shutil.copytree(hf_dir, reference)
    floats, packed = {}, {}
    top = (1 << bits) - 1
    for name, w in load_file(hf_dir / "model.safetensors").items():
        if not (name.startswith("model.layers.") and name.endswith("proj.weight")):
            floats[name] = packed[name] = w
            continue
        wt = w.astype(np.float32).T  # [in, out], as both formats store it
        rows = wt.shape[0]
        g = group_size if group_size > 0 else rows
        order = rng.permutation(rows) if act_order else np.arange(rows)
        row_group = np.empty(rows, np.int64)
        row_group[order] = np.arange(rows) // g
        groups = -(-rows // g)  # the last one shorter where g does not divide the rows, as the tools count them
        grouped = np.zeros((groups * g, wt.shape[1]), np.float32)  # zeros change no group's min, max or max |w|
        grouped[:rows] = wt[order]
        grouped = grouped.reshape(groups, g, -1)
        if sym:
            scale = np.abs(grouped).max(1) / ((top + 1) // 2 - 1)
            zero = np.full(scale.shape, (top + 1) // 2, np.int64)
        else:
            lo, hi = np.minimum(grouped.min(1), 0), np.maximum(grouped.max(1), 0)
            scale = (hi - lo) / top
        scale = scale.astype(np.float16).astype(np.float32)  # stored in float16
        if not sym:
            zero = np.clip(np.round(-lo / scale), 0, top).astype(np.int64)
        q = np.clip(np.round(wt / scale[row_group]) + zero[row_group], 0, top).astype(np.int64)
        floats[name] = np.ascontiguousarray(((q - zero[row_group]) * scale[row_group]).T)
        base = name[: -len(".weight")]
        if method == "awq":
            packed[base + ".qweight"] = _pack(q, bits, 1, AWQ_ORDER)
            packed[base + ".qzeros"] = _pack(zero, bits, 1, AWQ_ORDER)
        else:
            stored_zero = zero - 1 if checkpoint_format == "gptq" else zero
            packed[base + ".qweight"] = _pack(q, bits, 0)
            packed[base + ".qzeros"] = _pack(stored_zero & top, bits, 1)
            packed[base + ".g_idx"] = row_group.astype(np.int32)
        packed[base + ".scales"] = np.ascontiguousarray(scale.astype(np.float16))
    for directory, tensors in ((out, packed), (reference, floats)):
        (directory / "model.safetensors").unlink()
        save_file(tensors, directory / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": True, "version": "gemm"}
        if method == "awq" else
        {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": sym,
         "checkpoint_format": checkpoint_format})
    (out / "config.json").write_text(json.dumps(config))
    return out


VARIANTS = {
    "gptq-4bit-group32-sym": dict(method="gptq"),
    "gptq-4bit-group32-asym": dict(method="gptq", sym=False),
    "gptq-v2-4bit-group64-asym": dict(method="gptq", sym=False, group_size=64, checkpoint_format="gptq_v2"),
    "gptq-8bit-channel": dict(method="gptq", bits=8, group_size=-1),
    "gptq-4bit-act-order": dict(method="gptq", sym=False, act_order=True),  # dequantized at load
    "awq-4bit-group32": dict(method="awq", sym=False),
    # 96 divides neither 128 nor 256 input rows: 2 and 3 groups, the last shorter (dequantized at load)
    "awq-4bit-group96-uneven": dict(method="awq", sym=False, group_size=96),
}


@pytest.fixture(scope="module")
def packed_checkpoint(tiny_checkpoint, tmp_path_factory):
    made = {}

    def make(variant: str):
        if variant not in made:
            options = VARIANTS[variant]
            path = write_packed(tiny_checkpoint("llama", **TINY), tmp_path_factory.mktemp(variant) / "model",
                                **options)
            reference = AutoModelForCausalLM.from_pretrained(path.parent / "model-float", dtype=torch.float32)
            made[variant] = path, reference.eval(), options["method"]
        return made[variant]

    return make


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_packed_weights_match_the_float_weights_they_stand_for(variant, packed_checkpoint, caplog):
    path, reference, method = packed_checkpoint(variant)
    with caplog.at_level("INFO", logger="jaxserve.runner.weights"):
        served = small_engine(path, quantization=method)
    described = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights"))
    kept = not ("act-order" in variant or "uneven" in variant)  # those groups are dequantized at load
    assert ("w_down" in described) == kept, described
    check_parity(served, reference, PROMPTS, tol=TOLERANCE)


# 4x2: tp 4 splits the MLP's groups (the 8-bit per-channel ones narrowed to fit), pp 2 the layers. 3x1: tp 3 does
# not divide the MLP's 256 columns, whose padding must leave each device whole groups (it left 86 columns, groups
# of 2 and a crash).
@pytest.mark.parametrize("mesh", ["4x2", "3x1"])
def test_packed_groups_split_over_a_mesh(packed_checkpoint, mesh, caplog):
    for variant in ("gptq-8bit-channel", "awq-4bit-group32"):
        path, reference, method = packed_checkpoint(variant)
        caplog.clear()
        with caplog.at_level("INFO", logger="jaxserve.runner.weights"):
            served = small_engine(path, mesh, quantization=method)
        described = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights"))
        assert "w_down" in described, described  # kept in its groups on every device
        check_parity(served, reference, PROMPTS, tol=TOLERANCE)


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "gptq checkpoint holds 3-bit weights"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "awq checkpoint holds 4-bit gemv"),
])
def test_unsupported_variants_are_refused_by_name(config, message, packed_checkpoint, tmp_path):
    path, _, _ = packed_checkpoint("gptq-4bit-group32-sym")
    copy = tmp_path / "changed"
    shutil.copytree(path, copy)
    written = json.loads((copy / "config.json").read_text())
    written["quantization_config"] = config
    (copy / "config.json").write_text(json.dumps(written))
    with pytest.raises(ValueError, match=f"{message}.*which jaxserve cannot read yet"):
        small_engine(copy)
