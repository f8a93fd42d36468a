"""The load-time weight transform behind parallel/layout.py: a checkpoint array in our stacked layout -> the
padded array the effective config describes. Which axes change is read from the weight's logical axis names, so
a new weight needs no entry here. Applied one weight at a time: to numpy arrays on the host before a weight is
placed on devices, or to jax arrays inside the jitted program that makes a dummy load's weights on the devices.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxserve.parallel.layout import ParallelLayout


def _xp(a):
    """numpy for a host array, jax.numpy for a jax one (traced or not)."""
    return np if isinstance(a, np.ndarray) else jnp


def pad_axis(a, axis: int, size: int):
    """Zeros appended along `axis` up to `size`."""
    if a.shape[axis] == size:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return _xp(a).pad(a, widths)


def pad_q_heads(a, axis: int, layout: ParallelLayout, num_kv_heads: int):
    """[.., H, ..] kv-major (H = K*G) -> [.., K_pad*G_pad, ..]: zero heads fill each group and the padded groups."""
    h = layout.heads
    grouped = a.reshape(a.shape[:axis] + (num_kv_heads, -1) + a.shape[axis + 1:])
    grouped = pad_axis(pad_axis(grouped, axis, h.kv_heads), axis + 1, h.group)
    return grouped.reshape(a.shape[:axis] + (h.kv_heads * h.group,) + a.shape[axis + 1:])


def pad_kv_heads(a, axis: int, layout: ParallelLayout):
    """[.., K, ..] -> [.., K_pad*rep, ..]: zero heads, then each head repeated next to itself (kv head j*rep+r
    is a copy of head j, matching the q-head grouping above)."""
    return _xp(a).repeat(pad_axis(a, axis, layout.heads.kv_heads), layout.heads.replicas, axis=axis)


def pad_layers(a, axis: int, layout: ParallelLayout):
    """[L, ..] -> [pp*slots, ..]: each stage's real layers first in its slots, zero layers after them."""
    if layout.pp * layout.slots == a.shape[axis]:
        return a
    shape = a.shape[:axis] + (layout.pp * layout.slots,) + a.shape[axis + 1:]
    index = [slice(None)] * a.ndim
    index[axis] = np.asarray(layout.layer_slots())
    if isinstance(a, np.ndarray):
        out = np.zeros(shape, a.dtype)
        out[tuple(index)] = a  # in place: one padded copy held
        return out
    return jnp.zeros(shape, a.dtype).at[tuple(index)].set(a)


def pad_weight(a, logical: tuple[str | None, ...], layout: ParallelLayout, num_kv_heads: int):
    """The checkpoint array `a` (real sizes) padded on every axis whose logical name needs it."""
    sizes = {"mlp": layout.mlp, "vocab": layout.vocab, "parallel_experts": layout.experts,
             "shared_mlp": layout.shared_mlp}
    for axis, name in enumerate(logical):
        if name == "q_heads":
            a = pad_q_heads(a, axis, layout, num_kv_heads)
        elif name == "kv_heads":
            a = pad_kv_heads(a, axis, layout)
        elif name == "layers":
            a = pad_layers(a, axis, layout)
        elif name in sizes:
            a = pad_axis(a, axis, sizes[name])
    return a
