#!/usr/bin/env python
"""Sweep the Pallas GPU decode kernel's tuning knobs at the shapes of scripts/bench_kernels.py and print the
fastest settings per shape: how its defaults (pallas_kernels/paged_attention/gpu.py) were chosen.

    python scripts/tune_decode_kernel.py                    # on a GPU: pages x warps x stages x prefetch (x splits)
    python scripts/tune_decode_kernel.py --shapes 64x2048   # one shape
    python scripts/tune_decode_kernel.py --tiny             # CPU, interpret mode: checks the script

Splits (flash-decoding) are swept below batch 64 only, where sequences x kv heads leave SMs idle. The last line
names the setting with the best geometric-mean time over the shapes.
"""

from __future__ import annotations

import argparse
import itertools
import math

from bench_kernels import FULL, LOOP_CALLS, TINY, make_inputs, timed_in_loop

GRID = dict(pages_per_block=(2, 4, 8, 16), num_warps=(4, 8), num_stages=(1, 2, 3), prefetch=(False, True),
            num_splits=(None, 4, 16))
TINY_GRID = dict(pages_per_block=(1, 2), num_warps=(4,), num_stages=(1,), prefetch=(False,), num_splits=(None,))
SHAPES = ((64, 2048), (1, 512), (8, 8192), (256, 2048), (64, 8192), (256, 512))


def settings(grid: dict, batch: int):
    splits = grid["num_splits"] if batch < 64 else (None,)
    for p, w, s, f, n in itertools.product(grid["pages_per_block"], grid["num_warps"], grid["num_stages"],
                                           grid["prefetch"], splits):
        yield dict(pages_per_block=p, num_warps=w, num_stages=s, prefetch=f, num_splits=n)


def sweep(batch: int, context: int, cfg: dict, grid: dict, interpret: bool, iters: int) -> dict[tuple, float]:
    """Microseconds per call of each setting (tuple of its values) at one shape."""
    import jax

    from pallas_kernels.paged_attention import paged_decode_gpu

    inputs = make_inputs(batch, context, cfg)
    scale = cfg["d"] ** -0.5
    times = {}
    for knobs in settings(grid, batch):
        fn = jax.jit(lambda q, k, v, t, n, knobs=knobs: paged_decode_gpu(q, k, v, t, n, scale=scale,
                                                                          interpret=interpret, **knobs))
        times[tuple(knobs.items())] = 1e6 * timed_in_loop(fn, *inputs, iters=iters, calls=2 if interpret else LOOP_CALLS)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape and grid in interpret mode (CPU)")
    ap.add_argument("--shapes", nargs="+", metavar="BATCHxCONTEXT", help="default: six of bench_kernels' shapes")
    ap.add_argument("--iters", type=int, default=None)
    args = ap.parse_args()
    cfg, grid = (TINY, TINY_GRID) if args.tiny else (FULL, GRID)
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else \
        [(2, 32)] if args.tiny else SHAPES
    iters = args.iters or (1 if args.tiny else 10)
    by_shape = {}
    for batch, context in shapes:
        times = sweep(batch, context, cfg, grid, args.tiny, iters)
        by_shape[batch, context] = times
        print(f"batch {batch} x context {context}:")
        for knobs, us in sorted(times.items(), key=lambda kv: kv[1])[:5]:
            print(f"  {us:9.1f} us  {dict(knobs)}")
    common = set.intersection(*(set(t) for t in by_shape.values()))  # settings every shape tried
    best = min(common, key=lambda k: sum(math.log(t[k]) for t in by_shape.values()))
    print(f"best over {len(shapes)} shapes (geometric mean): {dict(best)}")


if __name__ == "__main__":
    main()
