"""The `jaxserve` command: `serve` (OpenAI-compatible HTTP server, cli/serve.py), `generate` (one-shot completion),
`batch` (a resumable batch job from a YAML file), `check` and `convert`. Engine options: cli/engine_options.py.

Subcommands live in `SUBCOMMANDS`; a new one adds an entry there. jax is imported only when a
command needs the engine, so `--help` and option errors answer at once.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from jaxserve import __version__
from jaxserve.cli.args import (
    OneLineErrorParser,
    UserError,
    add_distributed_arguments,
    fail,
    parse_with_config,
    positive_int,
)
from jaxserve.cli.check import add_check_arguments, run_check
from jaxserve.cli.compat import check_vllm_options, fold_model_option, normalize_option_spelling
from jaxserve.cli.convert import add_convert_arguments, run_convert
from jaxserve.cli.engine_options import LOG_LEVELS, add_engine_arguments, build_engine
from jaxserve.cli.serve import add_serve_arguments, run_serve


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


# --- generate -----------------------------------------------------------------------------------------------
def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    sampling = parser.add_argument_group("generation")
    sampling.add_argument("--prompt", help="the text to complete (required)")
    sampling.add_argument("--max-tokens", type=positive_int, metavar="N",
                          help="default: 64, or up to the generation config's max_new_tokens as room allows")
    sampling.add_argument("--temperature", type=float,
                          help="default: the generation config's, else 0 (greedy, so runs repeat exactly)")
    sampling.add_argument("--chat", action="store_true",
                          help="send the prompt as a user message through the chat template")
    # serve's (and vLLM's) engine flag: a serve command's options run here unchanged
    parser.add_argument("--disable-log-stats", action="store_true", help="(generate logs no stats in any case)")


def generate_params(args: argparse.Namespace, defaults: dict):
    """The model's generation defaults (its generation_config.json with --override-generation-config), under this
    command's flags. Unlike the server's, the fallbacks are greedy and 64 tokens, so a bare run repeats exactly."""
    from jaxserve.sampling_params import SamplingParams

    fields = {**defaults, "seed": args.seed}
    fields["temperature"] = args.temperature if args.temperature is not None else defaults.get("temperature", 0.0)
    # The generation config's max_new_tokens is a cap: None lets the engine take the room left, up to it.
    fields["max_tokens"] = args.max_tokens or (None if defaults.get("max_tokens") is not None else 64)
    return SamplingParams(**fields)


def try_as_user_error(function, *args):
    """function(*args), whose ValueError (a bad value, worded for people) becomes a one-line UserError."""
    try:
        return function(*args)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def run_generate(args: argparse.Namespace) -> int:
    if args.prompt is None:
        raise UserError("generate needs --prompt TEXT (or `prompt:` in the config file)")
    check_flags = functools.partial(generate_params, args)
    try_as_user_error(check_flags, {})  # the flags alone, checked before the model loads
    # One prompt meets a few step shapes: compiling those when first needed takes seconds, where warming up every
    # shape a server could meet took most of a minute for SmolLM2 on CPU.
    engine = build_engine(args, warmup=False)
    params = try_as_user_error(check_flags, engine.generation_defaults)
    prompt = engine.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    try:
        output = engine.generate([prompt], params, use_tqdm=False)[0]
    except ValueError as exc:  # e.g. the prompt is longer than the context
        raise UserError(str(exc)) from None
    print(output.outputs[0].text)
    return 0


# --- batch (jaxserve/batch/) --------------------------------------------------------------------------------
def add_batch_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxserve.cli.batch import add_job_arguments

    add_job_arguments(parser)
    add_distributed_arguments(parser)
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)


def run_batch(args: argparse.Namespace) -> int:
    from jaxserve.cli.batch import run_batch_command

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
    parser.add_argument("--version", action="version", version=f"jaxserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     parser_class=OneLineErrorParser)
    subparsers = {}
    for name, command in SUBCOMMANDS.items():
        subparsers[name] = commands.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(subparsers[name])
    return parser, subparsers


def configure_logging(level: str) -> None:
    """jaxserve's log at `level`; jax's own at warnings unless debugging: at info it reports each platform it
    probed and did not find ("Unable to initialize backend 'tpu'" on every GPU or CPU machine), which reads as a
    fault to someone starting a server."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet = max(logging.WARNING, logging.getLogger().level)
    logging.getLogger("jax").setLevel(logging.NOTSET if level == "debug" else quiet)


def main(argv: list[str] | None = None) -> int:
    parser, subparsers = build_parser()
    try:
        argv = normalize_option_spelling(sys.argv[1:] if argv is None else list(argv))
        args = parse_with_config(parser, subparsers, argv)
        args.argv = argv  # the Ray launcher starts followers with these same arguments
        configure_logging(args.log_level)
        fold_model_option(args, subparsers[args.command].get_default("model"))
        check_vllm_options(args)
        return SUBCOMMANDS[args.command].run(args) or 0
    except UserError as exc:
        fail(str(exc))


if __name__ == "__main__":
    sys.exit(main())
