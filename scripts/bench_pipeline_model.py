#!/usr/bin/env python
"""A step-time model of pipeline parallelism in steady decode, from decode steps measured on one device.

    python scripts/bench_pipeline_model.py --shape llama3-8b --batch 64 --rounds 1 --append BENCHMARKS.md  # GPU
    python scripts/bench_pipeline_model.py [--append BENCHMARKS.md]   # SmolLM2-135M's shape, batch 16
    python scripts/bench_pipeline_model.py --shape tiny --layers 64 --batch 2 --stages 2  # CI: the script works

The model subtracts step times, so it needs steady ones: on the 2-core CI VM, SmolLM2's 30-layer decode step at
batch 8 measured 72 ms in one engine and 122 ms in the next (2026-11-28), which swings the ratios by 2x; a GPU's
steps are steady. Each step time is the fastest of several runs' mean step, taken over --rounds fresh engines.

A pipeline stage runs a share of the layers, so its time is measured as such: decode steps of engines holding
k = L, ceil(L/2), ... layers (dummy weights; k layers of the model's shape), at the batch sizes a stage sees.
Two engines' times at the same batch split a step into a per-layer part and a fixed part (embedding, final
norm, LM head, sampler, host). With pp stages of s = ceil(L/pp) layers on pp devices and a decode batch of B:

  data parallelism  pp replicas of the whole model, B/pp sequences each: B / (L layer(B/pp) + fixed(B/pp))
  fill-drain        a step's M = min(pp, ...) micro-batches through the stages within the step (what a pipeline
                    runs without async scheduling): pp + M - 1 ticks of one stage's layers, then the fixed part
                    once: B / ((pp + M - 1) s layer(B/M) + fixed(B))
  stages busy       steps kept in flight across ticks (what a pipeline runs with async scheduling, the default):
                    every tick each stage runs one step's layers, at the largest batch b of the steps in its
                    stages, and the step leaving the last stage is sampled. The vocabulary-sized work of the fixed
                    part (LM head, sampler) is split over all pp devices (the vocabulary is), the rest is not:
                    tokens a tick / (s layer(b) + vocab(b) / pp + rest(b)). A third engine of s layers with an
                    eighth of the vocabulary tells the two apart (the fixed part's change is the vocabulary's).

The stages-busy line uses the engine's own schedule, recorded: the real scheduler and pipeline run B sequences
of steady decode on pp fake CPU devices (a tiny model: the schedule depends on the scheduler, not on the
weights), and report the tokens each tick completes, the batch b its stages run at, and how many ticks each
stage was busy on (the engine's stats). Ideal: B/pp tokens a tick, b = B/pp, every stage busy on every tick.

Throughputs are decode tokens per second; each is printed relative to data parallelism on the same devices.
Stage hand-offs (a ppermute of b x hidden values per tick) are left out: they are what the model cannot see.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_synthetic import SHAPES, write_model_dir
from benchmark_table import append_row, command_line

PROMPT_LEN = 8
WARM_STEPS = 3  # the first decode steps compile
TIMED_RUNS, TIMED_STEPS = 4, 8
RECORDED_TICKS = 24  # ticks of steady decode whose schedule is recorded


def decode_step_seconds(model_dir: Path, num_layers: int, batches: set[int], vocab: int = 0) -> dict[int, float]:
    """Seconds per decode step at each of `batches` sequences, on one engine of `num_layers` layers and a
    vocabulary of `vocab` (0: the shape's): at each batch, the fastest of TIMED_RUNS runs of TIMED_STEPS steps,
    each run's mean (noise only ever adds time, and the model subtracts step times). One engine serves every batch
    (`shared_engines` groups only batches whose steps run unpadded on one): at the 8B shape on a GPU an engine's
    dummy weights and first programs take most of a minute. With async scheduling, as replicas and pipelines both run
    by default: a step's host work overlaps the device's where the machine lets it, so the fixed part is what it
    does not hide. (One `step()` call is no step time then: it may only read back a step already done.)"""
    from jaxserve import Engine, SamplingParams

    overrides = {"num_hidden_layers": num_layers} | ({"vocab_size": vocab} if vocab else {})
    most = max(batches)
    engine = Engine(str(model_dir), load_format="dummy", hf_overrides=overrides, **engine_limits(most),
                    num_kv_blocks=most * 4 + 1, max_model_len=64, warmup=False)
    params = SamplingParams(max_tokens=1 + WARM_STEPS + TIMED_RUNS * TIMED_STEPS, ignore_eos=True, temperature=0)
    seconds = {}
    for batch in sorted(batches):
        for i in range(batch):
            engine.add_request(f"{batch}-{i}", {"prompt_token_ids": [2 + (i + j) % 97 for j in range(PROMPT_LEN)]},
                               params)
        engine.step()  # the prefill (one step: the budget holds every prompt)
        for _ in range(WARM_STEPS):
            engine.step()
        runs = []
        for _ in range(TIMED_RUNS):
            started = time.perf_counter()
            for _ in range(TIMED_STEPS):
                engine.step()
            runs.append((time.perf_counter() - started) / TIMED_STEPS)
        seconds[batch] = min(runs)
        while engine.has_unfinished_requests():  # the step in flight, before the next batch's requests
            engine.step()
    return seconds


def engine_limits(most: int) -> dict:
    """The step limits of the engine `decode_step_seconds` builds for batches of up to `most` sequences: every
    prompt of the largest batch prefills in one step."""
    return dict(max_num_seqs=most, max_num_batched_tokens=most * PROMPT_LEN)


def engine_buckets(most: int):
    """The step buckets an engine of `engine_limits(most)` runs (one device: the limits are a step's own)."""
    from jaxserve.runner.buckets import Buckets

    limits = engine_limits(most)
    return Buckets.for_limits(limits["max_num_batched_tokens"], limits["max_num_seqs"])


def shared_engines(batches: set[int]) -> list[set[int]]:
    """`batches` in groups that one engine each times: the largest with every smaller batch whose decode step runs
    at its own size there (a bucket of that engine), the others likewise among themselves. A batch padded to a
    larger bucket would time the larger step."""
    groups, left = [], sorted(batches, reverse=True)
    while left:
        buckets = engine_buckets(left[0])
        group = {b for b in left if buckets.shape(b, b) == (b, b)}
        groups.append(group)
        left = [b for b in left if b not in group]
    return groups


def record_schedule(pp: int, batch: int) -> dict:
    """The engine's schedule of `batch` sequences in steady decode on a pp-stage pipeline, recorded in a child
    process on pp fake CPU devices (the device count is fixed when jax starts): see `_record`."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={pp}")
    done = subprocess.run([sys.executable, __file__, "--record-schedule", str(pp), str(batch)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"recording the schedule of pp={pp} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _record(pp: int, batch: int) -> dict:
    """Run `batch` requests until each has a token (every prompt in, the pipeline full), then RECORDED_TICKS more
    steps: the tokens they completed a tick, the largest step batch, and each stage's busy ticks."""
    from jaxserve import Engine, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir("tiny", Path(tmp), num_hidden_layers=pp)
        engine = Engine(str(model_dir), load_format="dummy", mesh=f"1x{pp}", max_num_seqs=batch,
                        max_num_batched_tokens=batch * PROMPT_LEN, max_model_len=128, warmup=False, dtype="float32")
    assert engine.stage_ticks, "the engine does not keep its stages busy across steps"
    params = SamplingParams(max_tokens=RECORDED_TICKS + 4 * pp, ignore_eos=True, temperature=0)
    for i in range(batch):
        engine.add_request(str(i), {"prompt_token_ids": [2 + (i + j) % 97 for j in range(PROMPT_LEN)]}, params)
    tokens = {}
    while len(tokens) < batch:
        tokens |= {o.request_id: len(o.outputs[0].token_ids) for o in engine.step()}
    sizes = []
    real_plan = engine._plan  # the step batches planned while recording

    def plan(*args, **kwargs):
        planned = real_plan(*args, **kwargs)
        sizes.append(0 if planned is None else len(planned[0].chunks))
        return planned

    engine._plan = plan
    before, counted = engine.stats(), sum(tokens.values())
    for _ in range(RECORDED_TICKS):
        tokens |= {o.request_id: len(o.outputs[0].token_ids) for o in engine.step()}
    after = engine.stats()
    busy = [b - a for a, b in zip(before["pipeline_stage_busy_ticks"], after["pipeline_stage_busy_ticks"])]
    return dict(ticks=after["pipeline_ticks"] - before["pipeline_ticks"], stage_busy=busy,
                tokens_per_tick=(sum(tokens.values()) - counted) / RECORDED_TICKS, step_batch=max(sizes))


def stage_shape(num_layers: int, batch: int, pp: int) -> tuple[int, int]:
    """(layers a stage, micro-batches a step) of pp stages at `batch`, as parallel/pipeline.py cuts them."""
    from jaxserve.parallel.pipeline import num_microbatches

    return math.ceil(num_layers / pp), num_microbatches(batch, pp)


def small_vocab(vocab: int) -> int:
    return max(vocab // 8, 128)  # prompts use token ids below 100


def step_times_needed(num_layers: int, vocab: int, batch: int, pp: int,
                      step_batch: int | None = None) -> set[tuple[int, int, int]]:
    """The (layers, batch, vocabulary; 0: the shape's) step times `model` reads for pp stages (`step_batch`: the
    recorded schedule's)."""
    stage, micro = stage_shape(num_layers, batch, pp)
    step_batch = step_batch or batch // pp
    batches = {batch // pp, batch // micro, batch, step_batch}
    whole_vocab = {(layers, n, 0) for layers in (num_layers, stage) for n in batches}
    return whole_vocab | {(stage, step_batch, small_vocab(vocab))}


def model(measure, num_layers: int, vocab: int, batch: int, pp: int, recorded: dict | None = None) -> dict:
    """The three throughputs of pp stages at `batch`, from `measure(layers, batch, vocab)` -> seconds per step
    (vocab 0: the shape's own, `vocab`), and `recorded`: the engine's schedule (`record_schedule`; None: the ideal
    one)."""
    stage, micro = stage_shape(num_layers, batch, pp)
    recorded = recorded or dict(tokens_per_tick=batch / pp, step_batch=batch // pp)

    def parts(n: int) -> tuple[float, float]:
        whole, share = measure(num_layers, n, 0), measure(stage, n, 0)
        per_layer = (whole - share) / (num_layers - stage)
        if per_layer <= 0:
            raise SystemExit(f"at batch {n}, {num_layers} layers stepped no slower than {stage} ({1e3 * whole:.2f} vs "
                             f"{1e3 * share:.2f} ms): the machine's noise is larger than the layers' time; rerun "
                             "on a quiet machine or with a larger --batch")
        return per_layer, whole - num_layers * per_layer

    layer_dp, fixed_dp = parts(batch // pp)
    layer_micro, _ = parts(batch // micro)
    _, fixed_batch = parts(batch)
    b = recorded["step_batch"]
    layer_tick, fixed_tick = parts(b)
    v = small_vocab(vocab)  # the fixed part with an eighth of the vocabulary: what it loses is the vocabulary's
    vocab_part = min(max(0.0, (fixed_tick - (measure(stage, b, v) - stage * layer_tick)) * vocab / (vocab - v)),
                     fixed_tick)
    dp = batch / (num_layers * layer_dp + fixed_dp)
    fill_drain = batch / ((pp + micro - 1) * stage * layer_micro + fixed_batch)
    busy = recorded["tokens_per_tick"] / (stage * layer_tick + vocab_part / pp + fixed_tick - vocab_part)
    return dict(pp=pp, micro=micro, stage_layers=stage, data_parallel=dp, fill_drain=fill_drain, busy=busy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    ap.add_argument("--batch", type=int, default=16, help="decode sequences in a step")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4], metavar="PP")
    ap.add_argument("--rounds", type=int, default=2, help="times each step time is measured, in a fresh engine "
                    "each (the fastest counts)")
    ap.add_argument("--append", metavar="BENCHMARKS.md", help="append the result rows to this file")
    ap.add_argument("--record-schedule", nargs=2, type=int, metavar=("PP", "BATCH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.record_schedule:  # the child process of record_schedule
        print(json.dumps(_record(*args.record_schedule)))
        return
    num_layers, vocab = args.layers or SHAPES[args.shape]["num_hidden_layers"], SHAPES[args.shape]["vocab_size"]
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    for pp in args.stages:
        if not 1 < pp <= num_layers or args.batch % pp:
            ap.error(f"--stages {pp}: each needs 1 < PP <= {num_layers} (the layers) dividing --batch "
                     f"{args.batch}")

    schedules = {pp: record_schedule(pp, args.batch) for pp in args.stages}
    for pp, r in schedules.items():
        print(f"pp={pp} schedule of {args.batch} sequences, recorded over {r['ticks']} ticks: stages busy on "
              f"{r['stage_busy']} ticks, {r['tokens_per_tick']:.2f} tokens a tick, steps of <= {r['step_batch']} "
              f"sequences", flush=True)

    import jax

    device = jax.devices()[0].device_kind
    needed = sorted(set().union(*(step_times_needed(num_layers, vocab, args.batch, pp, schedules[pp]["step_batch"])
                                  for pp in args.stages)))
    by_model: dict[tuple[int, int], set[int]] = {}  # (layers, vocabulary) -> the batches timed at that model
    for layers, batch, v in needed:
        by_model.setdefault((layers, v), set()).add(batch)
    engines = [(key, group) for key, batches in sorted(by_model.items(), reverse=True)
               for group in shared_engines(batches)]
    times: dict[tuple[int, int, int], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(args.shape, Path(tmp))
        for _ in range(args.rounds):  # every step time once, then again: each keeps its fastest
            for (layers, v), batches in engines:
                for batch, seconds in decode_step_seconds(model_dir, layers, batches, v).items():
                    times[layers, batch, v] = min(times.get((layers, batch, v), math.inf), seconds)
                    # printed as measured: a run cut by a time limit still leaves its step times
                    print(f"decode step, {layers} layers, batch {batch}, vocabulary {v or vocab}: "
                          f"{1e3 * seconds:.2f} ms", flush=True)
    results = [model(lambda *key: times[key], num_layers, vocab, args.batch, pp, schedules[pp])
               for pp in args.stages]
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
