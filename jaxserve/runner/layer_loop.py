"""How the decoder layers run: one `lax.scan` over weights stacked on a `layers` axis, or an unrolled loop over
per-layer arrays.

Weights are loaded stacked (the sharding table, the pipeline's stages and LoRA's adapter slots all work on the
`layers` axis). Under a scan, XLA:GPU copies each layer's slice of every stacked weight out of the stack before
its matmul (an async dynamic-slice fusion per weight in the compiled HLO), so a decode step moves the layer
weights three times: read, write, read again. Measured on an H100 at the Llama-3-8B shape (BENCHMARKS.md), a
batch-1 pass over the 32 layers' matmuls took 15.97 ms scanned and 7.32 ms unrolled over per-layer arrays.

"unrolled" places each layer weight as per-layer arrays (split on the host while loading, runner/weights.py;
`unstack_layers` splits what arrives stacked) and runs the layers as a Python loop: every matmul reads its own
buffer in place. The program grows with depth, so compiles take longer; "auto" unrolls on GPU. CPU keeps
the scan for float weights (compile time dominates there: tests and warm-up compile every bucket; SmolLM2's cold
warm-up took 38 s scanned and 130 s unrolled on the 2-core CI VM), and for weights kept in integer groups, but not
for experts or float8/float4 weights, which a scan makes several times slower (`resolve_layer_loop`). TPU keeps the
scan but for experts (not measured here).

A pipeline (pp > 1) unrolls too. Its stages split the stacked `layers` axis, so per-layer arrays are grouped by
slot instead: one array [pp, ...] per slot j of a stage, holding layer s * slots + j of each stage s and split
over the pipeline axis like the stack. Inside a stage's program (parallel/pipeline.py) each such array is the
stage's own layer j with a leading axis of one, which a reshape drops for free: every matmul still reads its
weight in place, and the stages run the same code as one device.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.config import LAYER_LOOPS
from jaxserve.models.lora import is_lora_path
from jaxserve.parallel.sharding import named_sharding

log = logging.getLogger(__name__)


def resolve_layer_loop(choice: str, platform: str, experts: bool = False, low_bit_floats: bool = False) -> str:
    """"auto": unrolled on GPU, everywhere for a mixture of experts (`experts`), and on a CPU for layer weights
    held as float8 or float4 values (`low_bit_floats`: fp8 at load, FP8 and MXFP4 checkpoints). A scan hands each
    layer a slice of the stacked weights: the expert loop cannot read it in place, so XLA:CPU copied every expert
    of the layer each step (a 2-layer model's batch-1 decode step: 19.8 ms scanned, 0.83 ms unrolled); and XLA:CPU
    cannot slice a float8 or float4 array inside a loop, so it converted the whole stack to float16 before the
    loop, every step (SmolLM2's shape, batch 1: ~6x the unrolled layers' time). Integer groups (GGUF blocks, GPTQ, AWQ, int4/int8
    compressed-tensors) scan at the unrolled layers' speed (scripts/bench_layer_loop.py --weights int4)."""
    if choice not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {', '.join(LAYER_LOOPS)}, got {choice!r}")
    if choice == "auto":
        return "unrolled" if platform == "gpu" or experts or (platform == "cpu" and low_bit_floats) else "scan"
    return choice


def split_layers(stacked, stages: int = 1) -> tuple:
    """A stacked layer weight [L, ...] (numpy or jax) -> the unrolled loop's per-layer arrays: L arrays [...] on
    one stage; over `stages` pipeline stages, one array [stages, ...] per slot (module docstring)."""
    if stages == 1:
        return tuple(stacked[i] for i in range(stacked.shape[0]))
    grouped = stacked.reshape(stages, stacked.shape[0] // stages, *stacked.shape[1:])
    return tuple(grouped[:, j] for j in range(grouped.shape[1]))


def per_layer_logical(logical: tuple, stages: int = 1) -> tuple:
    """The logical axes of `split_layers`' arrays: the stack's less `layers`, or with it when `layers` now
    counts the stages (the pipeline axis splits it as it split the stack)."""
    return logical[1:] if stages == 1 else logical


def unstack_layers(params, stages: int = 1):
    """`params` with each layer weight still stacked [L, ...] (a `jaxserve convert` checkpoint's, restored so)
    replaced by its `split_layers` arrays, sharded by `per_layer_logical` (as loading places them,
    runner/weights.py). LoRA adapter slots stay stacked: runner/lora_weights.py writes into them at run
    time. Each stacked array is freed as soon as it is split; `params` must not be used afterwards. The device
    holds one weight twice meanwhile, which the KV cache sizing counts (it reads the peak memory in use)."""
    flat = dict(nnx.to_flat_state(params))
    for key, var in flat.items():
        if key[0] != "layers" or is_lora_path(key) or isinstance(var.get_value(), tuple):
            continue
        stacked = var[...]
        sharding = named_sharding(stacked.sharding.mesh, per_layer_logical(var.get_metadata()["logical"], stages))
        split = jax.jit(lambda a: split_layers(a, stages), out_shardings=sharding)
        flat[key] = var.replace(split(stacked))
        stacked.delete()
    return nnx.from_flat_state(list(flat.items()))


def unrolled_layers(layer_fn, weights: dict, x: jax.Array, kv, meta, *, kinds: list[int] | None = None):
    """The drop-in for the model's `scan_layers` over unstacked weights: tuples are indexed per layer (their own
    buffers); what stayed stacked is sliced statically.

    `kinds`: each layer's attention kind (`cfg.layer_kinds()`) when layers differ (Gemma 2/3). Unrolled, a
    layer's kind is known while tracing, so it goes in as a Python int in place of the traced `attn_kind`: the
    layer's program holds only its own kind's attention, not a `lax.switch` over every kind's kernel (a run-time
    branch per layer, and each kernel variant compiled into every layer)."""
    num_layers = next(len(v) for v in weights.values() if isinstance(v, tuple))
    for i in range(num_layers):
        layer_weights = {name: w[i] for name, w in weights.items()}
        if kinds is not None and kinds[i] is not None:  # None: this layer's kind stays traced
            layer_weights["attn_kind"] = kinds[i]
        x, kv = layer_fn((x, kv), layer_weights, jnp.int32(i), meta)
    return x, kv


def unrolled_stage_layers(layer_fn, weights: dict, x: jax.Array, kv, meta, *, kinds: list[int | None] | None = None):
    """`unrolled_layers` inside a pipeline stage's program (parallel/pipeline.py), where each per-layer array is
    this stage's share [1, ...] of a slot's [pp, ...] array: its one row is the stage's own layer. `kinds`: each
    slot's attention kind where its layers agree on every stage (`slot_kinds`); elsewhere it stays traced."""
    own = {name: tuple(a[0] for a in w) if isinstance(w, tuple) else w for name, w in weights.items()}
    return unrolled_layers(layer_fn, own, x, kv, meta, kinds=kinds)


def slot_kinds(kinds: list[int], layer_slots: list[int], slots: int) -> list[int | None]:
    """Each stage slot's attention kind, given each real layer's (`cfg.layer_kinds()`) and its slot over all
    stages (`ParallelLayout.layer_slots`): every stage runs one program, so a slot's kind is static only when the
    real layers in it agree on every stage (None otherwise). A padded slot's zero-weight layer adds nothing
    whatever its kind."""
    seen: list[set[int]] = [set() for _ in range(slots)]
    for kind, slot in zip(kinds, layer_slots, strict=True):
        seen[slot % slots].add(kind)
    return [next(iter(k)) if len(k) == 1 else None for k in seen]
