"""The options every `jaxserve` command that builds an engine shares (vLLM's names), and the Engine they describe.
jax is imported only inside `build_engine`, so `--help` and option errors answer at once."""

from __future__ import annotations

import argparse
import os

from jaxserve.cli.args import (
    UserError,
    add_distributed_arguments,
    generation_overrides,
    json_object,
    layer_partition,
    lora_module,
    lora_modules_dict,
    memory_fraction,
    mesh_shape,
    positive_int,
    speculative_config,
    token_count,
)
from jaxserve.cli.compat import add_vllm_compat_arguments
from jaxserve.config import ATTENTION_IMPLS, KV_CACHE_DTYPES, LAYER_LOOPS, MeshShape
from jaxserve.loader.chat_content import CONTENT_FORMATS

DEFAULT_MODEL_NOTE = "default: SmolLM2-135M-Instruct"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help=f"model id, directory or .gguf file ({DEFAULT_MODEL_NOTE})")
    parser.add_argument("--model", dest="model_option", metavar="MODEL", help="MODEL, spelled as vLLM's option")
    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--mesh", type=mesh_shape, metavar="TPxPP",
                          help="device mesh: tensor-parallel x pipeline-parallel devices, e.g. 8x2")
    parallel.add_argument("-tp", "--tensor-parallel-size", type=positive_int, metavar="N",
                          help="tensor-parallel devices (instead of --mesh)")
    parallel.add_argument("-pp", "--pipeline-parallel-size", type=positive_int, metavar="M",
                          help="pipeline stages (instead of --mesh)")
    parallel.add_argument("--pp-layer-partition", type=layer_partition, metavar="N,N,...",
                          help="decoder layers per pipeline stage, e.g. 8,8,7,7 (default: even, the remainder "
                               "going to the stages before the last, as in vLLM)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float", "half", "float16"),
                        help="weights and activations (auto: float32 on CPU, bfloat16 on GPU/TPU; float is float32; "
                             "float16 is not supported, bfloat16 replaces it)")
    engine.add_argument("--quantization", "-q", choices=("int8", "w8a8"),
                        help="int8: weight-only int8 with per-channel scales (a quarter of float32's weight bytes, "
                             "faster memory-bound decode); w8a8: those weights times int8 activations quantized "
                             "per token (integer matmuls). BENCHMARKS.md has the accuracy of each")
    engine.add_argument("--load-format", default="auto", choices=("auto", "dummy", "safetensors", "gguf", "pt"),
                        help="dummy: random weights for the model's config (no weight files needed; benchmarks); "
                             "auto reads safetensors or GGUF, whichever the model has (pt files are not read)")
    engine.add_argument("--max-model-len", type=token_count, metavar="N",
                        help="context length (prompt + output); 32k is 32,000 and 32K 32,768, as in vLLM")
    engine.add_argument("--max-num-seqs", type=positive_int, metavar="N",
                        help="most sequences in one step (default: 64 on CPU, 256 on GPU/TPU)")
    engine.add_argument("--max-num-batched-tokens", type=token_count, metavar="N",
                        help="most tokens in one step, prefill chunks cut to fit (default: 512 on CPU, 8192 on "
                             "GPU/TPU)")
    engine.add_argument("--block-size", type=positive_int, default=16, metavar="N", help="tokens per KV block")
    engine.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", type=positive_int, metavar="N",
                        help="KV cache blocks (default: sized from free device memory)")
    engine.add_argument("--gpu-memory-utilization", type=memory_fraction, default=0.9, metavar="FRACTION",
                        help="share of each accelerator's memory the engine fills: weights, activations, then the "
                             "KV cache in what is left (as in vLLM; ignored with --num-kv-blocks; default 0.9)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="share the KV blocks of a common prompt prefix between requests (default: on)")
    engine.add_argument("--attention-impl", default="auto", choices=ATTENTION_IMPLS,
                        help="auto: the Pallas kernels on GPU/TPU, the XLA reference on CPU; pallas-interpret "
                             "runs the kernels in Pallas's interpreter (slow; for debugging)")
    engine.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="auto: the model's dtype; fp8 (= fp8_e4m3) or fp8_e5m2 stores K/V in one byte a value, "
                             "twice a bf16 cache's tokens in the same memory (unscaled, as vLLM without scales)")
    engine.add_argument("--layer-loop", default="auto", choices=LAYER_LOOPS,
                        help="auto: unrolled over per-layer weights on GPU (each matmul reads its weights in place), "
                             "one scan over stacked weights elsewhere (faster compiles)")
    engine.add_argument("--tokenizer", metavar="DIR|HUB_ID",
                        help="serve with this Hugging Face tokenizer instead of the model's own (e.g. a GGUF "
                             "file's original model)")
    engine.add_argument("--revision", metavar="REV", help="branch, tag or commit of a hub model id")
    engine.add_argument("--tokenizer-revision", metavar="REV", help="branch, tag or commit of a hub --tokenizer")
    engine.add_argument("--hf-token", nargs="?", const=True, metavar="TOKEN",
                        help="the Hugging Face token for gated or private hub models (vLLM's; default: $HF_TOKEN or "
                             "the `hf auth login` one; given without a value, that one)")
    engine.add_argument("--download-dir", metavar="DIR",
                        help="where hub models and tokenizers are downloaded to (default: the Hugging Face cache)")
    engine.add_argument("--chat-template-content-format", default="auto", choices=CONTENT_FORMATS,
                        help="how message contents reach the chat template: string (text parts joined), openai (a "
                             "list of {'type': 'text', 'text': ...} parts) or auto (openai when the template loops "
                             "over a message's content), as in vLLM")
    engine.add_argument("--chat-template", metavar="TEMPLATE",
                        help="a Jinja chat template, or a file holding one, to use instead of the tokenizer's "
                             "(a model without one needs it for /v1/chat/completions)")
    engine.add_argument("--compilation-cache-dir", metavar="DIR",
                        help="where compiled step programs are kept between runs ('' turns the cache off; "
                             "default: ~/.cache/jaxserve/xla, under $XDG_CACHE_HOME when set)")
    engine.add_argument("--max-logprobs", type=int, default=20, metavar="N",
                        help="largest logprobs / top_logprobs a request may ask for")
    engine.add_argument("--seed", type=int, default=0, help="seed of requests that set none")
    engine.add_argument("--no-async-scheduling", action="store_true",
                        help="read each step back before scheduling the next (by default the next step is "
                             "dispatched first, so host work overlaps device work; for debugging)")
    engine.add_argument("--async-scheduling", dest="no_async_scheduling", action="store_false", default=False,
                        help="the default, as vLLM's option")
    engine.add_argument("--no-warmup", action="store_true",
                        help="compile step programs when first needed instead of at start-up (faster start, "
                             "slower first requests)")
    engine.add_argument("--hf-overrides", type=json_object, metavar="JSON",
                        help="keys laid over the model's config.json, as in vLLM: '{\"max_position_embeddings\": "
                             "65536, \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 2.0, "
                             "\"original_max_position_embeddings\": 32768}}'")
    engine.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                        help="where requests' sampling defaults come from, as in vLLM: the model's "
                             "generation_config.json (auto), none (vllm: OpenAI's defaults), or DIR's")
    engine.add_argument("--override-generation-config", type=generation_overrides, metavar="JSON",
                        help="sampling defaults laid over those, as in vLLM: '{\"temperature\": 0.6, \"top_p\": 0.95}'")
    engine.add_argument("--speculative-config", type=speculative_config, metavar="JSON",
                        help="speculative decoding, as in vLLM: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                             "\"prompt_lookup_max\": 4}' drafts tokens by looking the latest ones up earlier in the "
                             "sequence (faster on outputs that copy their input; the tokens are unchanged)")
    add_lora_arguments(parser)
    add_vllm_compat_arguments(parser)
    add_distributed_arguments(parser)
    parser.add_argument("--config", metavar="FILE.yaml", help="read any of these options from a YAML file")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    lora = parser.add_argument_group("LoRA adapters (vLLM's options)")
    lora.add_argument("--enable-lora", action="store_true",
                      help="give the model adapter slots (implied by --lora-modules)")
    lora.add_argument("--lora-modules", type=lora_module, nargs="+", metavar="NAME=PATH",
                      help="PEFT LoRA adapter directories, each served as model NAME (a request's \"model\" picks "
                           "it); loaded at start and kept")
    lora.add_argument("--max-loras", type=positive_int, default=1, metavar="N",
                      help="adapter slots on the devices (default 1; raised to the number of --lora-modules)")
    lora.add_argument("--max-lora-rank", type=positive_int, default=16, metavar="R",
                      help="largest adapter rank a slot holds (default 16)")


def mesh_from_args(args: argparse.Namespace) -> MeshShape:
    """The mesh from --mesh or -tp/-pp (MeshShape.of's one rule)."""
    try:
        return MeshShape.of(args.mesh, args.tensor_parallel_size, args.pipeline_parallel_size)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def check_model_path(model: str | None) -> None:
    """Fail fast (before jax starts) on a model that is plainly a local path and is missing."""
    if model is None:
        return
    looks_local = model.startswith(("/", "./", "../", "~")) or model.endswith(".gguf")
    if looks_local and not os.path.exists(os.path.expanduser(model)):
        raise UserError(f"model file {model} does not exist; pass an existing directory or .gguf file, "
                        f"or omit MODEL for the {DEFAULT_MODEL_NOTE.removeprefix('default: ')} default")


def build_engines(args: argparse.Namespace) -> list:
    """The engines `serve` runs: one, or with --data-parallel-size N, N replicas on disjoint devices of this
    process (async_engine/data_parallel.py), loaded one after another and then compiled side by side."""
    replicas = getattr(args, "data_parallel_size", 1)
    if replicas == 1:
        return [build_engine(args)]
    from jaxserve.cli.cluster import cluster_options

    if cluster_options(args) is not None or getattr(args, "distributed_executor_backend", "mp") == "ray":
        raise UserError(f"--data-parallel-size {replicas} runs its replicas in one process; it cannot be combined "
                        "with several processes (--num-processes, Ray): start one server per replica instead")
    check_model_path(args.model)
    from jaxserve.async_engine.data_parallel import build_replicas

    def replica(devices, **overrides):
        return build_engine(argparse.Namespace(**{**vars(args), "no_warmup": True, **overrides}), devices)

    try:
        return build_replicas(replica, mesh_from_args(args), replicas, args.seed, warmup=not args.no_warmup)
    except ValueError as exc:  # too few devices for the replicas (an engine's own errors are UserErrors already)
        raise UserError(str(exc)) from None


def build_engine(args: argparse.Namespace, devices=None):
    """The Engine the options describe (on `devices`, None: the first the mesh needs); its user-facing errors (bad
    mesh, missing file...) become UserError."""
    mesh = mesh_from_args(args)
    check_model_path(args.model)
    if isinstance(args.hf_token, str):  # what huggingface_hub reads for every download, the tokenizer's included
        os.environ["HF_TOKEN"] = args.hf_token
    from jaxserve.cli.cluster import is_leader, start_cluster

    cluster = start_cluster(args, mesh)  # None on one process; joins the others before jax starts its backends
    from jaxserve.engine import Engine  # imports jax: only now that it is needed

    try:
        engine = Engine(args.model, dtype=args.dtype, max_model_len=args.max_model_len, block_size=args.block_size,
                        num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, seed=args.seed, mesh=mesh,
                        max_logprobs=args.max_logprobs, pp_layer_partition=args.pp_layer_partition,
                        warmup=not args.no_warmup, quantization=args.quantization,
                        load_format=args.load_format, async_scheduling=not args.no_async_scheduling,
                        kv_cache_memory_fraction=args.gpu_memory_utilization,
                        enable_prefix_caching=args.enable_prefix_caching, attention_impl=args.attention_impl,
                        layer_loop=args.layer_loop, kv_cache_dtype=args.kv_cache_dtype,
                        chat_template=args.chat_template if is_leader(args) else None,  # only it sees prompts
                        chat_template_content_format=args.chat_template_content_format,
                        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                        lora_modules=lora_modules_dict(args.lora_modules), speculative_config=args.speculative_config,
                        hf_overrides=args.hf_overrides, tokenizer=args.tokenizer, revision=args.revision,
                        tokenizer_revision=args.tokenizer_revision, download_dir=args.download_dir,
                        generation_config=args.generation_config if is_leader(args) else "auto",
                        override_generation_config=args.override_generation_config, devices=devices,
                        **compilation_cache_option(args))
    except (ValueError, OSError) as exc:  # the engine words these for people (docs/architecture.md: errors are for people)
        raise UserError(str(exc)) from None
    # Process 0 gets its engine back (now driving the others); a follower follows and exits inside take_role.
    return engine if cluster is None else cluster.take_role(engine)


def compilation_cache_option(args: argparse.Namespace) -> dict:
    """--compilation-cache-dir as Engine keywords: none given keeps the Engine's default; '' turns it off."""
    if args.compilation_cache_dir is None:
        return {}
    return {"compilation_cache_dir": args.compilation_cache_dir or None}
