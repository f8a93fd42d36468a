"""GGUF weights kept in their quantized blocks (quantization="gguf"): decoded exactly as llama.cpp dequantizes,
carried through the loader's layout transforms with their scales, padded and split over meshes, and served with
the tokens of the model dequantized at load."""

import logging

import gguf
import jax
import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType as Q

from jaxserve import Engine, SamplingParams
from jaxserve.loader.gguf_blocks import KEPT_TYPES, decode_blocks
from jaxserve.loader.grouped import common_format, stack_grouped
from tests.helpers import K_QUANT_FLOAT16_FIELDS, kept_formats, quantized_blocks, write_gguf

SIMPLE_FLOAT16_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,)}


def random_blocks(kind, rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random bytes in `kind`'s blocks, every float16 field a finite value."""
    rng = np.random.default_rng(seed)
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows * blocks_per_row, block_bytes), dtype=np.uint8)
    for start in SIMPLE_FLOAT16_FIELDS.get(kind) or K_QUANT_FLOAT16_FIELDS[kind.name]:
        data[:, start:start + 2] = rng.normal(size=(len(data), 1)).astype(np.float16).view(np.uint8)
    return data.reshape(rows, blocks_per_row * block_bytes)


@pytest.mark.parametrize("kind", list(KEPT_TYPES), ids=lambda k: k.name)
def test_blocks_decode_to_llama_cpp_dequantization_bit_for_bit(kind):
    data = random_blocks(kind, rows=6, blocks_per_row=2)
    grouped = decode_blocks(data, kind)
    assert grouped.format == KEPT_TYPES[kind]
    np.testing.assert_array_equal(grouped.dequantize(), gguf.quants.dequantize(data, kind))


def test_layout_transforms_carry_the_groups_along():
    """Transpose, the q/o projections' head reshapes, a row permutation, conversion to a common format and
    stacking act on the dequantized weights as on the float ones."""
    q4k = decode_blocks(random_blocks(Q.Q4_K, rows=8, blocks_per_row=1, seed=1), Q.Q4_K)  # [8 out, 256 in]
    q6k = decode_blocks(random_blocks(Q.Q6_K, rows=8, blocks_per_row=1, seed=2), Q.Q6_K)
    w = q4k.dequantize()
    np.testing.assert_array_equal(q4k.T.reshape(256, 2, 4).dequantize(), w.T.reshape(256, 2, 4))  # like wq
    np.testing.assert_array_equal(q4k.T.reshape(4, 64, 8).dequantize(), w.T.reshape(4, 64, 8))  # like wo
    order = np.array([3, 1, 0, 2, 7, 5, 6, 4])
    np.testing.assert_array_equal(q4k.map_rows(lambda a: a[order]).dequantize(), w[order])
    target = common_format([q4k.format, q6k.format])
    assert (target.bits, target.group, target.offset) == (8, 16, True)
    stacked = stack_grouped([q4k.conform(target).T, q6k.conform(target).T], (2,))
    np.testing.assert_array_equal(stacked.dequantize(), np.stack([w.T, q6k.dequantize().T]))
    np.testing.assert_array_equal(q4k.T.reshape(8, 32, 8).dequantize(), w.T.reshape(8, 32, 8))  # one group a head
    with pytest.raises(ValueError, match="groups would straddle"):
        q4k.T.reshape(16, 16, 8)  # heads of 16 values: a group would span two


# Every kept type, layers of one weight in different types (converted to a common format), a weight with one
# float layer (dequantized at load), an untied LM head.
TINY_TYPES = {
    "token_embd.weight": Q.Q4_K, "output.weight": Q.Q6_K,
    "blk.0.attn_q.weight": Q.Q4_0, "blk.1.attn_q.weight": Q.Q4_K,
    "blk.0.attn_k.weight": Q.Q4_1, "blk.1.attn_k.weight": Q.Q4_1,
    "blk.0.attn_v.weight": Q.Q4_K, "blk.1.attn_v.weight": Q.Q6_K,
    "blk.0.attn_output.weight": Q.Q5_0,  # blk.1's stays float32
    "blk.0.ffn_gate.weight": Q.Q5_1, "blk.1.ffn_gate.weight": Q.Q5_1,
    "blk.0.ffn_up.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.Q8_0,
    "blk.0.ffn_down.weight": Q.Q5_K, "blk.1.ffn_down.weight": Q.Q6_K,
}
PROMPTS = ["Hello, my name is", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def tiny_quantized_gguf(tiny_checkpoint, gguf_tokenizer_source, tmp_path_factory):
    hf = tiny_checkpoint("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, head_dim=64,
                         tie_word_embeddings=False)
    return str(write_gguf(hf, tmp_path_factory.mktemp("quantized") / "tiny-q.gguf", "llama", gguf_tokenizer_source,
                          tensor_types=TINY_TYPES))


def _generate(model: str, mesh: str = "1x1", **options):
    engine = Engine(model, mesh=mesh, max_model_len=64, num_kv_blocks=16, max_num_seqs=2, warmup=False, **options)
    outs = [o.outputs[0] for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]
    return [o.token_ids for o in outs], np.array([[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]
                                                  for o in outs])


@pytest.fixture(scope="module")
def dequantized_reference(tiny_quantized_gguf):
    """The tokens and logprobs of the file's weights dequantized at load, as transformers reads a GGUF."""
    return _generate(tiny_quantized_gguf, quantization="none")


def test_the_default_keeps_the_blocks_and_none_dequantizes_them_at_load(tiny_quantized_gguf, caplog):
    options = dict(max_model_len=64, num_kv_blocks=16, max_num_seqs=2, warmup=False)
    with caplog.at_level(logging.INFO):
        Engine(tiny_quantized_gguf, **options)  # a CPU's default too
        assert kept_formats(caplog)["embed, wq, wk"] == "4-bit in groups of 32 with offsets"
        assert ", gguf quantization, mesh 1x1" in next(r.getMessage() for r in caplog.records
                                                        if r.getMessage().startswith("Loaded"))
        caplog.clear()
        Engine(tiny_quantized_gguf, quantization="none", **options)
    assert [r.getMessage().split(":")[0] for r in caplog.records if r.getMessage().startswith("weights")] == [
        "weights in float"]
    assert "quantization" not in next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Loaded"))


@pytest.mark.parametrize("mesh", ["1x1", "2x1", "4x2"])
def test_kept_blocks_serve_the_dequantized_models_tokens(mesh, tiny_quantized_gguf, dequantized_reference, caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.weights"):
        tokens, logprobs = _generate(tiny_quantized_gguf, mesh, quantization="gguf")
    assert tokens == dequantized_reference[0]
    np.testing.assert_allclose(logprobs, dequantized_reference[1], atol=1e-4)
    kept = kept_formats(caplog)
    # wo has a float32 layer, so it is dequantized at load; wv's Q4_K and Q6_K layers share 8-bit groups of 16
    assert kept == {"embed, wq, wk": "4-bit in groups of 32 with offsets", "lm_head": "8-bit in groups of 16",
                    "wv, w_down": "8-bit in groups of 16 with offsets", "w_gate": "8-bit in groups of 32 with offsets",
                    "w_up": "8-bit in groups of 32"}


def test_kept_weights_on_one_cpu_run_in_output_slices(tiny_quantized_gguf, dequantized_reference, monkeypatch):
    """On one CPU device a kept weight whose float copy would pass DEQUANTIZE_SLICE_BYTES is dequantized and
    multiplied a slice of its outputs at a time (layers.in_output_slices): here every layer weight and the LM
    head, in slices of 96 KiB, the last of each shorter than the others. The same tokens and logprobs as the
    weights dequantized at load."""
    from jaxserve.models import layers, llama

    matmuls: dict[str, int] = {}  # weight -> the matmuls it was traced in

    def counted(spec, weights, name, dtype, slice_bytes, matmul):
        def one(part):
            matmuls[name] = matmuls.get(name, 0) + 1
            return matmul(part)
        return layers_in_output_slices(spec, weights, name, dtype, slice_bytes, one)

    layers_in_output_slices = layers.in_output_slices
    monkeypatch.setattr(layers, "in_output_slices", counted)
    monkeypatch.setattr(llama, "in_output_slices", counted)
    monkeypatch.setattr("jaxserve.runner.weights.DEQUANTIZE_SLICE_BYTES", 96 << 10)
    engine = Engine(tiny_quantized_gguf, max_model_len=64, num_kv_blocks=16, max_num_seqs=2, warmup=False)
    assert engine.runner.layer_loop == "scan"  # "auto" on a CPU: integer groups scan
    outs = [o.outputs[0] for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]
    # per traced program: 1024 x 256 head rows (1 MiB of float32) in 11 slices, w_up's 512 KiB in 6 (the smallest
    # layer weights, wk's and wv's 128 KiB, in 2)
    assert matmuls["lm_head"] % 11 == 0 and matmuls["w_up"] % 6 == 0 and matmuls["w_up"] > 0, matmuls
    assert matmuls["wk"] % 2 == 0 and matmuls["wk"] > 0, matmuls
    assert [o.token_ids for o in outs] == dequantized_reference[0]
    logprobs = np.array([[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs])
    np.testing.assert_allclose(logprobs, dequantized_reference[1], atol=1e-4)


def test_the_default_model_is_kept_in_4_bits(smollm2_gguf_path, smol_engine):
    """The default model's Q4_1 file kept in its blocks by default, a CPU included, in under 0.35x of the float32
    model's weight bytes, its layers scanned. Its tokens are transformers' on the dequantized file
    (tests/engine/test_smollm2.py)."""
    float_bytes = 4 * sum(int(t.n_elements) for t in gguf.GGUFReader(smollm2_gguf_path).tensors)
    kept_bytes = sum(a.nbytes for a in jax.tree.leaves(smol_engine.runner.params))
    assert kept_bytes <= 0.35 * float_bytes, (kept_bytes, float_bytes)
    model = nnx.merge(smol_engine.runner.graphdef, smol_engine.runner.params)
    assert model.layers.w_up[...].dtype == np.uint8  # two 4-bit values a byte
    assert smol_engine.runner.layer_loop == "scan"


def test_gguf_quantization_needs_a_gguf_file(tiny_checkpoint):
    with pytest.raises(ValueError, match="quantization='gguf' keeps a gguf checkpoint's quantized weights in their "
                                         "blocks, and this model is not a quantized checkpoint jaxserve keeps in "
                                         "blocks: drop the option"):
        Engine(str(tiny_checkpoint("llama")), quantization="gguf", max_model_len=64, num_kv_blocks=8, warmup=False)


def test_k_quant_helper_blocks_decode():
    """The test helper's K-quant blocks are well formed: finite weights of a random model's size."""
    w = decode_blocks(quantized_blocks(np.zeros((4, 256), np.float32), Q.Q6_K), Q.Q6_K).dequantize()
    assert np.isfinite(w).all() and 0 < np.abs(w).max() < 1


# A mixture's experts (stacked per layer in GGUF, one type per stack): kept too, split over tp or whole over EP.
MOE_TYPES = {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q8_0} | {
    f"blk.{layer}.{name}.weight": kind for layer in range(2) for name, kind in
    (("attn_q", Q.Q8_0), ("attn_k", Q.Q8_0), ("attn_v", Q.Q8_0), ("attn_output", Q.Q8_0),
     ("ffn_gate_exps", Q.Q4_0), ("ffn_up_exps", Q.Q8_0), ("ffn_down_exps", (Q.Q4_1, Q.Q8_0)[layer]))}


@pytest.fixture(scope="module")
def moe_quantized_gguf(tiny_checkpoint, gguf_tokenizer_source, tmp_path_factory):
    hf = tiny_checkpoint("mixtral", num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                         intermediate_size=64, tie_word_embeddings=False)
    return str(write_gguf(hf, tmp_path_factory.mktemp("moe-quantized") / "tiny-moe-q.gguf", "llama",
                          gguf_tokenizer_source, tensor_types=MOE_TYPES))


@pytest.mark.parametrize("mesh, options, impl", [
    ("1x1", {}, "looped"), ("2x1", {}, "looped"), ("4x2", {"enable_expert_parallel": True}, "looped"),
    ("2x2", {"enable_expert_parallel": True}, "gathered"),  # the GPU/TPU scheme, gathering each block's groups
], ids=["1x1", "2x1-expert-tp", "4x2-expert-parallel", "2x2-gathered"])
def test_kept_experts_serve_the_dequantized_models_tokens(mesh, options, impl, moe_quantized_gguf, caplog,
                                                          monkeypatch):
    from jaxserve.runner import experts_impl

    reference = _generate(moe_quantized_gguf, quantization="none")
    monkeypatch.setattr(experts_impl, "expert_impl", lambda platform: impl)
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.weights"):
        tokens, logprobs = _generate(moe_quantized_gguf, mesh, quantization="gguf", **options)
    assert tokens == reference[0]
    np.testing.assert_allclose(logprobs, reference[1], atol=1e-4)
    kept = kept_formats(caplog)
    by_weight = {name: storage for names, storage in kept.items() for name in names.split(", ")}
    assert by_weight["w_gate"] == "4-bit in groups of 32 with offsets"
    assert by_weight["w_down"] == "8-bit in groups of 32 with offsets"  # Q4_1 and Q8_0 layers: int8 with offsets
    assert by_weight["w_up"] == by_weight["wq"] == "8-bit in groups of 32"


PHI3_TYPES = {f"blk.{i}.{name}.weight": kind for i in range(2)
              for name, kind in (("attn_qkv", Q.Q8_0), ("attn_output", Q.Q4_0), ("ffn_up", Q.Q4_1),
                                 ("ffn_down", Q.Q8_0))}


@pytest.mark.parametrize("mesh", ["1x1", "2x1"])
def test_phi3_fused_projections_keep_their_blocks(mesh, tiny_checkpoint, gguf_tokenizer_source, tmp_path, caplog):
    """Phi-3 stores q, k, v in one tensor and gate, up in another: each part keeps its rows of the fused
    tensor's blocks, and serves the tokens of the model dequantized at load."""
    hf = tiny_checkpoint("phi3", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0)
    gguf = str(write_gguf(hf, tmp_path / "phi3-q.gguf", "phi3", gguf_tokenizer_source, tensor_types=PHI3_TYPES))
    reference = _generate(gguf, quantization="none")
    with caplog.at_level(logging.INFO, logger="jaxserve.runner.weights"):
        tokens, logprobs = _generate(gguf, mesh, quantization="gguf")
    assert tokens == reference[0]
    np.testing.assert_allclose(logprobs, reference[1], atol=1e-4)
    assert kept_formats(caplog) == {"wq, wk, wv, w_down": "8-bit in groups of 32",
                                    "wo, w_gate, w_up": "4-bit in groups of 32 with offsets"}
