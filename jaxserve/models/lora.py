"""LoRA adapter slots beside the decoder's matmul weights (vLLM's multi-LoRA serving).

Each target weight W [L, <in>, <out>] gets A [L, N, <in>, R] and B [L, N, R, <out>]: N slots (`max_loras`) of
rank up to R (`max_lora_rank`), zeros until an adapter is written into a slot (runner/lora_weights.py). The
axes keep W's logical names, so tensor parallelism splits B like a column-parallel W and A like a row-parallel
one, and padding for the mesh and pipeline stages pads them as it pads W. The math is layers.lora_delta.
"""

from __future__ import annotations

from jaxserve.config import ModelConfig
from jaxserve.models.layers import param

# Our weight -> (the logical axes its matmul contracts, the axes it produces); HF's module for it in a layer.
ATTENTION_TARGETS = {
    "wq": (("embed",), ("q_heads", "head_dim"), "self_attn.q_proj"),
    "wk": (("embed",), ("kv_heads", "head_dim"), "self_attn.k_proj"),
    "wv": (("embed",), ("kv_heads", "head_dim"), "self_attn.v_proj"),
    "wo": (("q_heads", "head_dim"), ("embed",), "self_attn.o_proj"),
}
MLP_TARGETS = {
    "w_gate": (("embed",), ("mlp",), "mlp.gate_proj"),
    "w_up": (("embed",), ("mlp",), "mlp.up_proj"),
    "w_down": (("mlp",), ("embed",), "mlp.down_proj"),
}


def lora_targets(cfg: ModelConfig) -> dict[str, tuple[tuple[str, ...], tuple[str, ...], str]]:
    """The weights an adapter may change: attention and a dense MLP (a mixture of experts' MLP is not a target)."""
    return ATTENTION_TARGETS if cfg.num_experts else ATTENTION_TARGETS | MLP_TARGETS


def axis_sizes(cfg: ModelConfig) -> dict[str, int]:
    return {"embed": cfg.hidden_size, "q_heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "mlp": cfg.intermediate_size}


def add_lora_slots(layers, cfg: ModelConfig, dtype) -> None:
    """Give the stacked decoder layers `<weight>_lora_a` / `_lora_b` for every target (float even when the
    weights are int8: the factors are small and their products are what matters)."""
    L, N, R, size = cfg.num_layers, cfg.lora_slots, cfg.lora_rank, axis_sizes(cfg)
    for name, (ins, outs, _) in lora_targets(cfg).items():
        a_shape = (L, N, *(size[x] for x in ins), R)
        b_shape = (L, N, R, *(size[x] for x in outs))
        setattr(layers, f"{name}_lora_a", param(a_shape, ("layers", "lora_slots", *ins, "lora_rank"), dtype))
        setattr(layers, f"{name}_lora_b", param(b_shape, ("layers", "lora_slots", "lora_rank", *outs), dtype))


def is_lora_path(path: tuple[str, ...]) -> bool:
    return path[-1].endswith(("_lora_a", "_lora_b"))
