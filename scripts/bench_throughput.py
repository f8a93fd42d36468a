#!/usr/bin/env python
"""Offline throughput: jaxserve's Engine.generate vs transformers' batched generate, side by side, same
prompts, same weights (the default SmolLM2 GGUF, or --model: a GGUF file or a Hugging Face directory; float32
on CPU). Prints the ratio as the last line.

    python scripts/bench_throughput.py --num-prompts 64 --max-tokens 128 [--append BENCHMARKS.md]
    python scripts/bench_throughput.py --num-prompts 1 --hf-batch-sizes 1      # single-stream decode
    python scripts/bench_throughput.py --num-prompts 1 --quantization int8 --llama-cpp   # + llama.cpp, Q4_1 GGUF
    python scripts/bench_throughput.py --quantization gguf --also-float32   # the GGUF's 4-bit blocks vs float32

Every side is warmed up first (jaxserve compiles its step buckets; transformers and llama.cpp run once), then
the sides take turns, --repeats rounds, and each reports its best round: on a shared machine whose speed
drifts from minute to minute, interleaving keeps the ratio fair. Every request generates exactly --max-tokens
tokens (EOS ignored everywhere). llama.cpp (`pip install llama-cpp-python`, a 10-minute build) runs the prompts
one after another, as single streams.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from benchmark_table import append_row, command_line

from jaxserve.config import LAYER_LOOPS
from jaxserve.engine_args import QUANTIZATIONS


def make_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    words = "the a of model engine token batch serve fast river mountain code data cache page block".split()
    return [tokenizer(" ".join(rng.choice(words) for _ in range(rng.randint(8, 40))))["input_ids"] for _ in range(n)]


def make_engine(model_path: str, max_num_seqs: int, quantization: str | None = None, layer_loop: str = "auto",
                num_kv_blocks: int | None = None):
    """The engine the throughput scripts time: every request in one batch, prompts of up to 512 tokens, each
    program compiled when first needed (the scripts warm up on their own workload)."""
    from jaxserve import Engine

    return Engine(model_path, max_model_len=512, max_num_seqs=max_num_seqs, quantization=quantization,
                  max_num_batched_tokens=min(1024, 64 * max_num_seqs), layer_loop=layer_loop,
                  num_kv_blocks=num_kv_blocks, warmup=False)


def jaxserve_runner(model_path: str, prompts, max_tokens: int, quantization: str | None, layer_loop: str = "auto"):
    """-> run() that times one Engine.generate over every prompt, after a warm-up that compiles what it uses."""
    from jaxserve import SamplingParams

    engine = make_engine(model_path, len(prompts), quantization, layer_loop)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def run() -> float:
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return elapsed

    return run


def hf_location(model: str) -> dict:
    """from_pretrained's arguments for a model given as a GGUF file or a Hugging Face directory."""
    if model.endswith(".gguf"):
        d, f = os.path.split(model)
        return dict(pretrained_model_name_or_path=d, gguf_file=f)
    return dict(pretrained_model_name_or_path=model)


def load_transformers(model: str):
    """transformers' float32 model of `model`; a compressed-tensors checkpoint decompressed to float32 (as the
    tests read one: its packed int4 layers do not load into a plain model)."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    options = {}
    config = os.path.join(model, "config.json")
    if os.path.isfile(config):
        with open(config) as f:
            method = (json.load(f).get("quantization_config") or {}).get("quant_method")
        if method == "compressed-tensors":
            options["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    return AutoModelForCausalLM.from_pretrained(**hf_location(model), dtype=torch.float32, **options).eval()


def model_argument(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help="a GGUF file or a Hugging Face checkpoint directory (default: SmolLM2's GGUF)")


def chosen_model(args) -> str:
    from jaxserve.loader.default_model import default_model_path

    return args.model or str(default_model_path())


def transformers_runner(model, prompts, max_tokens: int, batch_size: int):
    """-> run() that times transformers' greedy generate over every prompt, `batch_size` left-padded at a time."""
    import torch

    pad = 2

    def generate(batch):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding for generation
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           do_sample=False, pad_token_id=pad)

    def run() -> float:
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            generate(prompts[i : i + batch_size])
        return time.perf_counter() - t0

    return run


def llama_cpp_runner(gguf: str, prompts, max_tokens: int):
    """-> run() that times llama.cpp (llama-cpp-python, all cores) decoding each prompt greedily in turn."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_ctx=512, n_batch=512, n_threads=os.cpu_count(), verbose=False)

    def one(prompt: list[int]) -> None:
        for n, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1, reset=True), start=1):
            if n == max_tokens:  # generate() yields until stopped, past EOS too
                return

    def run() -> float:
        t0 = time.perf_counter()
        for p in prompts:
            one(p)
        return time.perf_counter() - t0

    return run


def best_of_interleaved(runners: dict, repeats: int) -> dict[str, float]:
    """Warm each runner up, then run them in turn `repeats` times: name -> its shortest time."""
    for run in runners.values():
        run()
    times = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            times[name].append(run())
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=None,
                    help="transformers batch sizes to try; the best counts (default: 8 16 32 64, capped at the prompts)")
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                    help="jaxserve's weights (default none: float32, a GGUF dequantized at load as transformers reads "
                         "it; gguf: its blocks kept, the engine's own default)")
    ap.add_argument("--also-float32", action="store_true",
                    help="with --quantization: time jaxserve in float32 too, taking turns, for the quantized/float "
                         "ratio from one run")
    ap.add_argument("--layer-loop", choices=LAYER_LOOPS, default="auto", help="jaxserve's layer loop (both sides)")
    ap.add_argument("--llama-cpp", action="store_true", help="also time llama.cpp on the GGUF itself")
    model_argument(ap)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; each side's best counts")
    ap.add_argument("--append", metavar="BENCHMARKS.md", help="append a result row to this file")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.also_float32 and args.quantization == "none":
        ap.error("--also-float32 compares a --quantization with float32; give --quantization too")
    if args.llama_cpp and args.model and not args.model.endswith(".gguf"):
        ap.error("--llama-cpp runs a GGUF file: give --model a .gguf path")

    from transformers import AutoTokenizer

    model_path = chosen_model(args)
    tokenizer = AutoTokenizer.from_pretrained(**hf_location(model_path))
    prompts = make_prompts(tokenizer, args.num_prompts)
    sizes = args.hf_batch_sizes or sorted({min(b, args.num_prompts) for b in (8, 16, 32, 64)})
    runners = {"jaxserve": jaxserve_runner(model_path, prompts, args.max_tokens, args.quantization, args.layer_loop)}
    if args.also_float32:
        runners["jaxserve float32"] = jaxserve_runner(model_path, prompts, args.max_tokens, "none", args.layer_loop)
    model = load_transformers(model_path)
    runners |= {f"transformers batch {b}": transformers_runner(model, prompts, args.max_tokens, b) for b in sizes}
    if args.llama_cpp:
        runners["llama.cpp"] = llama_cpp_runner(model_path, prompts, args.max_tokens)
    tokens = args.num_prompts * args.max_tokens
    rate = {name: tokens / t for name, t in best_of_interleaved(runners, args.repeats).items()}
    ours = rate.pop("jaxserve")
    ours_float = rate.pop("jaxserve float32", None)
    llama_cpp = rate.pop("llama.cpp", None)
    best_batch = max(sizes, key=lambda b: rate[f"transformers batch {b}"])
    theirs = rate[f"transformers batch {best_batch}"]
    ratio = ours / theirs
    weights = "float32" if args.quantization == "none" else args.quantization
    line = (f"jaxserve ({weights}): {ours:.1f} tok/s   transformers (float32): {theirs:.1f} tok/s "
            f"(best batch size {best_batch} of {sizes})")
    if ours_float is not None:
        line += f"   jaxserve (float32): {ours_float:.1f} tok/s ({weights}/float32 {ours / ours_float:.2f}x)"
        weights += f" (float32 in the same run: {ours_float:.1f} tok/s, {ours / ours_float:.2f}x)"
    if llama_cpp is not None:
        line += f"   llama.cpp: {llama_cpp:.1f} tok/s (jaxserve/llama.cpp {ours / llama_cpp:.2f}x)"
    print(line)
    if args.append:
        cpp = "" if llama_cpp is None else f"{llama_cpp:.1f}"
        append_row(args.append, f"{platform.node() or 'cpu'} ({os.cpu_count()} cores, CPU)",
                   command_line("bench_throughput.py", args.append), weights, f"{ours:.1f}",
                   f"{theirs:.1f} (batch {best_batch})", f"{ratio:.2f}x", cpp)
    print(f"ratio jaxserve/transformers: {ratio:.2f}x")


if __name__ == "__main__":
    main()
