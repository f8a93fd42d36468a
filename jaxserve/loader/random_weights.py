"""Random weights for a model's config (`load_format="dummy"`, as in vLLM): benchmarks of large shapes without
downloading or writing their weights.

The tensors are made under Hugging Face names and layouts, so they take the same path as a real checkpoint's
(stacking, padding for the mesh, int8 quantization), but on the devices: runner/weights.py traces that path
inside one jitted program per weight, and each device computes its own shard. Making them on the host took 119 s
of an 8B cold start on an H100's host (first-touch page faults of fresh arrays, one thread), against seconds here.
Each tensor comes from its own key, (seed, name) folded: JAX's counter-based generator gives the same values
however the output is sharded, so every mesh and every process of a multi-node run sees identical weights, and
greedy output is the same everywhere, as with real weights.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig

# Uniform in [-a, a]: standard deviation a / sqrt(3) ~= 0.02, the init std of Llama-family configs.
HALF_RANGE = 0.035


def _hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Suffix of every HF tensor name -> its shape (PyTorch layout: Linear weights are [out, in])."""
    D, H, K, d, F, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                        cfg.vocab_size)
    shapes = {
        "embed_tokens.weight": (V, D), "lm_head.weight": (V, D), "norm.weight": (D,),
        "input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
        "pre_feedforward_layernorm.weight": (D,), "post_feedforward_layernorm.weight": (D,),
        "q_proj.weight": (H * d, D), "k_proj.weight": (K * d, D), "v_proj.weight": (K * d, D),
        "o_proj.weight": (D, H * d), "q_proj.bias": (H * d,), "k_proj.bias": (K * d,), "v_proj.bias": (K * d,),
        "q_norm.weight": (d,), "k_norm.weight": (d,),
        "gate_proj.weight": (F, D), "up_proj.weight": (F, D), "down_proj.weight": (D, F),
    }
    if cfg.num_experts:
        shapes |= {"gate.weight": (cfg.num_experts, D), "w1.weight": (F, D), "w3.weight": (F, D),
                   "w2.weight": (D, F)}
    return shapes


class RandomWeights:
    """A TensorSource (loader/weights.py) of random tensors for every name the config implies."""

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        self.seed = seed
        self._shapes = _hf_shapes(cfg)
        self._unit_gain = 1.0 - cfg.norm_weight_offset  # the stored value of a gain of 1 (Gemma stores w for 1 + w)

    def names(self) -> set[str]:
        return set()  # names are asked for by the loader, never listed

    def generate(self, name: str) -> jax.Array:
        """The tensor `name` as a jax array, float32 (traceable: runner/weights.py calls it inside jit)."""
        suffix = ".".join(name.split(".")[-2:])  # "model.layers.3.self_attn.q_proj.weight" -> "q_proj.weight"
        shape = self._shapes.get(suffix)
        if shape is None:
            raise KeyError(f"no random tensor for {name!r}: the dummy loader does not know this weight")
        if suffix.endswith("norm.weight"):
            return jnp.full(shape, self._unit_gain, jnp.float32)  # gains of 1: random ones would only rescale
        key = jax.random.fold_in(jax.random.key(self.seed), np.uint32(zlib.crc32(name.encode())))
        return jax.random.uniform(key, shape, jnp.float32, -HALF_RANGE, HALF_RANGE)

    def get(self, name: str) -> np.ndarray:
        """The tensor `name` on the host (the TensorSource protocol; tests write it into a checkpoint)."""
        return np.asarray(self.generate(name))
