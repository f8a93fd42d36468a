"""Building blocks shared by the model families.

Shape letters, used in every einsum of the package:
    B batch (sequences in a step)   T tokens (flat, across sequences)   S kv length
    D embed   H q heads   K kv heads   G q heads per kv head (H = K*G)   d head dim
    F mlp hidden   E experts   V vocab   L layers
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig


def param(shape: tuple[int, ...], logical: tuple[str | None, ...], dtype, init: float | None = None) -> nnx.Param:
    """A weight carrying its logical sharding names (mapped to mesh axes by parallel/sharding.py).

    Models are built under `nnx.eval_shape`, so the values here are placeholders: real weights come from a checkpoint.
    """
    assert len(shape) == len(logical), (shape, logical)
    value = jnp.ones(shape, dtype) if init is None else jnp.full(shape, init, dtype)
    return nnx.Param(value, logical=logical)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # Normalise in float32 whatever the activation dtype, as the reference implementations do.
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies of rotary embeddings, with Llama-3 frequency scaling when configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq.astype(np.float32)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    scaled = np.where(medium, (1 - smooth) * inv_freq / s.factor + smooth * inv_freq, scaled)
    return scaled.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate `x` [T, heads, d] by its token positions (the "rotate half" layout of HF checkpoints)."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, d/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def swiglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    gate = jnp.einsum("TD,DF->TF", x, w_gate)
    up = jnp.einsum("TD,DF->TF", x, w_up)
    return jnp.einsum("TF,FD->TD", jax.nn.silu(gate) * up, w_down)
