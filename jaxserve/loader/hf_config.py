"""Hugging Face `config.json` (and `generation_config.json`) -> ModelConfig."""

from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.models.registry import model_class


def _rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    params = d.get("rope_parameters") or {}
    theta = float(d.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = d.get("rope_scaling") or params
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: default, llama3")
    return theta, RopeScaling(
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
    )


# transformers' default for Qwen2/Qwen3 configs that leave max_window_layers out.
QWEN_MAX_WINDOW_LAYERS = 28


def _eos_ids(*sources: dict[str, Any]) -> tuple[int, ...]:
    ids: list[int] = []
    for src in sources:
        eos = src.get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return tuple(ids)


def _sliding_window(arch: str, d: dict[str, Any]) -> int | None:
    """The window every layer uses, or None when every layer attends to the whole context."""
    window = d.get("sliding_window")
    if arch.startswith(("Qwen2", "Qwen3")) and not d.get("use_sliding_window", False):
        return None
    if not window:
        return None
    kinds = set(_layer_kinds(arch, d))
    if kinds == {"full_attention"}:
        return None
    if len(kinds) > 1:
        raise ValueError(f"this {arch} mixes sliding-window and full-attention layers, which jaxserve does not run "
                         f"yet; only models whose layers all attend alike are supported")
    return int(window)


def _layer_kinds(arch: str, d: dict[str, Any]) -> list[str]:
    """Each layer's attention kind, as transformers decides it when config.json does not list them."""
    if d.get("layer_types"):
        return list(d["layer_types"])
    num_layers = int(d["num_hidden_layers"])
    if arch.startswith(("Qwen2", "Qwen3")):  # the first max_window_layers layers attend to everything
        first_sliding = int(d.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS))
        return ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
    return ["sliding_attention"] * num_layers


def model_config_from_hf(d: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    archs = d.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry; cannot tell which model it describes")
    arch = archs[0]
    model_class(arch)  # refuse an unsupported architecture before reading anything else
    theta, scaling = _rope(d)
    partial = float(d.get("partial_rotary_factor") or (d.get("rope_parameters") or {}).get("partial_rotary_factor")
                    or 1.0)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (rotary embedding on part of each head, "
                         f"as in Phi-4-mini); only models that rotate whole heads are")
    heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    return ModelConfig(
        architecture=arch,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        num_layers=int(d["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=arch.startswith("Qwen2") or bool(d.get("attention_bias", False)),
        qk_norm=arch.startswith("Qwen3"),
        sliding_window=_sliding_window(arch, d),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos_ids(generation or {}, d),
        num_experts=int(d.get("num_local_experts", 0)),
        num_experts_per_tok=int(d.get("num_experts_per_tok", 0)),
    )
