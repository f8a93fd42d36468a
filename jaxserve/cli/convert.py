"""`jaxserve convert MODEL OUT [--mesh TPxPP]`: options and the entry point (the work is in orbax_checkpoint.py).

Converting only reshapes and writes weights, so it runs on the host CPU with one (virtual) CPU device per mesh
position: a checkpoint for an 8x2 GPU mesh can be written on a machine without GPUs. No jax at import time:
the device count must be set before jax starts.
"""

from __future__ import annotations

import argparse
import os

from jaxserve.cli.args import UserError, add_mesh_arguments, json_object, layer_partition, mesh_of
from jaxserve.config import MeshShape
from jaxserve.loader.tokenizer import TokenizerChoice


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="model id, directory or .gguf file to convert")
    parser.add_argument("output", metavar="OUT", help="directory to write (must not exist yet)")
    add_mesh_arguments(parser, help="the mesh the checkpoint will be served on: its padding and layer split are "
                                    "baked in (default 1x1)")
    parser.add_argument("--pp-layer-partition", type=layer_partition, metavar="N,N,...",
                        help="decoder layers per pipeline stage, as serve takes it")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"),
                        help="stored dtype (serving casts to its own --dtype on load)")
    parser.add_argument("--hf-overrides", type=json_object, metavar="JSON",
                        help="keys laid over the model's config.json, as serve takes them; the checkpoint keeps "
                             "the result (a converted checkpoint takes no overrides of its own)")
    parser.add_argument("--revision", metavar="REV", help="branch, tag or commit of a hub model id")
    parser.add_argument("--tokenizer", metavar="DIR|HUB_ID",
                        help="store this tokenizer with the checkpoint instead of the model's own, as serve takes it")
    parser.add_argument("--tokenizer-revision", metavar="REV", help="branch, tag or commit of a hub --tokenizer")
    parser.add_argument("--download-dir", metavar="DIR",
                        help="where hub models and tokenizers are downloaded to (default: the Hugging Face cache)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def run_convert(args: argparse.Namespace) -> int:
    if os.path.exists(args.output):
        raise UserError(f"{args.output} already exists; give a new directory to write the checkpoint to")
    mesh = mesh_of(args) or MeshShape(1, 1)
    tp, pp = mesh
    _use_host_devices(tp * pp)
    from jaxserve.runner.convert import convert

    try:
        convert(args.model, args.output, (tp, pp), args.dtype, args.pp_layer_partition, args.hf_overrides,
                args.revision, TokenizerChoice(args.tokenizer, args.tokenizer_revision, args.download_dir),
                args.download_dir)
    except (ValueError, OSError) as exc:
        raise UserError(str(exc)) from None
    print(f"wrote {args.output}: serve it with `jaxserve serve {args.output} --mesh {mesh}`")
    return 0


def _use_host_devices(count: int) -> None:
    """One CPU device per mesh position, unless XLA_FLAGS already asks for enough, or jax already runs (then its
    devices stay: a mesh that does not fit is reported as such)."""
    import re

    import jax

    asked = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    try:
        jax.config.update("jax_platforms", "cpu")
        if not asked or int(asked.group(1)) < count:
            jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # backends already started
        pass
