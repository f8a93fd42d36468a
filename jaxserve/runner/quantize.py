"""Weight-only int8 and fp8 quantization, done on the host as each checkpoint weight is read.

Symmetric, per output channel: scale = max |w| over the contracted axes / 127, values = round(w / scale) (int8);
or scale = max |w| / 448, values = w / scale rounded to float8 e4m3 (fp8, vLLM's dynamic FP8 weights). It is
computed in numpy (IEEE division), before the weight is split over the mesh, so every platform and every mesh
serves the same int8 weights, and a quarter of the float32 bytes travels to the devices. A stacked weight is
quantized one layer at a time, so the temporaries stay the size of one layer. A dummy load's random weights are
made on the devices, and quantized there by the same function on jax arrays inside its program.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

FP8_MAX = 448.0  # float8 e4m3's largest finite value


def quantize(w, contract: tuple[int, ...], dtype=np.int8):
    """(values shaped like `w` in `dtype`, int8 or float8 e4m3, and float32 scales over the axes not in `contract`):
    numpy arrays for a numpy `w`, jax arrays for a jax one."""
    xp = np if isinstance(w, np.ndarray) else jnp
    # A stacked weight (layers, experts) on the host: one slice at a time, so temporaries stay one layer's size. A
    # jax one is quantized whole: XLA fuses it, and a program unrolled per slice compiled seconds longer.
    if xp is np and w.ndim > len(contract) + 1 and 0 not in contract:
        inner = tuple(a - 1 for a in contract)
        parts = [quantize(w[i], inner, dtype) for i in range(w.shape[0])]
        return np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])
    integer = np.dtype(dtype) == np.int8
    top = np.float32(127 if integer else FP8_MAX)
    w32 = w.astype(np.float32, copy=False) if xp is np else w.astype(np.float32)
    amax = xp.abs(w32).max(axis=contract)
    scale = xp.where(amax > 0, amax / top, np.float32(1)).astype(np.float32)  # zero channels: padding
    scaled = w32 / xp.expand_dims(scale, contract)
    if integer:
        scaled = xp.rint(scaled)
    return xp.clip(scaled, -top, top).astype(dtype), scale  # fp8: the cast rounds to nearest
