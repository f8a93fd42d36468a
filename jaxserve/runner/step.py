"""The one jitted step: embed -> layers over the paged cache -> logits at the sampled positions -> sample.

The KV cache is donated, so its pages are updated in place. Shapes come padded to compile buckets
(runner/buckets.py); each new shape or static choice is one trace, counted so tests can prove that nothing
recompiles after warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
from flax import nnx

from jaxserve.runner.attention import AttentionMetadata
from jaxserve.runner.sampler import SamplerFlags, SamplerOutput, SamplingTensors, prompt_logprobs, sample


@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    token_ids: jax.Array  # [T]
    meta: AttentionMetadata
    logits_indices: jax.Array  # [B], the token whose logits row samples each sequence's next token
    sampling: SamplingTensors
    prompt_targets: jax.Array  # [T] next prompt token of each token (for prompt_logprobs), or [0]


@dataclass(frozen=True)
class StepStatics:
    sampler: SamplerFlags = SamplerFlags()
    prompt_logprobs: int = -1  # -1: off; else the number of top alternatives per prompt position
    return_logits: bool = False  # also return the sampled rows' logits (parity tests and debugging)


@jax.tree_util.register_dataclass
@dataclass
class StepOutputs:
    sampled: SamplerOutput
    prompt: tuple | None  # (logprobs [T], ranks [T], top_ids [T, N], top_logprobs [T, N]) when asked
    logits: jax.Array | None  # [B, V] when asked


class TraceCounter:
    def __init__(self):
        self.count = 0


def make_step_fn(graphdef, attention_fn, traces: TraceCounter):
    def step(params, kv, inputs: StepInputs, statics: StepStatics):
        traces.count += 1  # runs only while tracing, i.e. once per compiled shape
        model = nnx.merge(graphdef, params)
        hidden, kv = model(inputs.token_ids, kv, inputs.meta, attention_fn)
        logits = model.logits(hidden[inputs.logits_indices])
        sampled = sample(logits, inputs.sampling, statics.sampler)
        prompt = None
        if statics.prompt_logprobs >= 0:
            prompt = prompt_logprobs(model.logits(hidden), inputs.prompt_targets, statics.prompt_logprobs)
        return kv, StepOutputs(sampled, prompt, logits if statics.return_logits else None)

    return jax.jit(step, static_argnames=("statics",), donate_argnames=("kv",))
