"""IBM Granite 3.x (dense): the Llama decoder with four scalar multipliers (muP-style).

The embeddings are scaled by `embedding_multiplier` and the logits divided by `logits_scaling` (here); each
layer's attention and MLP outputs are scaled by `residual_multiplier` before their residual adds, and the
attention scores by `attention_multiplier` instead of head_dim ** -0.5 (configuration the shared decoder reads).
"""

from __future__ import annotations

import jax

from jaxserve.models.llama import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    def embed_tokens(self, token_ids: jax.Array) -> jax.Array:
        return super().embed_tokens(token_ids) * self.cfg.embedding_multiplier

    def logits(self, hidden: jax.Array) -> jax.Array:
        return super().logits(hidden) / self.cfg.logits_scaling
