#!/usr/bin/env python
"""The decoder layers' matmuls at a model shape, run two ways side by side: one `lax.scan` over weights stacked
on a layers axis, and an unrolled loop over per-layer arrays (runner/layer_loop.py chooses between them).

    python scripts/bench_layer_loop.py [--append BENCHMARKS.md]     # on a GPU: Llama-3-8B shape, bfloat16
    python scripts/bench_layer_loop.py --shape tiny                 # CI, on CPU: checks that the script works
    python scripts/bench_layer_loop.py --shape smollm2 --weights int4   # kept 4-bit groups, on a CPU

Each layer: RMS norm, q/k/v/o and gate/up/down projections (attention itself left out: it reads the KV cache,
not weights), every matmul through the engine's own `models.layers.dense`. `--weights int4` / `int8` keep the
weights in groups of 32 along the contracted axis with a float32 scale (and, for int4, an offset): a GGUF's Q4_1
and Q8_0 blocks, dequantized inside the step as the engine runs them (int4: two values a uint8 byte, unpacked by
the engine). `uint4` holds the same values in XLA's own 4-bit type instead, which XLA:GPU may fuse into its
matmuls (not what the engine stores: a comparison for GPUs). Reports ms per pass and the weight bytes read
per second at batch 1, 8 and 64 (`--batches`), and counts the dynamic-slice ops in the scan's compiled program
(XLA:GPU copies each stacked weight's slice out before its matmul). The last line is the scan's time over the
unrolled loop's at the first batch (1).
"""

from __future__ import annotations

import argparse
from functools import partial

from bench_kernels import timed
from benchmark_table import append_row, command_line

SHAPES = {  # layers, hidden, MLP, q width, kv width
    "llama3-8b": (32, 4096, 14336, 4096, 1024),
    "smollm2": (30, 576, 1536, 576, 192),
    "tiny": (2, 64, 128, 64, 16),
}
BATCHES = (1, 8, 64)
WEIGHTS = ("float", "int4", "uint4", "int8")
GROUP = 32  # values per scale along the contracted axis (GGUF's blocks)


def make_layers(shape: str, dtype, weights: str = "float", num_layers: int | None = None):
    import jax
    import jax.numpy as jnp

    L, D, F, Q, K = SHAPES[shape]
    L = num_layers or L
    shapes = {"wq": (D, Q), "wk": (D, K), "wv": (D, K), "wo": (Q, D), "wg": (D, F), "wu": (D, F), "wd": (F, D)}
    layers = []
    for i in range(L):
        keys = jax.random.split(jax.random.key(i), len(shapes))
        layer = {}
        for key, (name, (k, n)) in zip(keys, shapes.items()):
            if weights == "float":
                layer[name] = jax.random.normal(key, (k, n), dtype) * 0.02
                continue
            values_key, scale_key = jax.random.split(key)
            layer[name + "_scale"] = jax.random.uniform(scale_key, (k // GROUP, n), jnp.float32) * 0.004
            if weights == "int8":
                layer[name] = jax.random.randint(values_key, (k, n), -128, 128, jnp.int32).astype(jnp.int8)
            elif weights == "uint4":  # XLA's own 4-bit type (packed two to a byte on a GPU; a byte each on a CPU)
                layer[name] = jax.random.randint(values_key, (k, n), 0, 16, jnp.int32).astype(jnp.uint4)
                layer[name + "_offset"] = -8 * layer[name + "_scale"]
            else:  # two 4-bit values to a byte along the contracted axis, and an offset per group
                layer[name] = jax.random.randint(values_key, (k // 2, n), 0, 256, jnp.int32).astype(jnp.uint8)
                layer[name + "_offset"] = -8 * layer[name + "_scale"]
        layers.append(layer)
    return layers


def layer(x, w, slice_bytes: int = 0):
    import jax
    import jax.numpy as jnp

    from jaxserve.models.layers import dense

    def mm(h, name):
        return dense("bd,df->bf", h, w, name, slice_bytes=slice_bytes)

    def rms(h):
        return h * jax.lax.rsqrt(jnp.mean(jnp.square(h.astype(jnp.float32)), -1, keepdims=True)).astype(h.dtype)

    h = rms(x)
    q, kv = mm(h, "wq"), mm(h, "wk") + mm(h, "wv")
    x = x + mm(q + jnp.tile(kv, (1, q.shape[-1] // kv.shape[-1])), "wo")
    h = rms(x)
    return x + mm(jax.nn.silu(mm(h, "wg")) * mm(h, "wu"), "wd")


def scanned(x, stacked, slice_bytes: int = 0):
    import jax

    return jax.lax.scan(lambda x, w: (layer(x, w, slice_bytes), None), x, stacked)[0]


def unrolled(x, layers, slice_bytes: int = 0):
    for w in layers:
        x = layer(x, w, slice_bytes)
    return x


HEADER = "### The layer loop: scan over stacked weights vs unrolled over per-layer arrays"
COLUMNS = ("| date | machine | commit | command | shape | layer weights GB | scan ms (batch 1 / 8 / 64) "
           "| unrolled ms (batch 1 / 8 / 64) | scan / unrolled at batch 1 |\n" + "| --- " * 9 + "|\n")


def write_header_once(path: str) -> None:
    """The table's heading and columns, unless the file already has them (BENCHMARKS.md does)."""
    try:
        with open(path) as f:
            if HEADER in f.read():
                return
    except FileNotFoundError:
        pass
    with open(path, "a") as f:
        f.write(f"\n{HEADER}\n\n{COLUMNS}")


def measure(storage: str, args, device, dtype, slice_bytes: int) -> None:
    """Both loops over `storage`'s weights at each batch: the lines printed, and a row appended to --append."""
    import jax
    import jax.numpy as jnp

    layers = make_layers(args.shape, dtype, storage, args.layers)
    weight_bytes = sum(a.nbytes for w in layers for a in w.values())
    stacked = {n: jnp.stack([w[n] for w in layers]) for n in layers[0]}
    ms = {"scan": [], "unrolled": []}
    for B in args.batches:
        x = jnp.ones((B, SHAPES[args.shape][1]), dtype)
        for name, fn, weights in (("scan", scanned, stacked), ("unrolled", unrolled, layers)):
            compiled = jax.jit(partial(fn, slice_bytes=slice_bytes)).lower(x, weights).compile()
            if B == args.batches[0] and name == "scan":
                print(f"scan program: {compiled.as_text().count('dynamic-slice(')} dynamic-slice ops")
            seconds = timed(compiled, x, weights, iters=args.iters)
            ms[name].append(1e3 * seconds)
            print(f"{name:8s} batch {B:3d}: {1e3 * seconds:8.2f} ms, {weight_bytes / seconds / 1e9:7.0f} GB/s of weights")
    if args.append:
        write_header_once(args.append)
        cells = [" / ".join(f"{t:.2f}" for t in ms[name]) for name in ("scan", "unrolled")]
        shape = args.shape + (f" ({len(layers)} layers)" if args.layers else "")
        if args.batches != list(BATCHES):
            shape += f", batches {' / '.join(map(str, args.batches))}"
        if storage != "float":
            shape += f", {storage} groups" + (f", slices of {slice_bytes / 2**20:.3g} MiB" if slice_bytes else "")
        append_row(args.append, device.device_kind, command_line("bench_layer_loop.py", args.append), shape,
                   f"{weight_bytes / 1e9:.2f}", *cells, f"**{ms['scan'][0] / ms['unrolled'][0]:.2f}x**")
    print(f"scan / unrolled at batch {args.batches[0]}: {ms['scan'][0] / ms['unrolled'][0]:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--weights", choices=WEIGHTS, nargs="+", default=["float"],
                    help="float (bfloat16 on an accelerator, float32 on a CPU) or kept groups of int4 / uint4 / int8 "
                         "values; several are measured one after another, a row each, in one process")
    ap.add_argument("--layers", type=int, help="this many of the shape's layers (default: all)")
    ap.add_argument("--slice-mib", type=float,
                    help="convert weights in slices of at most this many MiB of float (0: whole; default: the "
                         "engine's choice, runner/weights.DEQUANTIZE_SLICE_BYTES on a CPU and whole elsewhere)")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES),
                    help="the batch sizes timed, the first of them the ratio's (default: 1 8 64, the table's columns)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--append", metavar="BENCHMARKS.md", help="append the result rows to this file")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    import jaxserve  # noqa: F401  (before the backend starts: the XLA flags engines run with, jaxserve/xla_flags.py)
    from jaxserve.runner.weights import DEQUANTIZE_SLICE_BYTES

    device = jax.devices()[0]
    dtype = jnp.float32 if device.platform == "cpu" else jnp.bfloat16
    if args.slice_mib is None:
        slice_bytes = DEQUANTIZE_SLICE_BYTES if device.platform == "cpu" else 0
    else:
        slice_bytes = int(args.slice_mib * 2**20)
    for storage in args.weights:  # each storage's arrays are freed before the next is made
        measure(storage, args, device, dtype, slice_bytes)


if __name__ == "__main__":
    main()
