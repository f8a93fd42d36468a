#!/usr/bin/env python
"""Host work per engine step: what runs between device steps (scheduling, building inputs, detokenizing, stop
checks, outputs), measured where the device work is small, and what async scheduling makes of it.

    python scripts/bench_host.py --num-seqs 256 [--append BENCHMARKS.md]

A one-layer, 32-wide Llama with SmolLM2's tokenizer and vocabulary (random weights, `load_format="dummy"`)
generates --max-tokens greedy tokens for --num-seqs prompts at once. Host time = generate's wall time minus the
time spent inside `ModelRunner.execute` (dispatch, device work and the copy back), per step, on the synchronous
engine (`async_scheduling=False`); best of --repeats. Then the wall time per step of the synchronous and the
async engine (the default: step N+1 dispatched before step N is read back), taking turns. On this 2-core CPU the
device's threads and the host share the cores, so overlap can hide little here; on a GPU the host runs alone.
The last line is the host figure.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchmark_table import append_row, command_line

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            rms_norm_eps=1e-5, tie_word_embeddings=True)


def tiny_model_dir(out: Path) -> Path:
    from jaxserve.loader.default_model import default_model_path
    from jaxserve.loader.gguf import GGUFFile

    tokenizer = GGUFFile(default_model_path()).tokenizer()
    tokenizer.save_pretrained(out)
    config = dict(TINY, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    (out / "config.json").write_text(json.dumps(config))
    return out


def host_ms_per_step(engine, prompts, max_tokens: int, repeats: int) -> float:
    from jaxserve import SamplingParams
    from jaxserve.runner.model_runner import ModelRunner

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts, params, use_tqdm=False)  # compiles every shape the timed runs use
    inside = [0.0]
    execute = ModelRunner.execute

    def timed_execute(self, *args):
        t0 = time.perf_counter()
        try:
            return execute(self, *args)
        finally:
            inside[0] += time.perf_counter() - t0

    ModelRunner.execute = timed_execute
    try:
        best = float("inf")
        for _ in range(repeats):
            inside[0], steps_before = 0.0, engine._num_steps
            t0 = time.perf_counter()
            engine.generate(prompts, params, use_tqdm=False)
            steps = engine._num_steps - steps_before
            best = min(best, (time.perf_counter() - t0 - inside[0]) / steps * 1e3)
        return best
    finally:
        ModelRunner.execute = execute


def wall_ms_per_step(engines: dict, prompts, max_tokens: int, repeats: int) -> dict[str, float]:
    """name -> best wall time per step of generate, the engines taking turns."""
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    best = {name: float("inf") for name in engines}
    for engine in engines.values():
        engine.generate(prompts, params, use_tqdm=False)  # compiles
    for _ in range(repeats):
        for name, engine in engines.items():
            steps_before = engine._num_steps
            t0 = time.perf_counter()
            engine.generate(prompts, params, use_tqdm=False)
            best[name] = min(best[name], (time.perf_counter() - t0) / (engine._num_steps - steps_before) * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--append", metavar="BENCHMARKS.md", help="append a result row to this file")
    args = ap.parse_args()
    if min(args.num_seqs, args.prompt_len, args.max_tokens, args.repeats) < 1:
        ap.error("--num-seqs, --prompt-len, --max-tokens and --repeats must be at least 1")

    from jaxserve import Engine

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model_dir(Path(tmp))

        def engine(async_scheduling: bool):
            return Engine(str(model_dir), load_format="dummy", max_model_len=args.prompt_len + args.max_tokens,
                          max_num_seqs=args.num_seqs, max_num_batched_tokens=max(2048, args.num_seqs),
                          num_kv_blocks=args.num_seqs * (-(-(args.prompt_len + args.max_tokens) // 16)) + 1,
                          warmup=False, async_scheduling=async_scheduling)

        sync, overlapped = engine(False), engine(True)
        vocab = sync.config.model.vocab_size
        prompts = [[(7 * i + 13 * j) % (vocab - 300) + 300 for j in range(args.prompt_len)]
                   for i in range(args.num_seqs)]
        ms = host_ms_per_step(sync, prompts, args.max_tokens, args.repeats)
        walls = wall_ms_per_step({"synchronous": sync, "async": overlapped}, prompts, args.max_tokens, args.repeats)
    print("wall ms per step: " + ", ".join(f"{name} {wall:.2f}" for name, wall in walls.items()))
    if args.append:
        append_row(args.append, f"CPU ({os.cpu_count()} cores)", command_line("bench_host.py", args.append),
                   str(args.num_seqs), f"{ms:.1f}")
    print(f"host ms per step at {args.num_seqs} sequences: {ms:.2f}")


if __name__ == "__main__":
    main()
