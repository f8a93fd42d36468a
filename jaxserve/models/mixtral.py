"""Mixtral and Qwen3-MoE: the Llama decoder with a mixture-of-experts MLP (models/experts.py: a router choosing
k experts per token, their weights renormalised or not, and only the chosen experts run).

Architecture only; attention and the layer loop are llama.py's.
"""

from __future__ import annotations

from jaxserve.config import ModelConfig
from jaxserve.models.experts import EXPERT_CONTRACTS, expert_axes, moe_mlp
from jaxserve.models.layers import param, weight
from jaxserve.models.llama import DecoderLayers, LlamaForCausalLM


class MoeDecoderLayers(DecoderLayers):
    def init_mlp(self, cfg: ModelConfig, dtype, q: str | None):
        L, D, F, E = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
        Ep = E + cfg.expert_pad  # never-chosen experts, so that whole experts split evenly over tp
        # The router stays in the model's dtype and unquantized: small, and routing is precision-sensitive.
        self.router = param((L, D, E), ("layers", "embed", None), dtype)
        axes = expert_axes(cfg.expert_parallel)
        shapes = {"w_gate": (L, Ep, D, F), "w_up": (L, Ep, D, F), "w_down": (L, Ep, F, D)}
        for name, shape in shapes.items():
            value, scale = weight(shape, ("layers",) + axes[name], dtype, EXPERT_CONTRACTS[name], q)
            setattr(self, name, value)
            setattr(self, name + "_scale", scale)


class MixtralForCausalLM(LlamaForCausalLM):
    layers_class = MoeDecoderLayers
    mlp_fn = staticmethod(moe_mlp)
