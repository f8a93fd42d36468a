"""Mixtral and Qwen3-MoE: the Llama decoder with a mixture-of-experts MLP (softmax router, top-k experts, their
weights renormalised or not).

Architecture only; attention and the layer loop are llama.py's. The experts are split over tensor-parallel
devices (logical axis "experts"); each expert's own MLP width stays whole on its device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.layers import dense, param, weight
from jaxserve.models.llama import DecoderLayers, LlamaForCausalLM


class MoeDecoderLayers(DecoderLayers):
    def init_mlp(self, cfg: ModelConfig, dtype, q: str | None):
        L, D, F, E = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
        Ep = E + cfg.expert_pad  # zero experts so they split evenly over tp; the router never picks them
        self.router = param((L, D, E), ("layers", "embed", None), dtype)  # small, and routing is precision-sensitive
        gate_up = ((L, Ep, D, F), ("layers", "experts", "embed", "expert_mlp"), dtype, ("embed",), q)
        self.w_gate, self.w_gate_scale = weight(*gate_up)
        self.w_up, self.w_up_scale = weight(*gate_up)
        self.w_down, self.w_down_scale = weight((L, Ep, F, D), ("layers", "experts", "expert_mlp", "embed"), dtype,
                                                ("expert_mlp",), q)


def route(cfg: ModelConfig, h: jax.Array, router: jax.Array) -> jax.Array:
    """Combine weights [T, E + pad] (float32): the top-k router probabilities (renormalised where the model says so),
    zero elsewhere."""
    logits = jnp.einsum("TD,DE->TE", h, router, preferred_element_type=jnp.float32)
    top_p, top_i = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.num_experts_per_tok)
    if cfg.moe_renormalize:
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    chosen = jax.nn.one_hot(top_i, cfg.num_experts + cfg.expert_pad, dtype=jnp.float32)  # [T, k, E]
    return jnp.einsum("Tk,TkE->TE", top_p, chosen)


def moe_mlp(cfg: ModelConfig, w: dict[str, jax.Array], h: jax.Array, adapters: jax.Array | None = None) -> jax.Array:
    """(LoRA adapters change only the attention of these models: `adapters` is unused.) Every expert runs on every token and the combine weights zero the ones not chosen: dense, so with the
    experts split over tp each device runs its own experts and one all-reduce sums them. Costs E/k times the
    FLOPs of a sparse dispatch, which does not matter at the sizes this serves on CPU."""
    combine = route(cfg, h, w["router"])
    int8_activations = cfg.int8_activations
    gate = dense("TD,EDF->TEF", h, w, "w_gate", int8_activations=int8_activations)
    up = dense("TD,EDF->TEF", h, w, "w_up", int8_activations=int8_activations)
    out = dense("TEF,EFD->TED", jax.nn.silu(gate) * up, w, "w_down", int8_activations=int8_activations)
    return jnp.einsum("TE,TED->TD", combine, out.astype(jnp.float32)).astype(h.dtype)


class MixtralForCausalLM(LlamaForCausalLM):
    layers_class = MoeDecoderLayers
    mlp_fn = staticmethod(moe_mlp)
