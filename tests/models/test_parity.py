"""Logit parity with transformers (PyTorch CPU, float32, same weights) through the paged cache: several
sequences of different lengths in one batch, prefill then decode steps."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxserve import Engine, SamplingParams
from jaxserve.engine.steps import LogitsLog, StepLog
from tests.helpers import hf_logits, write_gguf

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}

# Qwen2.5 / Qwen3's long-context YaRN, for a model trained on 64 positions: with head_dim 16, frequency 0 keeps its
# speed, 1 and 2 are blends, 3..7 are divided by 4; cos and sin are scaled by 0.1 ln 4 + 1.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

# Phi-3.5 / Phi-4-mini's LongRoPE, for a model trained on 32 positions and extended to 512 (so cos and sin are
# scaled by sqrt(1 + ln 16 / ln 32) = 1.34); factors for the 4 frequencies of rotary width 8.
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.3, 2.0, 3.5], "long_factor": [1.5, 2.5, 6.0, 11.0]}
# RoPE on half of each head's 16 dims (Phi-4-mini turns 96 of 128), tied embeddings.
PHI4_MINI = dict(partial_rotary_factor=0.5, tie_word_embeddings=True, pad_token_id=0)

ARCHITECTURES = {
    "llama-untied-llama3-rope": ("llama", dict(rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    # biases on every projection (attention_bias and mlp_bias)
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "mistral-sliding-window": ("mistral", dict(sliding_window=12)),
    "qwen2-bias": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-yarn": ("qwen2", dict(tie_word_embeddings=True, rope_scaling=YARN, max_position_embeddings=256)),
    # q/k norms, and a head_dim that is not hidden_size / heads (32 vs 16), as in real Qwen3 checkpoints.
    "qwen3-qk-norm": ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),
    # embeddings x 3, residual branches x 0.5, attention scores x 0.2 (not 16 ** -0.5), logits / 2.5
    "granite-multipliers": ("granite", dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                                            attention_multiplier=0.2, logits_scaling=2.5, tie_word_embeddings=True,
                                            pad_token_id=0)),
    # no RoPE on every second layer (SmolLM3: every fourth)
    "smollm3-nope-layers": ("smollm3", dict(no_rope_layer_interval=2, tie_word_embeddings=True, pad_token_id=0)),
    # experts under Qwen's names, 32 wide, router weights not renormalised (norm_topk_prob false)
    "qwen3-moe": ("qwen3_moe", dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=False, tie_word_embeddings=False)),
    # routed experts (5, top-4, not renormalised) beside a shared expert behind its sigmoid gate; q/k/v biases
    "qwen2-moe-shared-expert": ("qwen2_moe", dict(num_experts=5, num_experts_per_tok=4, moe_intermediate_size=24,
                                                  shared_expert_intermediate_size=40, tie_word_embeddings=False)),
    # attention sinks and biases, sliding and full layers alternating, YaRN; a biased router (softmax over the top-k
    # logits), experts stacked per layer with gate and up interleaved, biased, and the clamped SwiGLU
    "gpt-oss": ("gpt_oss", dict(head_dim=16, num_local_experts=5, num_experts_per_tok=2, intermediate_size=24,
                                sliding_window=8, swiglu_limit=0.5)),
    # fused qkv_proj and gate_up_proj, split at load
    "phi3-fused-sliding-window": ("phi3", dict(sliding_window=12, tie_word_embeddings=False, pad_token_id=0)),
    "phi4-mini-partial-rotary": ("phi3", PHI4_MINI),
    # (1 + w) norm gains, GeGLU, the sqrt(hidden) embedding scale
    "gemma-geglu": ("gemma", dict(head_dim=16)),
    # + norms after attention and MLP, sliding and full layers alternating, soft caps small enough to bend
    # these scores and logits, a query scale that is not head_dim's; the exact GELU (Gemma 2 reads "gelu" as it
    # says, where Gemma 1 runs the tanh approximation)
    "gemma2-softcap-mixed-windows": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
                                                    attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
                                                    hidden_activation="gelu")),
    # + q/k norms, and the sliding layers' own RoPE base (the full layers' scaled linearly)
    "gemma3-local-rope": ("gemma3_text", dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=12,
                                              sliding_window_pattern=2, rope_parameters=GEMMA3_ROPE)),
    # every layer slides: one attention kind, still rotated with the sliding layers' base
    "gemma3-all-sliding": ("gemma3_text", dict(head_dim=32, sliding_window=12, rope_parameters=GEMMA3_ROPE,
                                               num_hidden_layers=2, layer_types=["sliding_attention"] * 2)),
}

PROMPTS = [
    list(range(100, 103)),  # shorter than a block
    list(range(200, 216)),  # exactly one block
    list(range(300, 341)),  # several blocks, a partial last one, longer than the sliding window
]


def check_parity(engine: Engine, reference, prompts, max_tokens: int = 9, tol: float = 1e-4) -> list[float]:
    """The engine's logits at every greedy step within `tol` of transformers' on the same tokens; -> each step's
    largest difference."""
    logits = LogitsLog()
    engine.observers.append(logits)
    try:
        outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                               use_tqdm=False)
    finally:
        engine.observers.remove(logits)
    log = logits.rows
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    # One logged row per sampled token: the prefill of each prompt and max_tokens - 1 decode steps.
    assert len(log) == len(prompts) * max_tokens
    # transformers' logits at every position of each finished sequence, one forward pass each (causal: a position's
    # logits see only the tokens before it, so a row's reference is its prefix's last position in the whole).
    finals = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    references = [hf_logits(reference, f) for f in finals]
    differences = []
    for tokens_so_far, logits in log:
        which = next(i for i, f in enumerate(finals) if f[: len(tokens_so_far)] == tokens_so_far)
        ref = references[which][len(tokens_so_far) - 1]
        differences.append(float(np.abs(ref - logits).max()))
    assert max(differences) <= tol, f"max abs logit difference {max(differences)}"
    return differences


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_tiny_model_logits_match_transformers(name, tiny_checkpoint):
    arch, overrides = ARCHITECTURES[name]
    path = tiny_checkpoint(arch, **overrides)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    engine = Engine(str(path), num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4, warmup=False)
    check_parity(engine, reference, PROMPTS)


@pytest.mark.parametrize("max_model_len, prompts", [
    (32, PROMPTS[:2]),  # within the original 32 positions: the short factors, as transformers uses there
    (None, [PROMPTS[2], list(range(400, 433))]),  # 512: the long factors, as transformers uses past 32 tokens
])
def test_longrope_runs_the_factor_set_max_model_len_chooses(max_model_len, prompts, tiny_checkpoint):
    path = tiny_checkpoint("phi3", **PHI4_MINI, rope_scaling=LONGROPE, original_max_position_embeddings=32)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    engine = Engine(str(path), max_model_len=max_model_len, num_kv_blocks=64, max_num_batched_tokens=64,
                    max_num_seqs=4, warmup=False)
    check_parity(engine, reference, prompts)


def test_chunked_prefill_keeps_parity(tiny_checkpoint):
    """A prompt longer than the token budget is prefilled over several steps, mixed with decodes."""
    path = tiny_checkpoint("llama", tie_word_embeddings=False)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = Engine(str(path), num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4, warmup=False)
    steps = StepLog()
    engine.observers.append(steps)
    check_parity(engine, reference, PROMPTS)
    chunked = [r for r in steps.records if any(n > 1 and start > 0 for _, start, n in r.chunks)]
    assert chunked, "expected at least one prefill chunk that started mid-prompt"


def test_smollm2_gguf_logits_match_transformers(smol_engine, hf_smollm2):
    prompts = [smol_engine.tokenizer(p)["input_ids"] for p in ("Hello, my name is", "def fibonacci(n):")]
    check_parity(smol_engine, hf_smollm2, prompts, max_tokens=8, tol=2e-4)


MIXTRAL = ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False))
# llama.cpp's SmolLM3 has no key for its NoPE layers: every 4th, as in SmolLM3-3B.
SMOLLM3_GGUF = ("smollm3", dict(num_hidden_layers=4, tie_word_embeddings=True, pad_token_id=0))

# Gemma 2/3 as llama.cpp runs them: the query scale head_dim's (llama.cpp knows another only for the 27B models),
# Gemma 3's layers five sliding then one full, its local RoPE base 10000.
GEMMA2_GGUF = ("gemma2", dict(head_dim=16, sliding_window=12, attn_logit_softcapping=1.0,
                              final_logit_softcapping=2.0, query_pre_attn_scalar=16))
GEMMA3_GGUF = ("gemma3_text", dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=12, num_hidden_layers=6,
                                   rope_parameters=GEMMA3_ROPE))

# name -> (llama.cpp architecture, HF checkpoint (model_type, overrides), write_gguf options, head_dim)
GGUF_CASES = {
    "qwen2-bias": ("qwen2", ARCHITECTURES["qwen2-bias"], {}, 16),
    "qwen3-qk-norm": ("qwen3", ARCHITECTURES["qwen3-qk-norm"], {}, 32),
    "phi3-fused-sliding-window": ("phi3", ARCHITECTURES["phi3-fused-sliding-window"], {}, 16),
    "phi4-mini-partial-rotary": ("phi3", ARCHITECTURES["phi4-mini-partial-rotary"], {}, 16),
    "llama-untied-llama3-rope": ("llama", ARCHITECTURES["llama-untied-llama3-rope"], {}, 16),
    "llama-biases": ("llama", ARCHITECTURES["llama-biases"], {}, 16),  # the optional biases llama.cpp reads
    "qwen2-yarn": ("qwen2", ARCHITECTURES["qwen2-yarn"], {}, 16),
    "mixtral-stacked-experts": ("llama", MIXTRAL, {}, 16),
    "mixtral-one-tensor-per-expert": ("llama", MIXTRAL, {"split_experts": True}, 16),
    # norm_topk_prob false, which llama.cpp's expert_weights_norm says (absent, it renormalises, as for Mixtral)
    "qwen3-moe": ("qwen3moe", ARCHITECTURES["qwen3-moe"], {"expert_weights_norm": False}, 32),
    # the shared expert's tensors and length key; no expert_weights_norm key, and llama.cpp never renormalises
    # Qwen2-MoE's
    "qwen2-moe-shared-expert": ("qwen2moe", ARCHITECTURES["qwen2-moe-shared-expert"], {}, 16),
    "granite-multipliers": ("granite", ARCHITECTURES["granite-multipliers"], {}, 16),
    "smollm3-every-4th-layer-nope": ("smollm3", SMOLLM3_GGUF, {}, 16),
    "gemma-geglu": ("gemma", ARCHITECTURES["gemma-geglu"], {}, 16),
    "gemma2-softcap-mixed-windows": ("gemma2", GEMMA2_GGUF, {}, 16),
    "gemma3-local-rope": ("gemma3", GEMMA3_GGUF, {}, 32),
    # keys older converters did not write, which llama.cpp defaults: a multi-head Llama's head_count_kv (the head
    # count), Gemma 2's soft caps (50, 30) and window (4096), as transformers' Gemma2Config defaults them
    "llama-mha-without-head-count-kv": ("llama", ("llama", dict(num_key_value_heads=4)),
                                        {"attention.head_count_kv": None}, 16),
    "gemma2-default-softcaps": ("gemma2", ("gemma2", dict(head_dim=16, query_pre_attn_scalar=16)),
                                {"attn_logit_softcapping": None, "final_logit_softcapping": None,
                                 "attention.sliding_window": None}, 16),
}


@pytest.mark.parametrize("name", list(GGUF_CASES))
def test_gguf_logits_match_transformers(name, tiny_checkpoint, gguf_tokenizer_source, tmp_path):
    """GGUFs (llama.cpp's tensor names and metadata: q/k/v biases, attn_q_norm, the head size as
    attention.key_length, Phi-3's fused attn_qkv and ffn_up, its sliding window and rotary width, the Llama
    lineage's interleaved q/k rows, Llama's RoPE scaling as per-frequency factors, YaRN's metadata, experts stacked
    or one tensor each, Qwen3-MoE's expert width, Granite's *_scale keys, SmolLM3's implied NoPE layers) read as
    the same model as their safetensors."""
    gguf_arch, (arch, overrides), options, head_dim = GGUF_CASES[name]
    path = tiny_checkpoint(arch, **overrides)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    gguf_file = write_gguf(path, tmp_path / f"tiny-{arch}.gguf", gguf_arch, gguf_tokenizer_source, **options)
    engine = Engine(str(gguf_file), num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4, warmup=False)
    assert engine.config.model.architecture == reference.config.architectures[0]
    assert engine.config.model.head_dim == head_dim
    check_parity(engine, reference, PROMPTS)


def test_longrope_gguf_matches_transformers(tiny_checkpoint, gguf_tokenizer_source, tmp_path):
    """Phi-3.5's LongRoPE as llama.cpp stores it (rope_factors_long/short, the original length, the logit scale)."""
    path = tiny_checkpoint("phi3", **PHI4_MINI, rope_scaling=LONGROPE, original_max_position_embeddings=32)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    gguf_file = write_gguf(path, tmp_path / "tiny-longrope.gguf", "phi3", gguf_tokenizer_source)
    engine = Engine(str(gguf_file), num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4, warmup=False)
    check_parity(engine, reference, [PROMPTS[2]])
