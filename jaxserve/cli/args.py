"""Argument parsing for the `jaxserve` CLI: one-line errors, option types, and YAML config files.

Every option of a subcommand can also come from `--config FILE.yaml` (keys are option names, with dashes or
underscores); the command line wins over the file, the file over the defaults.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

import yaml

from jaxserve.config import MeshShape, SpeculativeConfig
from jaxserve.engine_args import byte_count as engine_byte_count
from jaxserve.engine_args import token_count as engine_token_count
from jaxserve.errors import UserError
from jaxserve.loader.generation_config import check_overrides


def fail(message: str) -> NoReturn:
    print(f"jaxserve: error: {message}", file=sys.stderr)
    raise SystemExit(2)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a bad option is one line pointing at --help instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        fail(f"{message}; see '{self.prog} --help'")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def token_count(text: str) -> int | None:
    """engine_args.token_count on the command line: 4096, 32k = 32,000, 32K = 32,768; auto or -1: the default."""
    return _argument(engine_token_count, text)


def byte_count(text: str) -> int | None:
    """engine_args.byte_count on the command line: 4000000000, 4G = 4 GiB; auto or -1: the default."""
    return _argument(engine_byte_count, text)


def _argument(check, text: str):
    try:
        return check(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value:g}")
    return value


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"key\": true}}', got {text!r} "
                                         f"({exc.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"key\": true}}', got {text!r}")
    return value


def speculative_config(text: str) -> dict:
    """vLLM's --speculative-config JSON, checked at once (the Engine takes the dict)."""
    value = json_object(text)
    try:
        SpeculativeConfig.from_dict(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def generation_overrides(text: str) -> dict:
    """vLLM's --override-generation-config JSON, checked at once (before the model loads)."""
    try:
        return check_overrides(json_object(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("override_generation_config: ")) from None


def url_root_path(text: str) -> str:
    """--root-path: '/llm' (a trailing '/' dropped); '' or '/' for none."""
    if text and not text.startswith("/"):
        raise argparse.ArgumentTypeError(f"{text!r} must start with '/', e.g. /{text}")
    return text.rstrip("/")


def string_list(text: str) -> list[str]:
    """A JSON list of strings ('["a", "b"]', vLLM's spelling), or bare strings separated by commas."""
    if not text.lstrip().startswith("["):
        return [part.strip() for part in text.split(",") if part.strip()]
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON list such as '[\"a\", \"b\"]', got {text!r} "
                                         f"({exc.msg})") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"a\", \"b\"]', got {text!r}")
    return value


def memory_fraction(text: str) -> float:
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], such as 0.9, got {value:g}")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value:g}")
    return value


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 0 to 65535, got {value}")
    return value


def mesh_shape(text: str) -> MeshShape:
    try:
        return MeshShape.parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected TPxPP such as 8x2 (tensor-parallel x pipeline-parallel devices), got {text!r}") from None


def add_mesh_arguments(parser: argparse.ArgumentParser, help: str) -> None:
    """--mesh TPxPP and vLLM's -tp/-pp, as serve takes them (for the commands whose other options are not the
    engine's: check, convert); `mesh_of` reads them back."""
    parser.add_argument("--mesh", type=mesh_shape, metavar="TPxPP", help=help)
    parser.add_argument("--tensor-parallel-size", "-tp", type=positive_int, metavar="N",
                        help="the mesh's tp, vLLM's spelling (with -pp; instead of --mesh)")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, metavar="N",
                        help="the mesh's pp, vLLM's spelling (with -tp; instead of --mesh)")


def mesh_of(args: argparse.Namespace) -> MeshShape | None:
    """The mesh add_mesh_arguments' options give (None: none of them given)."""
    sizes = (args.tensor_parallel_size, args.pipeline_parallel_size)
    if sizes == (None, None):
        return args.mesh
    try:
        return MeshShape.of(args.mesh, *sizes)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def layer_partition(text: str) -> list[int]:
    """`8,8,7,7` -> [8, 8, 7, 7]: decoder layers per pipeline stage (the sum is checked against the model later)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"expected layer counts per pipeline stage separated by commas, such as 8,8,7,7, got {text!r}")
    return [int(p) for p in parts]


def lora_module(text: str) -> tuple[str, str]:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ...}` -> (name, path)."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get("path"), str):
            return value["name"], value["path"]
    else:
        name, sep, path = text.partition("=")
        if sep and name and path:
            return name, path
    raise argparse.ArgumentTypeError(f"expected NAME=PATH (an adapter directory served as model NAME) or "
                                     f"'{{\"name\": ..., \"path\": ...}}', got {text!r}")


def lora_modules_dict(modules: list[tuple[str, str]] | None) -> dict[str, str] | None:
    if not modules:
        return None
    names = [name for name, _ in modules]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UserError(f"--lora-modules names {', '.join(repeated)} more than once; give each adapter its own name")
    return dict(modules)


# Options whose value is JSON: in a YAML config file they may be written as a mapping or a list.
JSON_OPTION_TYPES = (json_object, speculative_config, generation_overrides, string_list, lora_module)


# --- multi-node (jaxserve/parallel/launch.py reads these) ---------------------------------------------------
def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-node (run the same command on every node)")
    group.add_argument("--coordinator", metavar="HOST:PORT",
                       help="address of process 0, reachable from every node; PORT and PORT+1 are used "
                            "(env JAX_COORDINATOR_ADDRESS)")
    group.add_argument("--num-processes", type=positive_int, metavar="N",
                       help="processes in all, one per node (env JAX_NUM_PROCESSES; default 1)")
    group.add_argument("--process-id", type=non_negative_int, metavar="I",
                       help="this process: 0 leads (serves HTTP, or runs the batch job), 1..N-1 follow it "
                            "(env JAX_PROCESS_ID)")
    group.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default="mp",
                       help="mp: start every process yourself (default); ray: process 0 starts the others as "
                            "Ray actors on the Ray cluster it joins")
    group.add_argument("--distributed-timeout", type=positive_float, default=300.0, metavar="SECONDS",
                       help="how long to wait for every process to join before naming the missing ones")


# --- config files -------------------------------------------------------------------------------------------
def read_config_file(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"config file {path} does not exist; check the --config path")
    try:
        content = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(exc, "problem", None) or "cannot be parsed"
        raise UserError(f"config file {path} is not valid YAML{line}: {problem}; fix the file") from None
    if content is None:
        return {}
    if not isinstance(content, dict):
        raise UserError(f"config file {path} must be a mapping of option names to values, "
                        f"not a {type(content).__name__}")
    return {str(key).replace("-", "_"): value for key, value in content.items()}


def _config_keys(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.Action, bool]]:
    """Each key a config file may use -> (its option, whether the key is the option's --no- form). Keys are the
    long option names, any alias included (`enable-log-requests`, `no-enable-prefix-caching`), as in vLLM's config
    files, with dashes or underscores."""
    actions = [action for action in parser._actions if action.dest not in ("help", "config", argparse.SUPPRESS)]
    keys = {}
    for action in actions:  # dests first: `model` is MODEL, not --model
        keys.setdefault(action.dest, (action, False))
    for action in actions:
        for option in action.option_strings:
            if option.startswith("--"):
                negated = isinstance(action, argparse.BooleanOptionalAction) and option.startswith("--no-")
                keys.setdefault(option[2:].replace("-", "_"), (action, negated))
    return keys


def _coerce(action: argparse.Action, key: str, value: Any, path: str, negated: bool = False) -> Any:
    """A YAML value checked and converted exactly as the same value on the command line would be."""
    if action.nargs == 0:  # a flag such as --enable-something
        if not isinstance(value, bool):
            raise UserError(f"{key} in config file {path} must be true or false, got {value!r}")
        # `async-scheduling: true` is --async-scheduling, which stores False (its dest is no_async_scheduling).
        return value != (negated or action.const is False)
    if action.nargs in ("+", "*"):
        return [_coerce_one(action, key, item, path) for item in (value if isinstance(value, list) else [value])]
    return _coerce_one(action, key, value, path)


def _coerce_one(action: argparse.Action, key: str, value: Any, path: str) -> Any:
    if isinstance(value, (dict, list)) and action.type in JSON_OPTION_TYPES:
        value = json.dumps(value)
    if value is None or isinstance(value, (dict, list)):
        raise UserError(f"{key} in config file {path} must be a single value, got {value!r}")
    converted = value
    if action.type is not None:
        try:
            converted = action.type(str(value))
        except (argparse.ArgumentTypeError, ValueError) as exc:
            raise UserError(f"{key} in config file {path}: {exc}") from None
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise UserError(f"{key} in config file {path} must be one of {choices}, got {value!r}")
    return converted


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> None:
    """Make the file's values the parser's defaults, so that the command line still overrides them."""
    keys = _config_keys(parser)
    values = read_config_file(path)
    unknown = sorted(set(values) - set(keys))
    if unknown:
        known = ", ".join(sorted({key.replace("_", "-") for key in keys}))
        raise UserError(f"unknown key {unknown[0]!r} in config file {path}; valid keys are: {known}")
    defaults = {}
    for key, value in values.items():
        action, negated = keys[key]
        defaults[action.dest] = _coerce(action, key, value, path, negated)
    parser.set_defaults(**defaults)


def parse_with_config(parser: argparse.ArgumentParser, subparsers: dict[str, argparse.ArgumentParser],
                      argv: list[str]) -> argparse.Namespace:
    """Parse once to find the subcommand and --config, then again with the file's values as defaults."""
    args = _parse(parser, subparsers, argv)
    config = getattr(args, "config", None)
    if config is None:
        return args
    apply_config_file(subparsers[args.command], config)
    return _parse(parser, subparsers, argv)


def _parse(parser: argparse.ArgumentParser, subparsers: dict[str, argparse.ArgumentParser],
           argv: list[str]) -> argparse.Namespace:
    """An option the subcommand does not know is refused by the subcommand, whose --help lists its options."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        subparsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args
