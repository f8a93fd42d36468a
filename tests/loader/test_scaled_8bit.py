"""Checkpoints of 8-bit weights and scales: FP8 (`quant_method: fp8` with 128x128 blocks; compressed-tensors
float-quantized per tensor, channel or block, FP8-dynamic) kept as float8 values with per-group scales, and
compressed-tensors int-quantized W8A8 as int8; logits against transformers reading the same files (it
dequantizes the weights on a CPU, activations in float, as here)."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from tests.helpers import kept_formats, small_engine, write_fp8
from tests.models.test_parity import PROMPTS, check_parity

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, head_dim=64, tie_word_embeddings=False)
LAYOUTS = {"fp8-block": ("block", False), "ct-tensor": ("ct-tensor", False), "ct-channel": ("ct-channel", False),
           "ct-block": ("ct-block", False), "ct-fp8-dynamic": ("ct-channel", True),
           "ct-w8a8": ("ct-int8-channel", True)}
TOLERANCE = 2e-4  # float8 x scale in float32, in another order of operations than torch's


@pytest.fixture(scope="module")
def fp8_checkpoint(tiny_checkpoint, tmp_path_factory):
    made = {}

    def make(name: str):
        if name not in made:
            layout, dynamic = LAYOUTS[name]
            path = write_fp8(tiny_checkpoint("llama", **TINY), tmp_path_factory.mktemp(name) / "model", layout, dynamic)
            options = {} if layout == "block" else dict(
                quantization_config=CompressedTensorsConfig(run_compressed=False))
            made[name] = path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **options).eval()
        return made[name]

    return make


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_kept_8_bit_weights_match_transformers(name, fp8_checkpoint, caplog):
    path, reference = fp8_checkpoint(name)
    method = "fp8" if name == "fp8-block" else "compressed-tensors"
    with caplog.at_level("INFO", logger="jaxserve.runner.weights"):
        served = small_engine(path, quantization=method)
    kept = kept_formats(caplog)
    # wo's groups narrowed to its head_dim (64), the others the block's (or an unblocked scale's) 128 columns
    values = "8-bit" if name == "ct-w8a8" else "float8"
    assert kept == {"wq, wk, wv, w_gate, w_up, w_down": f"{values} in groups of 128", "wo": f"{values} in groups of 64"}
    check_parity(served, reference, PROMPTS, tol=TOLERANCE)


def test_float8_blocks_split_over_a_mesh(fp8_checkpoint):
    mesh = "4x2"  # tp 4 and pp 2
    path, reference = fp8_checkpoint("fp8-block")
    check_parity(small_engine(path, mesh, quantization="fp8"), reference, PROMPTS, tol=TOLERANCE)


def test_the_cpu_default_dequantizes_fp8_at_load(fp8_checkpoint):
    path, reference = fp8_checkpoint("fp8-block")
    check_parity(small_engine(path), reference, PROMPTS, tol=TOLERANCE)


def test_static_activation_scales_are_refused(fp8_checkpoint, tmp_path):
    path, _ = fp8_checkpoint("fp8-block")
    copy = tmp_path / "static"
    shutil.copytree(path, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="activation_scheme is 'static'; supported: dynamic"):
        small_engine(copy)
