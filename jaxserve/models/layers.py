"""Building blocks shared by the model families.

Shape letters, used in every einsum of the package:
    B batch (sequences in a step)   T tokens (flat, across sequences)   S kv length
    D embed   H q heads   K kv heads   G q heads per kv head (H = K*G)   d head dim
    F mlp hidden   E experts   V vocab   L layers   N LoRA adapter slots   R LoRA rank
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.config import ModelConfig, RopeScaling


def param(shape: tuple[int, ...], logical: tuple[str | None, ...], dtype, init: float | None = None) -> nnx.Param:
    """A weight carrying its logical sharding names (mapped to mesh axes by parallel/sharding.py).

    Models are built under `nnx.eval_shape`, so the values here are placeholders: real weights come from a checkpoint.
    """
    assert len(shape) == len(logical), (shape, logical)
    value = jnp.ones(shape, dtype) if init is None else jnp.full(shape, init, dtype)
    return nnx.Param(value, logical=logical)


QUANTIZATIONS = (None, "int8", "w8a8", "fp8")
# What a quantized weight's values are stored as. fp8 (vLLM's dynamic FP8): float8 e4m3, per-channel scales
# max |w| / 448, dequantized inside the matmul like int8.
STORED_DTYPES = {"int8": jnp.int8, "w8a8": jnp.int8, "fp8": jnp.float8_e4m3fn}


# What kept 4-bit integer values are stored in: two a byte, and no other weight is (`values_held`).
PACKED_4BIT = jnp.uint8


def values_held(w: jax.Array) -> int:
    """How many weight values `w` holds: two a byte of packed 4-bit values, else one an element."""
    return w.size * (2 if w.dtype == PACKED_4BIT else 1)


@dataclasses.dataclass(frozen=True)
class Grouped:
    """A weight kept in the blocks a checkpoint was quantized in (GGUF's Q4_1, Q8_0, Q6_K...): w = q * scale +
    offset, one scale (and offset) per `group` consecutive values along the weight's last contracted axis.

    `bits=4`: q in 0..15, two values per uint8 byte (element 2i in the low nibble, 2i+1 in the high one) packed
    along the group axis, so half a byte per weight on every platform (XLA:CPU stores jnp.uint4 in a whole byte).
    `bits=4, float4=True`: q in float4 e2m1 (MXFP4), one per element (XLA packs that type in memory).
    `bits=8`: q in int8, or float8 e4m3 (`float8`). Scales and offsets are float32, with the weight's logical axes, so they pad and split
    over the mesh where the weight does (the group axis splits where `group` * devices divides it)."""
    bits: int
    group: int
    offset: bool
    float8: bool = False  # 8-bit values in float8 e4m3 (FP8 checkpoints), not int8
    float4: bool = False  # 4-bit values in float4 e2m1 (MXFP4 checkpoints): XLA stores them packed itself
    # One scale per output channel (or per tensor): the groups only repeat it, so a group may span the whole
    # contracted axis, and the values then multiply quantized activations where those run (layers.dense: float8
    # where FP8 GEMMs run, int8 for a W8A8 checkpoint).
    channel: bool = False

    @property
    def dtype(self):
        if self.float4:
            return jnp.float4_e2m1fn
        return PACKED_4BIT if self.bits == 4 else jnp.float8_e4m3fn if self.float8 else jnp.int8

    @property
    def packed(self) -> bool:
        """4-bit integers, two to a uint8 byte (packed by the loader: XLA:CPU stores jnp.uint4 in a whole byte)."""
        return self.bits == 4 and not self.float4


# Weights kept in their checkpoint's blocks, by parameter name ("wq", "w_down", "embed"...); those not named are
# floats. What a model's constructor gets as `quantization` beside the names above.
GroupedWeights = dict[str, Grouped]


def weight_format(quantization: str | GroupedWeights | None, name: str, quantized_by_name: bool = True
                  ) -> str | Grouped | None:
    """How the weight `name` is stored under the engine's `quantization`: a checkpoint's blocks name their weights
    one by one; int8/w8a8/fp8 quantize every matmul weight of the layers (`quantized_by_name=False` for the
    embedding and LM head, which they leave in float)."""
    if isinstance(quantization, dict):
        return quantization.get(name)
    return quantization if quantized_by_name else None


def weight(shape: tuple[int, ...], logical: tuple[str | None, ...], dtype, contract: tuple[str, ...],
           stored: str | Grouped | None) -> dict[str, nnx.Param]:
    """A matmul weight and what dequantizes it, by name suffix: {"": float weight}; with `stored="int8"` or
    "w8a8", {"": int8 weight, "_scale": float32 scale per output channel}, or "fp8" (float8 e4m3 weight, the same
    scales); with a `Grouped` format, its values, "_scale" and (if it has them) "_offset" per group.
    `contract` names the axes the matmul sums over; a per-channel scale has every other axis.

    Weight-only int8: activations stay float and `dense` converts the int8 weight inside the matmul, so
    memory-bound decode reads a quarter of the float32 bytes (half of bf16). Symmetric per-channel scales
    (max |w| / 127) keep a channel's outliers from costing the others their precision.
    """
    if stored is None:
        return {"": param(shape, logical, dtype)}
    if isinstance(stored, Grouped):
        axis = max(i for i, name in enumerate(logical) if name in contract)  # the group axis
        if stored.channel:  # one scale per output channel: size 1 along every contracted axis, on every device
            scale_shape = tuple(1 if name in contract else n for n, name in zip(shape, logical))
            scale_logical = tuple(None if name in contract else name for name in logical)
        else:
            scale_shape, scale_logical = _resized(shape, axis, shape[axis] // stored.group), logical
        grouped = {"": _resized(shape, axis, shape[axis] // 2 if stored.packed else shape[axis]), "_scale": scale_shape}
        dtypes = {"": stored.dtype, "_scale": jnp.float32, "_offset": jnp.float32}
        if stored.offset:
            grouped["_offset"] = grouped["_scale"]
        return {suffix: param(s, logical if suffix == "" else scale_logical, dtypes[suffix])
                for suffix, s in grouped.items()}
    if stored not in QUANTIZATIONS:
        raise ValueError(f"quantization={stored!r} is not supported; use None, 'int8', 'w8a8' or 'fp8'")
    kept = [i for i, name in enumerate(logical) if name not in contract]
    assert len(kept) < len(logical), (logical, contract)
    scale = param(tuple(shape[i] for i in kept), tuple(logical[i] for i in kept), jnp.float32)
    return {"": param(shape, logical, STORED_DTYPES[stored]), "_scale": scale}


def _resized(shape: tuple[int, ...], axis: int, size: int) -> tuple[int, ...]:
    return shape[:axis] + (size,) + shape[axis + 1:]


def add_weight(module: nnx.Module, name: str, shape: tuple[int, ...], logical: tuple[str | None, ...], dtype,
               contract: tuple[str, ...], stored: str | Grouped | None) -> None:
    """`module.<name>` and its scales (`<name>_scale`, `<name>_offset`), as `weight` declares them."""
    for suffix, p in weight(shape, logical, dtype, contract, stored).items():
        setattr(module, name + suffix, p)


def stored_name(name: str) -> str:
    """The weight a parameter belongs to: "w_up" for "w_up", "w_up_scale" and "w_up_offset"."""
    return name.removesuffix("_scale").removesuffix("_offset")


def dequantized(weights: dict[str, jax.Array], name: str, dtype) -> jax.Array:
    """The weight `name` in `dtype`: as stored when it is a float, else q * scale (+ offset) computed in float32,
    which is what a checkpoint's own dequantization computes (GGUF's `d * q + m`)."""
    w, scale = weights[name], weights.get(name + "_scale")
    if scale is None:
        return w.astype(dtype)
    assert scale.ndim == w.ndim, f"{name}: per-channel scales apply to a matmul's output (dense)"
    offset = weights.get(name + "_offset")
    if w.dtype != PACKED_4BIT and all(b == 1 for a, b in zip(w.shape, scale.shape) if a != b):
        values = w.astype(jnp.float32) * scale  # one group over each axis the scale does not vary along
        return (values if offset is None else values + offset).astype(dtype)
    axis = next(i for i, (a, b) in enumerate(zip(w.shape, scale.shape)) if a != b)  # the group axis
    if w.dtype == PACKED_4BIT:  # two 4-bit values per byte along the group axis, the first in the low nibble
        # Shifted through a broadcast rather than stacked: XLA:CPU ran a stack of the two nibbles 5.4x slower
        # inside a scan over the layers (a concatenate with a layout copy per layer), the shift at the speed of
        # unrolled layers (scripts/bench_layer_loop.py --weights int4).
        shifts = jnp.array([0, 4], jnp.uint8).reshape((2,) + (1,) * (w.ndim - axis - 1))
        w = (jnp.expand_dims(w, axis + 1) >> shifts) & 15
        w = w.reshape(w.shape[:axis] + (w.shape[axis] * 2,) + w.shape[axis + 2:])
    groups = scale.shape[axis]
    blocks = w.reshape(w.shape[:axis] + (groups, w.shape[axis] // groups) + w.shape[axis + 1:])
    values = blocks.astype(jnp.float32) * jnp.expand_dims(scale, axis + 1)
    if offset is not None:
        values = values + jnp.expand_dims(offset, axis + 1)
    return values.reshape(w.shape).astype(dtype)


def dense(spec: str, x: jax.Array, weights: dict[str, jax.Array], name: str,
          adapters: jax.Array | None = None, activations: str | None = None, slice_bytes: int = 0) -> jax.Array:
    """`einsum(spec, x, weights[name])`, scaled back when the weight is quantized (its `<name>_scale` is present),
    plus each token's LoRA update where the weight has adapter slots (`<name>_lora_a`/`_b`) and `adapters` says
    which slot each token uses.

    A per-output-channel scale is applied once to the [.., out] result instead of to the weight, in float32 (a
    bfloat16 scale would add up to 0.4% of gain error per channel). GPU backends can fuse the int8 -> float
    convert into the matmul's operand read; XLA's CPU backend converts the weight first, into a temporary
    (`slice_bytes`, ModelConfig.dequantize_slice_bytes: see `in_output_slices`).
    `activations` (ModelConfig.quantized_activations): "int8" (quantization="w8a8") multiplies an int8 weight by
    int8 activations, "float8" a float8 weight by float8 activations (FP8 GEMMs on GPUs that have them); see
    `quantized_matmul`. A weight kept in its checkpoint's groups (`Grouped`) is dequantized to x's dtype first,
    unless its values are of `activations`' type with one scale per output channel (one group along its
    contracted axes): it then multiplies quantized activations like a weight quantized at load.
    """
    w, scale = weights[name], weights.get(name + "_scale")
    quantized_gemm = activations is not None and w.dtype == QUANTIZED_ACTIVATIONS[activations][0]
    grouped = scale is not None and scale.ndim == w.ndim  # kept in a checkpoint's groups
    if grouped:
        scale = output_scale(spec, scale) if quantized_gemm else None
    if grouped and scale is None:  # dequantized inside the step, in one elementwise fusion
        y = in_output_slices(spec, weights, name, x.dtype, slice_bytes,
                             lambda part: jnp.einsum(spec, x, dequantized(part, name, x.dtype)))
    elif scale is None:
        y = jnp.einsum(spec, x, w)
    elif quantized_gemm:
        y = (quantized_matmul(spec, x, w, activations) * scale).astype(x.dtype)
    else:
        y = in_output_slices(spec, {name: w}, name, x.dtype, slice_bytes, lambda part: jnp.einsum(
            spec, x, part[name].astype(x.dtype), preferred_element_type=jnp.float32))
        y = (y * scale).astype(x.dtype)
    if adapters is not None and name + "_lora_a" in weights:
        y = y + lora_delta(spec, x, weights[name + "_lora_a"], weights[name + "_lora_b"], adapters)
    return y


def in_output_slices(spec: str, weights: dict[str, jax.Array], name: str, dtype, slice_bytes: int, matmul):
    """`matmul(weights)`, the einsum `spec` of the weight `name` converted to `dtype` inside it; when that
    converted copy would pass `slice_bytes` (0: never), `matmul` of one slice of the weight (its scale and offset
    alike) along its widest output axis after another, the results concatenated. XLA:CPU converts a weight whole
    into a temporary before its matmul: an 8B model's 4096 x 14336 weight in 4-bit groups made a 224 MiB float32
    one, written and read back on every step; in slices of 14 MiB, the batch-1 matmul took 4.0 ms instead of
    18.6 (36.7 under glibc's malloc, which maps such blocks from the kernel every step). Whole layers: 4 of that
    shape at batch 1 in 194 ms instead of 369 (scripts/bench_layer_loop.py --shape llama3-8b --layers 4 --weights
    int4, BENCHMARKS.md)."""
    w = weights[name]
    slices = -(-values_held(w) * jnp.dtype(dtype).itemsize // slice_bytes) if slice_bytes and w.dtype != dtype else 1
    if slices <= 1:
        return matmul(weights)
    x_axes, w_axes, out, _ = _axes(spec)
    # w's own output axes (not one it shares with x, such as the experts' block axis)
    letter = max((a for a in w_axes if a in out and a not in x_axes), key=lambda a: w.shape[w_axes.index(a)])
    axis, size = w_axes.index(letter), w.shape[w_axes.index(letter)]
    step = -(-size // min(slices, size))
    own = {n: a for n, a in weights.items() if n in (name, name + "_scale", name + "_offset")}
    parts = [matmul({n: jax.lax.slice_in_dim(a, start, min(start + step, size), axis=axis) for n, a in own.items()})
             for start in range(0, size, step)]
    return jnp.concatenate(parts, axis=out.index(letter))


def _axes(spec: str) -> tuple[str, str, str, str]:
    """(x's axes, w's axes, the output's, w's contracted axes) of a two-operand einsum spec."""
    inputs, out = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    return x_axes, w_axes, out, "".join(a for a in w_axes if a in x_axes and a not in out)


def output_scale(spec: str, scale: jax.Array) -> jax.Array | None:
    """A kept weight's scales [like w] as a factor of `einsum(spec, x, w)`'s output, when they are one per output
    channel (size 1 along every contracted axis of w); None when they vary along a contracted axis (groups)."""
    _, w_axes, out, contracted = _axes(spec)
    if any(scale.shape[w_axes.index(a)] != 1 for a in contracted):
        return None
    kept = "".join(a for a in w_axes if a not in contracted)
    per_channel = jnp.einsum(f"{w_axes}->{kept}", scale)  # drops the contracted axes (all of size 1)
    order = "".join(a for a in out if a in kept)
    per_channel = jnp.einsum(f"{kept}->{order}", per_channel)
    return per_channel.reshape([per_channel.shape[order.index(a)] if a in order else 1 for a in out])


# The weight and activation type of each activation quantization, its largest value and its sums' type.
QUANTIZED_ACTIVATIONS = {"int8": (jnp.int8, 127.0, jnp.int32), "float8": (jnp.float8_e4m3fn, 448.0, jnp.float32)}


def quantized_matmul(spec: str, x: jax.Array, w: jax.Array, activations: str) -> jax.Array:
    """`einsum(spec, x, w)` for an int8 or float8 `w`, in float32 before the weight's scale, with x quantized per
    row to the same type (dynamic, symmetric: each token's max |x| over the contracted axes / the type's largest
    value, 127 or 448) and multiplied in that type, with int32 or float32 sums. Int8: XLA:CPU then runs an integer
    GEMM rather than converting the weight to float first (offline throughput 1.72x float32's, BENCHMARKS.md).
    Float8: XLA runs an FP8 GEMM on GPUs with compute capability >= 8.9 (vLLM's dynamic per-token FP8). Per-token
    scales keep one token's outlier from costing the others their precision. A row's scale is its max over every
    contracted feature, padding included: padded features must be zero (self_attention zeroes the padded q heads).
    The output must list x's kept axes first (T..., then w's), as every spec here does."""
    dtype, top, sums = QUANTIZED_ACTIVATIONS[activations]
    x_axes, w_axes, out, _ = _axes(spec)
    contracted = tuple(i for i, axis in enumerate(x_axes) if axis in w_axes and axis not in out)
    kept = "".join(axis for axis in x_axes if axis not in w_axes or axis in out)
    assert out.startswith(kept), spec
    x32 = x.astype(jnp.float32)
    x_scale = jnp.max(jnp.abs(x32), axis=contracted, keepdims=True) / top
    x_scale = jnp.where(x_scale > 0, x_scale, 1.0)  # an all-zero row (padding) quantizes to zeros
    scaled = x32 / x_scale
    if activations == "int8":
        scaled = jnp.round(scaled)
    xq = jnp.clip(scaled, -top, top).astype(dtype)  # float8: the cast rounds to nearest
    y = jnp.einsum(spec, xq, w, preferred_element_type=sums).astype(jnp.float32)
    row_scale = jnp.squeeze(x_scale, contracted)
    return y * row_scale.reshape(row_scale.shape + (1,) * (y.ndim - row_scale.ndim))


def lora_delta(spec: str, x: jax.Array, a: jax.Array, b: jax.Array, adapters: jax.Array) -> jax.Array:
    """The LoRA update of `einsum(spec, x, w)`: x @ A @ B with each token's own adapter.

    `a` [N, <contracted axes of w>, R] and `b` [N, R, <produced axes of w>] hold every slot's factors (scale
    folded into B; unused slots and ranks are zeros); `adapters` [T, N] is one-hot per token (all zeros for the
    base model). Every slot's x @ A is computed and the others' zeroed: N * R extra columns, exact, and no gather
    of per-token weights. Adapter loads write slots in place, so nothing recompiles.
    """
    inputs, out = spec.split("->")
    x_axes, w_axes = inputs.split(",")
    contracted = "".join(c for c in w_axes if c in x_axes)
    produced = "".join(c for c in w_axes if c not in x_axes)
    rows = "".join(c for c in x_axes if c not in w_axes)  # the token axis
    xa = jnp.einsum(f"{x_axes},N{contracted}R->{rows}NR", x, a.astype(x.dtype))
    xa = xa * adapters[..., None].astype(x.dtype)
    return jnp.einsum(f"{rows}NR,NR{produced}->{out}", xa, b.astype(x.dtype))


def lora_selection(slots: jax.Array | None, weights: dict[str, jax.Array]) -> jax.Array | None:
    """[T, N] one-hot of each token's adapter slot (`slots` [T], -1 for none: an all-zero row), or None when the
    layers hold no adapter slots."""
    a = next((v for k, v in weights.items() if k.endswith("_lora_a")), None)
    if a is None or slots is None:
        return None
    return jax.nn.one_hot(slots, a.shape[0], dtype=a.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    # Normalise in float32 whatever the activation dtype, as the reference implementations do.
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def inv_freq_of(rope_width: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies of rotary embeddings [rope_width/2], scaled as configured."""
    inv_freq = 1.0 / (theta ** (np.arange(0, rope_width, 2, dtype=np.float64) / rope_width))
    s = scaling
    if s is None:
        return inv_freq.astype(np.float32)
    if s.rope_type == "linear":
        return (inv_freq / s.factor).astype(np.float32)
    if s.rope_type == "frequency_factors":
        return (inv_freq / np.asarray(s.frequency_factors, np.float64)).astype(np.float32)
    if s.rope_type != "llama3":  # longrope's set depends on the context length: ModelConfig.for_context picks it
        raise ValueError(f"rope_type {s.rope_type!r} must be resolved for a context length first (for_context)")
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    scaled = np.where(medium, (1 - smooth) * inv_freq / s.factor + smooth * inv_freq, scaled)
    return scaled.astype(np.float32)


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per attention kind (`cfg.attention_windows`' order): the inverse frequencies [kinds, rope_width/2], and the
    factor cos and sin are scaled by [kinds]. Gemma 3's sliding layers rotate with a base of their own and no
    scaling; NoPE kinds (SmolLM3) have zero frequencies, which rotate nothing."""
    full = inv_freq_of(cfg.rope_width, cfg.rope_theta, cfg.rope_scaling)
    full_factor = cfg.rope_scaling.attention_factor if cfg.rope_scaling else 1.0
    local = (full, full_factor) if cfg.rope_local_theta is None else \
        (inv_freq_of(cfg.rope_width, cfg.rope_local_theta), 1.0)
    # Whether a kind slides decides its base, whatever the other kinds are: a Gemma 3 whose layers all slide has
    # one kind, and it rotates with the local base.
    tables = [(full, full_factor) if window is None else local for window in cfg.window_kinds]
    freqs, factors = [f for f, _ in tables], [s for _, s in tables]
    if cfg.rope_layers:
        freqs, factors = freqs + [np.zeros_like(full)] * len(freqs), factors + [1.0] * len(factors)
    return np.stack(freqs), np.array(factors, np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq, factor=1.0) -> jax.Array:
    """Rotate `x` [T, heads, d] by its token positions (the "rotate half" layout of HF checkpoints). Only the
    first 2 * len(inv_freq) dims of each head turn (all of them but for partial rotary); cos and sin are scaled by
    `factor`."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, r/2]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    if not (isinstance(factor, float) and factor == 1.0):
        cos, sin = cos * factor, sin * factor
    x32 = x.astype(jnp.float32)
    width = 2 * angles.shape[-1]
    x1, x2 = jnp.split(x32[..., :width], 2, axis=-1)
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if width < x.shape[-1]:
        parts.append(x32[..., width:])
    return jnp.concatenate(parts, axis=-1).astype(x.dtype)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


def gated_mlp(x: jax.Array, w: dict[str, jax.Array], activation: str, adapters: jax.Array | None = None,
              activations: str | None = None, slice_bytes: int = 0) -> jax.Array:
    """down(act(gate(x)) * up(x)): SwiGLU with "silu" (Llama), GeGLU with "gelu_tanh" (Gemma); with the
    projections' biases where `w` has them (Llama's mlp_bias)."""
    gate = dense("TD,DF->TF", x, w, "w_gate", adapters, activations, slice_bytes)
    up = dense("TD,DF->TF", x, w, "w_up", adapters, activations, slice_bytes)
    if "b_gate" in w:
        gate, up = gate + w["b_gate"], up + w["b_up"]
    out = dense("TF,FD->TD", ACTIVATIONS[activation](gate) * up, w, "w_down", adapters, activations, slice_bytes)
    return out + w["b_down"] if "b_down" in w else out


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """Gemma 2's soft cap: cap * tanh(x / cap), smooth and bounded by +-cap; identity when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)
