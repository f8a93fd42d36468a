"""`jaxserve convert` in this process (8 fake devices): the orbax checkpoint serves the same tokens as the original,
refuses a mesh whose layout differs with a sentence naming both, and never overwrites."""

import json
import shutil
from pathlib import Path

import pytest

from jaxserve import Engine, SamplingParams
from jaxserve.cli import main as cli

SMALL = {"num_kv_blocks": 32, "max_num_batched_tokens": 16, "max_num_seqs": 2, "warmup": False, "dtype": "float32"}


def tokens(engine):
    outs = engine.generate(["Hello there", "The capital of France is"], SamplingParams(max_tokens=6, temperature=0),
                           use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_convert_then_serve_gives_the_original_tokens(tiny_checkpoint, tmp_path, capsys):
    model = str(tiny_checkpoint("llama"))
    out = str(tmp_path / "ckpt")
    assert cli.main(["convert", model, out, "--mesh", "2x2", "--dtype", "float32"]) == 0
    assert f"serve it with `jaxserve serve {out} --mesh 2x2`" in capsys.readouterr().out
    converted = Engine(out, mesh="2x2", **SMALL)
    assert converted.model_name == model and converted.tokenizer("Hello").input_ids
    assert tokens(converted) == tokens(Engine(model, mesh="2x2", **SMALL))

    with pytest.raises(ValueError, match=r"converted for mesh 2x2 .*serve it with --mesh 2x2, or convert the "
                                         r"original model again with --mesh 4x1"):
        Engine(out, mesh="4x1", **SMALL)
    with pytest.raises(ValueError, match="serve the original model .* with this quantization"):
        Engine(out, mesh="2x2", quantization="int8", **SMALL)
    # An older conversion: its layout without the keys added since is read; one padded otherwise is refused.
    marker = Path(out) / "jaxserve_checkpoint.json"
    meta = json.loads(marker.read_text())
    del meta["layout"]["shared_mlp"]
    marker.write_text(json.dumps(meta))
    assert tokens(Engine(out, mesh="2x2", **SMALL)) == tokens(converted)
    meta["layout"]["mlp"] += 2
    marker.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="converted for mesh 2x2 by a jaxserve that padded the weights for it "
                                         "otherwise: convert the original model again"):
        Engine(out, mesh="2x2", **SMALL)
    with pytest.raises(SystemExit):
        cli.main(["convert", model, out])
    assert "already exists" in capsys.readouterr().err


def test_a_converted_gemma3_keeps_its_layer_kinds_and_rope(tiny_checkpoint, tmp_path):
    """The config travels as JSON (layer kinds, linear RoPE scaling, the local RoPE base) and each layer's kind
    as a stored array: the converted model gives the original's tokens."""
    from tests.models.test_parity import ARCHITECTURES

    arch, overrides = ARCHITECTURES["gemma3-local-rope"]
    model, out = str(tiny_checkpoint(arch, **overrides)), str(tmp_path / "ckpt")
    assert cli.main(["convert", model, out, "-tp", "2", "--dtype", "float32"]) == 0  # vLLM's spelling of 2x1
    converted = Engine(out, mesh="2x1", **SMALL)
    assert converted.runner.cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert tokens(converted) == tokens(Engine(model, mesh="2x1", **SMALL))


def test_a_longrope_config_survives_its_json_round_trip():
    """LongRoPE's per-frequency factors come back from JSON as the tuples the config holds."""
    from jaxserve.loader.hf_config import model_config_from_hf
    from jaxserve.loader.orbax_checkpoint import model_config, stored_config
    from tests.loader.test_hf_config import BASE, PHI35_ROPE

    cfg = model_config_from_hf({"architectures": ["Phi3ForCausalLM"], **BASE, "max_position_embeddings": 4096,
                                "original_max_position_embeddings": 256, "partial_rotary_factor": 0.5,
                                "rope_scaling": PHI35_ROPE})
    assert model_config(json.loads(json.dumps({"config": stored_config(cfg)}))) == cfg
    # a checkpoint written while the config held the LM head's slice count (0319fe0 to c4dc814) still reads
    assert model_config({"config": stored_config(cfg) | {"head_slices": 1}}) == cfg
    # one from a jaxserve whose model config has a field this one lacks is refused by name, not a TypeError
    with pytest.raises(ValueError, match="another jaxserve version: its model config has new_knob, which this one"):
        model_config({"config": stored_config(cfg) | {"new_knob": True}}, "/ckpt")


def test_a_damaged_checkpoint_marker_is_named_with_the_fix(tmp_path):
    from jaxserve.loader.orbax_checkpoint import MARKER, open_orbax_checkpoint

    (tmp_path / MARKER).write_text('{"format": ')
    with pytest.raises(ValueError, match=f"{MARKER} is not valid JSON .* convert the original model again"):
        open_orbax_checkpoint(tmp_path)


def test_a_converted_checkpoint_keeps_the_tokenizer_it_was_given(tiny_checkpoint, tiny_tokenizer_source, tmp_path):
    """`--tokenizer` as serve takes it: stored beside the weights, so the checkpoint serves with it."""
    tokenizer_dir = tmp_path / "tokenizer"
    shutil.copytree(tiny_tokenizer_source, tokenizer_dir)
    (tokenizer_dir / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    out = str(tmp_path / "ckpt")
    assert cli.main(["convert", str(tiny_checkpoint("llama")), out, "--tokenizer", str(tokenizer_dir)]) == 0
    stored = json.loads((tmp_path / "ckpt" / "jaxserve_checkpoint.json").read_text())["config"]
    assert not {"quantized_activations", "dequantize_slice_bytes"} & set(stored)  # serving choices, unknown to older readers
    converted = Engine(out, **SMALL)
    assert converted.encode_chat([{"role": "user", "content": "Hi"}]) == converted.tokenizer.encode(
        "[Hi]", add_special_tokens=False)
