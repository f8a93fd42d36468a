#!/usr/bin/env python
"""Offline throughput: jaxserve's Engine.generate vs transformers' batched generate, side by side, same
prompts, same weights (the default SmolLM2 GGUF, float32 on CPU). Prints the ratio as the last line.

    python scripts/bench_throughput.py --num-prompts 64 --max-tokens 128 [--append BENCHMARKS.md]
    python scripts/bench_throughput.py --num-prompts 1 --hf-batch-sizes 1      # single-stream decode

Both sides are warmed up first (jaxserve compiles its step buckets; transformers runs one batch), so the
figures are steady-state generation. Every request generates exactly --max-tokens tokens (EOS ignored on both).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import time


def make_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    words = "the a of model engine token batch serve fast river mountain code data cache page block".split()
    return [tokenizer(" ".join(rng.choice(words) for _ in range(rng.randint(8, 40))))["input_ids"] for _ in range(n)]


def bench_jaxserve(gguf: str, prompts, max_tokens: int) -> tuple[float, float]:
    from jaxserve import Engine, SamplingParams

    t0 = time.perf_counter()
    engine = Engine(gguf, max_model_len=512, max_num_seqs=len(prompts),
                    max_num_batched_tokens=min(1024, 64 * len(prompts)), warmup=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts, params, use_tqdm=False)  # warm-up: compiles every bucket this workload uses
    warmup = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return len(prompts) * max_tokens / elapsed, warmup


def bench_transformers(gguf: str, prompts, max_tokens: int, batch_sizes: list[int]) -> tuple[float, int]:
    """transformers' throughput at its best batch size among `batch_sizes`: (tok/s, that batch size)."""
    import torch
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return max((_transformers_at(model, prompts, max_tokens, b), b) for b in batch_sizes)


def _transformers_at(model, prompts, max_tokens: int, batch_size: int) -> float:
    import torch

    pad = 2

    def run(batch):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding for generation
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           do_sample=False, pad_token_id=pad)

    run(prompts[:batch_size])  # warm-up
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        run(prompts[i : i + batch_size])
    return len(prompts) * max_tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=None,
                    help="transformers batch sizes to try; the best counts (default: 8 16 32 64, capped at the prompts)")
    ap.add_argument("--append", metavar="BENCHMARKS.md", help="append a result row to this file")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from jaxserve.loader.default_model import default_model_path

    gguf = str(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    prompts = make_prompts(tokenizer, args.num_prompts)
    ours, warmup = bench_jaxserve(gguf, prompts, args.max_tokens)
    sizes = args.hf_batch_sizes or sorted({min(b, args.num_prompts) for b in (8, 16, 32, 64)})
    theirs, best_batch = bench_transformers(gguf, prompts, args.max_tokens, sizes)
    ratio = ours / theirs
    print(f"jaxserve: {ours:.1f} tok/s (warm-up/compile {warmup:.0f} s)   "
          f"transformers: {theirs:.1f} tok/s (best batch size {best_batch} of {sizes})")
    if args.append:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        row = (f"| {datetime.date.today()} | {platform.node() or 'cpu'} ({os.cpu_count()} cores, CPU) | {commit} | "
               f"`scripts/bench_throughput.py --num-prompts {args.num_prompts} --max-tokens {args.max_tokens}` | "
               f"{ours:.1f} | {theirs:.1f} (batch {best_batch}) | {ratio:.2f}x |\n")
        with open(args.append, "a") as f:
            f.write(row)
    print(f"ratio jaxserve/transformers: {ratio:.2f}x")


if __name__ == "__main__":
    main()
