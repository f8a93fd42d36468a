"""Checkpoints jaxserve cannot serve, or finds where users keep them, answered with one clear error naming the file
and the fix: quantized-ahead configs, configs missing keys, GGUF files without the suffix, hub downloads."""

import errno
import fnmatch
import json
import shutil

import pytest

from jaxserve.loader import checkpoint
from jaxserve.loader.checkpoint import open_checkpoint


@pytest.fixture
def config_of(tiny_checkpoint, tmp_path):
    """A copy of a tiny Llama whose config.json `change` edits; returns its directory."""
    def make(change) -> str:
        directory = tmp_path / "m"
        shutil.copytree(tiny_checkpoint("llama"), directory, dirs_exist_ok=True)
        config = json.loads((directory / "config.json").read_text())
        change(config)
        (directory / "config.json").write_text(json.dumps(config))
        return str(directory)
    return make


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq"])
def test_a_checkpoint_quantized_ahead_is_refused_by_its_method(config_of, method):
    path = config_of(lambda config: config.update(quantization_config={"quant_method": method, "bits": 4}))
    with pytest.raises(ValueError, match=f"config.json describes a {method} checkpoint, whose weights jaxserve cannot "
                                         "read: serve the unquantized model"):
        open_checkpoint(path)
    assert open_checkpoint(path, load_format="dummy").config.num_layers  # random weights read none of the file's


def test_a_quantized_config_over_float_weights_is_refused(config_of):
    path = config_of(lambda config: config.update(quantization_config={"quant_method": "fp8",
                                                                       "weight_block_size": [128, 128]}))
    with pytest.raises(ValueError, match=r"describes fp8 8-bit weights, but it holds no weight scales "
                                         r"\(\*.weight_scale_inv\): it is not the checkpoint its config describes"):
        open_checkpoint(path)


@pytest.mark.parametrize("change, message", [
    (lambda config: config.pop("intermediate_size"), "lacks 'intermediate_size'"),
    (lambda config: config.update(rope_scaling="linear"), "has a value of the wrong shape"),
    (lambda config: config.update(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "lacks 'low_freq_factor'"),
])
def test_a_config_missing_a_key_names_the_file_and_the_key(config_of, change, message):
    with pytest.raises(ValueError, match=f"config.json {message}"):
        open_checkpoint(config_of(change), load_format="dummy")


def test_a_gguf_file_without_its_suffix_is_read_by_its_magic(smollm2_gguf_path, tmp_path):
    """ollama keeps its models as blobs named by their hash."""
    blob = tmp_path / "sha256-0123abcd"
    blob.symlink_to(smollm2_gguf_path)
    assert open_checkpoint(str(blob)).config.num_layers == 30
    with pytest.raises(ValueError, match="hf_overrides applies to a Hugging Face config.json"):
        open_checkpoint(str(blob), hf_overrides={"max_position_embeddings": 4096})
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="a file jaxserve cannot serve alone: give a GGUF file, or the Hugging Face "
                                         "model directory holding it"):
        open_checkpoint(str(other))


def test_hub_downloads_skip_mistrals_consolidated_copy_and_name_a_full_disk(monkeypatch, tmp_path):
    import huggingface_hub

    asked = {}
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, ignore_patterns, **_: asked.update(ignore=ignore_patterns) or str(tmp_path))
    checkpoint._download_from_hub("mistralai/model")
    assert any(fnmatch.fnmatch("consolidated.safetensors", pattern) for pattern in asked["ignore"])
    assert not any(fnmatch.fnmatch("model-00001-of-00003.safetensors", pattern) for pattern in asked["ignore"])

    def fail(error):
        def download(*args, **kwargs):
            raise error
        return download

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OSError, match="could not store 'mistralai/model' under /models: No space left on device; free "
                                      "space there or pass --download-dir DIR"):
        checkpoint._download_from_hub("mistralai/model", download_dir="/models")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail(ConnectionError("offline")))
    with pytest.raises(FileNotFoundError, match="could not fetch 'mistralai/model' from the Hugging Face hub"):
        checkpoint._download_from_hub("mistralai/model")


def test_a_part_of_a_split_gguf_says_to_merge_the_parts(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "model-00001-of-00003.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint16("split.count", 3)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="is one of 3 parts of a split GGUF: merge them into one file"):
        open_checkpoint(str(path))


def test_an_absent_tie_word_embeddings_takes_transformers_default():
    from jaxserve.loader.hf_config import model_config_from_hf

    config = {"architectures": ["SmolLM3ForCausalLM"], "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1}
    assert model_config_from_hf(config).tie_word_embeddings is True  # as SmolLM3Config's default
    assert model_config_from_hf({**config, "architectures": ["LlamaForCausalLM"]}).tie_word_embeddings is False


def test_yarn_extends_the_context_as_vllm_derives_it():
    """Qwen3's recipe for 128K: the rope_scaling alone (factor 4 over 32768), no max_position_embeddings."""
    from jaxserve.loader.hf_config import model_config_from_hf

    config = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
              "max_position_embeddings": 40960}
    assert model_config_from_hf(config).max_position_embeddings == 40960
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert model_config_from_hf({**config, "rope_scaling": yarn}).max_position_embeddings == 131072


def test_a_directory_holding_a_gguf_says_to_give_the_file(tmp_path):
    (tmp_path / "model.Q4_K_M.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=r"has no config.json; .* give the file's path \(.*model.Q4_K_M.gguf\)"):
        open_checkpoint(str(tmp_path))


def test_a_special_token_id_past_the_vocabulary_is_ignored_as_llama_cpp_ignores_it(
        tiny_checkpoint, gguf_tokenizer_source, tmp_path, caplog):
    """A GGUF's padding (or unknown) token id past the vocabulary: the tokenizer is built without it and a warning
    names it, as llama.cpp goes on (it was an IndexError)."""
    from jaxserve.loader.gguf import GGUFFile
    from tests.helpers import write_gguf

    path = tiny_checkpoint("llama")
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    file = write_gguf(path, tmp_path / "bad-pad.gguf", "llama", gguf_tokenizer_source,
                      tokenizer_fields={"tokenizer.ggml.padding_token_id": vocab})
    with caplog.at_level("WARNING"):
        tokenizer = GGUFFile(file).tokenizer()
    assert tokenizer.pad_token is None and tokenizer.eos_token is not None
    assert f"tokenizer.ggml.padding_token_id={vocab} is past the" in caplog.text
