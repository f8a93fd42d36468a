"""Random weights for a model's config (`load_format="dummy"`, as in vLLM): benchmarks of large shapes without
downloading or writing their weights.

The tensors are made under Hugging Face names and layouts, so they take the same path as a real checkpoint's
(stacking, padding for the mesh, int8 quantization), but on the devices: runner/weights.py traces that path
inside one jitted program per weight, and each device computes its own shard. Making them on the host took 119 s
of an 8B cold start on an H100's host (first-touch page faults of fresh arrays, one thread).

Each tensor has its own key: the seed, folded with the CRC of its name with the layer (and expert) numbers as
`*`, then with each number. A stacked weight's tensors are then one vmapped draw, so a weight's program holds one
generator however many layers it stacks (unrolled per layer, the 8B load spent most of its time compiling).
JAX's counter-based generator gives the same values however the output is sharded, so every mesh and every
process of a multi-node run sees identical weights, and greedy output is the same everywhere, as with real
weights.
"""

from __future__ import annotations

import re
import zlib
from typing import Callable

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
        "o_proj.weight": (D, H * d), "q_proj.bias": (H * d,), "k_proj.bias": (K * d,), "v_proj.bias": (K * d,), "o_proj.bias": (D,),
        "q_norm.weight": (d,), "k_norm.weight": (d,),
        "gate_proj.weight": (F, D), "up_proj.weight": (F, D), "down_proj.weight": (D, F),
        "gate_proj.bias": (F,), "up_proj.bias": (F,), "down_proj.bias": (D,),
    }
    if cfg.num_experts:
        shapes |= {"gate.weight": (cfg.num_experts, D), "w1.weight": (F, D), "w3.weight": (F, D),
                   "w2.weight": (D, F)}
    if cfg.expert_bias:  # gpt-oss: experts stacked per layer, gate and up in one tensor; biased router
        E = cfg.num_experts
        shapes |= {"experts.gate_up_proj": (E, D, 2 * F), "experts.gate_up_proj_bias": (E, 2 * F),
                   "experts.down_proj": (E, F, D), "experts.down_proj_bias": (E, D), "router.weight": (E, D),
                   "router.bias": (E,), "self_attn.sinks": (H,)}
    if cfg.shared_expert_size:  # named by three parts: the routed experts' gate_proj has two
        Fs = cfg.shared_expert_size
        shapes |= {"shared_expert.gate_proj.weight": (Fs, D), "shared_expert.up_proj.weight": (Fs, D),
                   "shared_expert.down_proj.weight": (D, Fs), "shared_expert_gate.weight": (1, D)}
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
        """The tensor `name` as a jax array, float32."""
        numbers = [int(n) for n in re.findall(r"(?<=\.)\d+(?=\.)", name)]  # layer, expert
        template = re.sub(r"(?<=\.)\d+(?=\.)", "*", name)
        return self._draw(template, jnp.asarray(numbers, jnp.uint32))

    def get(self, name: str) -> np.ndarray:
        """The tensor `name` on the host (the TensorSource protocol; tests write it into a checkpoint)."""
        return np.asarray(self.generate(name))

    def stack(self, template: str, counts: tuple[int, ...], transform: Callable, dtype) -> jax.Array:
        """[*counts, ...] of the named tensors in our layout, as `loader.weights.stacker_on_host` makes them from a
        checkpoint: one vmapped draw (traceable: runner/weights.py calls it inside jit)."""
        numbers = jnp.asarray(list(np.ndindex(*counts)), jnp.uint32)  # every (layer, expert) index, in order
        stacked = jax.vmap(lambda index: transform(self._draw(template, index)))(numbers)
        return stacked.reshape(counts + stacked.shape[1:]).astype(dtype)

    def _draw(self, template: str, numbers: jax.Array) -> jax.Array:
        """The tensor `fill(template, numbers)`; `numbers` may be traced."""
        parts = template.split(".")  # "model.layers.*.self_attn.q_proj.weight" -> "q_proj.weight"
        suffix = ".".join(parts[-3:]) if ".".join(parts[-3:]) in self._shapes else ".".join(parts[-2:])
        shape = self._shapes.get(suffix)
        if shape is None:
            raise KeyError(f"no random tensor for {template!r}: the dummy loader does not know this weight")
        if suffix.endswith("norm.weight"):
            return jnp.full(shape, self._unit_gain, jnp.float32)  # gains of 1: random ones would only rescale
        key = jax.random.fold_in(jax.random.key(self.seed), np.uint32(zlib.crc32(template.encode())))
        for i in range(numbers.shape[0]):
            key = jax.random.fold_in(key, numbers[i])
        return jax.random.uniform(key, shape, jnp.float32, -HALF_RANGE, HALF_RANGE)
