"""Owns everything on the devices: the weights, the KV cache and the compiled step."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.loader.weights import TensorSource
from jaxserve.parallel.sharding import make_mesh, named_sharding
from jaxserve.runner.attention import reference_attention_fn
from jaxserve.runner.kv_cache import KV_LOGICAL_AXES, allocate_kv_cache
from jaxserve.runner.step import StepInputs, StepStatics, TraceCounter, make_step_fn
from jaxserve.runner.weights import load_weights

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """Host copies of what the step returns, one row per scheduled sequence."""

    tokens: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    prompt: tuple[np.ndarray, ...] | None
    logits: np.ndarray | None = None


class ModelRunner:
    def __init__(self, cfg: ModelConfig, tensors: TensorSource, dtype: str, num_blocks: int, block_size: int,
                 mesh_shape: tuple[int, int] = (1, 1)):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.mesh = make_mesh(*mesh_shape)
        self.graphdef, self.params = load_weights(cfg, tensors, self.dtype, self.mesh)
        self.kv = allocate_kv_cache(cfg, num_blocks, block_size, self.dtype,
                                    named_sharding(self.mesh, KV_LOGICAL_AXES))
        attention = partial(reference_attention_fn, scale=cfg.head_dim**-0.5, sliding_window=cfg.sliding_window)
        self.traces = TraceCounter()
        self._step = make_step_fn(self.graphdef, attention, self.traces)

    def execute(self, inputs: StepInputs, statics: StepStatics) -> StepResult:
        self.kv, out = self._step(self.params, self.kv, inputs, statics)
        s = jax.device_get(out.sampled)
        prompt = None if out.prompt is None else tuple(np.asarray(a) for a in jax.device_get(out.prompt))
        logits = None if out.logits is None else np.asarray(out.logits)
        return StepResult(s.tokens, s.logprobs, s.ranks, s.top_ids, s.top_logprobs, prompt, logits)
