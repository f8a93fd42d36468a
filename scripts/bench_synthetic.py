#!/usr/bin/env python
"""A model shape with random weights, nothing downloaded: issue 9's GPU goals (Llama-3-8B shape, bfloat16).

    python scripts/bench_synthetic.py                          # on a GPU: Llama-3-8B shape, every figure below
    python scripts/bench_synthetic.py --shape tiny --num-prompts 4 --input-len 16 --output-len 4   # CI, on CPU

The model directory is written here: the shape's config.json and a stand-in tokenizer (one word per token id,
as many as the vocabulary: prompts are random token ids, and detokenizing them costs what a real fast
tokenizer's decode would). jaxserve serves it with `load_format="dummy"`; transformers builds the same config
with its own random initialisation on the same device (values do not change speed: every request generates
exactly --output-len tokens). Measured, in order:

- memory bandwidth: an on-device elementwise copy of --bandwidth-mib (bytes read + written / time, best of 10);
- batch-1 decode: ms per token from one request run to two output lengths (the prefill cancels out), against
  the roofline weight bytes / bandwidth (each decode step reads every weight once);
- offline throughput: --num-prompts requests of exactly --input-len prompt and --output-len new tokens, total
  (prompt + output) tokens/s as vLLM's benchmark_throughput reports it; best of --repeats runs, the first of
  which compiles the step programs it needs;
- transformers: batched greedy generate on the first --hf-num-prompts requests at each --hf-batch-sizes, the
  best batch size counting.

The last line is jaxserve's offline throughput over transformers'.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchmark_table import append_row, command_line

SHAPES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=False),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False),
}
BOS, EOS = 0, 1


def write_model_dir(shape: str, out: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
                  bos_token_id=BOS, eos_token_id=EOS, torch_dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {f"w{i}": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w0", eos_token="w1").save_pretrained(out)
    return out


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(2, vocab, size=(n, length)).tolist()  # never BOS/EOS


def measure_bandwidth(mib: int) -> float:
    """Bytes/s of an on-device elementwise pass: reads and writes `mib` MiB (best of 10)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    scale = jax.jit(lambda x: x * 1.0001)
    scale(x).block_until_ready()
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        scale(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * x.nbytes / best


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_seconds_per_token(engine, prompt: list[int], short: int, long: int, repeats: int) -> float:
    from jaxserve import SamplingParams

    def run(n):
        return lambda: engine.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                       use_tqdm=False)

    run(long)()  # compiles the batch-1 programs
    t_short = min(timed(run(short)) for _ in range(repeats))
    t_long = min(timed(run(long)) for _ in range(repeats))
    return (t_long - t_short) / (long - short)


def jaxserve_offline(engine, prompts, output_len: int, repeats: int) -> tuple[float, int]:
    """(best seconds, programs compiled during the best run)."""
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    best, compiles = float("inf"), 0
    for _ in range(repeats):
        before = engine.runner.num_compiles
        t = timed(lambda: engine.generate(prompts, params, use_tqdm=False))
        if t < best:
            best, compiles = t, engine.runner.num_compiles - before
    return best, compiles


def transformers_offline(model_dir: Path, prompts, output_len: int, batch_sizes) -> dict[int, float]:
    """batch size -> seconds for transformers' greedy generate over `prompts` (equal lengths: no padding), in
    bfloat16 on a GPU and float32 on CPU, like jaxserve's dtype="auto"."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.eval()

    def generate(batch):
        ids = torch.tensor(batch, device=device)
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                           min_new_tokens=output_len, do_sample=False, pad_token_id=EOS)
        if device == "cuda":
            torch.cuda.synchronize()

    times = {}
    for b in batch_sizes:
        generate(prompts[:b])  # warm-up: kernels, allocator
        times[b] = timed(lambda: [generate(prompts[i : i + b]) for i in range(0, len(prompts), b)])
    return times


def transformers_in_child(model_dir: Path, prompts, args) -> dict[int, float]:
    """transformers_offline in a child process that exits before jax starts here: jax keeps the device memory it
    allocated (the KV cache takes most of it), so the two cannot share one process on a GPU."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(transformers_offline, model_dir, prompts, args.output_len, args.hf_batch_sizes).result()


def run_jaxserve(model_dir: Path, prompts, args):
    """-> (offline total tok/s, batch-1 s/token, roofline s/token, bandwidth B/s, device, dtype); prints each."""
    import jax

    from jaxserve import Engine
    from jaxserve.config import resolve_dtype

    device = jax.devices()[0]
    dtype = resolve_dtype("auto", device.platform)
    print(f"device: {device.device_kind} ({device.platform}, jax {jax.__version__}), {args.shape}, {dtype}")
    bandwidth = measure_bandwidth(args.bandwidth_mib)
    print(f"memory bandwidth (elementwise copy of {args.bandwidth_mib} MiB): {bandwidth / 1e9:.0f} GB/s")
    short, long = args.decode_lens
    engine = Engine(str(model_dir), load_format="dummy", max_model_len=args.input_len + max(args.output_len, long),
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, warmup=False,
                    async_scheduling=not args.no_async_scheduling)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.runner.params))
    roofline = weight_bytes / bandwidth
    per_token = decode_seconds_per_token(engine, prompts[0][:16], short, long, args.repeats)
    print(f"batch-1 decode: {per_token * 1e3:.2f} ms/token; weights {weight_bytes / 1e9:.2f} GB / bandwidth = "
          f"{roofline * 1e3:.2f} ms: {per_token / roofline:.2f}x the roofline (goal <= 1.25x)")
    seconds, compiles = jaxserve_offline(engine, prompts, args.output_len, args.repeats)
    ours = len(prompts) * (args.input_len + args.output_len) / seconds
    print(f"jaxserve offline {len(prompts)} x ({args.input_len} in + {args.output_len} out): {ours:.0f} total tok/s "
          f"({seconds:.1f} s; {compiles} programs compiled in that run)")
    return ours, per_token, roofline, bandwidth, device, dtype


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2, help="offline runs; the best counts (the first compiles)")
    ap.add_argument("--decode-lens", type=int, nargs=2, default=(32, 160), metavar=("SHORT", "LONG"),
                    help="output lengths of the two batch-1 runs whose difference gives the per-token time")
    ap.add_argument("--bandwidth-mib", type=int, default=4096)
    ap.add_argument("--hf-num-prompts", type=int, default=128)
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="jaxserve reads each step back before scheduling the next (to measure what overlap buys)")
    ap.add_argument("--append", metavar="BENCHMARKS.md", help="append the result rows to this file")
    args = ap.parse_args()
    if min(args.num_prompts, args.input_len, args.output_len, args.repeats, args.hf_num_prompts) < 1:
        ap.error("--num-prompts, --input-len, --output-len, --repeats and --hf-num-prompts must be at least 1")
    short, long = args.decode_lens
    if not 0 < short < long:
        ap.error(f"--decode-lens needs 0 < SHORT < LONG, got {short} {long}")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(args.shape, Path(tmp))
        prompts = random_prompts(args.num_prompts, args.input_len, SHAPES[args.shape]["vocab_size"])
        hf = None if args.no_transformers else transformers_in_child(model_dir, prompts[: args.hf_num_prompts], args)
        ours, per_token, roofline, bandwidth, device, dtype = run_jaxserve(model_dir, prompts, args)
    theirs = best_batch = None
    if hf is not None:
        best_batch = min(hf, key=hf.get)
        n = min(args.hf_num_prompts, args.num_prompts)
        theirs = n * (args.input_len + args.output_len) / hf[best_batch]
        print(f"transformers offline, first {n} requests: {theirs:.0f} total tok/s "
              f"(best batch size {best_batch} of {args.hf_batch_sizes})")
    if args.append:
        append_rows(args, device, dtype, bandwidth, per_token, roofline, ours, theirs, best_batch)
    print(f"ratio jaxserve/transformers: {ours / theirs:.2f}x" if theirs else f"jaxserve: {ours:.0f} total tok/s")


def append_rows(args, device, dtype, bandwidth, per_token, roofline, ours, theirs, best_batch) -> None:
    hf = f"{theirs:.0f} (batch {best_batch})" if theirs else "not run"
    ratio = f"{ours / theirs:.2f}x" if theirs else ""
    append_row(args.append, f"{device.device_kind} ({os.cpu_count()} host cores)",
               command_line("bench_synthetic.py", args.append), dtype, f"{bandwidth / 1e9:.0f}",
               f"{per_token * 1e3:.2f} ({per_token / roofline:.2f}x roofline)", f"{ours:.0f}", hf, ratio)


if __name__ == "__main__":
    main()
