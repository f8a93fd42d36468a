"""The options every `jaxserve` command that builds an engine shares (vLLM's names), and the Engine they describe.
jax is imported only inside `build_engine`, so `--help` and option errors answer at once."""

from __future__ import annotations

import argparse
import os

from jaxserve.cli.args import (
    UserError,
    add_distributed_arguments,
    byte_count,
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
from jaxserve.cli.cluster import cluster_options, is_leader, start_cluster
from jaxserve.cli.compat import add_vllm_compat_arguments
from jaxserve.config import MeshShape
from jaxserve.engine_args import EngineArgs, option_fields

DEFAULT_MODEL_NOTE = "default: SmolLM2-135M-Instruct"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


# How a flag's text becomes each kind of EngineArgs value (engine_args.option says what the kinds are).
PARSERS = {"text": None, "int": int, "count": positive_int, "tokens": token_count, "bytes": byte_count,
           "fraction": memory_fraction,
           "json": json_object, "speculative": speculative_config, "generation": generation_overrides,
           "partition": layer_partition, "mesh": mesh_shape, "adapters": lora_module, "choice": None}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, one per EngineArgs field (its `flags`, else --field-name), grouped as the fields say;
    then MODEL, vLLM's accepted-with-a-warning options, the multi-node options, --config and --log-level."""
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help=f"model id, directory or .gguf file ({DEFAULT_MODEL_NOTE})")
    parser.add_argument("--model", dest="model_option", metavar="MODEL", help="MODEL, spelled as vLLM's option")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in option_fields("cli"):
        meta = f.metadata
        group = groups.get(meta["group"]) or groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        flags = meta["flags"] or (f"--{f.name.replace('_', '-')}",)
        kind = meta["kind"]
        if kind == "switch":
            group.add_argument(*flags, action="store_true", help=meta["help"])
        elif kind == "bool":
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=f.default, help=meta["help"])
        elif kind == "off-switch":  # --no-x stores True under its own dest (no_x); the field is its negation
            action = group.add_argument(*flags, action="store_true", help=meta["help"])
            for on in meta["on_flags"]:
                group.add_argument(on, dest=action.dest, action="store_false", default=False,
                                   help="the default, as vLLM's option")
        else:
            group.add_argument(*flags, type=PARSERS[kind], choices=meta["choices"] or None, metavar=meta["metavar"],
                               nargs="+" if kind == "adapters" else None, help=meta["help"],
                               default=None if kind == "adapters" else f.default)
    engine = groups["engine"]
    engine.add_argument("--hf-token", nargs="?", const=True, metavar="TOKEN",
                        help="the Hugging Face token for gated or private hub models (vLLM's; default: $HF_TOKEN or "
                             "the `hf auth login` one; given without a value, that one)")
    add_vllm_compat_arguments(parser)
    add_distributed_arguments(parser)
    parser.add_argument("--config", metavar="FILE.yaml", help="read any of these options from a YAML file")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)


def engine_args_from(args: argparse.Namespace, **overrides) -> EngineArgs:
    """The EngineArgs the parsed flags describe (`overrides`: fields laid over them); a bad value is a UserError."""
    values = {}
    for f in option_fields("cli"):
        flags = f.metadata["flags"] or (f"--{f.name.replace('_', '-')}",)
        dest = next(flag for flag in flags if flag.startswith("--"))[2:].replace("-", "_")
        value = getattr(args, dest)
        if f.metadata["kind"] == "off-switch":
            value = not value
        elif f.metadata["kind"] == "adapters":
            value = lora_modules_dict(value)
        values[f.name] = value
    try:
        return EngineArgs(model=args.model, **(values | overrides))
    except ValueError as exc:
        raise UserError(str(exc)) from None


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
    if cluster_options(args) is not None or getattr(args, "distributed_executor_backend", "mp") == "ray":
        raise UserError(f"--data-parallel-size {replicas} runs its replicas in one process; it cannot be combined "
                        "with several processes (--num-processes, Ray): start one server per replica instead")
    check_model_path(args.model)
    from jaxserve.async_engine.data_parallel import build_replicas

    options = engine_args_from(args)

    def replica(devices, **overrides):
        return build_engine(args, devices, warmup=False, **overrides)

    try:
        return build_replicas(replica, options.mesh_shape, replicas, options.seed, warmup=options.warmup)
    except ValueError as exc:  # too few devices for the replicas (an engine's own errors are UserErrors already)
        raise UserError(str(exc)) from None


def build_engine(args: argparse.Namespace, devices=None, **overrides):
    """The Engine the options describe (on `devices`, None: the first the mesh needs; `overrides`: EngineArgs
    fields laid over the flags); its user-facing errors (bad mesh, missing file...) become UserError."""
    mesh = mesh_from_args(args)
    check_model_path(args.model)
    if isinstance(args.hf_token, str):  # what huggingface_hub reads for every download, the tokenizer's included
        os.environ["HF_TOKEN"] = args.hf_token
    leader = is_leader(args)  # only it sees prompts: the others keep the default template and sampling defaults
    options = engine_args_from(args, devices=devices, chat_template=args.chat_template if leader else None,
                               generation_config=args.generation_config if leader else "auto", **overrides)
    cluster = start_cluster(args, mesh)  # None on one process; joins the others before jax starts its backends
    from jaxserve.engine import Engine  # imports jax: only now that it is needed

    try:
        engine = Engine(options.model, **options.engine_kwargs())
    except (ValueError, OSError) as exc:  # the engine words these for people (docs/architecture.md: errors are for people)
        raise UserError(str(exc)) from None
    # Process 0 gets its engine back (now driving the others); a follower follows and exits inside take_role.
    return engine if cluster is None else cluster.take_role(engine)
