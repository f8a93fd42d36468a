"""`jaxserve serve` once the engine exists: wrap it in an AsyncEngine, build the app, run uvicorn until a signal.

Separate from cli.py so that tests can serve a stand-in engine through exactly the code path users run.
"""

from __future__ import annotations

import argparse
import logging
import socket

from jaxserve.async_engine.data_parallel import DataParallelAsyncEngine, merge_stats
from jaxserve.async_engine.engine import AsyncEngine
from jaxserve.config import MeshShape
from jaxserve.server.app import build_app
from jaxserve.server.reasoning_parsers import reasoning_parser
from jaxserve.server.response_bodies import OutputOptions
from jaxserve.server.stats_log import log_stats_interval
from jaxserve.server.tool_parsers import tool_call_parser
from jaxserve.server.transport import CORSPolicy, ssl_options
from jaxserve.server.uvicorn_server import DrainingServer

logger = logging.getLogger("jaxserve")


def serve_engine(engines, args: argparse.Namespace, sock: socket.socket, mesh: MeshShape | None = None) -> int:
    """Serve an engine, or a list of data-parallel replicas, on the bound `sock` with the `serve` options in
    `args`; returns the exit status."""
    engines = engines if isinstance(engines, list) else [engines]
    engine = engines[0]  # what every replica shares: the model, its tokenizer, adapters and options
    names = args.served_model_name or [engine.model_name]
    cors, tls = CORSPolicy.from_args(args), ssl_options(args)
    options = dict(max_waiting_requests=args.max_waiting_requests, request_timeout=args.request_timeout,
                   log_prompts=args.log_prompts, max_log_len=args.max_log_len,
                   step_timeout=args.step_timeout or None)  # 0: off
    async_engine = AsyncEngine(engine, **options) if len(engines) == 1 else \
        DataParallelAsyncEngine.serving(engines, **options)
    app = build_app(async_engine, served_model_names=names, api_key=args.api_key,
                    max_body_bytes=args.max_request_body_bytes,
                    default_chat_template_kwargs=args.default_chat_template_kwargs,
                    tool_parser=tool_call_parser(args.tool_call_parser if args.enable_auto_tool_choice else None),
                    reasoning_parser=reasoning_parser(args.reasoning_parser, engine.tokenizer),
                    lora_adapters=engine.adapters.preloaded,
                    runtime_lora_updating=args.enable_runtime_lora_updating, cors=cors,
                    root_path=args.root_path,
                    log_stats_interval=None if args.disable_log_stats else log_stats_interval(),
                    output_options=OutputOptions(tokens_as_ids=args.return_tokens_as_token_ids,
                                                 prompt_tokens_details=args.enable_prompt_tokens_details,
                                                 response_role=args.response_role,
                                                 force_include_usage=args.enable_force_include_usage),
                    request_id_headers=args.enable_request_id_headers, vllm_metric_names=args.vllm_metric_names,
                    api_description=not args.disable_fastapi_docs)
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    log_startup(engines, args, mesh, names, f"{'https' if tls else 'http'}://{host}:{port}")
    if args.root_path:
        logger.info("served under %s too (--root-path, for a proxy)", args.root_path)
    if cors:
        logger.info("CORS: browser pages from %s may call the API", ", ".join(cors.origins))
        if args.api_key and cors.blocks_authorization():
            logger.warning("--allowed-headers does not include Authorization, which --api-key needs: browsers "
                           "will refuse to send the key")
    server = DrainingServer(app, async_engine, log_level=args.uvicorn_log_level or args.log_level,
                            drain_seconds=args.shutdown_grace_seconds, access_log=not args.disable_uvicorn_access_log,
                            **tls)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled; the shutdown itself went fine
        pass
    return 0


def log_startup(engines: list, args: argparse.Namespace, mesh: MeshShape | None, names: list[str], url: str) -> None:
    engine, stats = engines[0], merge_stats([replica.stats() for replica in engines])
    block_size = engine.config.cache.block_size
    logger.info("model %s served as %s; max_model_len %d", engine.model_name, ", ".join(names),
                engine.max_model_len)
    for name, lora in engine.adapters.preloaded.items():
        logger.info("LoRA adapter %s served as %s", lora.lora_path, name)
    if args.enable_runtime_lora_updating:
        logger.warning("LoRA adapters may be loaded and unloaded over HTTP (--enable-runtime-lora-updating): "
                       "clients can make this server read any adapter directory it can see")
    mesh = mesh or MeshShape()
    logger.info("mesh %s%s; dtype %s", mesh, " (one device)" if mesh.size == 1 else "", engine.config.dtype)
    if len(engines) > 1:
        logger.info("data parallel: %d replicas of that mesh, each request to the least loaded", len(engines))
    logger.info("KV cache: %d blocks x %d tokens = %d tokens", stats["total_blocks"], block_size,
                stats["total_blocks"] * block_size)
    logger.info("listening on %s (OpenAI API at %s/v1)", url, url)
