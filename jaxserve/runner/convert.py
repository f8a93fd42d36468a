"""`jaxserve convert`: the runner's parameter tree for one mesh layout, written as a sharded orbax checkpoint in
the format loader/orbax_checkpoint.py reads (placed by the same code that serves a checkpoint, so what is written
is exactly what a server of that layout holds)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from jaxserve.loader.checkpoint import open_checkpoint
from jaxserve.loader.orbax_checkpoint import FORMAT_VERSION, MARKER, layout_signature, nested, stored_config
from jaxserve.loader.tokenizer import TokenizerChoice
from jaxserve.parallel.layout import plan_layout
from jaxserve.parallel.sharding import make_mesh
from jaxserve.runner.weights import load_weights

log = logging.getLogger(__name__)


def convert(model: str, out: str, mesh_shape: tuple[int, int], dtype: str, partition: list[int] | None = None,
            hf_overrides: dict | None = None, revision: str | None = None, tokenizer=None,
            download_dir: str | None = None) -> None:
    """`tokenizer`: a loader.tokenizer.TokenizerChoice (None: the model's own), stored beside the weights.
    `download_dir`: where a hub model is downloaded to (None: the Hugging Face cache)."""
    ckpt = open_checkpoint(model, hf_overrides=hf_overrides, revision=revision,
                           tokenizer=tokenizer or TokenizerChoice(), download_dir=download_dir)
    if not ckpt.head.generates:  # what the checkpoint holds besides a causal LM is not written
        raise ValueError(f"{model} is not a causal language model (it has no LM head), and jaxserve convert writes "
                         "those only: serve the checkpoint directly")
    layout = plan_layout(ckpt.config, *mesh_shape, partition)
    _, params = load_weights(ckpt.config, ckpt.tensors, jnp.dtype(dtype), make_mesh(*mesh_shape), layout)
    arrays = {path: var.get_value() for path, var in nnx.to_flat_state(params)}
    out_dir = Path(out).absolute()
    out_dir.mkdir(parents=True)
    try:
        with ocp.StandardCheckpointer() as saver:
            saver.save(out_dir / "params", nested(arrays))
        ckpt.tokenizer.save_pretrained(str(out_dir))
        meta = {"format": FORMAT_VERSION, "name": ckpt.name, "config": stored_config(ckpt.config),
                "mesh": list(mesh_shape), "partition": list(layout.partition), "layout": layout_signature(layout),
                "dtype": dtype, "bytes": sum(a.nbytes for a in arrays.values()),
                "generation_defaults": ckpt.generation_defaults, "pooling": ckpt.pooling}
        (out_dir / MARKER).write_text(json.dumps(meta, indent=1))
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)  # no half-written checkpoint that looks complete
        raise
    log.info("wrote %s: %d arrays, %.1f MiB, for mesh %dx%d", out_dir, len(arrays), meta["bytes"] / 2**20,
             *mesh_shape)
