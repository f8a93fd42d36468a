"""The jitted step, in two programs that hand device arrays to each other (the host sees only token ids):

- `forward`: embed -> layers over the paged cache -> final norm; returns the hidden states of the rows that
  sample. Donates the KV cache, so its pages are updated in place. Compiled per (tokens, sequences) bucket.
  Token ids the host does not know yet (async scheduling) are taken from the previous step's sampled tokens.
  On a pipeline whose stages stay busy across steps, `forward_tick` replaces it: one tick, in which each stage
  works on its own step (parallel/pipeline.py), returning the rows of the step that leaves the last stage.
- `sample_rows`: LM head on those rows -> penalties, filters, sampling, logprobs. Compiled per sequence
  bucket and per static sampler choice.

Keeping them apart makes the number of programs the sum, not the product, of the forward buckets and the
sampler variants (about 30 + 80 instead of 30 x 16), which is what lets warm-up compile all of them.
Each trace is counted, so tests can prove nothing compiles after warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.runner.attention import AttentionMetadata
from jaxserve.runner.sampler import SamplerFlags, SamplingTensors, logprobs_of, sample


@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    token_ids: jax.Array  # [T]
    meta: AttentionMetadata
    logits_indices: jax.Array  # [B], the token whose logits row samples each sequence's next token
    sampling: SamplingTensors
    prompt_targets: jax.Array  # [T] next prompt token of each token (for prompt_logprobs)
    # [T] row of the previous step's sampled tokens that is this token's id (its host copy is a placeholder,
    # async scheduling), or -1: the id is token_ids'.
    token_source: jax.Array


@dataclass(frozen=True)
class StepStatics:
    sampler: SamplerFlags = SamplerFlags()
    prompt_logprobs: int = -1  # -1: off; else the number of top alternatives per prompt position
    return_logits: bool = False  # also return the sampled rows' logits (parity tests and debugging)
    return_hidden: bool = False  # also return the sampled rows' final hidden states (embedding requests)
    # A copy of `inputs.meta.decode_only` (a static field of the inputs' pytree), so that other processes, which
    # receive the inputs as bare arrays, can rebuild the same pytree (cluster/follower.py).
    decode_only: bool = False


class TraceCounter:
    def __init__(self):
        self.count = 0


class StepFunctions:
    def __init__(self, graphdef, attention_fn, run_layers=None, platform: str = "cpu", experts_fn=None,
                 tick_layers=None):
        """`run_layers`: how the layers run (None: the model's own scan; the unrolled loop, runner/layer_loop.py;
        a pipeline on pp > 1). `platform`: the devices', for the sampler. `experts_fn`: a mixture of experts'
        grouped matmuls on the mesh (runner/experts_impl.py; None for dense models). `tick_layers`: on pp > 1,
        one tick of the pipeline that keeps its stages busy across steps (`forward_tick`)."""
        self.traces = TraceCounter()
        traces = self.traces
        layer_runner = {} if run_layers is None else {"run_layers": run_layers}
        if experts_fn is not None:
            layer_runner["experts_fn"] = experts_fn

        def forward(params, kv, token_ids, meta, logits_indices, fed_tokens, token_source):
            traces.count += 1  # runs only while tracing, i.e. once per compiled shape
            token_ids = jnp.where(token_source >= 0, fed_tokens[jnp.maximum(token_source, 0)], token_ids)
            model = nnx.merge(graphdef, params)
            hidden, kv = model(token_ids, kv, meta, attention_fn, **layer_runner)
            return kv, hidden, hidden[logits_indices]

        def forward_tick(params, kv, carry, token_ids, stage_meta, logits_indices, fed_tokens, token_source):
            """`forward` for one pipeline tick: `token_ids` enter stage 0 while each later stage s works on the step
            `stage_meta` row s describes, its input the activations `carry` holds; returns the step leaving the
            last stage (its final hidden states and sampled rows), and the carry for the next tick."""
            traces.count += 1
            token_ids = jnp.where(token_source >= 0, fed_tokens[jnp.maximum(token_source, 0)], token_ids)
            model = nnx.merge(graphdef, params)
            extra = {} if experts_fn is None else {"experts_fn": experts_fn}
            hidden, (kv, carry) = model(token_ids, (kv, carry), stage_meta, attention_fn, run_layers=tick_layers,
                                        **extra)
            return kv, carry, hidden, hidden[logits_indices]

        def sample_rows(params, rows, sampling, flags, feed_rows, fed_tokens):
            """The sampler's output, and its tokens padded to `feed_rows` for the next step's `fed_tokens` (one
            size for every step, so the forward compiles once per shape, not once per previous shape too). It
            reads this step's `fed_tokens` too: penalties count the tokens the host does not know yet."""
            traces.count += 1
            out = sample(nnx.merge(graphdef, params).logits(rows), sampling, flags, fed_tokens, platform)
            return out, jnp.zeros(feed_rows, jnp.int32).at[: out.tokens.shape[0]].set(out.tokens)

        def prompt_rows(params, hidden, targets, num):
            traces.count += 1
            return logprobs_of(nnx.merge(graphdef, params).logits(hidden), targets, num)

        def logits(params, rows):
            return nnx.merge(graphdef, params).logits(rows)

        self.forward = jax.jit(forward, donate_argnames=("kv",))
        self.forward_tick = jax.jit(forward_tick, donate_argnames=("kv", "carry"))
        self.sample_rows = jax.jit(sample_rows, static_argnames=("flags", "feed_rows"))
        self.prompt_rows = jax.jit(prompt_rows, static_argnames=("num",))
        self.logits = jax.jit(logits)
