"""Build a model abstractly and fill it with checkpoint weights placed straight onto their devices."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.config import ModelConfig
from jaxserve.loader.weights import TensorSource, load_params
from jaxserve.models.registry import model_class
from jaxserve.parallel.sharding import named_sharding


def abstract_model(cfg: ModelConfig, dtype):
    """(graphdef, abstract state): shapes, dtypes and logical axis names, no memory."""
    cls = model_class(cfg.architecture)
    return nnx.split(nnx.eval_shape(lambda: cls(cfg, dtype)))


def load_weights(cfg: ModelConfig, tensors: TensorSource, dtype, mesh: Mesh):
    graphdef, abstract = abstract_model(cfg, dtype)
    flat = dict(nnx.to_flat_state(abstract))
    np_dtype = np.dtype(jax.numpy.dtype(dtype))
    placed = {}
    for path, array in load_params(cfg, tensors, np_dtype):
        var = flat[path]
        if tuple(array.shape) != tuple(var.shape):
            raise ValueError(
                f"weight {'.'.join(path)} has shape {array.shape} in the checkpoint but the config implies {var.shape}"
            )
        sharding = named_sharding(mesh, var.get_metadata()["logical"])
        placed[path] = var.replace(jax.device_put(array, sharding))
        del array
    missing = set(flat) - set(placed)
    if missing:
        raise ValueError(f"the checkpoint provides no weights for {sorted('.'.join(p) for p in missing)}")
    return graphdef, nnx.from_flat_state(list(placed.items()))
