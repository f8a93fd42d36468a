"""Gemma 1/2/3 (text): the Llama decoder with Gemma's embedding scale.

The rest of what sets Gemma apart is configuration the shared decoder (llama.py) reads: (1 + w) RMSNorm gains,
added at load (`norm_weight_offset`); GeGLU (`hidden_act`); Gemma 2/3's norms on the attention's and MLP's
outputs (`post_norms`); sliding-window and full layers interleaved, Gemma 3's sliding layers with a RoPE base of
their own (`layer_types`, `rope_local_theta`); Gemma 2's soft-capped attention scores and logits; Gemma 3's q/k
norms; the query scale from `query_pre_attn_scalar`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.models.llama import LlamaForCausalLM


class GemmaForCausalLM(LlamaForCausalLM):
    def embed_tokens(self, token_ids: jax.Array) -> jax.Array:
        x = super().embed_tokens(token_ids)
        # sqrt(hidden_size) rounded to the weights' dtype first, as transformers does (33.94 is 34.0 in bf16).
        return x * jnp.asarray(self.cfg.hidden_size**0.5, x.dtype)
