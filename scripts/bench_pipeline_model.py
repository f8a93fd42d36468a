#!/usr/bin/env python
"""A step-time model of pipeline parallelism in steady decode, from decode steps measured on one device.

    python scripts/bench_pipeline_model.py --shape llama3-8b --batch 64 --rounds 1 --append BENCHMARKS.md  # GPU
    python scripts/bench_pipeline_model.py [--append BENCHMARKS.md]   # SmolLM2-135M's shape, batch 16
    python scripts/bench_pipeline_model.py --shape tiny --batch 4     # CI: checks that the script works

The model subtracts step times, so it needs steady ones: on the 2-core CI VM, SmolLM2's 30-layer decode step at
batch 8 measured 72 ms in one engine and 122 ms in the next (2026-11-28), which swings the ratios by 2x; a GPU's
steps are steady. Each step time is the fastest of several steps, taken over --rounds fresh engines.

A pipeline stage runs a share of the layers, so its time is measured as such: decode steps of engines holding
k = L, ceil(L/2), ... layers (dummy weights; k layers of the model's shape), at the batch sizes a stage sees.
Two engines' times at the same batch split a step into a per-layer part and a fixed part (embedding, final
norm, LM head, sampler, host). With pp stages of s = ceil(L/pp) layers on pp devices and a decode batch of B:

  data parallelism  pp replicas of the whole model, B/pp sequences each: B / (L layer(B/pp) + fixed(B/pp))
  fill-drain        what parallel/pipeline.py runs today: M = min(pp, ...) micro-batches within a step, pp + M - 1
                    ticks of one stage's layers, then the fixed part once: B / ((pp + M - 1) s layer(B/M) + fixed(B))
  stages busy       pp batches of B/pp in flight across steps (vLLM's pipeline, not built yet): every tick each
                    stage runs one batch's layers and one batch completes: (B/pp) / (s layer(B/pp) + fixed(B/pp))

Throughputs are decode tokens per second; each is printed relative to data parallelism on the same devices.
Stage hand-offs (a ppermute of B/M x hidden values per tick) are left out: they are what the model cannot see.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from bench_synthetic import SHAPES, write_model_dir
from benchmark_table import append_row, command_line

PROMPT_LEN = 8
WARM_STEPS = 3  # the first decode steps compile
TIMED_STEPS = 16


def decode_step_seconds(model_dir: Path, num_layers: int, batch: int) -> float:
    """The fastest of TIMED_STEPS synchronous decode steps at `batch` sequences, on an engine of `num_layers`
    layers (noise only ever adds time, and the model subtracts step times)."""
    from jaxserve import Engine, SamplingParams

    engine = Engine(str(model_dir), load_format="dummy", hf_overrides={"num_hidden_layers": num_layers},
                    max_num_seqs=batch, max_num_batched_tokens=batch * PROMPT_LEN, num_kv_blocks=batch * 4 + 1,
                    max_model_len=64, warmup=False, async_scheduling=False)
    params = SamplingParams(max_tokens=1 + WARM_STEPS + TIMED_STEPS, ignore_eos=True, temperature=0)
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": [2 + (i + j) % 97 for j in range(PROMPT_LEN)]}, params)
    engine.step()  # the prefill (one step: the budget holds every prompt)
    for _ in range(WARM_STEPS):
        engine.step()
    times = []
    for _ in range(TIMED_STEPS):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    return min(times)


def stage_shape(num_layers: int, batch: int, pp: int) -> tuple[int, int]:
    """(layers a stage, micro-batches a step) of pp stages at `batch`, as parallel/pipeline.py cuts them."""
    from jaxserve.parallel.pipeline import num_microbatches

    return math.ceil(num_layers / pp), num_microbatches(batch, pp)


def step_times_needed(num_layers: int, batch: int, pp: int) -> set[tuple[int, int]]:
    """The (layers, batch) step times `model` reads for pp stages."""
    stage, micro = stage_shape(num_layers, batch, pp)
    return {(layers, n) for layers in (num_layers, stage) for n in (batch // pp, batch // micro, batch)}


def model(measure, num_layers: int, batch: int, pp: int) -> dict:
    """The three throughputs of pp stages at `batch`, from `measure(layers, batch)` -> seconds per step."""
    stage, micro = stage_shape(num_layers, batch, pp)

    def parts(n: int) -> tuple[float, float]:
        whole, share = measure(num_layers, n), measure(stage, n)
        per_layer = (whole - share) / (num_layers - stage)
        if per_layer <= 0:
            raise SystemExit(f"at batch {n}, {num_layers} layers stepped no slower than {stage} ({1e3 * whole:.2f} vs "
                             f"{1e3 * share:.2f} ms): the machine's noise is larger than the layers' time; rerun "
                             "on a quiet machine or with a larger --batch")
        return per_layer, whole - num_layers * per_layer

    layer_dp, fixed_dp = parts(batch // pp)
    layer_micro, _ = parts(batch // micro)
    _, fixed_batch = parts(batch)
    dp = batch / (num_layers * layer_dp + fixed_dp)
    fill_drain = batch / ((pp + micro - 1) * stage * layer_micro + fixed_batch)
    busy = (batch / pp) / (stage * layer_dp + fixed_dp)
    return dict(pp=pp, micro=micro, stage_layers=stage, data_parallel=dp, fill_drain=fill_drain, busy=busy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--batch", type=int, default=16, help="decode sequences in a step")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4], metavar="PP")
    ap.add_argument("--rounds", type=int, default=2, help="times each step time is measured, in a fresh engine "
                    "each (the fastest counts)")
    ap.add_argument("--append", metavar="BENCHMARKS.md", help="append the result rows to this file")
    args = ap.parse_args()
    num_layers = SHAPES[args.shape]["num_hidden_layers"]
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    for pp in args.stages:
        if not 1 < pp <= num_layers or args.batch % pp:
            ap.error(f"--stages {pp}: each needs 1 < PP <= {num_layers} (the shape's layers) dividing --batch "
                     f"{args.batch}")

    import jax

    device = jax.devices()[0].device_kind
    needed = sorted(set().union(*(step_times_needed(num_layers, args.batch, pp) for pp in args.stages)))
    times: dict[tuple[int, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(args.shape, Path(tmp))
        for _ in range(args.rounds):  # every step time once, then again: each keeps its fastest
            for key in needed:
                times[key] = min(times.get(key, math.inf), decode_step_seconds(model_dir, *key))
    for (layers, batch), seconds in times.items():
        print(f"decode step, {layers} layers, batch {batch}: {1e3 * seconds:.2f} ms", flush=True)
    results = [model(lambda layers, n: times[layers, n], num_layers, args.batch, pp) for pp in args.stages]
    for r in results:
        dp = r["data_parallel"]
        layers = f"{r['stage_layers']} layer{'s' * (r['stage_layers'] > 1)}"
        line = (f"pp={r['pp']} ({layers} a stage, {r['micro']} micro-batches), batch {args.batch}: "
                f"data parallel {dp:.0f} tok/s; fill-drain {r['fill_drain']:.0f} ({r['fill_drain'] / dp:.2f}x); "
                f"stages busy {r['busy']:.0f} ({r['busy'] / dp:.2f}x)")
        print(line, flush=True)
        if args.append:
            append_row(args.append, f"{device} (one device, {jax.device_count()} in all)",
                       command_line("bench_pipeline_model.py", args.append), args.shape, str(r["pp"]),
                       str(args.batch), f"{dp:.0f}", f"{r['fill_drain'] / dp:.2f}x", f"{r['busy'] / dp:.2f}x")


if __name__ == "__main__":
    main()
