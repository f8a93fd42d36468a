#!/usr/bin/env python
"""A model shape with random weights, nothing downloaded: the GPU goals at the Llama-3-8B shape, bfloat16.

    python scripts/bench_synthetic.py                          # on a GPU: Llama-3-8B shape, every figure below
    python scripts/bench_synthetic.py --shape tiny --num-prompts 4 --input-len 16 --output-len 4   # CI, on CPU
    python scripts/bench_synthetic.py --quantization fp8 --no-transformers     # FP8 weights (and GEMMs on 8.9+)

The model directory is written here: the shape's config.json and a stand-in tokenizer (one word per token id,
as many as the vocabulary: prompts are random token ids, and detokenizing them costs what a real fast
tokenizer's decode would). jaxserve serves it with `load_format="dummy"`; transformers builds the same config
with its own random initialisation on the same device (values do not change speed: every request generates
exactly --output-len tokens). Each side runs in a process of its own, jaxserve first, so each has the device's
memory to itself. Measured, in order, each line printed (and --json written) as it is known:

- memory bandwidth: an elementwise pass over --bandwidth-mib, 20 passes in one compiled loop (bytes read +
  written / time; scripts/bench_kernels.py), beside the device's rated HBM bandwidth and bf16 FLOP/s
  (scripts/roofline.py);
- batch-1 decode: ms per token from one request run to two output lengths (the prefill cancels out), against
  the roofline: the bytes a decode step reads (layer weights, final norm, LM head, the KV it attends to; not
  the input embedding table, of which a step reads one row) over the measured and over the rated bandwidth;
- offline throughput: --num-prompts requests of exactly --input-len prompt and --output-len new tokens, output
  tokens/s and total (prompt + output) tokens/s as vLLM's benchmark_throughput reports them; best of --repeats
  runs, the first of which compiles the step programs it needs. Each run takes fresh random prompts, so the
  prefix cache cannot serve one run from the last (the prompt tokens it served in the best run are printed: a
  request preempted when the KV cache filled finds its own blocks there when it resumes);
- prefill: the same number of fresh prompts with one output token each, its FLOPs (roofline.prefill_flops) over
  its time, and that as a share of the rated bf16 FLOP/s (MFU);
- transformers: batched greedy `generate` over the same prompts as jaxserve's runs; each --hf-batch-sizes is
  timed on one batch, the fastest then runs every prompt, best of the same --repeats.

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
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0, max_position_embeddings=8192,
                    tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False),
}
BOS, EOS = 0, 1
DECODE_PROMPT_LEN = 16  # the batch-1 request's prompt


def write_model_dir(shape: str, out: Path, architecture: str = "LlamaForCausalLM", model_type: str = "llama",
                    **overrides) -> Path:
    """`out` holding the shape's config.json (fields laid over by `overrides`) and the stand-in tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = dict(SHAPES[shape], architectures=[architecture], model_type=model_type, rms_norm_eps=1e-5,
                  bos_token_id=BOS, eos_token_id=EOS, torch_dtype="bfloat16") | overrides
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


def prompt_sets(args) -> list[list[list[int]]]:
    """One set of fresh prompts per repeat (seeds 0, 1, ...), the same for both sides."""
    vocab = SHAPES[args.shape]["vocab_size"]
    return [random_prompts(args.num_prompts, args.input_len, vocab, seed) for seed in range(args.repeats)]


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Results(dict):
    """The figures so far; each `put` prints its line and rewrites --json, so a run cut short keeps them."""

    def __init__(self, path: str | None):
        super().__init__()
        self.path = path

    def put(self, line: str, **figures) -> None:
        self.update(figures)
        print(line, flush=True)
        if self.path:
            Path(self.path).write_text(json.dumps(self, indent=1))


def param_groups(params) -> tuple[dict[str, int], int]:
    """(bytes per top-level parameter group, elements of the layers' matmul weights)."""
    import jax
    from roofline import is_matmul_weight

    groups: dict[str, int] = {}
    matmul = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        groups[names[0]] = groups.get(names[0], 0) + leaf.nbytes
        if names[0] == "layers" and is_matmul_weight(names[1], leaf.ndim):
            matmul += leaf.size
    return groups, matmul


def decode_seconds_per_token(engine, prompt: list[int], short: int, long: int, repeats: int) -> float:
    from jaxserve import SamplingParams

    def run(n):
        return lambda: engine.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                                       use_tqdm=False)

    run(long)()  # compiles the batch-1 programs
    # A negative ms/token is no figure: the machine's noise outweighed the extra tokens. Noise passes (another
    # process's burst), so a failed try is measured again before the run gives up.
    for _ in range(3):
        t_short = min(timed(run(short)) for _ in range(repeats))
        t_long = min(timed(run(long)) for _ in range(repeats))
        if t_long > t_short:
            return (t_long - t_short) / (long - short)
    raise SystemExit(f"decoding {long - short} more tokens took no longer ({t_long * 1e3:.1f} ms against "
                     f"{t_short * 1e3:.1f} ms, three times): this machine's timing noise exceeds the decode time; "
                     f"give --decode-lens further apart")


def run_jaxserve(model_dir: Path, args) -> dict:
    """Every jaxserve figure (in its own process: see the module docstring)."""
    import jax
    from bench_kernels import copy_bandwidth
    from roofline import decode_step_bytes, prefill_flops, rated_limits

    from jaxserve import Engine, SamplingParams
    from jaxserve.config import resolve_dtype

    r = Results(args.json)
    device = jax.devices()[0]
    dtype = resolve_dtype("auto", device.platform)
    rated = rated_limits(device.device_kind)
    limits = (f"rated {rated[0] / 1e9:.0f} GB/s HBM, {rated[1] / 1e12:.0f} TFLOP/s dense bf16" if rated
              else "no rated limits known for this device")
    weights = f", {args.quantization} weights" if args.quantization else ""
    r.put(f"device: {device.device_kind} ({device.platform}, jax {jax.__version__}), {args.shape}, {dtype}{weights}; "
          f"{limits}", device=device.device_kind, platform=device.platform, dtype=str(dtype), host_cores=os.cpu_count(),
          rated_bandwidth=rated and rated[0], rated_flops=rated and rated[1], quantization=args.quantization)
    # The engine's options are `jaxserve serve`'s defaults unless given, so its step programs are the ones
    # scripts/bench_coldstart.py's server compiled into a shared --compilation-cache-dir. It is built before the
    # bandwidth is measured: the KV cache is sized from the peak memory in use, which the copy would raise.
    short, long = args.decode_lens
    options = {k: v for k, v in dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                     compilation_cache_dir=args.compilation_cache_dir).items() if v is not None}
    engine = Engine(str(model_dir), load_format="dummy", warmup=False, async_scheduling=not args.no_async_scheduling,
                    quantization=args.quantization, **options)
    if engine.max_model_len < args.input_len + max(args.output_len, long):
        raise SystemExit(f"max_model_len {engine.max_model_len} is shorter than a request of this run")
    bandwidth = copy_bandwidth(args.bandwidth_mib << 20, iters=5)
    r.put(f"memory bandwidth (elementwise pass over {args.bandwidth_mib} MiB, 20 in one compiled loop): "
          f"{bandwidth / 1e9:.0f} GB/s" + (f" ({100 * bandwidth / rated[0]:.0f}% of rated)" if rated else ""),
          bandwidth=bandwidth)
    cfg = engine.runner.cfg
    groups, matmul_params = param_groups(engine.runner.params)
    kv = engine.runner.kv
    kv_per_token = (kv.k.nbytes + kv.v.nbytes) / (kv.k.shape[2] * kv.k.shape[3])  # [L, K, blocks, block, d]
    # The measured tokens' contexts run from prompt + short to prompt + long: count the middle one.
    context = DECODE_PROMPT_LEN + (short + long) // 2
    step = decode_step_bytes(groups, cfg.tie_word_embeddings, kv_per_token, [context], engine.blocks.block_size)
    prompt = random_prompts(1, DECODE_PROMPT_LEN, cfg.vocab_size, seed=10_000)[0]
    per_token = decode_seconds_per_token(engine, prompt, short, long, args.repeats)
    roofline = step.total / bandwidth
    rated_roofline = step.total / rated[0] if rated else None
    r.put(f"batch-1 decode: {per_token * 1e3:.2f} ms/token; a step reads {step.describe()}; / measured bandwidth = "
          f"{roofline * 1e3:.2f} ms: {per_token / roofline:.2f}x the roofline"
          + (f"; / rated bandwidth = {rated_roofline * 1e3:.2f} ms: {per_token / rated_roofline:.2f}x" if rated else ""),
          decode_ms=per_token * 1e3, step_bytes=step.total, step_bytes_parts=vars(step), roofline_ms=roofline * 1e3,
          rated_roofline_ms=rated_roofline and rated_roofline * 1e3)

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    best, compiles, hits = float("inf"), 0, 0
    for prompts in prompt_sets(args):
        before = engine.stats()
        t = timed(lambda prompts=prompts: engine.generate(prompts, params, use_tqdm=False))
        after = engine.stats()
        if t < best:
            best = t
            compiles = after["num_compiles"] - before["num_compiles"]
            hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    n = args.num_prompts
    output_rate, total_rate = n * args.output_len / best, n * (args.input_len + args.output_len) / best
    r.put(f"jaxserve offline {n} x ({args.input_len} in + {args.output_len} out): {output_rate:.0f} output tok/s, "
          f"{total_rate:.0f} total tok/s ({best:.1f} s, best of {args.repeats}; {compiles} programs compiled and "
          f"{hits} prompt tokens served by the prefix cache in that run, to preempted requests resuming)",
          offline_seconds=best, output_tok_s=output_rate, total_tok_s=total_rate, offline_compiles=compiles)

    prefill_prompts = random_prompts(n, args.input_len, cfg.vocab_size, seed=20_000)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.generate(prefill_prompts[: engine.config.scheduler.max_num_seqs], one, use_tqdm=False)  # its shapes
    prefill_prompts = random_prompts(n, args.input_len, cfg.vocab_size, seed=20_001)
    seconds = timed(lambda: engine.generate(prefill_prompts, one, use_tqdm=False))
    flops = prefill_flops(matmul_params, cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.hidden_size,
                          cfg.vocab_size, [args.input_len] * n)
    mfu = flops / seconds / rated[1] if rated else None
    r.put(f"prefill {n} x {args.input_len} tokens (1 output token each): {n * args.input_len / seconds:.0f} tok/s, "
          f"{flops / seconds / 1e12:.1f} TFLOP/s" + (f" = {100 * mfu:.1f}% of rated bf16 (MFU)" if rated else ""),
          prefill_tok_s=n * args.input_len / seconds, prefill_flops=flops, prefill_seconds=seconds, mfu=mfu)
    return dict(r)


def transformers_offline(model_dir: Path, sets, output_len: int, batch_sizes) -> dict:
    """transformers' greedy generate over every prompt set at its fastest batch size (probed on one batch each),
    in bfloat16 on a GPU and float32 on CPU, like jaxserve's dtype="auto"."""
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

    prompts = sets[0]
    probes = {}
    for b in batch_sizes:
        if b > len(prompts):
            continue
        generate(prompts[:b])  # warm-up: kernels, allocator
        probes[b] = b / timed(lambda b=b: generate(prompts[:b]))  # requests per second
        print(f"transformers batch {b}: {probes[b] * output_len:.0f} output tok/s on one batch", flush=True)
    best_batch = max(probes, key=probes.get)
    seconds = min(timed(lambda p=p: [generate(p[i : i + best_batch]) for i in range(0, len(p), best_batch)])
                  for p in sets)
    return dict(batch=best_batch, seconds=seconds, probes=probes)


def in_child(fn, *args):
    """`fn(*args)` in a fresh process that exits when done: jax keeps the device memory it allocated (the KV
    cache takes most of it), so the two sides cannot share one process on a GPU."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--max-num-seqs", type=int, help="default: the engine's (256 on a GPU)")
    ap.add_argument("--max-num-batched-tokens", type=int, help="default: the engine's (8192 on a GPU)")
    ap.add_argument("--compilation-cache-dir", help="default: the engine's (~/.cache/jaxserve/xla)")
    ap.add_argument("--repeats", type=int, default=2, help="offline runs per side; the best counts (jaxserve's "
                    "first compiles)")
    ap.add_argument("--decode-lens", type=int, nargs=2, default=(32, 160), metavar=("SHORT", "LONG"),
                    help="output lengths of the two batch-1 runs whose difference gives the per-token time")
    ap.add_argument("--bandwidth-mib", type=int, default=1024, help="read and written beside the KV cache: 1 GiB is "
                    "20x an H100's L2 cache and fits the memory the cache leaves")
    ap.add_argument("--quantization", choices=("int8", "w8a8", "fp8"),
                    help="jaxserve's weights quantized at load (fp8: FP8 GEMMs on GPUs of compute capability 8.9+); "
                    "the roofline counts the bytes they take; transformers stays in the model dtype")
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="jaxserve reads each step back before scheduling the next (to measure what overlap buys)")
    ap.add_argument("--json", metavar="PATH", help="write jaxserve's figures here as each is measured")
    ap.add_argument("--append", metavar="BENCHMARKS.md", help="append the result row to this file")
    args = ap.parse_args()
    if min(args.num_prompts, args.input_len, args.output_len, args.repeats) < 1:
        ap.error("--num-prompts, --input-len, --output-len and --repeats must be at least 1")
    short, long = args.decode_lens
    if not 0 < short < long:
        ap.error(f"--decode-lens needs 0 < SHORT < LONG, got {short} {long}")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(args.shape, Path(tmp))
        ours = in_child(run_jaxserve, model_dir, args)
        hf = None if args.no_transformers else in_child(transformers_offline, model_dir, prompt_sets(args),
                                                        args.output_len, args.hf_batch_sizes)
    theirs = None
    if hf is not None:
        theirs = args.num_prompts * (args.input_len + args.output_len) / hf["seconds"]
        print(f"transformers offline, the same {args.num_prompts} requests: "
              f"{args.num_prompts * args.output_len / hf['seconds']:.0f} output tok/s, {theirs:.0f} total tok/s "
              f"(batch {hf['batch']}, the fastest of {sorted(hf['probes'])}; best of {args.repeats})")
    if args.append:
        append_result_row(args, ours, hf, theirs)
    total = ours["total_tok_s"]
    print(f"ratio jaxserve/transformers: {total / theirs:.2f}x" if theirs else f"jaxserve: {total:.0f} total tok/s")


def append_result_row(args, ours: dict, hf: dict | None, theirs: float | None) -> None:
    rated = ours["rated_bandwidth"]
    bandwidth = f"{ours['bandwidth'] / 1e9:.0f}" + (f" (rated {rated / 1e9:.0f})" if rated else "")
    roofline = f"{ours['roofline_ms']:.2f}" + (f" / {ours['rated_roofline_ms']:.2f}" if rated else "")
    ratio = f"{ours['decode_ms'] / ours['roofline_ms']:.2f}x" + (
        f" / {ours['decode_ms'] / ours['rated_roofline_ms']:.2f}x" if rated else "")
    mfu = f"{100 * ours['mfu']:.1f}%" if ours["mfu"] is not None else f"{ours['prefill_flops'] / ours['prefill_seconds'] / 1e12:.2f} TFLOP/s"
    hf_cell = (f"{args.num_prompts * args.output_len / hf['seconds']:.0f} / {theirs:.0f} (batch {hf['batch']})"
               if hf else "not run")
    append_row(args.append, f"{ours['device']} ({ours['host_cores']} host cores)",
               command_line("bench_synthetic.py", args.append), ours["dtype"], bandwidth,
               f"{ours['decode_ms']:.2f}", roofline, ratio,
               f"{ours['output_tok_s']:.0f} / {ours['total_tok_s']:.0f}", mfu, hf_cell,
               f"{ours['total_tok_s'] / theirs:.2f}x" if theirs else "")


if __name__ == "__main__":
    main()
