"""Mixtral, Qwen2-MoE, Qwen3-MoE and gpt-oss: the Llama decoder with a mixture-of-experts MLP (models/experts.py: a router choosing
k experts per token, their weights renormalised or not, and only the chosen experts run).

Architecture only; attention and the layer loop are llama.py's.
"""

from __future__ import annotations

from jaxserve.config import ModelConfig
from jaxserve.models.experts import EXPERT_CONTRACTS, expert_axes, moe_mlp
from jaxserve.models.layers import GroupedWeights, add_weight, param, weight_format
from jaxserve.models.llama import DecoderLayers, LlamaForCausalLM


class MoeDecoderLayers(DecoderLayers):
    def init_mlp(self, cfg: ModelConfig, dtype, q: str | GroupedWeights | None):
        L, D, F, E = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
        Ep = E + cfg.expert_pad  # never-chosen experts, so that whole experts split evenly over tp
        # The router stays in the model's dtype and unquantized: small, and routing is precision-sensitive.
        self.router = param((L, D, E), ("layers", "embed", None), dtype)
        if cfg.router_bias:
            self.router_bias = param((L, E), ("layers", None), dtype)
        axes = expert_axes(cfg.expert_parallel)
        shapes = {"w_gate": (L, Ep, D, F), "w_up": (L, Ep, D, F), "w_down": (L, Ep, F, D)}
        for name, shape in shapes.items():
            add_weight(self, name, shape, ("layers",) + axes[name], dtype, EXPERT_CONTRACTS[name],
                       weight_format(q, name))
        if cfg.expert_bias:  # gpt-oss
            self.b_gate = param((L, Ep, F), ("layers",) + axes["b_gate"], dtype)
            self.b_up = param((L, Ep, F), ("layers",) + axes["b_up"], dtype)
            self.b_down = param((L, Ep, D), ("layers",) + axes["b_down"], dtype)
        if cfg.shared_expert_size:  # Qwen2-MoE: one expert every token runs, its output scaled by a sigmoid gate
            Fs = cfg.shared_expert_size
            self.add_weight("shared_gate", (L, D, Fs), ("layers", "embed", "shared_mlp"), dtype, ("embed",), q)
            self.add_weight("shared_up", (L, D, Fs), ("layers", "embed", "shared_mlp"), dtype, ("embed",), q)
            self.add_weight("shared_down", (L, Fs, D), ("layers", "shared_mlp", "embed"), dtype, ("shared_mlp",), q)
            self.shared_expert_gate = param((L, D, 1), ("layers", "embed", None), dtype)

class MixtralForCausalLM(LlamaForCausalLM):
    layers_class = MoeDecoderLayers
    mlp_fn = staticmethod(moe_mlp)
