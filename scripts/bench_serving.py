#!/usr/bin/env python
"""Online serving benchmark against an OpenAI-compatible /v1/completions endpoint (like vLLM's
benchmark_serving): streamed requests with random prompt and output lengths, either at a fixed maximum
concurrency or with Poisson arrivals. Reports request throughput, output tokens/s, and TTFT, TPOT and ITL
(p50 and p99). Sweeping several concurrencies draws a PNG of throughput and latency against concurrency.

    jaxserve serve &                      # or any OpenAI-compatible server
    python scripts/bench_serving.py --num-prompts 64 --max-concurrency 1 4 16 64 --plot bench_serving.png

The last line printed is the output-token throughput at the highest concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
from benchmark_table import append_row

WORDS = "the a of model engine token batch serve fast river mountain code data cache page block light".split()


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0  # seconds to the first streamed token
    latency: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)  # gaps between streamed chunks
    error: str = ""


@dataclass
class Workload:
    prompts: list[str]
    output_lens: list[int]


def make_workload(n: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*input_len))) for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(n)])


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result, last = RequestResult(ok=False), None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_load(base_url: str, model: str, work: Workload, concurrency: int, rate: float,
                   headers: dict[str, str], seed: int) -> tuple[list[RequestResult], float]:
    url = f"{base_url}/v1/completions"
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)

    async def limited(client, prompt, max_tokens):
        async with gate:
            return await one_request(client, url, model, prompt, max_tokens)

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), headers=headers,
                                 limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in zip(work.prompts, work.output_lens):
            tasks.append(asyncio.create_task(limited(client, prompt, max_tokens)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarise(results: list[RequestResult], duration: float, concurrency: int) -> dict:
    ok = [r for r in results if r.ok]
    if not ok:
        raise SystemExit(f"every request failed; first error: {results[0].error}")
    tokens = sum(r.output_tokens for r in ok)
    ms = lambda xs, q: float(np.percentile(xs, q) * 1000) if len(xs) else 0.0  # noqa: E731
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itls]
    return {
        "concurrency": concurrency, "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration, "request_throughput": len(ok) / duration, "output_throughput": tokens / duration,
        "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99), "tpot_p50_ms": ms(tpot, 50),
        "tpot_p99_ms": ms(tpot, 99), "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99),
    }


def print_row(s: dict) -> None:
    print(f"concurrency {s['concurrency']:>4}: {s['completed']} ok, {s['failed']} failed, "
          f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} out tok/s | "
          f"TTFT p50/p99 {s['ttft_p50_ms']:.0f}/{s['ttft_p99_ms']:.0f} ms | "
          f"TPOT p50/p99 {s['tpot_p50_ms']:.1f}/{s['tpot_p99_ms']:.1f} ms | "
          f"ITL p50/p99 {s['itl_p50_ms']:.1f}/{s['itl_p99_ms']:.1f} ms")


def plot(summaries: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [s["concurrency"] for s in summaries]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(c, [s["output_throughput"] for s in summaries], "o-")
    a.set(xscale="log", xlabel="max concurrency", ylabel="output tokens/s", title="Throughput")
    for key, style in (("ttft", "o-"), ("tpot", "s--")):
        for q in ("p50", "p99"):
            b.plot(c, [s[f"{key}_{q}_ms"] for s in summaries], style, label=f"{key.upper()} {q}")
    b.set(xscale="log", yscale="log", xlabel="max concurrency", ylabel="ms", title="Latency")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def append_rows(path: str, summaries: list[dict], args) -> None:
    for s in summaries:
        append_row(path, f"{platform.node() or 'host'} ({os.cpu_count()} cores)",
                   f"bench_serving.py --num-prompts {args.num_prompts}", str(s["concurrency"]),
                   f"{s['output_throughput']:.1f}", f"{s['ttft_p50_ms']:.0f} / {s['ttft_p99_ms']:.0f}",
                   f"{s['tpot_p50_ms']:.1f} / {s['tpot_p99_ms']:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, nargs="+", default=[16])
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    ap.add_argument("--input-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"), help="words")
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"), help="tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", metavar="PNG")
    ap.add_argument("--append", metavar="BENCHMARKS.md")
    args = ap.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    work = make_workload(args.num_prompts, tuple(args.input_len), tuple(args.output_len), args.seed)
    summaries = []
    for concurrency in args.max_concurrency:
        results, duration = asyncio.run(run_load(args.base_url, args.model, work, concurrency, args.request_rate,
                                                 headers, args.seed))
        summaries.append(summarise(results, duration, concurrency))
        print_row(summaries[-1])
    if args.plot:
        plot(summaries, args.plot)
    if args.append:
        append_rows(args.append, summaries, args)
    print(f"output throughput at concurrency {summaries[-1]['concurrency']}: "
          f"{summaries[-1]['output_throughput']:.1f} tok/s")


if __name__ == "__main__":
    main()
