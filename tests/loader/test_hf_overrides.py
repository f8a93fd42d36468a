"""hf_overrides (vLLM's): keys laid over config.json before the model is built, here a linear RoPE scaling and a
longer context, giving what transformers gives on a config.json edited the same way; refused where there is no
config.json to lay them over, and a config the overrides break is refused naming them."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxserve import Engine, SamplingParams
from jaxserve.loader.checkpoint import with_overrides

OVERRIDES = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "max_position_embeddings": 1024}
PROMPT = list(range(200, 260))


def _hf_greedy(path, n: int) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False)[0, len(PROMPT):].tolist()


def test_overrides_give_what_transformers_gives_on_the_edited_config(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3")
    for file in path.iterdir():  # the same checkpoint, its config.json edited by hand
        if file.name != "config.json":
            (tmp_path / file.name).symlink_to(file)
    edited = with_overrides(json.loads((path / "config.json").read_text()), OVERRIDES)
    (tmp_path / "config.json").write_text(json.dumps(edited))
    want, unscaled = _hf_greedy(tmp_path, 8), _hf_greedy(path, 8)
    assert want != unscaled, "the override should change the output, or this test shows nothing"
    engine = Engine(str(path), hf_overrides=OVERRIDES, dtype="float32", num_kv_blocks=80, max_num_batched_tokens=64,
                    max_num_seqs=2, warmup=False)
    assert engine.max_model_len == 1024 and engine.config.model.rope_scaling.factor == 2.0
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert engine.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids == want


def test_a_nested_config_is_updated_key_by_key():
    raw = {"architectures": ["X"], "text_config": {"hidden_size": 8, "rope_theta": 1.0}, "rope_scaling": {"a": 1}}
    merged = with_overrides(raw, {"text_config": {"rope_theta": 2.0}, "rope_scaling": {"b": 2}})
    assert merged["text_config"] == {"hidden_size": 8, "rope_theta": 2.0}  # nested config: updated
    assert merged["rope_scaling"] == {"b": 2}  # any other value: replaced, as vLLM replaces it
    assert raw["text_config"] == {"hidden_size": 8, "rope_theta": 1.0}  # the file's dict is left as it was


def test_overrides_are_refused_where_they_cannot_apply(tiny_checkpoint, smollm2_gguf_path):
    with pytest.raises(ValueError, match="hf_overrides applies to a Hugging Face config.json"):
        Engine(smollm2_gguf_path, hf_overrides={"max_position_embeddings": 4096}, warmup=False)
    with pytest.raises(ValueError, match="hf_overrides {'num_attention_heads': 'many'} is not a config"):
        Engine(str(tiny_checkpoint("qwen3")), hf_overrides={"num_attention_heads": "many"}, warmup=False)
    with pytest.raises(ValueError, match="hf_overrides must be a mapping"):
        Engine(str(tiny_checkpoint("qwen3")), hf_overrides=["max_position_embeddings"], warmup=False)


def test_the_cli_refuses_an_override_that_is_not_a_json_object():
    run = subprocess.run([sys.executable, "-m", "jaxserve.cli.main", "serve", "--hf-overrides", "[1]"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--hf-overrides: expected a JSON object" in run.stderr


def test_a_converted_checkpoint_keeps_the_overridden_config(tiny_checkpoint, tmp_path):
    """`jaxserve convert --hf-overrides` writes the overridden config, which the converted checkpoint serves with;
    overrides given to the converted checkpoint itself are refused (it has no config.json)."""
    from jaxserve.cli import main as cli

    out = str(tmp_path / "converted")
    assert cli.main(["convert", str(tiny_checkpoint("qwen3")), out, "--dtype", "float32",
                     "--hf-overrides", json.dumps(OVERRIDES)]) == 0
    engine = Engine(out, dtype="float32", num_kv_blocks=80, max_num_batched_tokens=64, max_num_seqs=2, warmup=False)
    assert engine.max_model_len == 1024 and engine.config.model.rope_scaling.factor == 2.0
    with pytest.raises(ValueError, match="hf_overrides applies to a Hugging Face config.json"):
        Engine(out, hf_overrides={"max_position_embeddings": 2048}, warmup=False)
