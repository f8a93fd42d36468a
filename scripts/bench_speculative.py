#!/usr/bin/env python
"""Single-stream decode with and without n-gram speculative decoding, side by side, on outputs that copy their
input (the default SmolLM2 GGUF or --model, float32 on CPU), with transformers' batch-1 generate, plain and with its own
prompt-lookup decoding, beside them. Prints the speedup as the last line.

    python scripts/bench_speculative.py --num-prompts 4 --max-tokens 96 [--append BENCHMARKS.md]
    python scripts/bench_speculative.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 5}'

Each prompt asks the model to copy a passage (prose, code, a list): the workload prompt lookup is for. Requests
run one after another (a single stream), greedy, until EOS or --max-tokens; each side's rate is its own
generated tokens over its time. Sides are warmed up, then take turns for --repeats rounds; each keeps its best.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from bench_throughput import best_of_interleaved, chosen_model, load_transformers, model_argument
from benchmark_table import append_row, command_line

PASSAGES = [
    "The river flows through the old town, past the market square and the stone bridge, where fishermen sell "
    "their catch every morning. In the afternoon the square fills with musicians and children.",
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n    return total / "
    "len(values)\n",
    "Shopping list: three apples, two loaves of bread, a litre of milk, a dozen eggs, a bag of rice, and "
    "some fresh basil for the sauce.",
    "Meeting notes: the release moves to Friday; Anna owns the migration guide; Tom checks the benchmarks; "
    "everyone reviews the changelog before Thursday noon.",
]
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}


def copy_prompts(engine, n: int) -> list[list[int]]:
    return [engine.encode_chat([{"role": "user", "content": "Copy this exactly:\n\n" + PASSAGES[i % len(PASSAGES)]}])
            for i in range(n)]


def jaxserve_runner(engine, prompts, max_tokens: int, generated: dict, name: str):
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)

    def run() -> float:
        t0 = time.perf_counter()
        outs = [engine.generate([p], params, use_tqdm=False)[0] for p in prompts]  # one stream
        elapsed = time.perf_counter() - t0
        generated[name] = sum(len(o.outputs[0].token_ids) for o in outs)
        return elapsed

    return run


def transformers_runner(model, prompts, max_tokens: int, generated: dict, name: str, lookup: int | None):
    import torch

    def run() -> float:
        t0, count = time.perf_counter(), 0
        for p in prompts:
            ids = torch.tensor([p])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                     do_sample=False, prompt_lookup_num_tokens=lookup)
            count += out.shape[1] - ids.shape[1]
        generated[name] = count
        return time.perf_counter() - t0

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--speculative-config", type=json.loads, default=DEFAULT_SPEC, metavar="JSON")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds; each side's best counts")
    ap.add_argument("--no-transformers", action="store_true", help="time jaxserve's two sides only")
    model_argument(ap)
    ap.add_argument("--append", metavar="BENCHMARKS.md", help="append a result row to this file")
    args = ap.parse_args()
    if args.repeats < 1 or args.num_prompts < 1:
        ap.error("--repeats and --num-prompts must be at least 1")

    from jaxserve import Engine

    model_path = chosen_model(args)
    settings = dict(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=256, warmup=False)
    plain = Engine(model_path, **settings)
    spec = Engine(model_path, speculative_config=args.speculative_config, **settings)
    prompts = copy_prompts(plain, args.num_prompts)
    generated: dict[str, int] = {}
    runners = {"jaxserve": jaxserve_runner(plain, prompts, args.max_tokens, generated, "jaxserve"),
               "jaxserve ngram": jaxserve_runner(spec, prompts, args.max_tokens, generated, "jaxserve ngram")}
    k = spec.speculative_config.num_speculative_tokens
    if not args.no_transformers:
        model = load_transformers(model_path)
        runners["transformers"] = transformers_runner(model, prompts, args.max_tokens, generated, "transformers", None)
        runners["transformers prompt lookup"] = transformers_runner(model, prompts, args.max_tokens, generated,
                                                                    "transformers prompt lookup", k)
    rate = {name: generated[name] / t for name, t in best_of_interleaved(runners, args.repeats).items()}
    stats = spec.stats()  # every round drafts the same (greedy, same prompts): the totals give the rate
    acceptance = stats["spec_decode_num_accepted_tokens"] / max(stats["spec_decode_num_draft_tokens"], 1)
    speedup = rate["jaxserve ngram"] / rate["jaxserve"]
    print("  ".join(f"{name}: {r:.1f} tok/s" for name, r in rate.items()) + f"  acceptance: {acceptance:.0%}")
    if args.append:
        theirs = [f"{rate[n]:.1f}" if n in rate else "" for n in ("transformers", "transformers prompt lookup")]
        append_row(args.append, f"{platform.node() or 'cpu'} ({os.cpu_count()} cores, CPU)",
                   command_line("bench_speculative.py", args.append), f"{rate['jaxserve']:.1f}",
                   f"{rate['jaxserve ngram']:.1f}", f"**{speedup:.2f}x**", f"{acceptance:.0%}", *theirs)
    print(f"speedup with ngram speculation: {speedup:.2f}x")


if __name__ == "__main__":
    main()
