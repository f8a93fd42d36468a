"""Test helpers: tiny random-weight checkpoints written by transformers, and reference logits."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import numpy as np

# The XLA_FLAGS tests run with (tests/conftest.py sets them before jax is imported). 8 fake CPU devices let mesh
# tests run anywhere. XLA's CPU compiler is most of the suite's time (docs/development.md): its older loop emitters
# and LLVM without its expensive passes compile a tiny model's engine about a third faster and run SmolLM2 a few
# percent slower; the suite as a whole, 13% faster. LLVM's module in one piece (not split for parallel codegen
# threads, which two workers on two cores never had idle): compile-bound tests 4% faster. Compile options only: the
# same programs in float32, their results equal to the last bits a change of compiler can move.
FAKE_DEVICES_XLA_FLAGS = "--xla_force_host_platform_device_count=8"
FAST_COMPILE_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false --xla_llvm_disable_expensive_passes=true "
                          "--xla_cpu_parallel_codegen_split_count=1")
# For a script that runs the Pallas kernels interpreted (bench_kernels, tune_decode_kernel): the compile options
# above run interpreted kernels up to 1.8x slower. Measured on those two script tests: 51.6 s with them, 33.4 s
# without.
INTERPRETED_KERNEL_XLA_FLAGS = FAKE_DEVICES_XLA_FLAGS

# Small but not trivial: GQA (4 q heads on 2 kv heads), 3 layers, weights large enough that logits spread.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.08)


# Tiny checkpoints' vocabulary: SmolLM2's tokenizer cut to its first TINY_VOCAB ids (its 17 special tokens, the 256
# byte tokens and its first merges), so any text still encodes. A tiny model's embedding and LM head are most of it:
# at SmolLM2's 49152 ids they made each step, each checkpoint written and each tokenizer loaded 30x the work.
TINY_VOCAB = 1024


def truncate_bpe_tokenizer(directory: Path, size: int = TINY_VOCAB) -> None:
    """Cut the byte-level BPE tokenizer saved in `directory` (tokenizer.json) to its first `size` ids: the merges
    that make a kept token stay, in order; added tokens past `size` go."""
    import json

    path = Path(directory) / "tokenizer.json"
    spec = json.loads(path.read_text())
    model = spec["model"]
    model["vocab"] = {token: i for token, i in model["vocab"].items() if i < size}
    merges = [m if isinstance(m, list) else m.split(" ") for m in model["merges"]]
    model["merges"] = [m for m in merges if "".join(m) in model["vocab"]]
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < size]
    path.write_text(json.dumps(spec, ensure_ascii=False))


def make_tiny_checkpoint(arch: str, out: Path, tokenizer_source: str, **overrides) -> Path:
    """`tokenizer_source`: a GGUF file holding the tokenizer, or a directory transformers saved one in."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if os.path.isdir(tokenizer_source):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    else:
        d, f = os.path.split(tokenizer_source)
        tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    settings = dict(TINY, vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2) | overrides
    config = AutoConfig.for_model(arch, **settings)
    config.architectures = [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                             "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                             "qwen2_moe": "Qwen2MoeForCausalLM", "gpt_oss": "GptOssForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                             "granite": "GraniteForCausalLM",
                             "mixtral": "MixtralForCausalLM", "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
                             "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}[arch]]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # RMSNorm gains start at 1 and biases at 0: made distinct, so one loaded into the wrong
        for name, weight in model.named_parameters():  # place (or not at all) shows
            if name.endswith("norm.weight"):
                weight.uniform_(0.5, 1.5)
            elif name.endswith("bias") and not weight.any():
                weight.normal_(0.0, 0.1)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_tiny_classifier(causal_dir: Path, out: Path, num_labels: int, **config):
    """The causal checkpoint's decoder under a random classification head, saved as transformers'
    *ForSequenceClassification; returns the transformers model (the reference)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_pretrained(causal_dir, num_labels=num_labels, dtype=torch.float32,
                                                               **config).eval()
    with torch.no_grad():  # transformers starts the head small; a larger one spreads the probabilities
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(causal_dir).save_pretrained(out)
    return model


def assert_equal_up_to_rounding(got, expected, tol: float = 1e-5, where: str = "") -> None:
    """`got` == `expected` (nested lists, tuples, dicts, dataclasses such as Logprob) with every float within `tol`:
    two engines whose steps batch the same rows differently (a pipeline's ticks, fill-drain micro-batches) give the
    same tokens, ranks and text, and logprobs a last bit apart (XLA's CPU matmul blocks by the batch's size)."""
    import dataclasses

    if isinstance(expected, float) and isinstance(got, float):
        assert abs(got - expected) <= tol, f"{where}: {got} vs {expected}"
    elif dataclasses.is_dataclass(expected) and type(got) is type(expected):
        assert_equal_up_to_rounding(dataclasses.astuple(got), dataclasses.astuple(expected), tol, where)
    elif isinstance(expected, dict) and isinstance(got, dict):
        assert got.keys() == expected.keys(), f"{where}: keys {sorted(got)} vs {sorted(expected)}"
        for key in expected:
            assert_equal_up_to_rounding(got[key], expected[key], tol, f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)) and type(got) is type(expected):
        assert len(got) == len(expected), f"{where}: {len(got)} items vs {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_equal_up_to_rounding(g, e, tol, f"{where}[{i}]")
    else:
        assert got == expected, f"{where}: {got!r} vs {expected!r}"


def hf_logits(model, token_ids: list[int]):
    """Reference logits [len, V] for one sequence."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().numpy()


def hf_greedy_choices(model, prompt_ids: list[int], generated: list[int]) -> list[int]:
    """transformers' greedy choice after the prompt and after each generated token but the last, from one forward
    pass over the whole sequence. Equal to `generated` exactly when transformers' greedy `generate` (no logits
    processors) gives `generated`: each choice is the next token given the tokens before it, and both stop at EOS
    or at the same length. One pass instead of `generate`'s one per token: SmolLM2's 7 x 32 tokens took 20 s."""
    sequence = prompt_ids + generated[:-1]
    return hf_logits(model, sequence)[len(prompt_ids) - 1:].argmax(-1).tolist()


def write_gguf(hf_dir: Path, out: Path, arch: str, tokenizer_gguf: str, split_experts: bool = False,
               tensor_types: dict | None = None, tokenizer_fields: dict | None = None, **metadata: int) -> Path:
    """The float32 weights of a tiny HF checkpoint as a GGUF file of llama.cpp's `arch`, written as llama.cpp's
    converter writes them: the Llama lineage's q/k rows interleaved, RoPE scaling as per-frequency factor tensors
    (Llama 3.1's `rope_freqs`, LongRoPE's `rope_factors_long/short`), Phi-3's rotary width in place of a head size,
    each layer's experts stacked in one tensor per matrix (or, `split_experts`, one tensor per expert as early
    Mixtral files have), Granite's multipliers as *_scale keys; with the tokenizer metadata of `tokenizer_gguf`
    (the same vocabulary).
    `metadata`: `{arch}.` keys to write instead of the config's (e.g. {"rope.dimension_count": 8}): integers,
    floats, booleans or strings; None leaves the key out (as older converters did). `tokenizer_fields`: tokenizer
    keys (integers) written instead of the tokenizer's. `tensor_types`: GGUF tensor name -> the quantized type to store it in
    (quantized_blocks); the others stay float32."""
    import json

    import gguf
    from safetensors.numpy import load_file

    from jaxserve.loader.gguf import _GLOBAL_NAMES, layer_names

    cfg = json.loads((hf_dir / "config.json").read_text())
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: its global layers' (llama.cpp hard-codes the local ones')
    theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary = int(head_dim * float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0))
    writer = gguf.GGUFWriter(str(out), arch)
    add_float_tensor = writer.add_tensor

    def add_tensor(name: str, w: np.ndarray) -> None:
        kind = (tensor_types or {}).get(name)
        if kind is None:
            return add_float_tensor(name, w)
        return add_float_tensor(name, quantized_blocks(w, kind), raw_dtype=kind)

    writer.add_tensor = add_tensor
    keys = {"context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
            "block_count": cfg["num_hidden_layers"], "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": cfg["num_attention_heads"],
            "attention.head_count_kv": cfg["num_key_value_heads"], "rope.dimension_count": rotary,
            "attention.sliding_window": cfg.get("sliding_window") or 0}
    if arch != "phi3":  # llama.cpp's Phi-3 converter writes no head size
        keys |= {"attention.key_length": head_dim, "attention.value_length": head_dim}
    for key, value in (keys | _gguf_model_metadata(cfg) | _gguf_rope_metadata(cfg, rope) | metadata).items():
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(f"{arch}.{key}", value)
        elif isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", int(value))
    writer.add_float32(f"{arch}.rope.freq_base", theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]))
    for name, factors in _gguf_rope_factors(cfg, rope, theta, rotary).items():
        writer.add_tensor(name, np.asarray(factors, np.float32))
    for key, kind, value in _tokenizer_fields(tokenizer_gguf, cfg["vocab_size"]):
        value = (tokenizer_fields or {}).get(key, value)
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        elif kind == gguf.GGUFValueType.BOOL:
            writer.add_bool(key, value)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    hf_to_gguf = {hf: name for name, hf in _GLOBAL_NAMES.items()}
    experts: dict[str, dict[int, np.ndarray]] = {}  # stacked GGUF name -> {expert: HF [out, in] matrix}
    for name, w in load_file(hf_dir / "model.safetensors").items():
        w = w.astype(np.float32)
        if arch.startswith("gemma") and name.endswith("norm.weight"):  # llama.cpp stores Gemma's gains as 1 + w
            w = w + 1.0
        if name in hf_to_gguf:
            writer.add_tensor(hf_to_gguf[name], w)
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        if arch in ("gemma2", "gemma3") and rest in GEMMA2_NORMS:
            writer.add_tensor(f"blk.{layer}.{GEMMA2_NORMS[rest]}", w)
            continue
        if expert := _gguf_expert_name(rest):
            kind, index = expert
            if split_experts:
                writer.add_tensor(f"blk.{layer}.ffn_{kind}.{index}.weight", w)
            else:
                experts.setdefault(f"blk.{layer}.ffn_{kind}_exps.weight", {})[index] = w
            continue
        if rest.endswith(".gate.weight"):  # the router
            writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", w)
            continue
        if rest in QWEN2MOE_SHARED_EXPERT:  # llama.cpp keeps the shared expert's gate as a vector
            writer.add_tensor(f"blk.{layer}.{QWEN2MOE_SHARED_EXPERT[rest]}", w.reshape(-1) if "gate_inp" in
                              QWEN2MOE_SHARED_EXPERT[rest] else w)
            continue
        gguf_name = next(g for g, hf in layer_names(arch).items() if hf == rest)
        if arch in LLAMA_LINEAGE and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                              "self_attn.q_proj.bias", "self_attn.k_proj.bias"):  # biases too
            w = _interleave_rotary_halves(w, cfg["num_attention_heads" if "q_proj" in rest else "num_key_value_heads"])
        writer.add_tensor(f"blk.{layer}.{gguf_name}", w)
    for name, by_expert in experts.items():
        writer.add_tensor(name, np.stack([by_expert[e] for e in sorted(by_expert)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# Where each K-quant block keeps its float16 scales (the `gguf` package cannot quantize to these types).
K_QUANT_FLOAT16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def quantized_blocks(w: np.ndarray, kind) -> np.ndarray:
    """`w` [rows, cols] as GGUF blocks of `kind`: quantized by the `gguf` package where it can; for the K-quants,
    random blocks whose float16 scales are drawn small enough for weights of a random model's size (their values
    come out near w's scale, not w: both the reference and the kept path decode the same bytes)."""
    import gguf

    if kind.name not in K_QUANT_FLOAT16_FIELDS:
        return gguf.quants.quantize(w.astype(np.float32), kind)
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(w.size)
    blocks = rng.integers(0, 256, (w.size // block, block_bytes), dtype=np.uint8)
    for start in K_QUANT_FLOAT16_FIELDS[kind.name]:
        d = rng.uniform(1e-5, 4e-5, (len(blocks), 1)).astype(np.float16)
        blocks[:, start:start + 2] = d.view(np.uint8)
    return blocks.reshape(w.shape[:-1] + (-1,))


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(gguf_path: str, vocab_size: int) -> tuple:
    """(key, type, value) of a GGUF's tokenizer.* metadata, read once per file, its vocabulary cut to its first
    `vocab_size` ids as truncate_bpe_tokenizer cuts the saved tokenizer (tiny checkpoints' vocabulary)."""
    from jaxserve.loader.gguf_reader import GGUFReader

    fields = {key: (field.type, field.value) for key, field in GGUFReader(gguf_path).fields.items()
              if key.startswith("tokenizer.")}
    tokens = fields["tokenizer.ggml.tokens"][1][:vocab_size]
    kept = set(tokens)
    cut = {"tokenizer.ggml.tokens": tokens,
           "tokenizer.ggml.token_type": fields["tokenizer.ggml.token_type"][1][:vocab_size],
           "tokenizer.ggml.merges": [m for m in fields["tokenizer.ggml.merges"][1] if m.replace(" ", "") in kept]}
    return tuple((key, kind, cut.get(key, value)) for key, (kind, value) in fields.items())


def _interleave_rotary_halves(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Llama converter: each head's rows [first half; second half] -> pairs (h0[0], h1[0], ...)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# llama.cpp's converters that subclass its LlamaModel, which interleaves q/k rows (stated here, not imported from
# the reader, so a reader that forgets one fails).
LLAMA_LINEAGE = ("llama", "granite", "smollm3")

# Gemma 2/3's norms as llama.cpp's tensor map names them (written out here, not taken from the reader).
GEMMA2_NORMS = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}

# Qwen2-MoE's shared expert as llama.cpp's tensor map names it (written out here, not taken from the reader).
QWEN2MOE_SHARED_EXPERT = {"mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
                          "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
                          "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
                          "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}

# HF expert matrix names (Mixtral's w1/w3/w2, Qwen's) -> llama.cpp's ffn_{gate,up,down}.
_EXPERT_MATRICES = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def _gguf_expert_name(hf_rest: str) -> tuple[str, int] | None:
    """(llama.cpp's matrix kind, expert index) of a layer tensor like `mlp.experts.3.gate_proj.weight`."""
    m = re.fullmatch(r"\w+\.experts\.(\d+)\.(\w+)\.weight", hf_rest)
    return (_EXPERT_MATRICES[m.group(2)], int(m.group(1))) if m else None


def _gguf_model_metadata(cfg: dict) -> dict:
    """Experts' counts and width; Granite's multipliers under llama.cpp's *_scale names."""
    keys = {}
    if experts := cfg.get("num_local_experts") or cfg.get("num_experts"):
        keys |= {"expert_count": experts, "expert_used_count": cfg["num_experts_per_tok"]}
        if "moe_intermediate_size" in cfg:
            keys["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
        if cfg.get("shared_expert_intermediate_size"):
            keys["expert_shared_feed_forward_length"] = cfg["shared_expert_intermediate_size"]
    granite = {"attention_multiplier": "attention.scale", "embedding_multiplier": "embedding_scale",
               "residual_multiplier": "residual_scale", "logits_scaling": "logit_scale"}
    if cfg["model_type"] == "granite":
        keys |= {key: float(cfg[name]) for name, key in granite.items()}
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2
        if cfg.get(cap):
            keys[cap] = float(cfg[cap])
    return keys


def _gguf_rope_metadata(cfg: dict, rope: dict) -> dict:
    """RoPE scaling keys as llama.cpp's converter writes them: YaRN's parameters; LongRoPE's original length and
    logit scale (its factors go in tensors)."""
    kind = rope.get("rope_type") or rope.get("type")
    if kind == "linear":
        return {"rope.scaling.type": "linear", "rope.scaling.factor": float(rope["factor"])}
    if kind == "yarn":
        return {"rope.scaling.type": "yarn", "rope.scaling.factor": float(rope["factor"]),
                "rope.scaling.original_context_length": rope["original_max_position_embeddings"]}
    if kind == "longrope":
        original = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        return {"rope.scaling.original_context_length": original,
                "rope.scaling.attn_factor": float((1 + np.log(scale) / np.log(original)) ** 0.5)}
    return {}


def _gguf_rope_factors(cfg: dict, rope: dict, theta: float, rotary: int) -> dict[str, list[float]]:
    """RoPE scaling as llama.cpp's converter stores it: per-frequency divisors of the unscaled frequencies."""
    import math

    kind = rope.get("rope_type") or rope.get("type")
    if kind == "longrope":
        return {"rope_factors_long.weight": rope["long_factor"], "rope_factors_short.weight": rope["short_factor"]}
    if kind != "llama3":
        return {}
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    divisors = []
    for i in range(0, rotary, 2):
        wavelen = 2 * math.pi * theta ** (i / rotary)
        if wavelen < old_context / high:
            divisors.append(1.0)
        elif wavelen > old_context / low:
            divisors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": divisors}


ALL_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_lora_adapter(base_dir: Path, out: Path, seed: int, r: int = 4, targets=tuple(ALL_LORA_TARGETS), **config):
    """A PEFT LoRA adapter for the checkpoint at base_dir, with random factors large enough to move the logits
    (PEFT starts B at zero); returns the PEFT model, the reference."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=r, target_modules=list(targets), init_lora_weights=False, **config))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_" in name:
                weight.mul_(3.0)
    model.save_pretrained(out)
    return model.eval()


def write_compressed_tensors(hf_dir: Path, out: Path, bits: int = 4, group_size: int | None = 32,
                             symmetric: bool = True, actorder: bool = False) -> Path:
    """The tiny HF checkpoint `hf_dir` as llm-compressor saves a pack-quantized one (compressed-tensors' published
    format, reproduced here: llm-compressor pins an older transformers): every decoder Linear's weight quantized
    to `bits` (min-max, by groups of `group_size` input columns or, None, per output channel; symmetric, or
    asymmetric with zero points), stored as `weight_packed` int32 (32 / bits values each, the first in the lowest
    bits, offset by 2^(bits-1)), `weight_scale`, `weight_zero_point` (packed along the output axis) and
    `weight_shape`; embeddings, norms and the LM head stay float (llm-compressor's `ignore: [lm_head]`).
    `actorder`: GPTQ's activation order, each group a shuffled set of columns (`weight_g_idx`)."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(hf_dir, out)
    tensors = load_file(hf_dir / "model.safetensors")
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    saved = {}
    for name, w in tensors.items():
        if not (name.startswith("model.layers.") and name.endswith("proj.weight")):
            saved[name] = w
            continue
        rows, columns = w.shape
        g = group_size or columns
        order = np.random.default_rng(rows * columns).permutation(columns) if actorder else np.arange(columns)
        blocks = w.astype(np.float32)[:, order].reshape(rows, columns // g, g)  # group k: columns order[k*g:(k+1)*g]
        if symmetric:
            scale = np.abs(blocks).max(-1) / high
            zero = np.zeros_like(scale, dtype=np.int8)
        else:
            lo, hi = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)
            scale = (hi - lo) / (high - low)
            zero = np.clip(np.round(low - lo / scale), low, high).astype(np.int8)
        q = np.empty((rows, columns), np.int8)
        q[:, order] = np.clip(np.round(blocks / scale[..., None]) + zero[..., None], low, high).reshape(rows, -1)
        prefix = name[: -len("weight")]
        saved[prefix + "weight_packed"] = _pack_int32(q, bits, axis=1)
        if actorder:
            groups = np.empty(columns, np.int32)
            groups[order] = np.arange(columns) // g
            saved[prefix + "weight_g_idx"] = groups
        saved[prefix + "weight_scale"] = np.ascontiguousarray(scale.astype(np.float32))
        saved[prefix + "weight_shape"] = np.asarray([rows, columns], np.int32)
        if not symmetric:
            saved[prefix + "weight_zero_point"] = _pack_int32(zero, bits, axis=0)
    (out / "model.safetensors").unlink()
    save_file(saved, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group" if group_size else
               "channel", "group_size": group_size, "dynamic": False, "actorder": "group" if actorder else None, "observer": "minmax"}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": "pack-quantized"}},
        "ignore": ["lm_head"], "kv_cache_scheme": None}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _pack_int32(q: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Signed `bits`-wide values -> int32 words along `axis` (compressed-tensors' pack_to_int32)."""
    per_word = 32 // bits
    unsigned = (q.astype(np.int32) + (1 << (bits - 1))).astype(np.uint32)
    if axis == 0:
        return np.ascontiguousarray(_pack_int32(unsigned.T.astype(np.int32) - (1 << (bits - 1)), bits, 1).T)
    pad = -unsigned.shape[1] % per_word
    unsigned = np.pad(unsigned, [(0, 0), (0, pad)])
    packed = np.zeros((unsigned.shape[0], unsigned.shape[1] // per_word), np.uint32)
    for i in range(per_word):
        packed |= unsigned[:, i::per_word] << np.uint32(bits * i)
    return np.ascontiguousarray(packed).view(np.int32)


def write_fp8(hf_dir: Path, out: Path, layout: str, dynamic_activations: bool = False) -> Path:
    """The tiny HF checkpoint `hf_dir` with every decoder Linear's weight in float8 e4m3 and its scales, in the
    published layouts: `layout` "block" is `quant_method: fp8` (128x128 blocks, `weight_scale_inv`, as the
    Qwen3-FP8 and DeepSeek releases); "ct-tensor", "ct-channel" and "ct-block" are compressed-tensors'
    float-quantized format (`weight_scale` per tensor, per output channel, per 128x128 block, as llm-compressor
    writes FP8 and, with `dynamic_activations`, FP8-dynamic); "ct-int8-channel" its int-quantized format (int8
    weights per output channel, W8A8 with `dynamic_activations`). Dimensions must be multiples of 128 for blocks."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf_dir, out)
    saved = {}
    strategy = layout.removeprefix("ct-").removeprefix("int8-")
    integer = layout.startswith("ct-int8")
    top = 127 if integer else 448
    for name, w in load_file(hf_dir / "model.safetensors").items():
        if not (name.startswith("model.layers.") and name.endswith("proj.weight")):
            saved[name] = w
            continue
        w = w.float()
        rows, columns = w.shape
        if strategy == "block":
            blocks = w.reshape(rows // 128, 128, columns // 128, 128)
            scale = blocks.abs().amax(dim=(1, 3)) / 448
            q = (blocks / scale[:, None, :, None]).reshape(rows, columns)
        else:
            scale = w.abs().amax().reshape(1) / top if strategy == "tensor" else w.abs().amax(1, keepdim=True) / top
            q = w / scale
        saved[name] = q.round().clamp(-127, 127).to(torch.int8) if integer else q.to(torch.float8_e4m3fn)
        saved[name[: -len("weight")] + ("weight_scale_inv" if layout == "block" else "weight_scale")] = \
            scale.float().contiguous()
    (out / "model.safetensors").unlink()
    save_file(saved, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    if layout == "block":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    else:
        kind = "int" if integer else "float"
        weights = {"num_bits": 8, "type": kind, "strategy": strategy, "symmetric": True, "dynamic": False,
                   "block_structure": [128, 128] if strategy == "block" else None}
        activations = {"num_bits": 8, "type": kind, "strategy": "token", "symmetric": True, "dynamic": True} \
            if dynamic_activations else None
        compressed = "int-quantized" if integer else "float-quantized"
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": compressed, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations,
                                          "output_activations": None, "format": compressed}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def small_engine(path, mesh: str = "1x1", **options):
    """An engine on a tiny checkpoint, sized for a parity check (tests/models/test_parity.check_parity)."""
    from jaxserve import Engine

    return Engine(str(path), mesh=mesh, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4, warmup=False,
                  **options)


def kept_formats(caplog) -> dict[str, str]:
    """The storage runner/weights.py's load log line gives each weight kept in its checkpoint's groups
    ("weights kept in the checkpoint's quantized blocks (wq, wk: 4-bit in groups of 32 with offsets; ...)"):
    {"wq, wk": "4-bit in groups of 32 with offsets", ...}, weights of one storage listed together."""
    described = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights kept"))
    return dict(part.split(": ") for part in described.split("(", 1)[1].split(")", 1)[0].split("; "))
