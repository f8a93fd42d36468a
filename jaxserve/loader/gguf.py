"""GGUF files (llama.cpp's format): metadata -> ModelConfig, tensors dequantized with the `gguf` package and
presented under Hugging Face names and layouts."""

from __future__ import annotations

import logging
import re
from functools import partial
from pathlib import Path

import gguf
import numpy as np

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.loader.gguf_blocks import KEPT_TYPES, decode_blocks
from jaxserve.loader.gguf_reader import GGUFReader, GGUFTensor, UnknownTensorType, UnreadableGGUF
from jaxserve.loader.grouped import GroupedArray
from jaxserve.loader.hf_config import attention_layout, rope_layer_flags
from jaxserve.loader.rope_scaling import longrope_attention_factor, yarn_scaling
from jaxserve.loader.weights import MOE_NAMES
from jaxserve.models.layers import Grouped

log = logging.getLogger(__name__)

# GGUF `general.architecture` -> HF architecture name. llama.cpp converts Mixtral to "llama" (with experts).
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM",
                      "smollm3": "SmolLM3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                      "gemma3": "Gemma3ForCausalLM"}
# llama.cpp's converter interleaves the rotary halves of each q/k head for the Llama lineage.
INTERLEAVED_QK_ARCHS = ("llama", "granite", "smollm3")
QK_ROWS = ("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")
# llama.cpp hard-codes SmolLM3's NoPE layers as every 4th (its converter writes no key for them).
SMOLLM3_NOPE_INTERVAL = 4
GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
# What llama.cpp (and transformers' Gemma2Config) take for Gemma 2 keys early converters did not write
GEMMA2_DEFAULTS = {"attn": 50.0, "final": 30.0, "sliding_window": 4096}
# llama.cpp hard-codes Gemma 3's sliding layers' RoPE base, and gives Gemma 2/3 27B (known by its layer count) a
# query scale of (hidden / heads) ** -0.5 instead of head_dim's, as their query_pre_attn_scalar says.
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3's fused q/k/v (split by loader/fused.py)
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # Optional biases llama.cpp reads for Llama-family files (a checkpoint with attention_bias or mlp_bias)
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}


# Names whose meaning depends on the architecture: Phi-3's ffn_up holds gate and up together; Gemma 2/3 norm the
# attention's output (post_attention_norm) and the MLP's input and output (ffn_norm, post_ffw_norm).
_GEMMA2_NORMS = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                 "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                 "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# Qwen2-MoE's shared expert and its gate (`_shexp`).
_SHARED_EXPERT = {"ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                  "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                  "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
                  "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"}
ARCH_LAYER_NAMES = {"phi3": {"ffn_up.weight": "mlp.gate_up_proj.weight"}, "gemma2": _GEMMA2_NORMS,
                    "gemma3": _GEMMA2_NORMS, "qwen2moe": _SHARED_EXPERT}


def layer_names(arch: str) -> dict[str, str]:
    """GGUF layer tensor suffix -> HF suffix, for this architecture."""
    return _LAYER_NAMES | ARCH_LAYER_NAMES.get(arch, {})


# A layer's experts: stacked in one [experts, out, in] tensor (`ffn_gate_exps`), or, in Mixtral files converted
# before llama.cpp stacked them, one tensor per expert (`ffn_gate.3`).
_EXPERT_TENSOR = re.compile(r"ffn_(gate|up|down)(_exps|\.\d+)\.weight")
_EXPERT_KINDS = {"gate": "w_gate", "up": "w_up", "down": "w_down"}


def _hf_tensor_names(t: GGUFTensor, arch: str, architecture: str) -> list[tuple[str, int | None]]:
    """The HF names GGUF tensor `t` holds, each with its index on t's expert axis (None: all of `t`)."""
    if t.name in _GLOBAL_NAMES:
        return [(_GLOBAL_NAMES[t.name], None)]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
    if m is None:
        return []
    layer, rest = m.groups()
    if architecture in MOE_NAMES:
        block, expert_names = MOE_NAMES[architecture]
        prefix = f"model.layers.{layer}.{block}"
        if rest == "ffn_gate_inp.weight":
            return [(f"{prefix}.gate.weight", None)]
        if e := _EXPERT_TENSOR.fullmatch(rest):
            name = expert_names[_EXPERT_KINDS[e.group(1)]]
            if e.group(2) == "_exps":
                return [(f"{prefix}.experts.{i}.{name}.weight", i) for i in range(int(t.shape[-1]))]
            return [(f"{prefix}.experts.{e.group(2)[1:]}.{name}.weight", None)]
    names = layer_names(arch)
    return [(f"model.layers.{layer}.{names[rest]}", None)] if rest in names else []


def _unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the two rotary halves of each q/k head; undo it for the HF layout."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Special tokens of a GGUF tokenizer and the metadata keys (under tokenizer.ggml.) holding their ids.
# Tokens that end an assistant's turn in the chat templates of the families served (llama.cpp stops at them too).
END_OF_TURN_TOKENS = {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>"}
SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                     "pad_token": "padding_token_id"}


class GGUFFile:
    method = "gguf"  # how its quantized weights are kept (loader/weights.keep_blocks)

    def __init__(self, path: Path):
        if not path.exists():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        try:
            self.reader = GGUFReader(path)
        except (UnknownTensorType, UnreadableGGUF) as e:
            raise ValueError(f"{path}: {e}") from None
        except (ValueError, OSError) as e:
            raise ValueError(f"{path} is not a readable GGUF file ({e}); it may be truncated: re-download it") from None
        self.path = path
        splits = self.field("split.count")
        if splits is not None and int(splits) > 1:
            raise ValueError(f"{path.name} is one of {int(splits)} parts of a split GGUF: merge them into one file "
                             "(llama.cpp's `llama-gguf-split --merge FIRST-PART OUT.gguf`) and serve that")
        self.arch = self.field("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF architecture {self.arch!r} in {path.name} is not supported; supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)}")
        self.architecture = GGUF_ARCHITECTURES[self.arch]
        if self.arch == "llama" and self.field("llama.expert_count"):
            self.architecture = "MixtralForCausalLM"
        self._tensors: dict[str, tuple[GGUFTensor, int | None]] = {}
        self._rope_factors = {}  # llama.cpp's per-frequency RoPE factors: rope_freqs, rope_factors_{long,short}
        for t in self.reader.tensors:
            if t.name.startswith(("rope_freqs.", "rope_factors_")):
                self._rope_factors[t.name.split(".")[0]] = tuple(float(x) for x in np.asarray(t.data).reshape(-1))
            for name, expert in _hf_tensor_names(t, self.arch, self.architecture):
                self._tensors[name] = (t, expert)

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.value

    def tokenizer(self):
        """The tokenizer (and chat template) this file describes.

        Built with transformers' own GGUF tokenizer mapping, but from metadata read by the `gguf` package:
        `AutoTokenizer.from_pretrained(gguf_file=...)` goes through transformers' GGUF reader, which imports
        torch, and serving needs no torch.
        """
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

        groups = {group: {name: self.field(f"tokenizer.{key}") for key, name in renames.items()
                          if f"tokenizer.{key}" in self.reader.fields}
                  for group, renames in GGUF_TOKENIZER_MAPPING.items()}
        tokenizer, config = groups["tokenizer"], groups["tokenizer_config"]
        if tokenizer.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary by default
            config.setdefault("add_bos_token", True)
        for name, key in SPECIAL_TOKEN_IDS.items():
            token_id = self.field(f"tokenizer.ggml.{key}")
            known = token_id is not None and 0 <= int(token_id) < len(tokenizer["tokens"])
            if token_id is not None and not known:  # llama.cpp warns and goes on without it
                log.warning("%s: tokenizer.ggml.%s=%s is past the %d tokens of the vocabulary; ignored",
                            self.path, key, token_id, len(tokenizer["tokens"]))
            config[name] = tokenizer["tokens"][token_id] if known else None
        backend, extra = convert_gguf_tokenizer(self.arch, tokenizer)
        return PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path=str(self.path), **config, **extra)

    def model_config(self) -> ModelConfig:
        a = self.arch
        heads = int(self.field(f"{a}.attention.head_count"))
        hidden = int(self.field(f"{a}.embedding_length"))
        rotary = self.field(f"{a}.rope.dimension_count")
        # Qwen3 says its head size (128, not hidden / heads) as the key length; Llama as the rotary width, which
        # for Phi-3 may be part of the head (Phi-4-mini turns 96 of 128).
        head_dim = int(self.field(f"{a}.attention.key_length") or (None if a == "phi3" else rotary) or hidden // heads)
        if rotary is not None and int(rotary) != head_dim and a != "phi3":
            raise ValueError(f"{self.path.name} rotates {rotary} of each head's {head_dim} dimensions (partial rotary "
                             f"embedding), which jaxserve supports for phi3 only")
        theta = float(self.field(f"{a}.rope.freq_base", 10000.0))
        embed, _ = self._tensors["model.embed_tokens.weight"]
        layers = int(self.field(f"{a}.block_count"))
        fields = dict(
            architecture=self.architecture,
            vocab_size=int(self.field(f"{a}.vocab_size", embed.shape[-1])),
            hidden_size=hidden,
            intermediate_size=int(self.field(f"{a}.feed_forward_length")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(self.field(f"{a}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=theta,
            rope_scaling=self._rope_scaling(int(rotary or head_dim), theta),
            rotary_dim=None if rotary is None or int(rotary) == head_dim else int(rotary),
            max_position_embeddings=int(self.field(f"{a}.context_length", 2048)),
            tie_word_embeddings="lm_head.weight" not in self._tensors,
            qkv_bias=a in ("qwen2", "qwen2moe") or self._has_layer_tensor("self_attn.q_proj.bias"),
            o_bias=self._has_layer_tensor("self_attn.o_proj.bias"),
            mlp_bias=self._has_layer_tensor("mlp.gate_proj.bias"),
            qk_norm=a in ("qwen3", "qwen3moe"),
            sliding_window=int(self.field(f"{a}.attention.sliding_window", GEMMA2_DEFAULTS["sliding_window"]
                                          if a == "gemma2" else 0)) or None,
            rope_layers=rope_layer_flags(layers, SMOLLM3_NOPE_INTERVAL) if a == "smollm3" else (),
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_ids=self._end_token_ids(),
        )
        return ModelConfig(**(fields | self._experts() | self._granite() | self._gemma(fields)))

    def _has_layer_tensor(self, name: str) -> bool:
        return f"model.layers.0.{name}" in self._tensors

    def _end_token_ids(self) -> tuple[int, ...]:
        """The ids generation stops at: EOS, and, as llama.cpp stops, the end of a turn where the file names it
        (eot/eom ids) or its vocabulary has a known end-of-turn token: a Gemma or Phi-3 chat's EOS is not the token
        that ends the assistant's turn, and generation would run on into made-up turns."""
        eos = self.field("tokenizer.ggml.eos_token_id")
        tokens = self.field("tokenizer.ggml.tokens") or []
        turn_ends = [self.field(f"tokenizer.ggml.{kind}_token_id") for kind in ("eot", "eom")]
        turn_ends += [i for i, text in enumerate(tokens) if text in END_OF_TURN_TOKENS]
        turn_ends = [int(i) for i in turn_ends if i is not None and 0 <= int(i) < len(tokens)]  # a bad id stops nothing
        return tuple(dict.fromkeys(([] if eos is None else [int(eos)]) + turn_ends))

    def _experts(self) -> dict:
        """Mixtral's, Qwen2-MoE's and Qwen3-MoE's experts; intermediate_size becomes each expert's MLP width."""
        a = self.arch
        experts = int(self.field(f"{a}.expert_count", 0))
        if not experts:
            return {}
        width = self.field(f"{a}.expert_feed_forward_length") or self.field(f"{a}.feed_forward_length")
        # llama.cpp renormalises the top-k router weights unless the file says otherwise, but never Qwen2-MoE's.
        renormalize = self.field(f"{a}.expert_weights_norm", a != "qwen2moe")
        return dict(num_experts=experts, num_experts_per_tok=int(self.field(f"{a}.expert_used_count")),
                    intermediate_size=int(width), moe_renormalize=bool(renormalize),
                    shared_expert_size=int(self.field(f"{a}.expert_shared_feed_forward_length", 0)))

    def _granite(self) -> dict:
        """Granite's multipliers, which llama.cpp's converter writes as *_scale keys (each only when set)."""
        if self.arch != "granite":
            return {}
        attention = self.field("granite.attention.scale")  # absent: head_dim ** -0.5, as llama.cpp does
        return dict(embedding_multiplier=float(self.field("granite.embedding_scale", 1.0)),
                    residual_multiplier=float(self.field("granite.residual_scale", 1.0)),
                    logits_scaling=float(self.field("granite.logit_scale", 1.0)),
                    attention_scale=None if attention is None else float(attention))

    def _gemma(self, fields: dict) -> dict:
        """Gemma's departures from Llama as llama.cpp's Gemma architectures state or imply them."""
        a = self.arch
        if a not in GEMMA_ARCHS:
            return {}
        layers, hidden, heads = fields["num_layers"], fields["hidden_size"], fields["num_heads"]
        hf_window = {"sliding_window": fields["sliding_window"], "num_hidden_layers": layers}
        window, layer_types = attention_layout(self.architecture, hf_window)  # transformers' layer pattern
        softcaps = [float(self.field(f"{a}.{k}_logit_softcapping", GEMMA2_DEFAULTS[k] if a == "gemma2" else 0.0))
                    or None for k in ("attn", "final")]
        return dict(hidden_act="gelu_tanh", norm_weight_offset=1.0, post_norms=a != "gemma", qk_norm=a == "gemma3",
                    sliding_window=window, layer_types=layer_types, attn_logit_softcap=softcaps[0],
                    final_logit_softcap=softcaps[1],
                    rope_local_theta=GEMMA3_LOCAL_ROPE_THETA if a == "gemma3" else None,
                    attention_scale=(hidden // heads) ** -0.5 if GEMMA_27B_LAYERS.get(a) == layers else None)

    def _rope_scaling(self, width: int, theta: float) -> RopeScaling | None:
        """llama.cpp stores Llama 3.1's scaling as per-frequency factors (rope_freqs), Phi-3.5's LongRoPE as two
        sets (rope_factors_long/short) beside its original length and logit scale, linear scaling and YaRN as
        metadata."""
        a, factors = self.arch, self._rope_factors
        if "rope_factors_long" in factors:
            original = int(self.field(f"{a}.rope.scaling.original_context_length"))
            longest = int(self.field(f"{a}.context_length"))
            factor = longest / original
            default_scale = longrope_attention_factor(factor, original)
            return RopeScaling(factor=factor, original_max_position_embeddings=original, rope_type="longrope",
                               long_factor=factors["rope_factors_long"],
                               short_factor=factors.get("rope_factors_short", factors["rope_factors_long"]),
                               attention_factor=float(self.field(f"{a}.rope.scaling.attn_factor", default_scale)))
        if "rope_freqs" in factors:
            return RopeScaling(rope_type="frequency_factors", frequency_factors=factors["rope_freqs"])
        kind = self.field(f"{a}.rope.scaling.type", "none")
        if kind == "linear":
            return RopeScaling(factor=float(self.field(f"{a}.rope.scaling.factor")), rope_type="linear")
        if kind == "yarn":
            return self._yarn(width, theta)
        if kind != "none":
            raise ValueError(f"{self.path.name} uses RoPE scaling {kind!r}, which is not supported; supported: none, "
                             f"linear, yarn, per-frequency factors (Llama 3.1's rope_freqs, Phi-3's rope_factors)")
        return None

    def _yarn(self, width: int, theta: float) -> RopeScaling:
        """YaRN as llama.cpp's converter writes it for Qwen and Llama checkpoints: factor and original length."""
        a = self.arch
        extra = [k for k in ("attn_factor", "yarn_log_multiplier", "yarn_ext_factor", "yarn_attn_factor")
                 if f"{a}.rope.scaling.{k}" in self.reader.fields]
        if extra:
            raise ValueError(f"{self.path.name}: YaRN with rope.scaling.{extra[0]} is not supported (only the factor, "
                             f"original length and beta_fast/beta_slow that converted Qwen and Llama checkpoints carry)")
        return yarn_scaling(width, theta, float(self.field(f"{a}.rope.scaling.factor")),
                            int(self.field(f"{a}.rope.scaling.original_context_length")),
                            beta_fast=float(self.field(f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
                            beta_slow=float(self.field(f"{a}.rope.scaling.yarn_beta_slow", 1.0)))

    # TensorSource
    def names(self) -> set[str]:
        return set(self._tensors)

    def get(self, name: str) -> np.ndarray:
        t, data = self._data(name)
        w = np.asarray(gguf.quants.dequantize(data, t.tensor_type), dtype=np.float32)
        if self.arch in GEMMA_ARCHS and name.endswith("norm.weight"):  # llama.cpp stores Gemma's 1 + w
            w = w - 1.0
        return self._hf_rows(name, w)

    # Kept in blocks (loader/grouped.py)
    def block_format(self, name: str) -> Grouped | None:
        """How the tensor `name` is kept in its blocks, or None for a float tensor or a type dequantized at load."""
        return KEPT_TYPES.get(self._data(name)[0].tensor_type)

    def get_grouped(self, name: str) -> GroupedArray:
        t, data = self._data(name)
        return self._hf_rows(name, decode_blocks(data, t.tensor_type))

    def _data(self, name: str) -> tuple[GGUFTensor, np.ndarray]:
        if name not in self._tensors:
            raise ValueError(f"tensor {name!r} is missing from {self.path.name}")
        t, expert = self._tensors[name]
        return t, (t.data if expert is None else t.data[expert])  # blocks run along rows: one expert slices

    def _hf_rows(self, name: str, w):
        """The rows of a float or grouped tensor in HF's order (llama.cpp interleaves each q/k head's rotary
        halves for the Llama lineage)."""
        if self.arch in INTERLEAVED_QK_ARCHS and name.endswith(QK_ROWS):  # the biases too: llama.cpp's converter
            heads = int(self.field(f"{self.arch}.attention.head_count"))  # permutes both
            if "k_proj" in name:  # optional: older multi-head Llamas' files leave it out (llama.cpp: head_count)
                heads = int(self.field(f"{self.arch}.attention.head_count_kv", heads))
            unpermute = partial(_unpermute_rotary, n_heads=heads)
            return w.map_rows(unpermute) if isinstance(w, GroupedArray) else unpermute(w)
        return w
