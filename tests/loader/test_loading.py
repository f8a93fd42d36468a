"""Checkpoint loading: sharded safetensors, generation defaults, and each bad input's clear error."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve import Engine, SamplingParams
from jaxserve.loader.checkpoint import open_checkpoint
from jaxserve.loader.safetensors import SafetensorsSource


def test_sharded_safetensors_with_index_load_the_same_weights(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama", tie_word_embeddings=False)
    single = SafetensorsSource(src)
    names = sorted(single.names())
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({n: single.get(n) for n in shard_names}, str(tmp_path / shard))
    index = {"weight_map": {n: shard for shard, ns in shards.items() for n in ns}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, tmp_path / f)
    sharded = SafetensorsSource(tmp_path)
    assert sharded.names() == single.names()
    for n in names[:5]:
        np.testing.assert_array_equal(sharded.get(n), single.get(n))
    a = Engine(str(src), num_kv_blocks=16, warmup=False).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5),
                                                    use_tqdm=False)
    b = Engine(str(tmp_path), num_kv_blocks=16, warmup=False).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5),
                                                         use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_generation_config_defaults_are_read(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen2")
    shutil.copytree(src, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9,
                                                                       "eos_token_id": [2, 5]}))
    ckpt = open_checkpoint(str(tmp_path / "m"))
    assert ckpt.generation_defaults == {"temperature": 0.6, "top_p": 0.9}
    assert ckpt.config.eos_token_ids == (2, 5)
    defaults = Engine(str(tmp_path / "m"), num_kv_blocks=16, warmup=False).default_sampling_params()
    assert (defaults.temperature, defaults.top_p) == (0.6, 0.9)


def test_unknown_architecture_lists_the_supported_ones(tiny_checkpoint, tmp_path):
    shutil.copytree(tiny_checkpoint("llama"), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'FooForCausalLM' is not supported; supported architectures: .*LlamaForCausalLM"):
        Engine(str(tmp_path / "m"))


def _write_metadata_gguf(path, arch: str, metadata: dict[str, int], tensors: dict | None = None):
    """A GGUF of `arch` holding these `{arch}.` integer keys and (default) a token embedding only."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        writer.add_uint32(f"{arch}.{key}", value)
    for name, array in (tensors or {"token_embd.weight": np.zeros((4, 8), np.float32)}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["falcon", "deepseek2"])
def test_unsupported_gguf_architecture_is_named(arch, tmp_path):
    with pytest.raises(ValueError, match=f"GGUF architecture '{arch}' in m.gguf is not supported; supported: "
                                         f"llama, qwen2, qwen3, qwen2moe, qwen3moe, phi3, granite, smollm3, gemma, gemma2, gemma3"):
        Engine(str(_write_metadata_gguf(tmp_path / "m.gguf", arch, {})))


@pytest.mark.parametrize("arch, layers, query_scale", [
    ("gemma2", 46, 144 ** -0.5), ("gemma2", 42, None),  # Gemma 2 27B: hidden 4608 / 32 heads; 9B: head_dim's
    ("gemma3", 62, 168 ** -0.5), ("gemma3", 48, None),  # Gemma 3 27B: 5376 / 32; 12B: head_dim's
])
def test_gemma_27b_ggufs_get_the_query_scale_llama_cpp_gives_them(arch, layers, query_scale, tmp_path):
    """GGUF has no query_pre_attn_scalar: llama.cpp knows the 27B models by their layer count."""
    from jaxserve.loader.gguf import GGUFFile

    hidden = {"gemma2": 4608, "gemma3": 5376}[arch]
    metadata = {"block_count": layers, "embedding_length": hidden, "attention.head_count": 32,
                "attention.head_count_kv": 16, "attention.key_length": 128, "feed_forward_length": 4 * hidden,
                "attention.sliding_window": 4096}
    cfg = GGUFFile(_write_metadata_gguf(tmp_path / "m.gguf", arch, metadata)).model_config()
    assert cfg.attention_scale == query_scale
    assert cfg.head_dim == 128 and cfg.sliding_window == 4096


@pytest.mark.parametrize("eot_field", [True, False])
def test_gguf_chats_stop_at_the_end_of_a_turn_not_only_at_eos(tmp_path, eot_field):
    """A Gemma chat's EOS is <eos>, its turn ends at <end_of_turn>: llama.cpp stops at both, named in the file
    (tokenizer.ggml.eot_token_id) or known by the token's text."""
    import gguf

    from jaxserve.loader.gguf import GGUFFile

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in {"block_count": 2, "embedding_length": 64, "attention.head_count": 4,
                       "attention.head_count_kv": 1, "attention.key_length": 16, "feed_forward_length": 128}.items():
        writer.add_uint32(f"gemma3.{key}", value)
    writer.add_token_list(["<pad>", "<eos>", "<bos>", "hello", "<end_of_turn>" if not eot_field else "turn-end"])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 1)
    if eot_field:
        writer.add_uint32("tokenizer.ggml.eot_token_id", 4)
        writer.add_uint32("tokenizer.ggml.eom_token_id", 99)  # outside the vocabulary: stops nothing
    writer.add_tensor("token_embd.weight", np.zeros((5, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert GGUFFile(path).model_config().eos_token_ids == (1, 4)


def test_one_expert_of_a_quantized_stacked_expert_tensor_reads_as_its_slice(tmp_path):
    """Quantized blocks run along rows, so an expert's rows are dequantized alone: Mixtral 8x7B's stacked
    experts are 1.4 GB per layer as float32, read one expert at a time."""
    import gguf

    from jaxserve.loader.gguf import GGUFFile

    experts = np.random.default_rng(0).normal(size=(4, 32, 64)).astype(np.float32)  # [experts, out, in]
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_uint32("llama.expert_count", 4)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", gguf.quants.quantize(experts, q8), raw_dtype=q8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile(tmp_path / "m.gguf")
    assert f.architecture == "MixtralForCausalLM"
    assert f.names() == {f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight" for e in range(4)}
    whole = gguf.quants.dequantize(gguf.quants.quantize(experts, q8), q8)
    for e in range(4):
        one = f.get(f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight")
        np.testing.assert_array_equal(one, whole[e])
        np.testing.assert_allclose(one, experts[e], atol=0.05)


@pytest.mark.parametrize("metadata, message", [
    ({"rope.scaling.type": "dynamic"}, "uses RoPE scaling 'dynamic', which is not supported; supported: none, linear, "
                                       "yarn"),
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64,
      "rope.scaling.yarn_log_multiplier": 0.1}, "YaRN with rope.scaling.yarn_log_multiplier is not supported"),
])
def test_gguf_rope_scalings_it_cannot_run_are_refused_by_name(metadata, message, tiny_checkpoint, gguf_tokenizer_source,
                                                              tmp_path):
    """Rather than run a model with the wrong positions, as llama.cpp metadata left unread once did."""
    from tests.helpers import write_gguf

    qwen2 = tiny_checkpoint("qwen2", tie_word_embeddings=True)
    with pytest.raises(ValueError, match=message):
        open_checkpoint(str(write_gguf(qwen2, tmp_path / "m.gguf", "qwen2", gguf_tokenizer_source, **metadata)))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine(str(tmp_path / "nothing.gguf"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine(str(tmp_path / "no" / "such" / "dir"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Engine(str(tmp_path / "empty"))


def test_truncated_safetensors_is_a_clear_error(tiny_checkpoint, tmp_path):
    shutil.copytree(tiny_checkpoint("llama"), tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        Engine(str(tmp_path / "m"))


def test_truncated_gguf_is_a_clear_error(smollm2_gguf_path, tmp_path):
    with open(smollm2_gguf_path, "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(1 << 20))
    with pytest.raises(ValueError, match="truncated"):
        Engine(str(tmp_path / "cut.gguf"))


def test_unreachable_hub_id_is_a_clear_error():
    # No network to the hub here: the loader must say so, not hang or dump a traceback from the hub client.
    with pytest.raises(FileNotFoundError, match="could not fetch 'someone/some-model' from the Hugging Face hub"):
        open_checkpoint("someone/some-model")


def test_bad_requests_are_refused_with_clear_errors(smol_engine):
    e = smol_engine
    with pytest.raises(ValueError, match="maximum context length is 1024"):
        e.generate("word " * 1100, SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens=2000 is more than the model's maximum context length of 1024"):
        e.generate("x " * 33, SamplingParams(max_tokens=2000), use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        e.generate([[1, 2, 10**9]], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        e.generate([[]], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"logprobs=21 \(chat.s top_logprobs\) exceeds the maximum of 20"):
        e.generate("hi", SamplingParams(logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="max_model_len=100000"):
        Engine(None, max_model_len=100000)
    assert not e.has_unfinished_requests()  # nothing half-admitted by the refused batches


def test_generation_config_sampling_defaults_are_checked_once_at_load(caplog, tmp_path):
    """A model file's bad value must not make every request that omits the field fail: nulls are skipped,
    a float top_k that is whole becomes an int, an invalid value is dropped with a warning."""
    from jaxserve.loader.generation_config import sampling_defaults

    generation = {"temperature": None, "top_k": 50.0, "top_p": 2.0, "min_p": 0.1, "repetition_penalty": 1.1,
                  "do_sample": True, "max_new_tokens": 20}
    defaults = sampling_defaults(generation, tmp_path / "generation_config.json")
    assert defaults == {"top_k": 50, "min_p": 0.1, "repetition_penalty": 1.1, "max_tokens": 20}
    assert isinstance(defaults["top_k"], int)
    assert any("ignoring top_p=2.0" in r.message for r in caplog.records)


def test_gguf_tokenizer_without_torch_matches_transformers(smollm2_gguf_path):
    """The engine builds a GGUF's tokenizer from `gguf` metadata (transformers' GGUF reader imports torch, which
    serving does not install); it must tokenize, decode and render chats exactly as transformers' own loader."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from jaxserve.loader.gguf import GGUFFile
    from jaxserve.loader.tokenizer import apply_chat_template

    path = Path(smollm2_gguf_path)
    ours, ref = GGUFFile(path).tokenizer(), AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["Hello, my name is", "def f(n):\n    return n", "  spaces\tand tabs  ", "日本語", "émigré café",
             "<|im_start|>user\nhi<|im_end|>", ""]
    for text in texts:
        ids = ours(text)["input_ids"]
        assert ids == ref(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True), text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors."}]
    assert apply_chat_template(ours, messages) == apply_chat_template(ref, messages)
    assert (ours.bos_token, ours.eos_token, ours.eos_token_id, len(ours)) == (ref.bos_token, ref.eos_token,
                                                                             ref.eos_token_id, len(ref))
