#!/usr/bin/env python
"""A mixture of experts against the dense model of the same active MLP width, side by side in one run.

    python scripts/bench_moe.py                          # CPU: 128 experts top-8 of width 128 vs a dense 1024
    python scripts/bench_moe.py --shape qwen3-30b-a3b    # GPU: Qwen3-30B-A3B's shape in bfloat16
    python scripts/bench_moe.py --append BENCHMARKS.md   # also one table row per model

Three engines on random weights (`load_format="dummy"`, nothing downloaded), one after another in this process:
- dense: the Llama of the shape with MLP width k * expert width (the FLOPs a token's experts do);
- moe: the same attention, E experts of which each token runs k (models/experts.py's sparse dispatch);
- every-expert: the same MoE weights with every expert run on every token and the unchosen ones zeroed, the path
  jaxserve ran before sparse dispatch (E/k times the expert FLOPs), for the ratio it replaced.
Each measures prefill (--prefill-prompts prompts of --prefill-len tokens, one output token each: prompt tokens/s)
and decode at each --batches size (prompts of 16 tokens, output tokens/s from two output lengths, so the prefill
cancels out), best of --repeats after a run that compiles. Decode steps are also shown against the roofline of
the bytes a step reads from the expert weights it touches (all of them once every expert has a token).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench_synthetic import random_prompts, write_model_dir
from benchmark_table import append_row, command_line

MOE_SHAPES = {
    # hidden 256, 2 layers; experts 128 x width 128, top-8 (a dense width of 1024)
    "cpu": dict(base="tiny", overrides=dict(vocab_size=2048, hidden_size=256, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2),
                experts=128, k=8, width=128),
    "qwen3-30b-a3b": dict(base="llama3-8b", overrides=dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                                                           num_attention_heads=32, num_key_value_heads=4,
                                                           head_dim=128, max_position_embeddings=8192,
                                                           tie_word_embeddings=False),
                          experts=128, k=8, width=768),
}
VARIANTS = ("dense", "moe", "every-expert")


def model_dir(shape: dict, variant: str, root: Path) -> Path:
    out = root / variant
    out.mkdir()
    fields = shape["overrides"]
    if variant == "dense":
        return write_model_dir(shape["base"], out, intermediate_size=shape["k"] * shape["width"], **fields)
    return write_model_dir(shape["base"], out, "MixtralForCausalLM", "mixtral", intermediate_size=shape["width"],
                           num_local_experts=shape["experts"], num_experts_per_tok=shape["k"], **fields)


def every_expert(cfg, x, weights, experts, w):
    """The pre-sparse path: every expert on every token, the unchosen zeroed by the combine weights."""
    import jax
    import jax.numpy as jnp

    combine = jnp.einsum("Tk,TkE->TE", weights, jax.nn.one_hot(experts, w["w_gate"].shape[0], dtype=jnp.float32))
    gate = jnp.einsum("TD,EDF->TEF", x, w["w_gate"])
    up = jnp.einsum("TD,EDF->TEF", x, w["w_up"])
    out = jnp.einsum("TEF,EFD->TED", jax.nn.silu(gate) * up, w["w_down"])
    return jnp.einsum("TE,TED->TD", combine, out.astype(jnp.float32))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(path: Path, variant: str, vocab: int, args) -> dict:
    from jaxserve import Engine, SamplingParams
    from jaxserve.runner import model_runner

    original = model_runner.make_experts_fn
    if variant == "every-expert":
        model_runner.make_experts_fn = lambda *a: every_expert
    try:
        engine = Engine(str(path), load_format="dummy", max_num_seqs=max(args.batches),
                        max_num_batched_tokens=args.prefill_len, max_model_len=args.prefill_len + 64,
                        enable_prefix_caching=False, warmup=False,  # each measurement's first run compiles its own
                        **dict(a.split("=") for a in args.engine))
    finally:
        model_runner.make_experts_fn = original

    def run(prompts, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return lambda: engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def best(fn):
        fn()  # compiles what it needs
        return min(timed(fn) for _ in range(args.repeats))

    figures = {}
    prompts = random_prompts(args.prefill_prompts, args.prefill_len, vocab)
    figures["prefill"] = args.prefill_prompts * args.prefill_len / best(run(prompts, 1))
    for b in args.batches:
        prompts = random_prompts(b, 16, vocab, seed=b)
        short, long = best(run(prompts, 4)), best(run(prompts, 4 + args.decode_tokens))
        figures[f"decode b{b}"] = b * args.decode_tokens / (long - short)
        figures[f"step ms b{b}"] = 1e3 * (long - short) / args.decode_tokens

    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=MOE_SHAPES, default="cpu")
    parser.add_argument("--prefill-prompts", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--engine", nargs="*", default=[], metavar="OPTION=VALUE", help="engine options, as text")
    parser.add_argument("--append", metavar="BENCHMARKS.md", help="append one row per variant to this table")
    parser.add_argument("--machine", default="this machine's CPU", help="the machine column of --append's rows")
    args = parser.parse_args()
    import tempfile

    shape = MOE_SHAPES[args.shape]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants:
            results[variant] = measure(model_dir(shape, variant, Path(tmp)), variant, shape["overrides"]["vocab_size"],
                                       args)
            print(variant, {k: round(v, 2) for k, v in results[variant].items()}, flush=True)
    dense = results.get("dense")
    keys = [k for k in next(iter(results.values())) if not k.startswith("step")]
    print(f"\n{'tokens/s':14}" + "".join(f"{v:>22}" for v in results))
    for key in keys:
        cells = []
        for variant in results:
            value = results[variant][key]
            ratio = f" ({value / dense[key]:.2f}x)" if dense and variant != "dense" else ""
            cells.append(f"{value:.1f}{ratio}")
        print(f"{key:14}" + "".join(f"{c:>22}" for c in cells))
    if args.append:
        command = command_line("bench_moe.py", args.append)
        for variant, figures in results.items():
            append_row(args.append, args.machine, command, variant,
                       ", ".join(f"{k} {v:.1f}" + (f" ({v / dense[k]:.2f}x dense)" if dense and variant != "dense"
                                                    and not k.startswith("step") else "")
                                 for k, v in figures.items()))


if __name__ == "__main__":
    main()
