"""Sharded orbax checkpoints: `jaxserve convert` writes one (runner/convert.py), `serve` restores it with each
process reading only the chunks of its own devices' shards.

What is stored is the runner's own parameter tree for one mesh layout: stacked layers, heads / MLP / vocabulary
padded for its tp, layer slots for its pp split (parallel/layout.py). That is what makes restoring fast: no
transposes, no padding, no host copy of a whole tensor, just each shard read straight onto its device. The
price, as with vLLM's `sharded_state` format: a checkpoint serves meshes with the same layout (the same tp and
layer split; the device count may differ), and another mesh needs another `convert`.

Layout on disk: `jaxserve_checkpoint.json` (model config, layout, name), `params/` (orbax), tokenizer files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.loader.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

MARKER = "jaxserve_checkpoint.json"
FORMAT_VERSION = 1


def is_orbax_checkpoint(path: Path) -> bool:
    return (path / MARKER).is_file()


def layout_signature(layout) -> dict:
    """Everything that fixes the stored arrays' shapes and where each real layer and head sits in them."""
    return {"heads": dataclasses.asdict(layout.heads), "mlp": layout.mlp, "vocab": layout.vocab,
            "experts": layout.experts, "shared_mlp": layout.shared_mlp, "layer_slots": layout.layer_slots(),
            "num_slots": layout.pp * layout.slots}


def nested(flat: dict) -> dict:
    """{("layers", "wq"): x} -> {"layers": {"wq": x}}: the tree orbax saves and restores."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = value
    return tree


def _leaf(tree: dict, path: tuple):
    for key in path:
        tree = tree[str(key)]
    return tree


# ModelConfig's fields that say how an engine runs the model (set from its quantization and devices), not what
# the model is: left out of a converted checkpoint's config, so that a jaxserve from before a field still reads the
# file, and ignored when read ("head_slices": written by 0319fe0 up to dequantize_slice_bytes, which replaced it).
SERVING_FIELDS = ("quantized_activations", "dequantize_slice_bytes", "head_slices")


def stored_config(config: ModelConfig) -> dict:
    """The model's config as written, without its SERVING_FIELDS."""
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in SERVING_FIELDS}


# --- restore -------------------------------------------------------------------------------------------------
def model_config(meta: dict, directory: Path | str = "the checkpoint") -> ModelConfig:
    values = {k: v for k, v in meta["config"].items() if k not in SERVING_FIELDS}
    # A field this jaxserve does not know changes the model in a way it would not compute: refused, not ignored.
    unknown = sorted(values.keys() - {f.name for f in dataclasses.fields(ModelConfig)})
    if unknown:
        raise ValueError(f"{directory} was written by another jaxserve version: its model config has "
                         f"{', '.join(unknown)}, which this one does not know; convert the original model again with "
                         "this version (or upgrade jaxserve)")
    rope = values.get("rope_scaling")
    if rope:  # JSON gave lists for the per-frequency factors
        rope = {k: tuple(v) if isinstance(v, list) else v for k, v in rope.items()}
    values["rope_scaling"] = RopeScaling(**rope) if rope else None
    for name in ("eos_token_ids", "layer_types", "rope_layers"):  # JSON gave lists; the config holds tuples
        values[name] = tuple(values.get(name) or ())
    return ModelConfig(**values)


@dataclass
class OrbaxParams:
    """A Checkpoint's weights when they come from `convert`: restored whole-tree, never read tensor by tensor."""

    directory: Path
    meta: dict

    def restore(self, cfg: ModelConfig, dtype, mesh, layout):
        """-> (graphdef, params) placed on `mesh`; orbax reads only the chunks this process's devices hold."""
        import jax
        import orbax.checkpoint as ocp
        from flax import nnx

        from jaxserve.models.registry import abstract_model
        from jaxserve.parallel.sharding import named_sharding

        self._check_layout(layout)
        graphdef, abstract = abstract_model(layout.effective_config(cfg), dtype)
        flat = dict(nnx.to_flat_state(abstract))
        # Each weight in the dtype the model declares it (the serving dtype, int32 for layer kinds).
        target = {path: jax.ShapeDtypeStruct(var.shape, var.dtype,
                                             sharding=named_sharding(mesh, var.get_metadata()["logical"]))
                  for path, var in flat.items()}
        before = _bytes_read()
        with ocp.StandardCheckpointer() as loader:
            restored = loader.restore(self.directory / "params", nested(target))
        read, own = _bytes_read() - before, _own_shard_bytes(jax.tree.leaves(restored))
        log.info("restored %s: this process read %d bytes for its own shards' %d bytes, of the checkpoint's %d",
                 self.directory, read, own, self.meta["bytes"])
        return graphdef, nnx.from_flat_state([(path, var.replace(_leaf(restored, path))) for path, var in flat.items()])

    def _check_layout(self, layout) -> None:
        stored = self.meta["layout"]  # an older conversion's has fewer keys (shared_mlp): those it has must match
        if {key: value for key, value in layout_signature(layout).items() if key in stored} != stored:
            tp, pp = self.meta["mesh"]
            parts = ",".join(map(str, self.meta["partition"]))
            if (tp, pp) == (layout.tp, layout.pp) and list(layout.partition) == list(self.meta["partition"]):
                # an older jaxserve padded this mesh otherwise (a width tp does not divide: parallel/layout.py)
                raise ValueError(f"{self.directory} was converted for mesh {tp}x{pp} by a jaxserve that padded the "
                                 "weights for it otherwise: convert the original model again")
            raise ValueError(f"{self.directory} was converted for mesh {tp}x{pp} (layer partition {parts}), and its "
                             f"weights are padded and split for that layout; serve it with --mesh {tp}x{pp}, or "
                             f"convert the original model again with --mesh {layout.tp}x{layout.pp}")


def _own_shard_bytes(arrays) -> int:
    """Bytes of the distinct shards this process's devices hold (a replicated shard counts once)."""
    total = 0
    for a in arrays:
        distinct = {tuple((i.start, i.stop) for i in shard.index): shard.data.nbytes for shard in a.addressable_shards}
        total += sum(distinct.values())
    return total


def _bytes_read() -> int:
    """Bytes tensorstore has read from files so far in this process (an experimental API: 0 if it is gone)."""
    try:
        import tensorstore as ts

        metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
        return sum(v.get("value", 0) for m in metrics for v in m.get("values", []))
    except Exception:  # noqa: BLE001 (a diagnostic only)
        return 0


def open_orbax_checkpoint(directory: Path) -> dict:
    """The fields of a loader.checkpoint.Checkpoint for a directory `convert` wrote."""
    try:
        meta = json.loads((directory / MARKER).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{directory / MARKER} is not valid JSON ({exc}): the conversion did not finish or the file "
                         "was damaged; convert the original model again") from None
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{directory} has checkpoint format {meta.get('format')}, this jaxserve reads format "
                         f"{FORMAT_VERSION}; convert the original model again")
    return dict(name=meta["name"], config=model_config(meta, directory), tensors=OrbaxParams(directory.absolute(), meta),
                tokenizer=load_tokenizer(directory, advice="convert the original model again"),
                generation_defaults=meta.get("generation_defaults") or {}, pooling=meta.get("pooling"))
