#!/usr/bin/env python
"""bfloat16 accuracy on the accelerator, against transformers float32 on the same device and the same weights.

    python scripts/gpu_accuracy.py --tokenizer DIR          # on a GPU: SmolLM2-135M's shape, every check below
    python scripts/gpu_accuracy.py --shape tiny             # CPU dry run (float32 there, so exact)

No model hub is reachable from a GPU machine and a real checkpoint is too large to carry there, so the model is
made on the spot: SmolLM2-135M's shape (30 layers, 576 wide, 9 q heads on 3 kv heads, tied embeddings) under
the given tokenizer, trained (until its loss is within 0.35 nats of the chain's entropy, or --train-steps or
--train-seconds run out) on sequences from a random Markov chain over --active-tokens token ids, each token followed by one of four successors with probabilities 0.55 / 0.25 / 0.12 / 0.08. A
random model's next-token distributions are near-flat, so which token is most likely is decided by noise and
agreement would measure nothing; the trained one predicts its chain with clear margins, through every layer.

Measured over --sequences held-out chain sequences of --length tokens, teacher-forced (each position's most
likely next token and the log-probability of the actual one), each side against transformers float32:
- next-token agreement (share of positions with the same most likely token) and the mean |log p difference|;
- the same for transformers' own bfloat16, the yardstick: jaxserve bfloat16 should agree at least as well
  (goal: agreement >= 99%, mean |log p difference| within 1.5x of transformers bfloat16's);
then each variant, in this order: `--quantization int8`, `w8a8`, `--kv-cache-dtype fp8` (against float32 and
against the same variant run by jaxserve in float32 on the host's CPU), a LoRA adapter (against transformers +
PEFT float32), ngram speculative decoding (greedy tokens against the same engine's without speculation) and a
structured-output request (the reply parses and matches its JSON schema). Each result is printed and written to
--json as it finishes, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from eval_quantization import teacher_forced

SHAPES = {
    # SmolLM2-135M's
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=100000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True),
}
SUCCESSOR_PROBS = (0.55, 0.25, 0.12, 0.08)
# The chain's tokens: ids FIRST_ID.. (clear of the special and byte tokens at the start of a byte-level BPE
# vocabulary; a tokenizer of 300 + --active-tokens ids is enough, such as the test suite's cut SmolLM2 one).
FIRST_ID = 300
VARIANTS = ("int8", "w8a8", "fp8-kv", "lora", "ngram", "structured")
# Bounded, so that a model which never chooses to end a string still closes the object within max_tokens.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "count"], "additionalProperties": False}
TRAIN_BATCH = {"smollm2": (32, 128), "tiny": (4, 64)}  # sequences x tokens a training step
TARGET_EXCESS = 0.35  # nats above the chain's entropy where training stops: the chain is learned
DECISIVE = 0.1  # a position whose reference top-1 logit leads the second by at least this much


class MarkovChain:
    def __init__(self, active: int, seed: int = 0):
        import numpy as np

        rng = np.random.default_rng(seed)
        self.active = active
        self.successors = np.stack([rng.choice(active, len(SUCCESSOR_PROBS), replace=False) for _ in range(active)])

    def sample(self, n: int, length: int, seed: int) -> list[list[int]]:
        import numpy as np

        rng = np.random.default_rng(seed)
        seqs = np.empty((n, length), np.int64)
        seqs[:, 0] = rng.integers(0, self.active, n)
        for t in range(1, length):
            pick = rng.choice(len(SUCCESSOR_PROBS), n, p=SUCCESSOR_PROBS)
            seqs[:, t] = self.successors[seqs[:, t - 1], pick]
        return (seqs + FIRST_ID).tolist()


def train_model(shape: str, tokenizer_dir: str, out: Path, chain: MarkovChain, max_steps: int, max_seconds: float,
                device: str) -> dict:
    """Trains the shape on the chain until its loss is within TARGET_EXCESS of the chain's entropy (or
    `max_steps` / `max_seconds` run out), saves it (float32) with the tokenizer to `out`; returns loss figures."""
    import math

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = load_tokenizer(tokenizer_dir)
    if len(tokenizer) < FIRST_ID + chain.active:
        raise SystemExit(f"the tokenizer has {len(tokenizer)} tokens; the chain needs ids up to "
                         f"{FIRST_ID + chain.active - 1}: give fewer --active-tokens or a larger tokenizer")
    config = AutoConfig.for_model("llama", **SHAPES[shape], vocab_size=len(tokenizer), rms_norm_eps=1e-5,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    entropy = -sum(p * math.log(p) for p in SUCCESSOR_PROBS)
    losses: list[float] = []
    start = time.perf_counter()
    model.train()
    for step in range(max_steps):
        batch = torch.tensor(chain.sample(*TRAIN_BATCH[shape], seed=1000 + step), device=device)
        with autocast:
            loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        recent = sum(losses[-10:]) / len(losses[-10:])
        if step % 50 == 0:
            print(f"  training step {step}: loss {recent:.3f}", flush=True)
        if (len(losses) >= 10 and recent < entropy + TARGET_EXCESS) or time.perf_counter() - start > max_seconds:
            break
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model, opt
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(steps=len(losses), first_loss=losses[0], last_loss=recent, chain_entropy=entropy)


def load_tokenizer(source: str):
    from transformers import AutoTokenizer

    if os.path.isdir(source):
        return AutoTokenizer.from_pretrained(source)
    d, f = os.path.split(source)
    return AutoTokenizer.from_pretrained(d, gguf_file=f)


def hf_teacher_forced(model_dir: Path, seqs, dtype: str, device: str, adapter: Path | None = None) -> list:
    """transformers' (log p of each actual next token, most likely next token, its lead over the second in logits)
    per position after the first."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    out = []
    with torch.no_grad():
        for ids in seqs:
            logits = model(torch.tensor([ids], device=device)).logits[0].float()
            logp = torch.log_softmax(logits, -1)
            nxt = torch.tensor(ids[1:], device=device)
            lp = logp[:-1].gather(1, nxt[:, None])[:, 0]
            top2 = logits[:-1].topk(2, -1).values
            out.append(list(zip(lp.tolist(), logits[:-1].argmax(-1).tolist(), (top2[:, 0] - top2[:, 1]).tolist())))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def compare(side: list, reference: list) -> dict:
    """Next-token agreement and mean |log p difference| of `side` against `reference`, and the agreement at the
    positions where the reference's choice is decisive (its top-1 logit leads by DECISIVE or more: elsewhere a
    rounding can swap two near-equal tokens in any implementation)."""
    pairs = [(a, b) for s, r in zip(side, reference) for a, b in zip(s, r)]
    decisive = [(a, b) for a, b in pairs if len(b) < 3 or b[2] >= DECISIVE]
    return dict(agreement=sum(a[1] == b[1] for a, b in pairs) / len(pairs),
                mean_abs_logp_diff=sum(abs(a[0] - b[0]) for a, b in pairs) / len(pairs), positions=len(pairs),
                decisive_agreement=sum(a[1] == b[1] for a, b in decisive) / max(1, len(decisive)),
                decisive_share=len(decisive) / len(pairs))


def agreement_text(c: dict) -> str:
    return (f"agreement {100 * c['agreement']:.2f}% ({100 * c['decisive_agreement']:.2f}% at the "
            f"{100 * c['decisive_share']:.0f}% of positions where the reference's choice is decisive), mean |log p "
            f"diff| {c['mean_abs_logp_diff']:.4f}")


def make_adapter(model_dir: Path, out: Path, r: int = 8) -> Path:
    """A PEFT LoRA adapter on every projection, with random factors large enough to move the logits."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.mul_(0.2)
    model.save_pretrained(out)
    return out


def jax_engine(model_dir: Path, cpu: bool = False, **options):
    """An engine with a cache of its own size: several live in this process beside torch, so none may size its
    cache from the memory left (the first would take it all)."""
    import jax

    from jaxserve import Engine

    devices = jax.devices("cpu")[:1] if cpu else None
    return Engine(str(model_dir), warmup=False, max_model_len=512, num_kv_blocks=1024, devices=devices, **options)


def run(args) -> dict:
    import jax
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    results: dict = {}

    def put(key: str, line: str, value) -> None:
        results[key] = value
        print(line, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))

    chain = MarkovChain(args.active_tokens)
    seqs = chain.sample(args.sequences, args.length, seed=7)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        t0 = time.perf_counter()
        trained = train_model(args.shape, args.tokenizer, model_dir, chain, args.train_steps, args.train_seconds,
                              device)
        put("training", f"trained {args.shape} on {device} for {trained['steps']} steps in "
            f"{time.perf_counter() - t0:.0f} s: loss {trained['first_loss']:.2f} -> {trained['last_loss']:.2f} "
            f"(the chain's entropy: {trained['chain_entropy']:.2f})", trained)
        f32 = hf_teacher_forced(model_dir, seqs, "float32", device)
        hf16 = compare(hf_teacher_forced(model_dir, seqs, "bfloat16", device), f32)
        put("transformers_bf16", f"transformers bfloat16 vs float32: {agreement_text(hf16)} ({hf16['positions']} "
            f"positions)", hf16)

        engine = jax_engine(model_dir)
        dtype = str(engine.runner.dtype)
        ours = teacher_forced(engine, seqs)
        base = compare(ours, f32)
        base["goal_met"] = base["agreement"] >= 0.99 and \
            base["mean_abs_logp_diff"] <= 1.5 * max(hf16["mean_abs_logp_diff"], 1e-6)
        put("jaxserve", f"jaxserve {dtype} on {jax.devices()[0].device_kind} vs transformers float32: "
            f"{agreement_text(base)} (goal: >= 99% and <= 1.5 x {hf16['mean_abs_logp_diff']:.4f}: "
            f"{'met' if base['goal_met'] else 'NOT met'})",
            base)
        for variant in args.variants:
            check_variant(variant, engine, model_dir, seqs, f32, put, tmp, device)
    return results


def check_variant(variant: str, engine, model_dir: Path, seqs, f32, put, tmp: str, device: str) -> None:
    from jaxserve import SamplingParams
    from jaxserve.lora_request import LoRARequest

    if variant in ("int8", "w8a8", "fp8-kv"):
        options = dict(kv_cache_dtype="fp8") if variant == "fp8-kv" else dict(quantization=variant)
        ours = teacher_forced(jax_engine(model_dir, **options), seqs)  # each engine is freed once it has answered
        on_cpu = teacher_forced(jax_engine(model_dir, cpu=True, **options), seqs)
        vs_ref, vs_cpu = compare(ours, f32), compare(ours, on_cpu)
        put(variant, f"{variant}: vs transformers float32 {agreement_text(vs_ref)}; vs the same {variant} in float32 "
            f"on the CPU {agreement_text(vs_cpu)}",
            dict(vs_float32=vs_ref, vs_cpu_variant=vs_cpu))
    elif variant == "lora":
        adapter = make_adapter(model_dir, Path(tmp) / "adapter")
        reference = hf_teacher_forced(model_dir, seqs, "float32", device, adapter)
        lora = jax_engine(model_dir, enable_lora=True, max_lora_rank=8)
        ours = teacher_forced(lora, seqs, lora_request=LoRARequest("acc", 1, str(adapter)))
        vs_ref, moved = compare(ours, reference), compare(f32, reference)
        put("lora", f"LoRA: vs transformers + PEFT float32 {agreement_text(vs_ref)} (the adapter moves float32's log p by "
            f"{moved['mean_abs_logp_diff']:.4f} on average)", dict(vs_reference=vs_ref, adapter_effect=moved))
    elif variant == "ngram":
        spec = jax_engine(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                         "prompt_lookup_max": 3, "prompt_lookup_min": 2})
        prompts = [s[:32] for s in seqs]
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        plain = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        drafted = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
        same = sum(a == b for a, b in zip(plain, drafted))
        stats = spec.stats()
        accepted = stats["spec_decode_num_accepted_tokens"] / max(1, stats["spec_decode_num_draft_tokens"])
        put("ngram", f"ngram speculation: {same}/{len(prompts)} greedy continuations equal to the engine's without "
            f"it ({stats['spec_decode_num_draft_tokens']} draft tokens, {100 * accepted:.0f}% accepted)",
            dict(equal=same, of=len(prompts), draft_tokens=stats["spec_decode_num_draft_tokens"], accepted=accepted))
    elif variant == "structured":
        params = SamplingParams(temperature=0, max_tokens=64, structured_outputs={"json": SCHEMA})
        text = engine.generate(["Describe one item as JSON:"], params, use_tqdm=False)[0].outputs[0].text
        try:
            value = json.loads(text)
            valid = set(value) == {"name", "count"} and isinstance(value["name"], str) and \
                len(value["name"]) <= 12 and isinstance(value["count"], int) and 0 <= value["count"] <= 999
        except ValueError:
            valid = False
        put("structured", f"structured output: {'valid' if valid else 'INVALID'} against its schema: {text!r}",
            dict(valid=valid, text=text))


def main() -> None:
    # torch and jax share the GPU in this process: jax takes memory as it needs it rather than 75% at its start.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--tokenizer", help="a tokenizer directory or GGUF file (default: $JAXSERVE_TEST_TOKENIZER_DIR, "
                    "else the built-in SmolLM2 GGUF's)")
    ap.add_argument("--train-steps", type=int, default=3000, help="at most")
    ap.add_argument("--train-seconds", type=float, default=60, help="at most")
    ap.add_argument("--active-tokens", type=int, default=256, help="token ids the chain runs over")
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--variants", nargs="*", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--json", metavar="PATH", help="write the results here as each is measured")
    args = ap.parse_args()
    if min(args.train_steps, args.sequences, args.length - 1, args.active_tokens - len(SUCCESSOR_PROBS)) < 1:
        ap.error("--train-steps and --sequences must be at least 1, --length at least 2, --active-tokens at least 5")
    if args.tokenizer is None:
        args.tokenizer = os.environ.get("JAXSERVE_TEST_TOKENIZER_DIR")
    if args.tokenizer is None:
        from jaxserve.loader.default_model import default_model_path

        args.tokenizer = str(default_model_path())
    run(args)


if __name__ == "__main__":
    main()
