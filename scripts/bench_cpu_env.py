#!/usr/bin/env python
"""CPU steps under two process environments, side by side: two engine processes on the same weights, taking
turns on the same requests. What a CPU process's environment decides that no engine option can (it is read
before Python or jax start):

    --compare allocator   glibc's malloc vs tcmalloc (LD_PRELOAD): XLA:CPU allocates each step's temporaries
                          afresh, and glibc maps blocks over 32 MiB from the kernel every time
                          (jaxserve/runner/host_allocator.py)
    --compare scheduler   XLA:CPU's concurrency-optimized scheduler (XLA's default) vs the sequential one
                          jaxserve sets (jaxserve/xla_flags.py): the first keeps more temporaries alive at once

    python scripts/bench_cpu_env.py [--append BENCHMARKS.md]          # allocators, SmolLM2 float32: 1 and 64 requests
    python scripts/bench_cpu_env.py --compare scheduler --quantization gguf   # the GGUF's blocks kept
    python scripts/bench_cpu_env.py --compare scheduler --model DIR --num-prompts 2 --max-tokens 4 --rounds 1 \
        --num-kv-blocks 64                                           # CI: it works

Each process builds its engine and warms up on the workload twice (the prefix cache's hits compile too); then the
processes take turns, --rounds rounds, and each reports its best round (a shared machine's speed drifts from
minute to minute). Output tok/s counts generated tokens; total tok/s adds the prompts'. Minor page faults are
counted in the engine process per generated token: the cost of memory the kernel hands out afresh.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

from bench_throughput import chosen_model, make_engine, make_prompts, model_argument
from benchmark_table import append_row, command_line

from jaxserve.config import LAYER_LOOPS
from jaxserve.engine_args import QUANTIZATIONS
from jaxserve.runner.host_allocator import installed_tcmalloc, mapped_allocator
from jaxserve.xla_flags import cpu_scheduler_flag


def _engine_process(args) -> None:
    """The child: an engine on stdin's orders. Reads the workload sizes from its arguments, warms up, prints its
    allocator, XLA flags and prompt sizes as JSON, then for each line "single" or "batch" runs that workload and
    prints its seconds and minor faults as JSON."""
    from jaxserve import SamplingParams

    engine = make_engine(args.model, args.num_prompts, args.quantization, args.layer_loop, args.num_kv_blocks)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = make_prompts(engine.tokenizer, args.num_prompts)
    workloads = {"single": prompts[:1], "batch": prompts}

    def run(name: str) -> dict:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.perf_counter()
        outs = engine.generate([{"prompt_token_ids": p} for p in workloads[name]], params, use_tqdm=False)
        seconds = time.perf_counter() - started
        assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
        return dict(seconds=seconds, faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)

    for name in [*workloads, *workloads]:  # warm-up: compiles what the workloads use, the prefix cache's hits too
        run(name)
    prompt_tokens = {name: sum(map(len, batch)) for name, batch in workloads.items()}
    print(json.dumps(dict(allocator=mapped_allocator() or "glibc", xla_flags=os.environ.get("XLA_FLAGS", ""),
                          prompt_tokens=prompt_tokens)), flush=True)
    for line in sys.stdin:
        print(json.dumps(run(line.strip())), flush=True)


class EngineProcess:
    def __init__(self, args, preload: str | None = None, xla_flag: str | None = None):
        """An engine process with `preload` as LD_PRELOAD (None: none) and `xla_flag` added to XLA_FLAGS."""
        env = dict(os.environ)
        if preload:
            env["LD_PRELOAD"] = preload
        else:
            env.pop("LD_PRELOAD", None)
        if xla_flag:
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flag}".strip()
        command = [sys.executable, __file__, "--engine-process", "--model", args.model, "--num-prompts",
                   str(args.num_prompts), "--max-tokens", str(args.max_tokens), "--quantization", args.quantization,
                   "--layer-loop", args.layer_loop]
        if args.num_kv_blocks:
            command += ["--num-kv-blocks", str(args.num_kv_blocks)]
        self.proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._reply()
        self.allocator, self.xla_flags, self.prompt_tokens = ready["allocator"], ready["xla_flags"], \
            ready["prompt_tokens"]

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"an engine process ended (exit status {self.proc.wait()}); its errors are above")
        return json.loads(line)

    def run(self, workload: str) -> dict:
        self.proc.stdin.write(workload + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_argument(ap)
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                    help="the engines' weights (default none: float32, a GGUF dequantized at load)")
    ap.add_argument("--layer-loop", choices=LAYER_LOOPS, default="auto", help="the engines' layer loop")
    ap.add_argument("--num-kv-blocks", type=int, help="the engines' KV cache (default: sized from free memory)")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests of the batch workload")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates")
    ap.add_argument("--rounds", type=int, default=3, help="turns each process takes; its best counts")
    ap.add_argument("--compare", choices=("allocator", "scheduler"), default="allocator",
                    help="glibc vs tcmalloc, or XLA:CPU's concurrency-optimized scheduler vs the sequential one")
    ap.add_argument("--tcmalloc", help="the tcmalloc library to preload (default: the one the loader finds)")
    ap.add_argument("--append", metavar="BENCHMARKS.md", help="append the result rows to this file")
    ap.add_argument("--engine-process", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_process:
        _engine_process(args)
        return
    if args.rounds < 1 or args.num_prompts < 1 or args.max_tokens < 1:
        ap.error("--rounds, --num-prompts and --max-tokens must be at least 1")
    args.model = chosen_model(args)
    engines = start_engines(args, ap)
    try:
        best: dict[tuple[str, str], dict] = {}
        for _ in range(args.rounds):
            for workload in ("single", "batch"):
                for name, engine in engines.items():
                    r = engine.run(workload)
                    if (name, workload) not in best or r["seconds"] < best[name, workload]["seconds"]:
                        best[name, workload] = r
    finally:
        for engine in engines.values():
            engine.close()

    baseline, variant = engines
    prompt_tokens = engines[baseline].prompt_tokens
    for workload, requests in (("single", 1), ("batch", args.num_prompts)):
        generated = requests * args.max_tokens
        rates = {}
        for name in engines:
            r = best[name, workload]
            rates[name] = generated / r["seconds"]
            total = (generated + prompt_tokens[workload]) / r["seconds"]
            print(f"{name:8s} {requests} x {args.max_tokens} tokens: {rates[name]:.1f} output tok/s, {total:.1f} "
                  f"total tok/s; {r['faults'] / generated:.0f} minor page faults a generated token", flush=True)
        ratio = rates[variant] / rates[baseline]
        print(f"{requests} request{'s' * (requests > 1)}: {variant}/{baseline} {ratio:.2f}x", flush=True)
        if args.append:
            append_row(args.append, f"{platform.node() or 'cpu'} ({os.cpu_count()} cores, CPU)",
                       command_line("bench_cpu_env.py", args.append),
                       "float32" if args.quantization == "none" else args.quantization,
                       f"{requests} x {args.max_tokens}", f"{baseline} {rates[baseline]:.1f}",
                       f"{variant} {rates[variant]:.1f}", f"{ratio:.2f}x",
                       f"{best[baseline, workload]['faults'] / generated:.0f}",
                       f"{best[variant, workload]['faults'] / generated:.0f}")


def start_engines(args, ap) -> dict[str, EngineProcess]:
    """The baseline's engine process, then the variant's, each checked for the environment it was given."""
    if args.compare == "scheduler":  # both under the allocator this process has (LD_PRELOAD passed on as it is)
        preload = os.environ.get("LD_PRELOAD")
        flags = {name: cpu_scheduler_flag(concurrent=name == "concurrent") for name in ("concurrent", "sequential")}
        engines = {name: EngineProcess(args, preload, flag) for name, flag in flags.items()}
        for name, engine in engines.items():
            if not engine.xla_flags.rstrip().endswith(flags[name]):
                raise SystemExit(f"the {name} engine process ran with XLA_FLAGS={engine.xla_flags!r}")
        return engines
    tcmalloc = args.tcmalloc or installed_tcmalloc()
    if not tcmalloc:
        ap.error("no tcmalloc found: install it (Debian/Ubuntu: apt install libtcmalloc-minimal4) or give --tcmalloc")
    engines = {"glibc": EngineProcess(args), "tcmalloc": EngineProcess(args, tcmalloc)}
    if engines["tcmalloc"].allocator != "tcmalloc":
        raise SystemExit(f"LD_PRELOAD={tcmalloc} did not load tcmalloc into the engine process")
    return engines


if __name__ == "__main__":
    main()
