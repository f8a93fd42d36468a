"""Weight-only int8 quantization, done on the host as each checkpoint weight is read.

Symmetric, per output channel: scale = max |w| over the contracted axes / 127, values = round(w / scale). It is
computed in numpy (IEEE division), before the weight is split over the mesh, so every platform and every mesh
serves the same int8 weights, and a quarter of the float32 bytes travels to the devices. A stacked weight is
quantized one layer at a time, so the temporaries stay the size of one layer. A dummy load's random weights are
made on the devices, and quantized there by the same function on jax arrays inside its program.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def quantize_int8(w, contract: tuple[int, ...]):
    """(int8 values shaped like `w`, float32 scales over the axes not in `contract`): numpy arrays for a numpy
    `w`, jax arrays for a jax one."""
    xp = np if isinstance(w, np.ndarray) else jnp
    # A stacked weight (layers, experts) on the host: one slice at a time, so temporaries stay one layer's size. A
    # jax one is quantized whole: XLA fuses it, and a program unrolled per slice compiled seconds longer.
    if xp is np and w.ndim > len(contract) + 1 and 0 not in contract:
        inner = tuple(a - 1 for a in contract)
        parts = [quantize_int8(w[i], inner) for i in range(w.shape[0])]
        return np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])
    w32 = w.astype(np.float32, copy=False) if xp is np else w.astype(np.float32)
    amax = xp.abs(w32).max(axis=contract)
    scale = xp.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)  # zero channels: padding
    values = xp.clip(xp.rint(w32 / xp.expand_dims(scale, contract)), -127, 127).astype(np.int8)
    return values, scale
