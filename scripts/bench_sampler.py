#!/usr/bin/env python
"""The sampler's top-k/top-p/min-p filter: the sort-free search (runner/top_filter.py) against the plain sorted
version it replaced, side by side on the same logits, on whatever device jax finds.

    python scripts/bench_sampler.py --rows 64 --vocab 49152 [--append BENCHMARKS.md]

Random logits with every row asking for top_k 50, top_p 0.9 and min_p 0.05; each version jitted, warmed up, then
timed (best of --repeats rounds of 10 calls, the versions taking turns). The two must keep the same tokens: the
script checks that first. The last line is the speed-up.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmark_table import append_row, command_line


def best_ms(fn, args, repeats: int) -> float:
    import jax

    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(10):
            jax.block_until_ready(fn(*args))
        best = min(best, (time.perf_counter() - start) / 10 * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--append", metavar="BENCHMARKS.md", help="append a result row to this file")
    args = ap.parse_args()
    if min(args.rows, args.vocab, args.repeats) < 1:
        ap.error("--rows, --vocab and --repeats must be at least 1")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.runner.top_filter import filter_top, filter_top_sorted

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((args.rows, args.vocab)).astype(np.float32) * 3)
    inputs = (logits, jnp.full(args.rows, 50, jnp.int32), jnp.full(args.rows, 0.9, jnp.float32),
              jnp.full(args.rows, 0.05, jnp.float32))
    search, sort = jax.jit(filter_top), jax.jit(filter_top_sorted)
    if not np.array_equal(np.asarray(search(*inputs)), np.asarray(sort(*inputs))):
        sys.exit("the two filters kept different tokens")
    times = {"sort": [], "search": []}
    for _ in range(args.repeats):  # taking turns: this machine's speed drifts from minute to minute
        times["sort"].append(best_ms(sort, inputs, 1))
        times["search"].append(best_ms(search, inputs, 1))
    sort_ms, search_ms = min(times["sort"]), min(times["search"])
    device = jax.devices()[0]
    machine = f"CPU ({os.cpu_count()} cores)" if device.platform == "cpu" else device.device_kind
    print(f"{args.rows} x {args.vocab} on {machine}: sort {sort_ms:.1f} ms, search {search_ms:.1f} ms")
    if args.append:
        append_row(args.append, machine, command_line("bench_sampler.py", args.append),
                   f"{sort_ms:.1f}", f"{search_ms:.1f}", f"**{sort_ms / search_ms:.1f}x**")
    print(f"filter speed-up: {sort_ms / search_ms:.1f}x")


if __name__ == "__main__":
    main()
