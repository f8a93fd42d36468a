"""Hugging Face `config.json` (and `generation_config.json`) -> ModelConfig."""

from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.loader.rope_scaling import longrope_attention_factor, yarn_mscale, yarn_scaling
from jaxserve.models.registry import model_class


def _scaling(arch: str, scaling: dict[str, Any] | None, d: dict[str, Any], width: int, theta: float
             ) -> RopeScaling | None:
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling(factor=float(scaling["factor"]), rope_type="linear")
    if kind == "su" or (kind == "yarn" and arch.startswith("Phi3")):  # transformers reads both as longrope there
        kind = "longrope"
    if kind == "longrope":
        return _longrope(arch, scaling, d, width)
    if kind == "yarn":
        return _yarn(scaling, d, width, theta)
    if kind != "llama3":
        raise ValueError(f"{arch}: rope_scaling type {kind!r} is not supported; supported: default, linear, llama3, "
                         f"longrope, yarn")
    return RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


def _extension(scaling: dict[str, Any], d: dict[str, Any]) -> tuple[int, float]:
    """(original context length, extension factor) of LongRoPE or YaRN, with transformers' defaults: a top-level
    original_max_position_embeddings first (Phi-3 keeps it there), the factor from the two lengths."""
    longest = int(d.get("max_position_embeddings", 2048))
    original = int(d.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                   or longest)
    return original, float(scaling.get("factor") or longest / original)


def _longrope(arch: str, scaling: dict[str, Any], d: dict[str, Any], width: int) -> RopeScaling:
    """Phi-3.5 / Phi-4-mini's LongRoPE, with transformers' defaults: the extension factor from the two lengths,
    and the logit scale from the extension factor."""
    original, factor = _extension(scaling, d)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = longrope_attention_factor(factor, original)
    for name in ("short_factor", "long_factor"):
        if len(scaling[name]) != width // 2:
            raise ValueError(f"{arch}: rope_scaling {name} has {len(scaling[name])} entries; RoPE turns {width} dims "
                             f"per head, so it needs {width // 2}")
    return RopeScaling(factor=factor, original_max_position_embeddings=original, rope_type="longrope",
                       short_factor=tuple(map(float, scaling["short_factor"])),
                       long_factor=tuple(map(float, scaling["long_factor"])), attention_factor=float(attention))


def _yarn(scaling: dict[str, Any], d: dict[str, Any], width: int, theta: float) -> RopeScaling:
    original, factor = _extension(scaling, d)
    attention = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None and mscale and mscale_all_dim:  # DeepSeek's spelling of the logit scale
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    ramp = {k: v for k, v in (("beta_fast", scaling.get("beta_fast")), ("beta_slow", scaling.get("beta_slow")),
                              ("truncate", scaling.get("truncate"))) if v is not None}
    return yarn_scaling(width, theta, factor, original, attention, **ramp)


def _rope(arch: str, d: dict[str, Any], width: int) -> tuple[float, RopeScaling | None, float | None]:
    """(theta, scaling) of the (full-attention) layers, and the sliding layers' own theta where they differ."""
    # transformers 5 writes `rope_parameters`, per layer kind for Gemma 3; older checkpoints `rope_theta` +
    # `rope_scaling` (+ Gemma 3's `rope_local_base_freq`).
    params = d.get("rope_parameters") or {}
    local = None
    if "full_attention" in params:
        sliding = params.get("sliding_attention") or {}
        if (sliding.get("rope_type") or sliding.get("type") or "default") != "default":
            raise ValueError(f"{arch}: scaled RoPE on sliding-window layers is not supported")
        local, params = sliding.get("rope_theta"), params["full_attention"]
    # A top-level rope_theta first: it is what hf_overrides={"rope_theta": ...} writes over a transformers 5 config.
    theta = float(d.get("rope_theta") or params.get("rope_theta") or DEFAULT_ROPE_THETA.get(arch, 10000.0))
    local = local or d.get("rope_local_base_freq") or (GEMMA3_LOCAL_ROPE_THETA if arch.startswith("Gemma3") else None)
    scaling = _scaling(arch, d.get("rope_scaling") or params, d, width, theta)
    return theta, scaling, None if local is None else float(local)


# transformers' RoPE base where a config gives none (its config classes' default_theta); 10000 for the others.
DEFAULT_ROPE_THETA = {"MixtralForCausalLM": 1e6, "SmolLM3ForCausalLM": 2e6, "Gemma3ForCausalLM": 1e6,
                      "GptOssForCausalLM": 150000.0}
GEMMA3_LOCAL_ROPE_THETA = 10000.0  # Gemma 3's sliding layers' base when the config names none


def _context_length(d: dict[str, Any]) -> int:
    """The longest context: max_position_embeddings, or what YaRN extends the original length to, as vLLM derives
    it (Qwen3's recipe for 128K adds the rope_scaling alone: factor 4 over 32768)."""
    longest = int(d.get("max_position_embeddings", 2048))
    scaling = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if (scaling.get("rope_type") or scaling.get("type")) != "yarn" or not scaling.get("factor"):
        return longest
    original = d.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")  # _yarn's
    return max(longest, int(int(original) * float(scaling["factor"]))) if original else longest


MLP_BIAS_ARCHITECTURES = ("LlamaForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM")

# transformers' default for Qwen2/Qwen3 configs that leave max_window_layers out.
QWEN_MAX_WINDOW_LAYERS = 28
# transformers' default for Gemma 3 configs that list neither layer_types nor sliding_window_pattern.
GEMMA3_SLIDING_PATTERN = 6


def _eos_ids(*sources: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for src in sources:
        eos = src.get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return tuple(ids)


def attention_layout(arch: str, d: dict[str, Any]) -> tuple[int | None, tuple[str, ...]]:
    """(window, layer_types): the window of the sliding layers (None when no layer slides), and each layer's
    kind when the layers differ (() when they attend alike)."""
    window = d.get("sliding_window")
    if arch.startswith(("Qwen2", "Qwen3", "SmolLM3")) and not d.get("use_sliding_window", False):
        return None, ()
    if not window:
        return None, ()
    kinds = _layer_kinds(arch, d)
    if set(kinds) == {"full_attention"}:
        return None, ()
    if set(kinds) == {"sliding_attention"}:
        return int(window), ()
    unknown = set(kinds) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"{arch}: layer_types {sorted(unknown)} are not supported; supported: full_attention, "
                         f"sliding_attention")
    return int(window), tuple(kinds)


def _layer_kinds(arch: str, d: dict[str, Any]) -> list[str]:
    """Each layer's attention kind, as transformers decides it when config.json does not list them."""
    if d.get("layer_types"):
        return list(d["layer_types"])
    num_layers = int(d["num_hidden_layers"])
    max_window_layers = int(d.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS))
    if arch.startswith("Qwen2Moe"):  # every other layer of the first max_window_layers slides, the first one included
        return ["sliding_attention" if (i + 1) % 2 and i < max_window_layers else "full_attention"
                for i in range(num_layers)]
    if arch.startswith(("Qwen2", "Qwen3")) and not arch.startswith("Qwen3Moe"):
        # the first max_window_layers layers attend to everything (Qwen3-MoE has no such rule: all slide)
        return ["sliding_attention" if i >= max_window_layers else "full_attention" for i in range(num_layers)]
    if arch.startswith("SmolLM3"):  # only the layers without RoPE slide
        flags = _rope_layers(arch, d)
        return ["sliding_attention" if flags and not flags[i] else "full_attention" for i in range(num_layers)]
    if arch.startswith("Gemma2"):  # every other layer slides, the first one included
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if arch.startswith("Gemma3"):  # five sliding layers, then one full one
        pattern = int(d.get("sliding_window_pattern", GEMMA3_SLIDING_PATTERN))
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    return ["sliding_attention"] * num_layers


def _rope_width(arch: str, d: dict[str, Any], head_dim: int) -> int:
    """How many of each head's dims RoPE turns: all but for partial rotary (Phi-4-mini: 96 of 128). Read for every
    architecture, as vLLM's Llama reads it; transformers 5 reads a top-level key for Phi-3 only (no released
    Llama-family checkpoint sets one)."""
    partial = float(d.get("partial_rotary_factor") or (d.get("rope_parameters") or {}).get("partial_rotary_factor")
                    or 1.0)
    width = int(head_dim * partial)
    if width % 2 or not 0 < width <= head_dim:
        raise ValueError(f"{arch}: partial_rotary_factor {partial} turns {width} of each head's {head_dim} dims; "
                         f"RoPE needs an even number of them, at least 2")
    return width


def _rope_layers(arch: str, d: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's NoPE layers: transformers' `no_rope_layers` holds 1 where a layer DOES apply RoPE (by default
    every layer but each `no_rope_layer_interval`-th). () when every layer applies it."""
    if not arch.startswith("SmolLM3"):
        return ()
    flags = d.get("no_rope_layers")
    if not flags:
        return rope_layer_flags(int(d["num_hidden_layers"]), int(d.get("no_rope_layer_interval") or 4))
    return () if all(flags) else tuple(int(f) for f in flags)


def rope_layer_flags(num_layers: int, nope_interval: int) -> tuple[int, ...]:
    """1 for each layer that applies RoPE, 0 for every `nope_interval`-th (SmolLM3's NoPE layers); () if none is."""
    flags = tuple(int((i + 1) % nope_interval != 0) for i in range(num_layers))
    return () if all(flags) else flags


ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
               "gelu": "gelu"}


def _activation(arch: str, d: dict[str, Any]) -> str:
    # Gemma's configs name the MLP's activation `hidden_activation`; Gemma 1 also carries a stale `hidden_act`.
    name = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    if name == "gelu" and arch == "GemmaForCausalLM":
        name = "gelu_pytorch_tanh"  # what transformers runs for Gemma 1's legacy "gelu" (Gemma 2/3: exact GELU)
    if name not in ACTIVATIONS:
        raise ValueError(f"{arch}: hidden activation {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _experts(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """Mixture-of-experts fields (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss); intermediate_size becomes each expert's
    MLP width. Mixtral and gpt-oss (a softmax over the top-k logits) always renormalise the top-k weights; Qwen's
    norm_topk_prob defaults to false, as in transformers. gpt-oss adds biases to its router and experts and clamps
    its SwiGLU."""
    experts = int(d.get("num_local_experts") or d.get("num_experts") or 0)
    if not experts:
        return {}
    if d.get("mlp_only_layers") or int(d.get("decoder_sparse_step") or 1) != 1:
        raise ValueError(f"{arch}: dense MLP layers between the mixture-of-experts ones (mlp_only_layers "
                         f"{d.get('mlp_only_layers')}, decoder_sparse_step {d.get('decoder_sparse_step')}) are not "
                         f"supported; every layer must be a mixture of experts")
    return dict(num_experts=experts, num_experts_per_tok=int(d["num_experts_per_tok"]),
                moe_renormalize=bool(d.get("norm_topk_prob", arch.startswith(("Mixtral", "GptOss")))),
                intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]),
                shared_expert_size=int(d.get("shared_expert_intermediate_size") or 0),
                router_scoring=str(d.get("scoring_func", "softmax")),
                **(dict(router_bias=True, expert_bias=True, swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                        swiglu_alpha=float(d.get("swiglu_alpha", 1.702))) if arch.startswith("GptOss") else {}))


def _granite(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """Granite's multipliers (muP-style); its attention_multiplier replaces head_dim ** -0.5."""
    if not arch.startswith("Granite"):
        return {}
    return dict(embedding_multiplier=float(d.get("embedding_multiplier", 1.0)),
                residual_multiplier=float(d.get("residual_multiplier", 1.0)),
                logits_scaling=float(d.get("logits_scaling", 1.0)),
                attention_scale=float(d.get("attention_multiplier", 1.0)))


def _gemma(arch: str, d: dict[str, Any]) -> dict[str, Any]:
    """Gemma's departures from Llama: (1 + w) norm gains, a query scale of its own, tied embeddings by default,
    Gemma 2's soft-capping, Gemma 2/3's norms after attention and MLP, Gemma 3's q/k norms."""
    if not arch.startswith("Gemma"):
        return {}
    scalar = d.get("query_pre_attn_scalar")
    return dict(
        norm_weight_offset=1.0,
        attention_scale=None if scalar is None else float(scalar) ** -0.5,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        # Gemma 3's config carries the key, but its attention never reads it (transformers, vLLM)
        attn_logit_softcap=None if arch.startswith("Gemma3") else d.get("attn_logit_softcapping"),
        final_logit_softcap=d.get("final_logit_softcapping"),
        post_norms=arch.startswith(("Gemma2", "Gemma3")),
        qk_norm=arch.startswith("Gemma3"),
    )


def model_config_from_hf(d: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    archs = d.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry; cannot tell which model it describes")
    arch = archs[0]
    model_class(arch)  # refuse an unsupported architecture before reading anything else
    window, layer_types = attention_layout(arch, d)
    heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    head_dim = int(d.get("head_dim") or hidden // heads)
    width = _rope_width(arch, d, head_dim)
    theta, scaling, local_theta = _rope(arch, d, width)
    fields = dict(
        architecture=arch,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_context_length(d),
        # transformers' defaults when the key is absent: SmolLM3 ties (Gemma too: _gemma), the others do not
        tie_word_embeddings=bool(d.get("tie_word_embeddings", arch.startswith("SmolLM3"))),
        qkv_bias=arch.startswith("Qwen2") or bool(d.get("attention_bias", False)),
        o_bias=bool(d.get("attention_bias", False)),  # Llama-style attention_bias covers o_proj too
        # only these architectures' MLPs read mlp_bias in transformers (Mistral's, Qwen's... have no biases)
        mlp_bias=arch in MLP_BIAS_ARCHITECTURES and bool(d.get("mlp_bias", False)),
        attention_sinks=arch.startswith("GptOss"),
        qk_norm=arch.startswith("Qwen3"),
        sliding_window=window,
        layer_types=layer_types,
        rope_local_theta=local_theta,
        rotary_dim=None if width == head_dim else width,
        rope_layers=_rope_layers(arch, d),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos_ids(generation or {}, d),
        hidden_act=_activation(arch, d),
    )
    return ModelConfig(**(fields | _experts(arch, d) | _gemma(arch, d) | _granite(arch, d)))
