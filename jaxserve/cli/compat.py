"""vLLM's command lines, taken as they are: `--model`, `--max_model_len` spellings, and the vLLM options that
mean nothing under JAX (CUDA graphs, swap space, custom all-reduce...), accepted with a warning naming why, so a
launch command or manifest written for `vllm serve` starts jaxserve unchanged. Options jaxserve cannot honour
(float16 weights, the Mistral tokenizer) stop it with a one-line reason instead."""

from __future__ import annotations

import argparse
import logging

from jaxserve.cli.args import UserError, json_object, positive_int
from jaxserve.engine_args import VLLM_NO_EFFECT, VLLM_RUNNERS, VLLM_TASKS, vllm_no_effect

logger = logging.getLogger("jaxserve.cli.main")

# dest -> why the option changes nothing here: vLLM's engine options (engine_args.VLLM_NO_EFFECT; not
# --disable-log-stats, which turns serve's stats log off) and its server's. Each is warned about when given (None or
# False: not given; the one option with a --no- form says so with False).
NO_EFFECT = {dest: why for dest, why in VLLM_NO_EFFECT.items() if dest != "disable_log_stats"} | {
    "disable_frontend_multiprocessing": "the HTTP server and the engine loop share one process",
    "api_server_count": "one HTTP server process serves every request (its event loop never blocks on a step)",
    "enable_server_load_tracking": "the server's load is in /metrics (jaxserve:num_requests_running, ...) always",
    "data_parallel_backend": "serve -dp runs its replicas in this process, one mesh each",
}
TOKENIZER_MODES = ("auto", "hf", "slow", "mistral", "custom")


def add_vllm_compat_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM options accepted for its command lines (no effect here; a warning says "
                                      "why)")
    group.add_argument("--enforce-eager", action="store_true")
    group.add_argument("--max-seq-len-to-capture", type=positive_int, metavar="N")
    group.add_argument("--compilation-config", "-O", metavar="JSON|LEVEL")
    group.add_argument("--swap-space", type=float, metavar="GIB")
    group.add_argument("--disable-custom-all-reduce", action="store_true")
    group.add_argument("--trust-remote-code", action="store_true")
    group.add_argument("--guided-decoding-backend", metavar="NAME")
    group.add_argument("--max-parallel-loading-workers", type=positive_int, metavar="N")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("--task", choices=VLLM_TASKS)
    group.add_argument("--runner", choices=VLLM_RUNNERS)
    group.add_argument("--limit-mm-per-prompt", type=modality_limits, metavar="JSON|image=N,...")
    group.add_argument("--scheduling-policy", choices=("fcfs", "priority"))
    group.add_argument("--structured-outputs-config", type=json_object, metavar="JSON")
    group.add_argument("--tokenizer-pool-size", type=int, metavar="N")
    group.add_argument("--num-scheduler-steps", type=positive_int, metavar="N")
    group.add_argument("--disable-async-output-proc", action="store_true")
    group.add_argument("--preemption-mode", choices=("recompute", "swap"))
    group.add_argument("--model-impl", metavar="NAME")
    group.add_argument("--max-cpu-loras", type=positive_int, metavar="N")
    group.add_argument("--prefix-caching-hash-algo", metavar="NAME")
    group.add_argument("--enable-sleep-mode", action="store_true")
    group.add_argument("--cpu-offload-gb", type=float, metavar="GIB", help="0 only (vLLM's default)")
    group.add_argument("--tokenizer-mode", default="auto", choices=TOKENIZER_MODES,
                       help="auto/hf: the model's Hugging Face tokenizer (the only kind jaxserve reads)")
    refused = parser.add_argument_group("vLLM options jaxserve cannot honour (refused, saying why)")
    refused.add_argument("--calculate-kv-scales", action="store_true")
    refused.add_argument("--disable-sliding-window", action="store_true")


def add_vllm_serve_compat_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM server options accepted for its command lines (no effect here)")
    group.add_argument("--disable-frontend-multiprocessing", action="store_true")
    group.add_argument("--api-server-count", type=positive_int, metavar="N")
    group.add_argument("--enable-server-load-tracking", action="store_true")
    group.add_argument("--data-parallel-backend", metavar="NAME")


def modality_limits(text: str) -> dict:
    """vLLM's --limit-mm-per-prompt: JSON ('{"image": 2}') or its older form, image=2,video=1."""
    if text.lstrip().startswith("{"):
        return json_object(text)
    try:
        return {key.strip(): int(count) for key, count in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected JSON such as '{{\"image\": 0}}' or image=0,video=0, got {text!r}") from None


def normalize_option_spelling(argv: list[str]) -> list[str]:
    """`--max_model_len=8k` -> `--max-model-len=8k`, as vLLM's parser reads it; values are left alone."""
    normalized, after_separator = [], False
    for item in argv:
        if item == "--":
            after_separator = True
        if not after_separator and item.startswith("--") and "_" in item.partition("=")[0]:
            name, sep, value = item.partition("=")
            item = name.replace("_", "-") + sep + value
        normalized.append(item)
    return normalized


def fold_model_option(args: argparse.Namespace, config_model: str | None = None) -> None:
    """vLLM's `--model NAME` is the MODEL positional's other spelling: afterwards only `args.model` holds it.
    `config_model`: a config file's `model`, which --model overrides as the command line overrides the file."""
    option = vars(args).pop("model_option", None)
    if option is None:
        return
    if args.model not in (None, option, config_model):
        raise UserError(f"the model is given twice ({args.model} and --model {option}); give it once")
    args.model = option


def check_vllm_options(args: argparse.Namespace) -> None:
    """Refuse what cannot be honoured; warn about what is accepted but changes nothing."""
    if getattr(args, "dtype", None) in ("half", "float16"):
        raise UserError(f"--dtype {args.dtype} is not supported; use --dtype bfloat16 (float16's speed and memory "
                        "with float32's range) or auto")
    if getattr(args, "load_format", None) == "pt":
        raise UserError("--load-format pt is not supported: jaxserve reads safetensors and GGUF weights; leave the "
                        "option out (auto) and give a model that has .safetensors or .gguf files")
    if getattr(args, "load_format", None) in ("safetensors", "gguf"):
        args.load_format = "auto"  # the loader reads whichever the model has
    if getattr(args, "calculate_kv_scales", False):
        raise UserError("--calculate-kv-scales is not supported: jaxserve's fp8 KV cache is unscaled (a scale of 1, "
                        "saturating at the format's largest value); leave the option out")
    if getattr(args, "disable_sliding_window", False):
        raise UserError("--disable-sliding-window is not supported: jaxserve always attends within a model's sliding "
                        "window as the model was trained (vLLM's option instead caps the context at the window); "
                        "leave it out, and lower --max-model-len for a shorter context")
    mode = getattr(args, "tokenizer_mode", "auto")
    if mode in ("mistral", "custom"):
        raise UserError(f"--tokenizer-mode {mode} is not supported: jaxserve reads Hugging Face tokenizers "
                        "(tokenizer.json); leave it out, or pass --tokenizer with a Hugging Face one")
    for dest in NO_EFFECT:
        value = getattr(args, dest, None)
        try:
            reason = vllm_no_effect(dest, value) if dest in VLLM_NO_EFFECT else value and NO_EFFECT[dest]
        except ValueError as exc:  # a task jaxserve does not serve, a value it cannot honour
            raise UserError("--" + str(exc).replace(dest, dest.replace("_", "-"), 1)) from None
        if reason:
            option = "--" + ("no-" if value is False else "") + dest.replace("_", "-")
            logger.warning("%s has no effect in jaxserve: %s", option, reason)
