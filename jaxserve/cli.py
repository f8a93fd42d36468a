"""The `jaxserve` command: `serve` (OpenAI-compatible HTTP server), `generate` (one-shot completion) and
`batch` (a resumable batch job from a YAML file).

Subcommands live in `SUBCOMMANDS`; a new one adds an entry there. jax is imported only when a
command needs the engine, so `--help` and option errors answer at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

from jaxserve.async_engine import DEFAULT_STEP_TIMEOUT_S
from jaxserve.cli_args import (
    OneLineErrorParser,
    UserError,
    add_distributed_arguments,
    fail,
    generation_overrides,
    json_object,
    layer_partition,
    lora_module,
    lora_modules_dict,
    memory_fraction,
    mesh_shape,
    non_negative_float,
    parse_with_config,
    port_number,
    positive_float,
    positive_int,
    speculative_config,
    string_list,
    url_root_path,
)
from jaxserve.config import ATTENTION_IMPLS
from jaxserve.loader.convert_command import add_convert_arguments, run_convert
from jaxserve.parallel.check_command import add_check_arguments, run_check
from jaxserve.server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from jaxserve.server.reasoning_parsers import REASONING_PARSERS
from jaxserve.server.tool_parsers import TOOL_CALL_PARSERS
from jaxserve.server.uvicorn_server import DEFAULT_DRAIN_SECONDS

logger = logging.getLogger("jaxserve")

DEFAULT_MODEL_NOTE = "default: SmolLM2-135M-Instruct"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


# --- options shared by every command that builds an engine ------------------------------------------------
def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help=f"model id, directory or .gguf file ({DEFAULT_MODEL_NOTE})")
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
    engine.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="weights and activations (auto: float32 on CPU, bfloat16 on GPU/TPU)")
    engine.add_argument("--quantization", "-q", choices=("int8", "w8a8"),
                        help="int8: weight-only int8 with per-channel scales (a quarter of float32's weight bytes, "
                             "faster memory-bound decode); w8a8: those weights times int8 activations quantized "
                             "per token (integer matmuls). BENCHMARKS.md has the accuracy of each")
    engine.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                        help="dummy: random weights for the model's config (no weight files needed; benchmarks)")
    engine.add_argument("--max-model-len", type=positive_int, metavar="N", help="context length (prompt + output)")
    engine.add_argument("--max-num-seqs", type=positive_int, default=64, metavar="N",
                        help="most sequences in one step")
    engine.add_argument("--max-num-batched-tokens", type=positive_int, default=512, metavar="N",
                        help="most tokens in one step (prefill chunks are cut to fit)")
    engine.add_argument("--block-size", type=positive_int, default=16, metavar="N", help="tokens per KV block")
    engine.add_argument("--num-kv-blocks", type=positive_int, metavar="N",
                        help="KV cache blocks (default: sized from free device memory)")
    engine.add_argument("--gpu-memory-utilization", type=memory_fraction, default=0.9, metavar="FRACTION",
                        help="share of each accelerator's memory the engine fills: weights, activations, then the "
                             "KV cache in what is left (as in vLLM; ignored with --num-kv-blocks; default 0.9)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="share the KV blocks of a common prompt prefix between requests (default: on)")
    engine.add_argument("--attention-impl", default="auto", choices=ATTENTION_IMPLS,
                        help="auto: the Pallas kernels on GPU/TPU, the XLA reference on CPU; pallas-interpret "
                             "runs the kernels in Pallas's interpreter (slow; for debugging)")
    engine.add_argument("--tokenizer", metavar="DIR|HUB_ID",
                        help="serve with this Hugging Face tokenizer instead of the model's own (e.g. a GGUF "
                             "file's original model)")
    engine.add_argument("--revision", metavar="REV", help="branch, tag or commit of a hub model id")
    engine.add_argument("--tokenizer-revision", metavar="REV", help="branch, tag or commit of a hub --tokenizer")
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


def mesh_from_args(args: argparse.Namespace) -> str | None:
    """The mesh as "TPxPP" (or None for one device) from --mesh or -tp/-pp."""
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    if args.mesh is not None:
        if tp is not None or pp is not None:
            raise UserError("give the mesh either as --mesh TPxPP or as -tp/-pp, not both")
        return args.mesh
    if tp is None and pp is None:
        return None
    return f"{tp or 1}x{pp or 1}"


def check_model_path(model: str | None) -> None:
    """Fail fast (before jax starts) on a model that is plainly a local path and is missing."""
    if model is None:
        return
    looks_local = model.startswith(("/", "./", "../", "~")) or model.endswith(".gguf")
    if looks_local and not os.path.exists(os.path.expanduser(model)):
        raise UserError(f"model file {model} does not exist; pass an existing directory or .gguf file, "
                        f"or omit MODEL for the {DEFAULT_MODEL_NOTE.removeprefix('default: ')} default")


def build_engine(args: argparse.Namespace):
    """The Engine the options describe; its user-facing errors (bad mesh, missing file...) become UserError."""
    mesh = mesh_from_args(args)
    check_model_path(args.model)
    from jaxserve.parallel.multinode import is_leader, start_cluster

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
                        chat_template=args.chat_template if is_leader(args) else None,  # only it sees prompts
                        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                        lora_modules=lora_modules_dict(args.lora_modules), speculative_config=args.speculative_config,
                        hf_overrides=args.hf_overrides, tokenizer=args.tokenizer, revision=args.revision,
                        tokenizer_revision=args.tokenizer_revision,
                        generation_config=args.generation_config if is_leader(args) else "auto",
                        override_generation_config=args.override_generation_config, **compilation_cache_option(args))
    except (ValueError, OSError) as exc:  # the engine words these for people (DESIGN.md convention 9)
        raise UserError(str(exc)) from None
    # Process 0 gets its engine back (now driving the others); a follower follows and exits inside take_role.
    return engine if cluster is None else cluster.take_role(engine)


def compilation_cache_option(args: argparse.Namespace) -> dict:
    """--compilation-cache-dir as Engine keywords: none given keeps the Engine's default; '' turns it off."""
    if args.compilation_cache_dir is None:
        return {}
    return {"compilation_cache_dir": args.compilation_cache_dir or None}


# --- serve --------------------------------------------------------------------------------------------------
def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    server.add_argument("--port", type=port_number, default=8000, help="0 picks a free port")
    server.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    server.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="name(s) clients use for the model (default: MODEL as given)")
    server.add_argument("--max-waiting-requests", type=positive_int, default=1024, metavar="N",
                        help="requests waiting for their first token before new ones get 503")
    server.add_argument("--max-request-body-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        metavar="N", help="larger request bodies get 413 (default: 8 MiB)")
    server.add_argument("--request-timeout", type=positive_float, metavar="SECONDS",
                        help="abort a request still running after this long (504, or an error event when "
                             "streaming); default: no limit")
    server.add_argument("--step-timeout", type=non_negative_float, default=DEFAULT_STEP_TIMEOUT_S,
                        metavar="SECONDS",
                        help="/health answers 503 while one engine step has run longer than this (a hung device "
                             "neither fails nor returns), so a load balancer stops sending requests here; 0 turns "
                             "it off, e.g. for --no-warmup with a model whose first compile takes longer "
                             "(default: %(default).0f)")
    server.add_argument("--shutdown-grace-seconds", type=non_negative_float, default=DEFAULT_DRAIN_SECONDS,
                        metavar="SECONDS", help="on SIGTERM or Ctrl-C, how long requests in flight may run on "
                                                "before they are aborted (new ones get 503 meanwhile)")
    server.add_argument("--default-chat-template-kwargs", type=json_object, metavar="JSON",
                        help="template variables for every chat request, e.g. '{\"enable_thinking\": false}' for "
                             "Qwen3; a request's own chat_template_kwargs win (as in vLLM)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="answer tool_choice \"auto\" (OpenAI's default when tools are given): the model calls "
                             "tools in its own format, read by --tool-call-parser (as in vLLM)")
    server.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                        help="the model's tool-call format: hermes (<tool_call>{...}</tool_call>: Qwen2.5, Qwen3, "
                             "Hermes), llama3_json (Llama 3.1-3.3), pythonic (Llama 3.2, 4: [f(x=1)]), mistral "
                             "([TOOL_CALLS])")
    server.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                        help="split the model's <think>...</think> reasoning into the chat message's `reasoning`, "
                             "apart from its `content` (as in vLLM): qwen3 (Qwen3, QwQ, SmolLM3; reasoning only "
                             "where a block is opened) or deepseek_r1 (reasoning until </think> even unopened)")
    server.add_argument("--enable-runtime-lora-updating", action="store_true",
                        help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; there "
                             "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): anyone who can reach the server, with the "
                             "--api-key if set, can make it read adapter directories it can see. Implies --enable-lora")
    server.add_argument("--log-prompts", action="store_true",
                        help="log each request's prompt (kept out of the logs unless set: prompts may be private)")
    web = parser.add_argument_group("CORS, TLS and proxies (vLLM's options)")
    web.add_argument("--allowed-origins", type=string_list, metavar="JSON",
                     help="origins whose browser pages may call the API, e.g. '[\"https://app.example\"]' "
                          "('[\"*\"]': any site). Default: none (vLLM's default is any)")
    web.add_argument("--allowed-methods", type=string_list, metavar="JSON", help="CORS methods (default: all)")
    web.add_argument("--allowed-headers", type=string_list, metavar="JSON", help="CORS headers (default: all)")
    web.add_argument("--allow-credentials", action="store_true", help="let those origins send cookies")
    web.add_argument("--root-path", type=url_root_path, default="", metavar="PATH",
                     help="the prefix a reverse proxy serves this under, e.g. /llm: requests are answered with or "
                          "without it")
    web.add_argument("--ssl-keyfile", metavar="PEM", help="the TLS private key (serve HTTPS)")
    web.add_argument("--ssl-certfile", metavar="PEM", help="the TLS certificate chain (serve HTTPS)")
    web.add_argument("--ssl-ca-certs", metavar="PEM", help="CA certificates that verify client certificates")
    web.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2), default=0,
                     help="client certificates: 0 not asked, 1 optional, 2 required (as Python's ssl.CERT_*)")


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a busy port is reported in a second rather than after compiling."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({exc.strerror}); pick another --port or --host") from None
    return sock


def run_serve(args: argparse.Namespace) -> int:
    from jaxserve.parallel.multinode import is_leader
    from jaxserve.server.launch import serve_engine
    from jaxserve.server.transport import CORSPolicy, ssl_options

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UserError("--enable-auto-tool-choice needs --tool-call-parser to say how the model writes tool calls "
                        f"(one of: {', '.join(TOOL_CALL_PARSERS)})")
    args.enable_lora = args.enable_lora or args.enable_runtime_lora_updating
    sock = None  # followers serve no HTTP
    if is_leader(args):
        CORSPolicy.from_args(args)  # both checked now, not after the model loads
        ssl_options(args)
        sock = listen_socket(args.host, args.port)
    return serve_engine(build_engine(args), args, sock, mesh=mesh_from_args(args))


# --- generate -----------------------------------------------------------------------------------------------
def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    sampling = parser.add_argument_group("generation")
    sampling.add_argument("--prompt", help="the text to complete (required)")
    sampling.add_argument("--max-tokens", type=positive_int, metavar="N",
                          help="default: the generation config's max_new_tokens, else 64")
    sampling.add_argument("--temperature", type=float,
                          help="default: the generation config's, else 0 (greedy, so runs repeat exactly)")
    sampling.add_argument("--chat", action="store_true",
                          help="send the prompt as a user message through the chat template")


def generate_params(args: argparse.Namespace, defaults: dict):
    """The model's generation defaults (its generation_config.json with --override-generation-config), under this
    command's flags. Unlike the server's, the fallbacks are greedy and 64 tokens, so a bare run repeats exactly."""
    from jaxserve.sampling_params import SamplingParams

    fields = {**defaults, "seed": args.seed}
    fields["temperature"] = args.temperature if args.temperature is not None else defaults.get("temperature", 0.0)
    fields["max_tokens"] = args.max_tokens or defaults.get("max_tokens") or 64
    return SamplingParams(**fields)


def run_generate(args: argparse.Namespace) -> int:
    if args.prompt is None:
        raise UserError("generate needs --prompt TEXT (or `prompt:` in the config file)")
    try:
        generate_params(args, {})  # the flags alone, checked before the model loads
        engine = build_engine(args)
        params = generate_params(args, engine.generation_defaults)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    prompt = engine.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    try:
        output = engine.generate([prompt], params, use_tqdm=False)[0]
    except ValueError as exc:  # e.g. the prompt is longer than the context
        raise UserError(str(exc)) from None
    print(output.outputs[0].text)
    return 0


# --- batch (jaxserve/batch/) --------------------------------------------------------------------------------
def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxserve.batch.command import add_job_arguments

    add_job_arguments(parser)
    add_distributed_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)


def run_batch(args: argparse.Namespace) -> int:
    from jaxserve.batch.command import run_batch_command

    return run_batch_command(args)


SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": Subcommand("run the OpenAI-compatible HTTP server", add_serve_arguments, run_serve),
    "generate": Subcommand("complete one prompt and print the text", add_generate_arguments, run_generate),
    "batch": Subcommand("run a batch job file (OpenAI batch JSONL in and out; resumable)", add_batch_arguments,
                        run_batch),
    "check": Subcommand("check a (multi-node) mesh before serving: processes, devices, collective bandwidth",
                        add_check_arguments, run_check),
    "convert": Subcommand("write a model as a sharded orbax checkpoint for a mesh (fast, per-process loading)",
                          add_convert_arguments, run_convert),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = OneLineErrorParser(prog="jaxserve", description="A JAX/XLA LLM inference engine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=OneLineErrorParser)
    subparsers = {}
    for name, command in SUBCOMMANDS.items():
        subparsers[name] = commands.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(subparsers[name])
    return parser, subparsers


def main(argv: list[str] | None = None) -> int:
    parser, subparsers = build_parser()
    try:
        argv = sys.argv[1:] if argv is None else list(argv)
        args = parse_with_config(parser, subparsers, argv)
        args.argv = argv  # the Ray launcher starts followers with these same arguments
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return SUBCOMMANDS[args.command].run(args) or 0
    except UserError as exc:
        fail(str(exc))


if __name__ == "__main__":
    sys.exit(main())
