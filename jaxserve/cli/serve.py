"""`jaxserve serve`'s options (vLLM's names) and its start: options checked and the port bound before the model
loads, then the server (server/launch.py) runs until a signal."""

from __future__ import annotations

import argparse
import os
import socket

from jaxserve.async_engine.engine import MAX_LOGGED_PROMPT_CHARS
from jaxserve.async_engine.step_watch import DEFAULT_STEP_TIMEOUT_S
from jaxserve.cli.args import (
    UserError,
    json_object,
    lora_modules_dict,
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
    string_list,
    url_root_path,
)
from jaxserve.cli.cluster import is_leader
from jaxserve.cli.compat import add_vllm_serve_compat_arguments
from jaxserve.cli.engine_options import add_engine_arguments, build_engines, mesh_from_args
from jaxserve.loader.model_name import check_adapter_names, served_name
from jaxserve.server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from jaxserve.server.reasoning_parsers import REASONING_PARSERS
from jaxserve.server.tool_parsers import TOOL_CALL_PARSERS
from jaxserve.server.uvicorn_server import DEFAULT_DRAIN_SECONDS

# A manifest written for vLLM keeps its key in VLLM_API_KEY: ignoring it would serve with no authentication at all.
API_KEY_VARIABLES = ("JAXSERVE_API_KEY", "VLLM_API_KEY")


def api_key_from_environment() -> list[str] | None:
    for variable in API_KEY_VARIABLES:
        if os.environ.get(variable):
            return [os.environ[variable]]
    return None


# Options that take several values (as vLLM's do): a MODEL written after one is read as one more value.
MANY_VALUED_OPTIONS = {"--api-key": "for several keys, repeat --api-key",
                       "--served-model-name": "for several names, put MODEL first"}


def check_model_not_taken_as_a_key(args: argparse.Namespace) -> None:
    """`serve --api-key KEY org/model`: --api-key takes several keys (as vLLM's), so the model would be read as a
    second key, and the default model served with it as a valid key (--served-model-name alike: the default model
    served under the model's name). Several values with no MODEL are refused."""
    argv = getattr(args, "argv", [])
    if args.model is not None:
        return
    for option, several in MANY_VALUED_OPTIONS.items():
        for start in (i + 1 for i, word in enumerate(argv) if word == option):
            after = argv[start:]
            given = next((i for i, word in enumerate(after) if word.startswith("-")), len(after))
            if given > 1:
                raise UserError(f"{option} got {given} values and no MODEL was given: if {after[given - 1]!r} is "
                                f"the model, put it before {option} (or pass --model); {several}")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    engine_dests = {action.dest for action in parser._actions}
    parser.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1, metavar="N",
                        help="serve N replicas of the model, each on its own mesh of devices (N x tp x pp in all), "
                             "each request sent to the least loaded (as vLLM's)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    server.add_argument("--port", type=port_number, default=8000, help="0 picks a free port")
    server.add_argument("--api-key", nargs="+", action="extend", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' (any of the keys given) on /v1 routes (default: "
                             f"${' or $'.join(API_KEY_VARIABLES)} when set, as vLLM reads VLLM_API_KEY)")
    server.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="name(s) clients use for the model (default: MODEL as given; a GGUF file's name without "
                             "its directory and suffix; SmolLM2-135M-Instruct for the built-in default)")
    server.add_argument("--max-waiting-requests", type=positive_int, default=1024, metavar="N",
                        help="requests waiting for their first token before new ones get 503 (default: 1024)")
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
                             "([TOOL_CALLS]), qwen3_coder (Qwen3-Coder: <function=f><parameter=x>), granite "
                             "(Granite 3: <tool_call>[...]), phi4_mini_json (Phi-4-mini: functools[...]), xlam (xLAM: "
                             "[...], maybe in a ```json fence after text)")
    server.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                        help="split the model's <think>...</think> reasoning into the chat message's `reasoning`, "
                             "apart from its `content` (as in vLLM): qwen3 (Qwen3, QwQ, SmolLM3; reasoning only "
                             "where a block is opened), deepseek_r1 (reasoning until </think> even unopened) or "
                             "granite (Granite 3.2: 'Here is my thought process:' ... 'Here is my response:'; Granite "
                             "3.3: <think>...</think> then <response>...</response>)")
    server.add_argument("--enable-runtime-lora-updating", action="store_true",
                        help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes; there "
                             "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): anyone who can reach the server, with the "
                             "--api-key if set, can make it read adapter directories it can see. Implies --enable-lora")
    server.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="logprobs name tokens 'token_id:N' instead of their text (as vLLM), which maps back even "
                             "where a token is part of a character")
    server.add_argument("--vllm-metric-names", action="store_true",
                        help="name /metrics series vllm:NAME instead of jaxserve:NAME, so dashboards and autoscalers "
                             "written for vLLM (vllm:num_requests_waiting, ...) read them unchanged")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="usage reports prompt_tokens_details.cached_tokens: prompt tokens the prefix cache served")
    server.add_argument("--response-role", default="assistant", metavar="ROLE",
                        help="the role chat replies name after a generation prompt (default: assistant, as vLLM)")
    server.add_argument("--enable-force-include-usage", action="store_true",
                        help="every streamed response reports its usage (each chunk, and a last usage chunk), as "
                             "if it asked with stream_options (vLLM's option)")
    add_logging_arguments(parser)
    add_vllm_serve_compat_arguments(parser)
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
    web.add_argument("--disable-fastapi-docs", action="store_true",
                     help="serve no API description (/openapi.json, /docs), as vLLM's option of that name")
    web.add_argument("--enable-request-id-headers", action="store_true",
                     help="answer with an X-Request-Id header: the request's own, or a new one")
    web.add_argument("--ssl-keyfile", metavar="PEM", help="the TLS private key (serve HTTPS)")
    web.add_argument("--ssl-certfile", metavar="PEM", help="the TLS certificate chain (serve HTTPS)")
    web.add_argument("--ssl-ca-certs", metavar="PEM", help="CA certificates that verify client certificates")
    web.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2), default=0,
                     help="client certificates: 0 not asked, 1 optional, 2 required (as Python's ssl.CERT_*)")

    # The server's own options: process 0 alone serves HTTP, so several processes need not agree on them
    # (cli/cluster.py compares the rest). Runtime LoRA updating is compared too: it turns enable_lora on (the
    # adapter slots every process's programs hold), and a mismatch should name the flag the user gave.
    parser.set_defaults(server_only_options=frozenset({a.dest for a in parser._actions} - engine_dests
                                                      - {"enable_runtime_lora_updating"}))


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    logs = parser.add_argument_group("logging (vLLM's options)")
    logs.add_argument("--log-prompts", "--enable-log-requests", dest="log_prompts", action="store_true",
                      help="log each request's prompt and parameters (kept out of the logs unless set: prompts may be "
                           "private)")
    logs.add_argument("--max-log-len", type=non_negative_int, default=MAX_LOGGED_PROMPT_CHARS, metavar="N",
                      help="characters of a prompt --enable-log-requests logs (default: %(default)s)")
    logs.add_argument("--disable-log-requests", action="store_true",
                      help="requests are not logged unless --enable-log-requests is given (vLLM's old flag)")
    logs.add_argument("--disable-log-stats", action="store_true",
                      help="no periodic line of throughput, running and waiting requests and KV cache use (logged "
                           "every 10 s while there is work)")
    logs.add_argument("--uvicorn-log-level", choices=("debug", "info", "warning", "error", "critical", "trace"),
                      help="uvicorn's own log level (default: --log-level)")
    logs.add_argument("--disable-uvicorn-access-log", action="store_true", help="no line per HTTP request")


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
    from jaxserve.server.launch import serve_engine
    from jaxserve.server.transport import CORSPolicy, ssl_options

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UserError("--enable-auto-tool-choice needs --tool-call-parser to say how the model writes tool calls "
                        f"(one of: {', '.join(TOOL_CALL_PARSERS)})")
    args.enable_lora = args.enable_lora or args.enable_runtime_lora_updating
    check_model_not_taken_as_a_key(args)
    try:
        check_adapter_names(args.served_model_name or [served_name(args.model)], lora_modules_dict(args.lora_modules)
                            or {})
    except ValueError as exc:
        raise UserError(str(exc)) from None
    args.api_key = args.api_key or api_key_from_environment()
    sock = None  # followers serve no HTTP
    if is_leader(args):
        CORSPolicy.from_args(args)  # both checked now, not after the model loads
        ssl_options(args)
        sock = listen_socket(args.host, args.port)
    return serve_engine(build_engines(args), args, sock, mesh=mesh_from_args(args))
