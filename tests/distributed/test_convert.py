"""`jaxserve convert` in this process (8 fake devices): the orbax checkpoint serves the same tokens as the original,
refuses a mesh whose layout differs with a sentence naming both, and never overwrites."""

import pytest

from jaxserve import Engine, SamplingParams, cli

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
    with pytest.raises(SystemExit):
        cli.main(["convert", model, out])
    assert "already exists" in capsys.readouterr().err


def test_a_converted_gemma3_keeps_its_layer_kinds_and_rope(tiny_checkpoint, tmp_path):
    """The config travels as JSON (layer kinds, linear RoPE scaling, the local RoPE base) and each layer's kind
    as a stored array: the converted model gives the original's tokens."""
    from tests.models.test_parity import ARCHITECTURES

    arch, overrides = ARCHITECTURES["gemma3-local-rope"]
    model, out = str(tiny_checkpoint(arch, **overrides)), str(tmp_path / "ckpt")
    assert cli.main(["convert", model, out, "--mesh", "2x1", "--dtype", "float32"]) == 0
    converted = Engine(out, mesh="2x1", **SMALL)
    assert converted.runner.cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert tokens(converted) == tokens(Engine(model, mesh="2x1", **SMALL))
