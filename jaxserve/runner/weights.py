"""Build a model abstractly and fill it with checkpoint weights placed straight onto their devices.

Each weight is read, padded for the mesh (parallel/padding.py) and handed to `jax.device_put` with the sharding
its logical names give, one weight at a time: every device receives only its own slice, and the host holds at
most one (padded) weight beyond the checkpoint reader's own buffers. A quantized model's matmul weights are
quantized on the host as they are read (runner/quantize.py), so only int8 values travel to the devices. A
quantized checkpoint's weights (GGUF, compressed-tensors, FP8, GPTQ, AWQ) can instead stay in the groups they were
stored in (loader/grouped.py): values, scales and offsets padded for the mesh alike, 4-bit values packed two to
a byte, dequantized inside each step (models/layers.dequantized).

A dummy load (`load_format="dummy"`) reads nothing: each weight's random HF tensors are drawn and stacked
(loader/random_weights.py), then padded and quantized by the same functions as a checkpoint's, inside one jitted
program whose outputs carry the weight's sharding, so each device computes only its own slice and the host holds
none of it. On a CPU, whose devices are host memory, the tensors are drawn on the host and placed like a
checkpoint's instead: a program per weight costs more compile time there (~0.5 s each) than it saves.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.config import BLOCK_QUANTIZATIONS, ModelConfig
from jaxserve.loader.grouped import GroupedArray, pack_nibbles
from jaxserve.loader.random_weights import RandomWeights
from jaxserve.loader.weights import TensorSource, keep_blocks, load_params, param_builders
from jaxserve.models.layers import PACKED_4BIT, Grouped, GroupedWeights
from jaxserve.models.lora import is_lora_path
from jaxserve.models.registry import abstract_model
from jaxserve.parallel.layout import ParallelLayout, plan_layout
from jaxserve.parallel.padding import pad_axis, pad_weight
from jaxserve.parallel.sharding import mesh_axis, named_sharding
from jaxserve.runner.layer_loop import per_layer_logical, split_layers
from jaxserve.runner.quantize import quantize

log = logging.getLogger(__name__)
# The most bytes of a weight's float copy made at once inside a step on a CPU (ModelConfig.dequantize_slice_bytes):
# in cache, and well under glibc's 32 MiB mmap threshold beside the step's other temporaries. An 8B model's MLP
# weight in 4-bit groups, batch 1: 4.4 ms in slices of 14 MiB, 5.8 ms of 3.5 MiB, 36.7 ms whole; SmolLM2's single
# stream (its kept head sliced) peaks at 4-8 MiB (BENCHMARKS.md).
DEQUANTIZE_SLICE_BYTES = 8 << 20


def _flat_abstract(cfg: ModelConfig, dtype, quantization: str | None = None):
    graphdef, abstract = abstract_model(cfg, dtype, quantization)
    return graphdef, dict(nnx.to_flat_state(abstract))


FP8_GEMM_ENV = "JAXSERVE_FP8_GEMM"  # "1" or "0": FP8 GEMMs forced on (numerics on a CPU) or off (a GPU comparison)


def fp8_gemms(devices) -> bool:
    """Whether float8 weights multiply float8 activations (an FP8 GEMM: twice bfloat16's tensor-core rate and no
    convert of the weight): on GPUs of compute capability >= 8.9 (Ada, Hopper, Blackwell), as vLLM does. Elsewhere
    (older GPUs, TPU v5e/v6e, CPU) a float8 weight is converted to the compute dtype inside its matmul."""
    forced = os.environ.get(FP8_GEMM_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return all(d.platform == "gpu" and float(getattr(d, "compute_capability", 0) or 0) >= 8.9 for d in devices)


def holds_float8(quantization: str | GroupedWeights | None) -> bool:
    """Whether the model's matmul weights are float8: quantized at load (fp8) or kept from an FP8 checkpoint."""
    if isinstance(quantization, dict):
        return any(group.float8 for group in quantization.values())
    return quantization == "fp8"


def load_weights(cfg: ModelConfig, tensors: TensorSource, dtype, mesh: Mesh, layout: ParallelLayout | None = None,
                 quantization: str | None = None, per_layer: bool = False, dummy_on_devices: bool | None = None):
    """-> (graphdef, params) of the model under `layout`'s effective config (default: no padding, one stage);
    with `quantization="int8"`, every matmul weight is quantized on the host as it is read (a dummy load's on
    the devices); the checkpoint's own method ("gguf", "compressed-tensors", "fp8", "gptq", "awq":
    resolve_quantization) keeps its quantized weights. `per_layer`: each
    layer weight is placed as a tuple of per-layer arrays (runner/layer_loop.split_layers, grouped by stage slot
    when `layout` has several stages), split on the host so the device never holds a stacked copy beside them
    (except a `jaxserve convert` checkpoint's, restored stacked).
    `dummy_on_devices`: where a dummy load draws its tensors (None: on the devices unless they are CPUs)."""
    layout = layout or plan_layout(cfg, 1, 1)
    if hasattr(tensors, "restore"):  # a `jaxserve convert` checkpoint: stored padded, each process reads its shards
        if cfg.lora_slots:
            raise ValueError("LoRA adapters cannot be served on a `jaxserve convert` checkpoint yet: serve the "
                             "original model (HF directory or GGUF) with enable_lora instead")
        if quantization is not None:
            raise ValueError(f"quantization={quantization!r} quantizes weights as they are read from the original "
                             "checkpoint, and a `jaxserve convert` checkpoint holds placed float weights: serve the "
                             "original model (HF directory or GGUF) with this quantization instead")
        return tensors.restore(cfg, dtype, mesh, layout)
    platform = mesh.devices.flat[0].platform
    checkpoint_activations = None  # "int8": a kept W8A8 checkpoint's matmuls quantize their inputs too
    if quantization is not None and quantization == getattr(tensors, "method", None):
        checkpoint_activations = getattr(tensors, "activations", None)
        # the contracted axes a mesh splits over tp: the MLP's (dense, shared, and the experts' unless whole experts
        # go to each device: expert parallelism)
        split = {"shared_down": layout.shared_mlp // layout.tp}
        if not (cfg.num_experts and cfg.expert_parallel):
            split["w_down"] = layout.mlp // layout.tp
        quantization, tensors = keep_blocks(cfg, tensors, split)
        quantization = quantization or None  # nothing kept (a GGUF of float tensors): float weights
    _, real = _flat_abstract(cfg, dtype)  # checkpoint shapes, checked before padding
    model_cfg = layout.effective_config(cfg)
    if holds_float8(quantization) and fp8_gemms(mesh.devices.flat):
        model_cfg = dataclasses.replace(model_cfg, quantized_activations="float8")
        log.info("float8 weights multiply float8 activations (FP8 GEMMs, each token's activations scaled per step)")
    elif checkpoint_activations:
        model_cfg = dataclasses.replace(model_cfg, quantized_activations=checkpoint_activations)
        log.info("the checkpoint's %s weights multiply %s activations, each token's scaled per step, as it was "
                 "quantized", checkpoint_activations, checkpoint_activations)
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    if platform == "cpu" and mesh.devices.size == 1:  # on a mesh, slices of a sharded axis would move data
        model_cfg = dataclasses.replace(model_cfg, dequantize_slice_bytes=DEQUANTIZE_SLICE_BYTES)
    graphdef, flat = _flat_abstract(model_cfg, dtype, quantization)
    if dummy_on_devices is None:
        dummy_on_devices = platform != "cpu"
    stages = layout.pp if per_layer else None  # how split_layers groups a layer weight's arrays, if at all
    if isinstance(tensors, RandomWeights) and dummy_on_devices:
        placed = _random_on_devices(cfg, tensors, np_dtype, mesh, layout, flat, real, stages)
    else:
        placed = {}
        for path, array in load_params(cfg, tensors, np_dtype):
            _check_shape(path, array, real)
            split = stages if path[0] == "layers" else None
            for part_path, part in _prepared(cfg, path, array, flat, layout).items():
                placed[part_path] = flat[part_path].replace(_place(part, _logical(flat, part_path), mesh, split))
            del array, part
    for path in filter(is_lora_path, flat):  # adapter slots start empty (zeros); runner/lora_weights.py fills them
        var = flat[path]
        sharding = named_sharding(mesh, var.get_metadata()["logical"])
        placed[path] = var.replace(jax.jit(lambda v=var: jax.numpy.zeros(v.shape, v.dtype), out_shardings=sharding)())
    missing = set(flat) - set(placed)
    if missing:
        raise ValueError(f"the checkpoint provides no weights for {sorted('.'.join(p) for p in missing)}")
    log.info(describe_storage(placed, quantization))
    return graphdef, nnx.from_flat_state(list(placed.items()))


def resolve_quantization(quantization: str | None, tensors: TensorSource | None, platform: str) -> str | None:
    """The engine's quantization for this checkpoint. A quantized checkpoint's weights are kept in their blocks
    (loader/weights.keep_blocks) when `quantization` names its method ("gguf", "compressed-tensors", "fp8", "gptq",
    "awq", "mxfp4"), and by default, but for float8 and float4 values on a CPU, which it dequantizes at load.
    "none" dequantizes them at load everywhere (None: float weights). A quantization done at load (int8, w8a8, fp8
    of a float checkpoint) quantizes the dequantized weights."""
    if quantization == "none":
        return None
    method = getattr(tensors, "method", None)
    if quantization in BLOCK_QUANTIZATIONS and quantization != method:
        held = f"a {method} checkpoint" if method else "not a quantized checkpoint jaxserve keeps in blocks"
        raise ValueError(f"quantization={quantization!r} keeps a {quantization} checkpoint's quantized weights in "
                         f"their blocks, and this model is {held}: drop the option"
                         + (f" or pass quantization={method!r}" if method else ""))
    if quantization is not None or method is None:
        return quantization
    # On a CPU, integer groups (GGUF's blocks, GPTQ, AWQ, compressed-tensors int4/int8 and W8A8) beat float32
    # weights, dequantized in each matmul (SmolLM2's Q4_1: 1.37x single stream, 0.96x at 64 requests) or
    # multiplying int8 activations (W8A8: 1.29x, 1.33x), at a fraction of the bytes (BENCHMARKS.md). XLA:CPU
    # converts float8 and float4 values in software: ~0.87x and ~0.35x float32's speed per layer at batch 1.
    keeps = platform != "cpu" or not low_bit_float_weights(method, tensors)
    return method if keeps else None


def low_bit_float_weights(quantization: str | None, tensors: TensorSource | None) -> bool:
    """Whether `resolve_quantization`'s choice holds layer weights as float8 or float4 values: quantized to fp8 at
    load, or kept in an FP8 or MXFP4 checkpoint's groups. A CPU runs such layers unrolled
    (runner/layer_loop.resolve_layer_loop)."""
    if quantization == "fp8":
        return True
    kept = quantization is not None and quantization == getattr(tensors, "method", None)
    return kept and getattr(tensors, "float_values", False)


def stored_bytes(array) -> int:
    """The bytes an array takes on its device: numpy's itemsize counts a float4 as a byte, XLA stores two a byte."""
    bits = jax.numpy.finfo(array.dtype).bits if array.dtype.name == "float4_e2m1fn" else 8 * array.dtype.itemsize
    return array.size * bits // 8


def _values_kind(fmt: Grouped) -> str:
    return "float8" if fmt.float8 else "float4 e2m1" if fmt.float4 else f"{fmt.bits}-bit"


def describe_storage(placed: dict, quantization: str | GroupedWeights | None) -> str:
    """One log line: how the weights are stored, and the bytes the fullest device holds."""
    kinds: dict[str, int] = {}
    per_device: dict = {}
    for path, var in placed.items():
        name = path[-1]
        for array in jax.tree.leaves(var.get_value()):
            if name.endswith(("_scale", "_offset")):
                kind = "scales"
            else:
                kind = {jax.numpy.dtype(PACKED_4BIT).name: "4-bit pairs", "int8": "int8", "float8_e4m3fn": "fp8",
                        "float4_e2m1fn": "fp4"}.get(array.dtype.name, array.dtype.name)
            for shard in array.addressable_shards:
                size = stored_bytes(shard.data)
                per_device[shard.device] = per_device.get(shard.device, 0) + size
                if shard.device == array.addressable_shards[0].device:
                    kinds[kind] = kinds.get(kind, 0) + size
    if isinstance(quantization, dict):
        formats: dict[Grouped, list[str]] = {}
        for name, fmt in quantization.items():
            formats.setdefault(fmt, []).append(name)
        kept = "; ".join(f"{', '.join(names)}: {_values_kind(fmt)} in groups of {fmt.group}"
                         f"{' with offsets' if fmt.offset else ''}{', scales per output channel' if fmt.channel else ''}"
                         for fmt, names in formats.items())
        how = f"kept in the checkpoint's quantized blocks ({kept}), the others in float"
    else:
        how = f"{quantization} quantized at load" if quantization else "in float"
    mib = 2**20
    split = ", ".join(f"{kind} {size / mib:.1f}" for kind, size in sorted(kinds.items(), key=lambda kv: -kv[1]))
    return (f"weights {how}: {max(per_device.values(), default=0) / mib:.1f} MiB on the fullest device "
            f"(one device's MiB by storage: {split})")


def _random_on_devices(cfg: ModelConfig, tensors: RandomWeights, dtype, mesh: Mesh, layout: ParallelLayout,
                       flat: dict, real: dict, stages: int | None) -> dict:
    """A dummy load: each weight made by one jitted program straight into its sharding (module docstring)."""
    placed = {}
    for path, build in param_builders(cfg, tensors.generate, tensors.stack, dtype):
        split = stages if path[0] == "layers" else None

        def make(build=build, path=path, split=split):
            array = build()
            _check_shape(path, array, real)
            parts = _prepared(cfg, path, array, flat, layout)
            return {p: a if split is None else split_layers(a, split) for p, a in parts.items()}

        shardings = {p: _sharding(_logical(flat, p), mesh, flat[p].shape[0], split) for p in _part_paths(path, flat)}
        for part_path, part in jax.jit(make, out_shardings=shardings)().items():
            placed[part_path] = flat[part_path].replace(part)
    return placed


def _check_shape(path, array, real: dict) -> None:
    if tuple(array.shape) != tuple(real[path].shape):
        raise ValueError(f"weight {'.'.join(path)} has shape {array.shape} in the checkpoint but the config "
                         f"implies {real[path].shape}")


def _logical(flat: dict, path) -> tuple[str, ...]:
    return flat[path].get_metadata()["logical"]


def _prepared(cfg: ModelConfig, path, array, flat: dict, layout: ParallelLayout) -> dict:
    """The weight at `path` padded for the mesh: {path: array}, or for a quantized weight its int8 values and
    float32 scales, {path: values, path_scale: scales} (a checkpoint's groups: _prepared_groups). Numpy in, numpy
    out; jax in, jax out."""
    logical = _logical(flat, path)
    if isinstance(array, GroupedArray):
        return _prepared_groups(cfg, path, array, logical, _logical(flat, _suffixed(path, "_scale")), layout)
    array = pad_weight(array, logical, layout, cfg.num_kv_heads)
    if len(paths := _part_paths(path, flat)) == 1:
        return {path: array}
    contract = tuple(i for i, name in enumerate(logical) if name not in _logical(flat, paths[1]))
    return dict(zip(paths, quantize(array, contract, flat[path].get_value().dtype)))


def _prepared_groups(cfg: ModelConfig, path, array: GroupedArray, logical: tuple[str, ...],
                     scale_logical: tuple[str, ...], layout: ParallelLayout) -> dict:
    """A weight kept in groups, padded for the mesh: the values like a float weight's; the scales and offsets on
    every axis but the group axis alike, and on the group axis to the padded size over the group (padded groups
    are zeros: zero weights). 4-bit values are then packed two to a byte along the group axis. Per-channel scales
    (`scale_logical` leaves out the contracted axes, models/layers.weight) are one over every contracted axis."""
    values = pad_weight(array.values, logical, layout, cfg.num_kv_heads)
    if scale_logical != logical:
        return {path: values, _suffixed(path, "_scale"): _per_channel(path, array.scale, logical, scale_logical,
                                                                       layout, cfg.num_kv_heads)}
    axis, group = array.axis, array.group
    if values.shape[axis] % group:
        raise ValueError(f"{'.'.join(path)} is quantized in groups of {group} along {logical[axis]!r}, which this mesh "
                         f"pads to {values.shape[axis]}: not whole groups; use a mesh with fewer tensor-parallel devices")
    split = {"tp": layout.tp, "pp": layout.pp}.get(mesh_axis(logical[axis]), 1)
    if (values.shape[axis] // group) % split:
        raise ValueError(f"{'.'.join(path)} is quantized in groups of {group} along {logical[axis]!r} "
                         f"({values.shape[axis] // group} groups), which this mesh splits over {split} devices: not "
                         f"whole groups on each; use a mesh with fewer tensor-parallel devices")
    unpadded_axis = logical[:axis] + (None,) + logical[axis + 1:]

    def groups(a: np.ndarray) -> np.ndarray:
        return pad_axis(pad_weight(a, unpadded_axis, layout, cfg.num_kv_heads), axis, values.shape[axis] // group)

    parts = {path: pack_nibbles(values, axis) if array.format.packed else values, _suffixed(path, "_scale"):
             groups(array.scale)}
    if array.offset is not None:
        parts[_suffixed(path, "_offset")] = groups(array.offset)
    return parts


def _per_channel(path, scale: np.ndarray, logical: tuple[str, ...], scale_logical: tuple[str, ...],
                 layout: ParallelLayout, num_kv_heads: int) -> np.ndarray:
    """A per-channel scale in its groups' layout (repeated over the groups of each contracted axis: wo's heads)
    as one over each contracted axis, padded like the weight's other axes."""
    for axis, (name, kept) in enumerate(zip(logical, scale_logical)):
        if name != kept and scale.shape[axis] > 1:
            first = scale.take([0], axis=axis)
            if not np.array_equal(scale, np.broadcast_to(first, scale.shape)):
                raise ValueError(f"{'.'.join(map(str, path))}: its scales vary along {name!r}, so they are not one per "
                                 "output channel as its format says")
            scale = first
    return pad_weight(scale, scale_logical, layout, num_kv_heads)


def _suffixed(path, suffix: str):
    return path[:-1] + (path[-1] + suffix,)


def _part_paths(path, flat: dict) -> tuple:
    """The parameters the checkpoint weight at `path` becomes: itself, or its quantized values and their scales
    (and offsets)."""
    return (path,) + tuple(p for p in (_suffixed(path, "_scale"), _suffixed(path, "_offset")) if p in flat)


def _sharding(logical: tuple[str, ...], mesh: Mesh, num_layers: int, stages: int | None):
    """The output sharding of a weight made on the devices; one per `split_layers` array when it is split over
    `stages` (None: kept stacked)."""
    if stages is None:
        return named_sharding(mesh, logical)
    return (named_sharding(mesh, per_layer_logical(logical, stages)),) * (num_layers // stages)


def _place(array: np.ndarray, logical: tuple[str, ...], mesh: Mesh, stages: int | None):
    """The host array on the mesh; a stacked layer weight as its `split_layers` arrays when split over `stages`
    (None: kept stacked), each placed on its own."""
    if stages is None:
        return jax.device_put(array, named_sharding(mesh, logical))
    sharding = named_sharding(mesh, per_layer_logical(logical, stages))
    return tuple(jax.device_put(layer, sharding) for layer in split_layers(array, stages))
