#!/usr/bin/env python
"""Sweep the Pallas GPU decode kernel's tuning knobs at the shapes of scripts/bench_kernels.py and print the
fastest settings per shape: how its defaults (pallas_kernels/paged_attention/gpu.py) were chosen.

    python scripts/tune_decode_kernel.py                    # on a GPU: pages x warps x stages x prefetch x target
    python scripts/tune_decode_kernel.py --shapes 64x2048   # one shape
    python scripts/tune_decode_kernel.py --tiny             # CPU, interpret mode: checks the script

Splits (flash-decoding) are swept as the kernel chooses them, through target_programs: a setting is then one
rule for every shape, not a split count fitted to one. The last line names the setting with the best
geometric-mean time over the shapes; --best FILE also writes it as bench_kernels.py flags.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import math

from bench_kernels import FULL, LOOP_CALLS, TINY, as_flags, make_inputs, timed_in_loop

GRID = dict(pages_per_block=(4, 8), num_warps=(2, 4), num_stages=(1, 2), prefetch=("none", "pages", "tiles"),
            target_programs=(512, 2048))
TINY_GRID = dict(pages_per_block=(1, 2), num_warps=(4,), num_stages=(1,), prefetch=("none", "pages"),
                 target_programs=(512,))
SHAPES = ((64, 2048), (1, 512), (8, 8192), (256, 2048), (64, 8192), (256, 512))


def settings(grid: dict):
    for values in itertools.product(*grid.values()):
        yield dict(zip(grid, values))


def sweep(batch: int, context: int, cfg: dict, grid: dict, interpret: bool, iters: int) -> dict[tuple, float]:
    """Microseconds per call of each setting (tuple of its values) at one shape; settings that fail to compile
    or run are reported and left out."""
    import jax

    from pallas_kernels.paged_attention import paged_decode_gpu

    inputs = make_inputs(batch, context, cfg)
    scale = cfg["d"] ** -0.5
    times = {}
    for knobs in settings(grid):
        fn = jax.jit(lambda q, k, v, t, n, knobs=knobs: paged_decode_gpu(q, k, v, t, n, scale=scale,
                                                                          interpret=interpret, **knobs))
        try:
            times[tuple(knobs.items())] = 1e6 * timed_in_loop(fn, *inputs, iters=iters,
                                                              calls=2 if interpret else LOOP_CALLS)
        except Exception as e:  # a setting the compiler refuses (resources, tile sizes) drops out of the sweep
            print(f"  failed: {knobs}: {str(e).splitlines()[0][:200]}", flush=True)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny shape and grid in interpret mode (CPU)")
    ap.add_argument("--shapes", nargs="+", metavar="BATCHxCONTEXT", help="default: six of bench_kernels' shapes")
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--best", metavar="FILE", help="write the best setting here, as bench_kernels.py flags")
    args = ap.parse_args()
    cfg, grid = (TINY, TINY_GRID) if args.tiny else (FULL, GRID)
    import jax

    if not args.tiny and jax.devices()[0].platform != "gpu":
        raise SystemExit(f"this sweep needs a GPU (found {jax.devices()[0].platform}); use --tiny to check it on CPU")
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else \
        [(2, 32)] if args.tiny else SHAPES
    iters = args.iters or (1 if args.tiny else 10)
    by_shape = {}
    default = default_setting(grid)
    for batch, context in shapes:
        times = sweep(batch, context, cfg, grid, args.tiny, iters)
        by_shape[batch, context] = times
        print(f"batch {batch} x context {context}:")
        for knobs, us in sorted(times.items(), key=lambda kv: kv[1])[:5]:
            print(f"  {us:9.1f} us  {dict(knobs)}")
        if default in times:
            print(f"  {times[default]:9.1f} us  the kernel's defaults")
        best = best_setting(by_shape)
        if args.best and best:  # after every shape: a sweep cut short by a time limit still leaves its answer so far
            with open(args.best, "w") as f:
                f.write(as_flags(dict(best)) + "\n")
    if best is None:
        raise SystemExit("no setting ran at every shape")
    print(f"best over {len(shapes)} shapes (geometric mean): {dict(best)}")


def best_setting(by_shape: dict) -> tuple | None:
    common = set.intersection(*(set(t) for t in by_shape.values()))  # settings every shape ran
    return min(common, key=lambda k: sum(math.log(t[k]) for t in by_shape.values()), default=None)


def default_setting(grid: dict) -> tuple:
    """The kernel's own defaults for the knobs the grid sweeps, as a setting key."""
    from pallas_kernels.paged_attention import paged_decode_gpu

    params = inspect.signature(paged_decode_gpu).parameters
    return tuple((k, params[k].default) for k in grid)


if __name__ == "__main__":
    main()
