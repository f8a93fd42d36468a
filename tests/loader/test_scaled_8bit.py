"""Checkpoints of 8-bit weights and scales: FP8 (`quant_method: fp8` with 128x128 blocks; compressed-tensors
float-quantized per tensor, channel or block, FP8-dynamic) kept as float8 values with per-group scales, and
compressed-tensors int-quantized W8A8 as int8; logits against transformers reading the same files (it
dequantizes the weights on a CPU, activations in float, as here; where the engine quantizes activations, W8A8's
int8 and FP8 GEMMs' float8, transformers gets those layers' inputs fake-quantized the same way)."""

import contextlib
import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from jaxserve.config import ModelConfig
from jaxserve.loader.scaled import FLOAT8, ScaledSource
from jaxserve.loader.weights import keep_blocks, weight_tensors
from tests.helpers import kept_formats, small_engine, write_fp8
from tests.models.test_parity import PROMPTS, check_parity
from tests.models.test_w8a8 import TIP_PROMPTS, TIPPED, exact_but_where_a_value_tipped

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
    values = "8-bit" if name == "ct-w8a8" else "float8"
    if LAYOUTS[name][0] in ("block", "ct-block"):  # wo's groups narrowed to its head_dim (64), the others the block's
        assert kept == {"wq, wk, wv, w_gate, w_up, w_down": f"{values} in groups of 128",
                        "wo": f"{values} in groups of 64"}
    else:  # scales per output channel (or tensor): groups as wide as the contracted axis (wo's: its head_dim)
        channel = ", scales per output channel"
        assert kept == {"wq, wk, wv, w_gate, w_up": f"{values} in groups of 256{channel}",
                        "wo": f"{values} in groups of 64{channel}", "w_down": f"{values} in groups of 512{channel}"}
    if name != "ct-w8a8":
        check_parity(served, reference, PROMPTS, tol=TOLERANCE)
        return
    # W8A8: every layer (its scales one per output channel, over each contracted axis: wo's heads too) multiplies
    # int8 activations, each token rounded at max |x| / 127, as vLLM serves it.
    from tests.models.test_int8 import int8_rounded

    assert "the checkpoint's int8 weights multiply int8 activations" in caplog.text
    with fake_quantized_inputs(reference, PER_CHANNEL_PROJECTIONS, int8_rounded):
        exact_but_where_a_value_tipped(check_parity(served, reference, TIP_PROMPTS, tol=TIPPED))



PER_CHANNEL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_w8a8_on_a_mesh_splitting_and_padding_w_down_computes_as_on_one_device(fp8_checkpoint, caplog):
    """tp 3 splits (and pads) w_down's contracted axis: its per-channel scale stays one group, so its matmul still
    multiplies int8 activations (a group per device dequantized it instead: 0.08 off one device's logits)."""
    from tests.models.test_int8 import int8_rounded

    path, reference = fp8_checkpoint("ct-w8a8")
    with caplog.at_level("INFO", logger="jaxserve.runner.weights"):
        served = small_engine(path, "3x1")
    assert kept_formats(caplog)["w_down"] == "8-bit in groups of 512, scales per output channel"
    with fake_quantized_inputs(reference, PER_CHANNEL_PROJECTIONS, int8_rounded):
        exact_but_where_a_value_tipped(check_parity(served, reference, TIP_PROMPTS, tol=TIPPED))


@contextlib.contextmanager
def fake_quantized_inputs(reference, projections, rounded):
    """transformers' `reference` with the inputs of the layers named `projections` passed through `rounded`."""
    hooks = [module.register_forward_pre_hook(lambda module, args: (rounded(args[0]),))
             for name, module in reference.named_modules() if name.endswith(projections)]
    try:
        assert len(hooks) == len(projections) * reference.config.num_hidden_layers
        yield
    finally:
        for hook in hooks:
            hook.remove()


def test_float8_blocks_split_over_a_mesh(fp8_checkpoint):
    mesh = "4x2"  # tp 4 and pp 2
    path, reference = fp8_checkpoint("fp8-block")
    check_parity(small_engine(path, mesh, quantization="fp8"), reference, PROMPTS, tol=TOLERANCE)


def test_the_cpu_default_dequantizes_fp8_at_load(fp8_checkpoint, caplog):
    """XLA:CPU converts float8 values in software, slower than reading float32 weights (runner/weights.py)."""
    path, reference = fp8_checkpoint("fp8-block")
    with caplog.at_level("INFO", logger="jaxserve.runner.weights"):
        served = small_engine(path)
    assert any(r.getMessage().startswith("weights in float:") for r in caplog.records), caplog.text
    check_parity(served, reference, PROMPTS, tol=TOLERANCE)


def test_the_cpu_default_keeps_w8a8_for_its_integer_gemms(fp8_checkpoint, caplog):
    path, _ = fp8_checkpoint("ct-w8a8")
    with caplog.at_level("INFO", logger="jaxserve.runner.weights"):
        small_engine(path)
    assert "the checkpoint's int8 weights multiply int8 activations" in caplog.text
    assert kept_formats(caplog)["wo"] == "8-bit in groups of 64, scales per output channel"


def test_static_activation_scales_are_refused(fp8_checkpoint, tmp_path):
    path, _ = fp8_checkpoint("fp8-block")
    copy = tmp_path / "static"
    shutil.copytree(path, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="activation_scheme is 'static'; supported: dynamic"):
        small_engine(copy)


def test_fp8_without_a_block_size_reads_its_per_tensor_scales(fp8_checkpoint, tmp_path):
    """`quant_method: fp8` with no weight_block_size (AutoFP8's, vLLM's own serialized FP8): `weight_scale` per
    tensor, the tensors compressed-tensors' per-tensor FP8 holds (it asked for weight_scale_inv and refused)."""
    path, reference = fp8_checkpoint("ct-tensor")
    copy = tmp_path / "fp8-tensor"
    shutil.copytree(path, copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (copy / "config.json").write_text(json.dumps(config))
    check_parity(small_engine(copy, quantization="fp8"), reference, PROMPTS, tol=TOLERANCE)


def _with_config(path, tmp_path, change) -> str:
    copy = tmp_path / "changed"
    shutil.copytree(path, copy)
    config = json.loads((copy / "config.json").read_text())
    change(config)
    (copy / "config.json").write_text(json.dumps(config))
    return str(copy)


def test_the_older_compression_config_key_is_read(fp8_checkpoint, tmp_path):
    """Older llm-compressor and sparseml releases named it compression_config: read as vLLM reads it (the weights
    were taken as floats without their scales, every one wrong)."""
    path, reference = fp8_checkpoint("ct-channel")
    older = _with_config(path, tmp_path, lambda c: c.update(compression_config=c.pop("quantization_config")))
    check_parity(small_engine(older, quantization="compressed-tensors"), reference, PROMPTS, tol=TOLERANCE)


def test_naive_quantized_8_bit_weights_are_read_as_their_type_s_format(fp8_checkpoint, tmp_path):
    """compressed-tensors' naive-quantized format stores 8-bit values in their own dtype, as float-quantized
    (and int-quantized) do: it was refused."""
    path, reference = fp8_checkpoint("ct-channel")

    def naive(config):
        q = config["quantization_config"]
        q["format"] = q["config_groups"]["group_0"]["format"] = "naive-quantized"
    check_parity(small_engine(_with_config(path, tmp_path, naive), quantization="compressed-tensors"), reference,
                 PROMPTS, tol=TOLERANCE)


def test_quantized_tensors_under_a_config_that_declares_none_are_refused(fp8_checkpoint, tmp_path):
    path, _ = fp8_checkpoint("ct-channel")
    undeclared = _with_config(path, tmp_path, lambda c: c.pop("quantization_config"))
    with pytest.raises(ValueError, match=r"holds quantized tensors \(model.layers.0.mlp.down_proj.weight_scale, "
                                         r"...\) but its config.json declares no quantization_config"):
        small_engine(undeclared)
    (tmp_path / "changed" / "hf_quant_config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"is an NVIDIA ModelOpt checkpoint \(hf_quant_config.json\)"):
        small_engine(undeclared)


class InMemory:
    """A TensorSource of numpy arrays."""

    def __init__(self, tensors):
        self.tensors = tensors

    def names(self):
        return set(self.tensors)

    def get(self, name):
        return self.tensors[name]

    def shape(self, name):
        return self.tensors[name].shape


@pytest.mark.parametrize("rows, columns", [(256, 64), (300, 128), (256, 129), (200, 300)])
def test_128_by_128_blocks_of_any_weight_shape_dequantize_exactly(rows, columns):
    """A row one block wide has block scales [n, 1], which are no per-channel scales (they were broadcast as if,
    and failed); partial blocks at the edges; a width of 129 leaves groups of 1."""
    rng = np.random.default_rng(0)
    values = rng.normal(size=(rows, columns)).astype(FLOAT8)
    scale = rng.uniform(0.5, 2, size=(-(-rows // 128), -(-columns // 128))).astype(np.float32)
    source = ScaledSource(InMemory({"x.weight": values, "x.weight_scale_inv": scale}), ".weight_scale_inv", "fp8",
                          (128, 128))
    expected = values.astype(np.float32) * np.repeat(np.repeat(scale, 128, 0), 128, 1)[:rows, :columns]
    np.testing.assert_array_equal(source.get("x.weight"), expected)


def test_a_weight_whose_groups_narrow_below_16_columns_is_dequantized_at_load_not_kept():
    """An MLP 129 wide: w_down's 128-column blocks narrow to groups of 1 (kept, it had a scale for every value and
    its matmul could not find the group axis: a crash), the weights beside it stay kept."""
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=64, intermediate_size=129,
                      num_layers=1, num_heads=1, num_kv_heads=1, head_dim=64)
    shapes = {"wq": (64, 64), "wk": (64, 64), "wv": (64, 64), "wo": (64, 64), "w_gate": (129, 64),
              "w_up": (129, 64), "w_down": (64, 129)}
    tensors = {}
    for ours, (name,) in ((k, v) for k, v in weight_tensors(cfg).items() if k in shapes):
        rows, columns = shapes[ours]
        tensors[name] = np.ones(shapes[ours], FLOAT8)
        tensors[name + "_scale_inv"] = np.ones((-(-rows // 128), -(-columns // 128)), np.float32)
    formats, _ = keep_blocks(cfg, ScaledSource(InMemory(tensors), ".weight_scale_inv", "fp8", (128, 128)))
    assert set(formats) == set(shapes) - {"w_down"}
    assert formats["w_up"].group == 64


# 2x1 and 3x1 split w_down's contracted axis (3x1 pads it too): its per-channel scale stays one group, replicated,
# so it multiplies float8 activations as on one device (a group per device took the dequantized path: other
# logits, other tokens than on one device).
@pytest.mark.parametrize("mesh", [None, "2x1", "3x1"])
def test_fp8_gemms_on_kept_per_channel_float8_weights(mesh, fp8_checkpoint, monkeypatch, caplog):
    """An FP8-dynamic checkpoint kept where FP8 GEMMs run (forced on the CPU here): every weight whose scales are
    one per output channel over its whole contracted axis multiplies float8 activations (each token's rounded to
    e4m3 at max |x| / 448), as transformers computes with those layers' inputs fake-quantized; wo too, its
    per-channel scale one over both its contracted axes (heads and head_dim), where it was kept grouped per head
    and dequantized in its matmul."""
    from tests.models.test_int8 import fp8_rounded

    path, reference = fp8_checkpoint("ct-fp8-dynamic")
    monkeypatch.setenv("JAXSERVE_FP8_GEMM", "1")
    with caplog.at_level("INFO", logger="jaxserve.runner.weights"):
        served = small_engine(path, mesh, quantization="compressed-tensors")
    assert "float8 weights multiply float8 activations" in caplog.text
    with fake_quantized_inputs(reference, PER_CHANNEL_PROJECTIONS, fp8_rounded):
        exact_but_where_a_value_tipped(check_parity(served, reference, TIP_PROMPTS, tol=TIPPED))
