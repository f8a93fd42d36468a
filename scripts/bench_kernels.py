#!/usr/bin/env python
"""Paged decode attention: jaxserve's Pallas GPU kernel side by side with JAX's bundled
`jax.experimental.pallas.ops.gpu.paged_attention`, and against the roofline (KV bytes read / the device's
measured copy bandwidth). bf16, 32 q heads, 8 kv heads, head_dim 128, 16-token pages, shuffled block tables.

    python scripts/bench_kernels.py [--append BENCHMARKS.md]     # on a GPU: batch {1,8,64,256} x context {512,2048,8192}
    python scripts/bench_kernels.py --tiny                       # CPU, interpret mode: checks that the script works

Prints one row per configuration and, as the last line, the ratio (JAX's time / ours, geometric mean).
Times are per call, the kernel called 20 times in one compiled loop (device time, no host dispatch between
calls; `timed_in_loop`). They are only meaningful on a GPU; --tiny figures are interpreter speed.
"""

from __future__ import annotations

import argparse
import datetime
import math
import time
from dataclasses import dataclass

from benchmark_table import current_commit

FULL = dict(batches=(1, 8, 64, 256), contexts=(512, 2048, 8192), H=32, K=8, d=128, bs=16, dtype="bfloat16")
TINY = dict(batches=(1, 2), contexts=(32, 64), H=4, K=2, d=64, bs=16, dtype="float32")


@dataclass
class Row:
    batch: int
    context: int
    ours_us: float
    jax_us: float
    roofline_us: float
    max_diff: float

    @property
    def speedup(self) -> float:
        return self.jax_us / self.ours_us


CALLS_PER_SAMPLE = 10


def timed(fn, *args, iters: int) -> float:
    """Median seconds per call over `iters` samples, after a warm-up (compile) call. A sample is
    CALLS_PER_SAMPLE calls dispatched back to back and waited for once: the host enqueues the next call while the
    device runs this one, so a kernel shorter than a host round trip (the 1-8 sequence shapes: ~70-100 us per
    call waited for singly on an H100, for microseconds of KV) is not timed as that round trip."""
    import jax

    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = [fn(*args) for _ in range(CALLS_PER_SAMPLE)]
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / CALLS_PER_SAMPLE)
    return sorted(samples)[len(samples) // 2]


LOOP_CALLS = 20


def timed_in_loop(kernel, q, *rest, iters: int, calls: int = LOOP_CALLS) -> float:
    """Median seconds per kernel call, the calls made `calls` at a time inside one compiled loop: device time,
    as the kernel runs inside the engine's step program, with no host dispatch between calls. Each call's q
    takes the previous output times a zero passed in at run time, so the calls form a chain XLA can neither
    hoist out of the loop nor fold away."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def chain(q, zero, *rest):
        def call(_, q_in):
            return q + (kernel(q_in, *rest) * zero).astype(q.dtype)
        return jax.lax.fori_loop(0, calls, call, q)

    return timed(chain, q, jnp.zeros((), q.dtype), *rest, iters=iters) / calls


def copy_bandwidth(nbytes: int, iters: int, calls: int = LOOP_CALLS) -> float:
    """Bytes/s of an elementwise pass over `nbytes` (read once, written once): the achievable memory bandwidth.
    The passes run `calls` at a time in one compiled loop, timed as the kernels are (timed with host dispatch
    between passes, an H200 gave 3164 GB/s, below what its decode kernel then read at)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    passes = jax.jit(lambda a: jax.lax.fori_loop(0, calls, lambda _, a: a + 1, a))
    return 2 * nbytes * calls / timed(passes, x, iters=iters)


def make_inputs(B: int, ctx: int, cfg: dict, seed: int = 0):
    import jax
    import jax.numpy as jnp
    import numpy as np

    pages = ctx // cfg["bs"]
    NB = B * pages + 1  # block 0: the null block
    tables = np.random.default_rng(seed).permutation(np.arange(1, NB))[: B * pages].reshape(B, pages)
    keys = jax.random.split(jax.random.key(seed), 3)
    dtype = jnp.dtype(cfg["dtype"])
    shape = (cfg["K"], NB, cfg["bs"], cfg["d"])  # one layer's pages, the layout both kernels take
    q = jax.random.normal(keys[0], (B, cfg["H"], cfg["d"]), dtype)
    k = jax.random.normal(keys[1], shape, dtype)
    v = jax.random.normal(keys[2], shape, dtype)
    return q, k, v, jnp.asarray(tables, jnp.int32), jnp.full((B,), ctx, jnp.int32)


def bench_one(B: int, ctx: int, cfg: dict, bandwidth: float, interpret: bool, iters: int, tuning: dict) -> Row:
    calls = 2 if interpret else LOOP_CALLS  # the interpreter only checks that the code runs
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as jax_paged_attention

    from pallas_kernels.paged_attention import paged_decode_gpu

    q, k, v, tables, lens = make_inputs(B, ctx, cfg)
    scale = cfg["d"] ** -0.5
    ours = jax.jit(lambda q, k, v, t, n: paged_decode_gpu(q, k, v, t, n, scale=scale, interpret=interpret, **tuning))
    pages = tables.shape[1]
    splits = math.gcd(16, pages)  # JAX's kernel needs its k_splits to divide the pages per sequence
    theirs = jax.jit(lambda q, k, v, t, n: jax_paged_attention(q * scale, k, v, t, n, k_splits=splits,
                                                               pages_per_compute_block=min(8, pages // splits),
                                                               interpret=interpret))
    diff = float(jnp.max(jnp.abs(ours(q, k, v, tables, lens).astype(jnp.float32)
                                 - theirs(q, k, v, tables, lens).astype(jnp.float32))))
    kv_bytes = 2 * B * ctx * cfg["K"] * cfg["d"] * jnp.dtype(cfg["dtype"]).itemsize
    return Row(B, ctx, 1e6 * timed_in_loop(ours, q, k, v, tables, lens, iters=iters, calls=calls),
               1e6 * timed_in_loop(theirs, q, k, v, tables, lens, iters=iters, calls=calls),
               1e6 * kv_bytes / bandwidth, diff)


def table(rows: list[Row]) -> str:
    lines = ["| batch | context | ours (us) | JAX paged_attention (us) | JAX / ours | ours % of roofline | max abs diff |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r.batch} | {r.context} | {r.ours_us:.1f} | {r.jax_us:.1f} | {r.speedup:.2f}x | "
              f"{100 * r.roofline_us / r.ours_us:.0f}% | {r.max_diff:.1e} |" for r in rows]
    return "\n".join(lines)


def append_results(path: str, rows: list[Row], device: str, bandwidth: float, command: str) -> None:
    commit = current_commit()
    header = "## Paged decode kernel: jaxserve Pallas vs jax.experimental.pallas.ops.gpu.paged_attention"
    try:
        with open(path) as f:
            has_header = header in f.read()
    except FileNotFoundError:  # a fresh file (a GPU session's $OUT)
        has_header = False
    with open(path, "a") as f:
        if not has_header:
            f.write(f"\n{header}\n\nbf16, 32 q heads, 8 kv heads, head_dim 128, 16-token pages, shuffled block tables; "
                    "roofline = KV bytes read / measured copy bandwidth.\n")
        f.write(f"\n{datetime.date.today()}, {device}, commit {commit}, `{command}`, "
                f"measured copy bandwidth {bandwidth / 1e9:.0f} GB/s:\n\n{table(rows)}\n")


def as_flags(knobs: dict) -> str:
    """This script's flags for the kernel settings `knobs` (keyword -> value)."""
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in knobs.items())


def main() -> None:
    from pallas_kernels.gpu_pages import PREFETCH_MODES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes in interpret mode (CPU): checks the script")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per kernel and configuration")
    ap.add_argument("--append", metavar="BENCHMARKS.md", help="append the table to this file")
    ap.add_argument("--shapes", nargs="+", metavar="BATCHxCONTEXT", help="only these (default: all 12)")
    for flag in ("pages-per-block", "num-splits", "num-warps", "num-stages", "target-programs"):
        ap.add_argument(f"--{flag}", type=int, help="override the decode kernel's default (for tuning)")
    ap.add_argument("--prefetch", choices=PREFETCH_MODES, help="load the next block's page ids or tiles ahead "
                    "(for tuning; gpu_pages.attend_pages)")
    args = ap.parse_args()
    tuning = {k: v for k in ("pages_per_block", "num_splits", "num_warps", "num_stages", "target_programs", "prefetch")
              if (v := getattr(args, k)) is not None}

    import jax

    cfg = TINY if args.tiny else FULL
    device = jax.devices()[0]
    if not args.tiny and device.platform != "gpu":
        raise SystemExit(f"this benchmark needs a GPU (found {device.platform}); use --tiny to check it on CPU")
    iters = args.iters or (2 if args.tiny else 20)
    bandwidth = copy_bandwidth((64 << 20) if args.tiny else (2 << 30), iters)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else \
        [(B, ctx) for B in cfg["batches"] for ctx in cfg["contexts"]]
    rows = [bench_one(B, ctx, cfg, bandwidth, args.tiny, iters, tuning) for B, ctx in shapes]
    print(f"device: {device.device_kind}; measured copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(table(rows))
    if args.append:
        command = " ".join(["scripts/bench_kernels.py", *(["--tiny"] if args.tiny else []),
                            *([as_flags(tuning)] if tuning else [])])
        append_results(args.append, rows, device.device_kind, bandwidth, command)
    ratio = math.exp(sum(math.log(r.speedup) for r in rows) / len(rows))
    print(f"ratio JAX paged_attention time / ours (geometric mean over {len(rows)} configs): {ratio:.2f}x")


if __name__ == "__main__":
    main()
