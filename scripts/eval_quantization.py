#!/usr/bin/env python
"""Accuracy of a quantization (weight-only int8, or w8a8: int8 weights and activations) and/or a float8 KV cache
against the float model, on the same weights (default: SmolLM2, float32 on CPU).

    python scripts/eval_quantization.py [--model PATH] [--quantization int8|w8a8|none] [--kv-cache-dtype fp8]
                                        [--max-tokens 64] [--append BENCHMARKS.md]
    python scripts/eval_quantization.py --variant int8 --variant none,fp8   # several, one float reference

Three measures, each side by side:
- perplexity of a fixed English text (teacher-forced, from prompt logprobs);
- next-token agreement: how often the two models' most likely next token is the same, over that text;
- greedy continuations of a few prompts: how many tokens match before the first difference.
Each variant ends with its perplexity ratio quantized / float, e.g. "perplexity ratio int8/float: 1.0050" (the
quantized side named by what it changes: "int8", "fp8 KV cache", "int8 + fp8 KV cache").
"""

from __future__ import annotations

import argparse
import math
import os
import platform

from benchmark_table import append_row

from jaxserve.config import KV_CACHE_DTYPES
from jaxserve.engine_args import QUANTIZATIONS

TEXT = (
    "The river starts high in the mountains, where snow melts in the spring and runs down through narrow "
    "valleys. By the time it reaches the town it is wide and slow, and children fish from the old stone bridge "
    "on summer evenings. Farmers along its banks have used its water for centuries, and the mill that once "
    "ground their grain is now a small museum that tells the story of the valley.\n\n"
    "A computer program is a list of instructions that a machine follows one after another. Programmers write "
    "these instructions in a language that people can read, and a compiler translates them into the simple "
    "operations the processor understands. Good programs are easy to read, because code is read far more often "
    "than it is written, and every reader must understand what it does before changing it.\n\n"
    "To bake bread, mix flour, water, salt and yeast into a dough, then knead it until it is smooth and elastic. "
    "Leave it to rise in a warm place for an hour or two, shape it into a loaf, let it rise again, and bake it "
    "in a hot oven until the crust is brown and the loaf sounds hollow when tapped underneath."
)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "The three primary colors are"]


def teacher_forced(engine, seqs: list[list[int]], **generate_options) -> list[list[tuple[float, int]]]:
    """For each sequence: (logprob of the actual next token, the model's most likely next token) for every
    position after the first. `generate_options`: more `Engine.generate` keywords (a lora_request)."""
    from jaxserve import SamplingParams

    outs = engine.generate(seqs, SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0), use_tqdm=False,
                           **generate_options)
    results = []
    for ids, out in zip(seqs, outs):
        result = []
        for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
            top = next(token for token, lp in entry.items() if lp.rank == 1)
            result.append((entry[ids[position]].logprob, top))
        results.append(result)
    return results


def greedy(engine, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from jaxserve import SamplingParams

    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def variant_name(quantization: str, kv_cache_dtype: str) -> str:
    parts = ([quantization] if quantization != "none" else []) + ([] if kv_cache_dtype == "auto" else [f"{kv_cache_dtype} KV cache"])
    return " + ".join(parts) or "float"


def engine(model: str, quantization: str, kv_cache_dtype: str):
    from jaxserve import Engine

    return Engine(model, quantization=quantization, kv_cache_dtype=kv_cache_dtype, max_model_len=512,
                  num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=512, warmup=False)


def measure(model: str, max_tokens: int, quantization: str, kv_cache_dtype: str):
    """-> (teacher-forced results over TEXT, greedy continuations of PROMPTS) of one engine, built and dropped."""
    e = engine(model, quantization, kv_cache_dtype)
    return teacher_forced(e, [e.tokenizer(TEXT)["input_ids"]])[0], greedy(e, PROMPTS, max_tokens)


def perplexity(teacher_forced_results) -> float:
    return math.exp(-sum(lp for lp, _ in teacher_forced_results) / len(teacher_forced_results))


def compare(reference, measured, max_tokens: int) -> dict:
    (ref_tf, ref_greedy), (q_tf, q_greedy) = reference, measured
    agree = sum(a[1] == b[1] for a, b in zip(ref_tf, q_tf)) / len(ref_tf)
    prefixes = [common_prefix(a, b) for a, b in zip(ref_greedy, q_greedy)]
    return dict(ppl_float=perplexity(ref_tf), ppl_variant=perplexity(q_tf), top1_agreement=agree,
                positions=len(ref_tf), greedy_prefixes=prefixes, max_tokens=max_tokens)


def parse_variant(text: str) -> tuple[str, str]:
    """"int8" -> ("int8", "auto"); "none,fp8" -> ("none", "fp8")."""
    quantization, _, kv_cache_dtype = text.partition(",")
    if quantization not in QUANTIZATIONS or (kv_cache_dtype or "auto") not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r}: a variant is QUANTIZATION[,KV_CACHE_DTYPE] with QUANTIZATION "
                                         f"in {', '.join(QUANTIZATIONS)} and KV_CACHE_DTYPE in "
                                         f"{', '.join(KV_CACHE_DTYPES)}")
    return quantization, kv_cache_dtype or "auto"


def report(r: dict, quantization_flag: str, kv_cache_dtype: str, append: str | None) -> None:
    q = variant_name(quantization_flag, kv_cache_dtype)
    ratio = r["ppl_variant"] / r["ppl_float"]
    prefixes = "/".join(map(str, r["greedy_prefixes"]))
    print(f"perplexity: float {r['ppl_float']:.3f}, {q} {r['ppl_variant']:.3f} ({r['positions']} tokens)   "
          f"next-token agreement {100 * r['top1_agreement']:.1f}%   "
          f"greedy tokens equal before the first difference: {prefixes} of {r['max_tokens']}")
    if append:
        append_row(append, f"{platform.node() or 'cpu'} ({os.cpu_count()} cores)",
                   f"scripts/eval_quantization.py --max-tokens {r['max_tokens']}"
                   + ("" if quantization_flag == "int8" else f" --quantization {quantization_flag}")
                   + ("" if kv_cache_dtype == "auto" else f" --kv-cache-dtype {kv_cache_dtype}"),
                   f"{r['ppl_float']:.3f}",
                   f"{r['ppl_variant']:.3f} ({q}, {100 * (ratio - 1):+.1f}%)", f"{100 * r['top1_agreement']:.1f}%",
                   f"{prefixes} of {r['max_tokens']}")
    print(f"perplexity ratio {q}/float: {ratio:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model to evaluate (default: the built-in SmolLM2 GGUF)")
    ap.add_argument("--max-tokens", type=int, default=64, help="length of each greedy continuation")
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default="int8",
                    help="the weights' quantization to compare with float (none: float weights)")
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                    help="the KV cache's dtype on the compared side (auto: the model's)")
    ap.add_argument("--variant", action="append", type=parse_variant, metavar="QUANTIZATION[,KV_CACHE_DTYPE]",
                    help="a variant to compare (repeatable; replaces --quantization and --kv-cache-dtype): every "
                         "one against the same float run, measured once")
    ap.add_argument("--append", metavar="BENCHMARKS.md", help="append a result row per variant to this file")
    args = ap.parse_args()
    from jaxserve.loader.default_model import default_model_path

    model = args.model or str(default_model_path())
    reference = measure(model, args.max_tokens, "none", "auto")  # float weights, a quantized checkpoint's dequantized
    for quantization, kv_cache_dtype in args.variant or [(args.quantization, args.kv_cache_dtype)]:
        measured = measure(model, args.max_tokens, quantization, kv_cache_dtype)
        report(compare(reference, measured, args.max_tokens), quantization, kv_cache_dtype, args.append)


if __name__ == "__main__":
    main()
