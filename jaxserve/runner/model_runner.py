"""Owns everything on the devices: the weights, the KV cache and the compiled step programs."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.loader.weights import TensorSource
from jaxserve.models.llama import scan_layers
from jaxserve.parallel.layout import describe, plan_layout
from jaxserve.parallel.multihost import host_copy
from jaxserve.parallel.pipeline import pipeline_layers, pipeline_tick_layers
from jaxserve.parallel.sharding import make_mesh, named_sharding
from jaxserve.runner.attention_impl import cache_head_dim, make_attention_fn, resolve_attention_impl
from jaxserve.runner.experts_impl import make_experts_fn
from jaxserve.runner.kv_cache import KV_LOGICAL_AXES, allocate_kv_cache, resolve_kv_cache_dtype, storage_dtype
from jaxserve.runner.layer_loop import (
    resolve_layer_loop,
    slot_kinds,
    unrolled_layers,
    unrolled_stage_layers,
    unstack_layers,
)
from jaxserve.runner.plan import PlanShape, empty_inputs, empty_meta, padded, padded_meta
from jaxserve.runner.sampler import SamplerFlags
from jaxserve.runner.step import StepFunctions, StepInputs, StepStatics
from jaxserve.runner.weights import load_weights, low_bit_float_weights, resolve_quantization

log = logging.getLogger(__name__)


@jax.tree_util.register_dataclass
@dataclass
class PendingStep:
    """A launched step's device outputs, not read back yet."""

    sampled: object  # SamplerOutput of device arrays
    prompt: object | None
    logits: object | None
    hidden: object | None = None


@dataclass
class StagedStep:
    """A step inside a pipeline whose stages stay busy across steps: entered at stage 0, not sampled yet."""

    inputs: StepInputs
    statics: StepStatics
    # The sampled tokens its placeholders stand for (the device's token feed when it entered): when it leaves the
    # last stage, penalties and bad words read its in-flight tokens there, not in the feed of that later tick.
    fed_tokens: jax.Array
    tag: object = None  # the caller's (the engine's SchedulerOutput), handed back when the step leaves


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
    hidden: np.ndarray | None = None  # [B, D] the sampled rows' final hidden states, when asked (embeddings)


def precompile(calls: list[tuple], threads: int, tick) -> int:
    """Trace each (jitted function, positional args) here, one after another (tracing holds the GIL), and compile
    them on `threads` threads meanwhile (XLA compiles without it); the calls that follow find the programs in jit's
    cache. Returns how many it compiled: 0 with one thread, where the calls themselves compile. A program whose
    compile fails here (the GPU autotuner out of memory beside its neighbours, say) is compiled again by its call,
    alone."""
    if threads <= 1:
        return 0

    def compile_one(program):
        try:
            program.compile()
        except Exception as e:  # noqa: BLE001 - retried, alone, when the program is called
            log.debug("compiling in parallel failed (%s); the call will compile it alone", e)
        tick(1)

    with ThreadPoolExecutor(threads, thread_name_prefix="jaxserve-compile") as pool:
        for done in [pool.submit(compile_one, fn.lower(*args)) for fn, args in calls]:
            done.result()
    return len(calls)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, tensors: TensorSource, dtype: str, block_size: int,
                 mesh_shape: tuple[int, int] = (1, 1), attention_impl: str = "auto",
                 pp_layer_partition: list[int] | None = None, quantization: str | None = None,
                 layer_loop: str = "auto", kv_cache_dtype: str = "auto", devices=None):
        self.dtype = jnp.dtype(dtype)
        self.kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        self.block_size = block_size
        self.mesh = make_mesh(*mesh_shape, devices)  # devices None: the first tp x pp of jax.devices()
        # The runner works on the effective config: heads, MLP, vocab and layers padded to split evenly.
        self.layout = plan_layout(cfg, *mesh_shape, pp_layer_partition)
        log.info(describe(self.layout, self.mesh.devices))
        self.cfg = self.layout.effective_config(cfg)
        platform = self.mesh.devices.flat[0].platform
        attention_impl = resolve_attention_impl(attention_impl, platform, self.cfg)  # once: "auto" decided here
        attention_fn = make_attention_fn(attention_impl, platform, self.cfg, self.mesh, self.kv_dtype)
        self.cache_head_dim = cache_head_dim(attention_impl, platform, self.cfg)
        self.kv_storage_dtype = storage_dtype(self.kv_dtype, platform, xla_attention=attention_impl == "reference")
        if self.cache_head_dim != self.cfg.head_dim:
            log.info("head_dim %d runs zero-padded to %d in the attention kernels, and the KV cache stores %d "
                     "(%.0f%% more bytes per token; --attention-impl reference stores %d)", self.cfg.head_dim,
                     self.cache_head_dim, self.cache_head_dim, 100 * (self.cache_head_dim / self.cfg.head_dim - 1),
                     self.cfg.head_dim)
        # The Pallas attention has a decode kernel for steps of one token per sequence (inside pipeline stages
        # too: a decode step's micro-batches take their own rows of the block table, parallel/pipeline.py).
        self.decode_kernel = attention_impl != "reference"
        # what the weights are stored as: a quantization done at load, a checkpoint's own kept, or None (float)
        self.quantization = quantization = resolve_quantization(quantization, tensors, platform)
        self.layer_loop = resolve_layer_loop(layer_loop, platform, experts=bool(cfg.num_experts),
                                             low_bit_floats=low_bit_float_weights(quantization, tensors))
        unrolled = self.layer_loop == "unrolled"
        self.graphdef, self.params = load_weights(cfg, tensors, self.dtype, self.mesh, self.layout,
                                                  quantization, per_layer=unrolled)
        if unrolled:
            self.params = unstack_layers(self.params, self.layout.pp)
        self.kv = None
        self.deferred: set[tuple] = set()  # planned programs warm-up left to the first step that needs each
        self.deferred_compiles = 0
        attention = partial(attention_fn, scale=cfg.attention_scale or cfg.head_dim**-0.5,
                            windows=cfg.attention_windows, softcap=cfg.attn_logit_softcap)
        # Unrolled, a layer slot's attention kind is fixed while tracing where it is the same on every stage.
        kinds = slot_kinds(cfg.layer_kinds(), self.layout.layer_slots(), self.layout.slots) \
            if unrolled and cfg.layers_differ else None
        tick_layers = None
        if self.layout.pp > 1:
            stage_layers = partial(unrolled_stage_layers, kinds=kinds) if unrolled else scan_layers
            run_layers = pipeline_layers(self.mesh, stage_layers)
            tick_layers = pipeline_tick_layers(self.mesh, stage_layers)
        elif unrolled:
            run_layers = partial(unrolled_layers, kinds=kinds)
        else:
            run_layers = None  # the model's own scan
        experts_fn = make_experts_fn(self.cfg, platform, self.mesh) if cfg.num_experts else None
        self.fns = StepFunctions(self.graphdef, attention, run_layers, platform, experts_fn, tick_layers)
        # Stages busy across steps (`start_ticks`): the steps in stages 0 .. pp - 2 after the last tick (None: a
        # stage with none), and the activations each stage handed the next.
        self.staged: list[StagedStep | None] | None = None
        self.unsampled = None  # (step, its padded inputs, hidden, rows): the last stage ran it, the sampler not yet
        self.carry = None
        self.ticks = 0  # ticks run, and in how many of them each stage had a step to work on
        self.stage_busy_ticks = [0] * self.layout.pp
        self.plan_shape: PlanShape | None = None

    @property
    def num_compiles(self) -> int:
        return self.fns.traces.count

    def allocate_cache(self, num_blocks: int) -> None:
        self.kv = None  # free the old cache first
        self.kv = allocate_kv_cache(self.cfg, num_blocks, self.block_size, self.kv_storage_dtype,
                                    named_sharding(self.mesh, KV_LOGICAL_AXES), head_dim=self.cache_head_dim)

    def set_token_feed(self, max_rows: int) -> None:
        """Size the device buffer of the last step's sampled tokens, which the next step reads for the ids its
        host copy holds as placeholders (async scheduling): the largest sequence bucket, one size for all."""
        replicated = named_sharding(self.mesh, ())
        self.feed_rows = max_rows
        self.fed_tokens = jax.jit(lambda: jnp.zeros(max_rows, jnp.int32), out_shardings=replicated)()

    def start_ticks(self, shape: PlanShape) -> None:
        """Keep the pipeline's stages (pp > 1) busy across steps from now on: each `tick` moves every step one stage
        on. With several processes every one calls it, and the followers tick with process 0 (cluster/follower.py).
        The carried activations [pp, T_max, D] are sized for the largest token bucket. Called again when the plan's
        shape changes (the context fitted to the cache), with the pipeline empty."""
        assert self.layout.pp > 1 and self.pipeline_empty, "ticks need a pipeline, and no step inside it"
        self.plan_shape = shape
        self.staged = [None] * (self.layout.pp - 1)
        carry_shape = (self.layout.pp, shape.buckets.tokens[-1], self.cfg.hidden_size)
        if self.carry is None or self.carry.shape != carry_shape:
            by_stage = named_sharding(self.mesh, ("layers",))  # row s on stage s, as the layers split over stages
            self.carry = None
            self.carry = jax.jit(lambda: jnp.zeros(carry_shape, self.dtype), out_shardings=by_stage)()

    @property
    def ticking(self) -> bool:
        return self.staged is not None

    @property
    def pipeline_empty(self) -> bool:
        return not self.ticking or (self.unsampled is None and all(step is None for step in self.staged))

    def launch(self, inputs: StepInputs, statics: StepStatics) -> PendingStep:
        """Dispatch the step and return at once: the device works while the host goes on (jax is asynchronous)."""
        self.kv, hidden, rows = self.fns.forward(self.params, self.kv, inputs.token_ids, inputs.meta,
                                                 inputs.logits_indices, self.fed_tokens, inputs.token_source)
        return self._sample(inputs, statics, hidden, rows, self.fed_tokens)

    def tick(self, inputs: StepInputs | None, statics: StepStatics | None,
             tag=None) -> tuple[object, PendingStep | None]:
        """One tick of a pipeline whose stages stay busy across steps (`start_ticks`): the step `inputs` (None: no
        new step) enters stage 0, every step inside moves one stage on, and the one reaching the last stage is
        sampled. Returns that step's `tag` and PendingStep, or (None, None) while no step leaves. The stages run
        at one shape, the largest of their steps' buckets."""
        assert self.unsampled is None, "the step left by an interrupted tick is sampled first (sample_unsampled)"
        entering = None if inputs is None else StagedStep(inputs, statics, self.fed_tokens, tag)
        stages = [entering, *self.staged]  # stage s works on stages[s]
        present = [step for step in stages if step is not None]
        if not present:
            return None, None
        T = max(step.inputs.token_ids.shape[0] for step in present)
        B = max(step.inputs.logits_indices.shape[0] for step in present)
        decode_only = all(step.statics.decode_only for step in present)
        # Padded to the tick's shape (no copy where a step has it already): the entering step's tokens, the leaving
        # one's sampling inputs, and every stage's metadata.
        shape, leaving = self.plan_shape, stages[-1]
        first = None if entering is None else padded(entering.inputs, T, B, shape, decode_only)
        last = None if leaving is None else padded(leaving.inputs, T, B, shape, decode_only)
        blank = empty_meta(T, B, shape, decode_only) if len(present) < len(stages) else None  # steady decode: none
        metas = [blank if first is None else first.meta,
                 *(blank if step is None else padded_meta(step.inputs.meta, T, B, shape, decode_only)
                   for step in stages[1:-1]),
                 blank if last is None else last.meta]
        stage_meta = jax.tree.map(lambda *rows: np.stack(rows), *metas)
        if first is None:
            token_ids, token_source = np.zeros(T, np.int32), np.full(T, -1, np.int32)
        else:
            token_ids, token_source = first.token_ids, first.token_source
        logits_indices = np.zeros(B, np.int32) if last is None else last.logits_indices
        self.kv, self.carry, hidden, rows = self.fns.forward_tick(
            self.params, self.kv, self.carry, token_ids, stage_meta, logits_indices, self.fed_tokens, token_source)
        # The steps move on only once the tick's program is dispatched: an interrupt or error before (its first
        # compile, out of memory) leaves the pipeline as it was, the entering step never entered.
        self.staged = stages[:-1]
        self.ticks += 1
        for stage, step in enumerate(stages):
            self.stage_busy_ticks[stage] += step is not None
        if last is None:
            return None, None
        # Kept until sampled: the stages have run it, so an interrupt in the sampler (its first compile) must not
        # lose it; the engine samples it before the next tick (sample_unsampled).
        self.unsampled = (leaving, last, hidden, rows)
        return self.sample_unsampled()

    def sample_unsampled(self) -> tuple[object, PendingStep]:
        """Sample the step that left the last stage (its tag and PendingStep): at the end of its tick, or at the
        next call after an interrupted one."""
        leaving, last, hidden, rows = self.unsampled
        pending = self._sample(last, leaving.statics, hidden, rows, leaving.fed_tokens)
        self.unsampled = None
        return leaving.tag, pending

    def _sample(self, inputs: StepInputs, statics: StepStatics, hidden, rows, fed_tokens) -> PendingStep:
        """The sampler (and what else the step asks for) on a forward's outputs; `fed_tokens`: the token feed the
        step's placeholders stand in. The new feed holds what it samples."""
        f = self.fns
        if self.deferred:
            self._first_use(("sampler", inputs.sampling.fed_row.shape[0], statics.sampler))
            if statics.prompt_logprobs >= 0:
                self._first_use(("prompt logprobs", inputs.token_ids.shape[0]))
        sampled, self.fed_tokens = f.sample_rows(self.params, rows, inputs.sampling, statics.sampler, self.feed_rows,
                                                 fed_tokens)
        prompt = None
        if statics.prompt_logprobs >= 0:
            prompt = f.prompt_rows(self.params, hidden, inputs.prompt_targets, statics.prompt_logprobs)
        logits = f.logits(self.params, rows) if statics.return_logits else None
        return PendingStep(sampled, prompt, logits, rows if statics.return_hidden else None)

    @staticmethod
    def collect(pending: PendingStep) -> StepResult:
        """Wait for a launched step and copy its results to the host."""
        s, prompt, logits, hidden = host_copy((pending.sampled, pending.prompt, pending.logits, pending.hidden))
        return StepResult(s.tokens, s.logprobs, s.ranks, s.top_ids, s.top_logprobs, prompt, logits, hidden)

    def execute(self, inputs: StepInputs, statics: StepStatics) -> StepResult:
        """Run one step and wait for it; with ticks, through the whole pipeline (which must be empty)."""
        if not self.ticking:
            return self.collect(self.launch(inputs, statics))
        assert self.pipeline_empty, "a step run alone would overtake the steps in the pipeline"
        _, pending = self.tick(inputs, statics)
        while pending is None:
            _, pending = self.tick(None, None)
        return self.collect(pending)

    def warmup(self, shape: PlanShape, progress=None, compile_threads: int = 1,
               sampler_variants: list[SamplerFlags] | None = None) -> None:
        """Compile the programs a step can need: each (T, B) forward and, per B, the sampler variants given (None:
        every one) and prompt logprobs per T when every variant is asked for. What is left out stays planned
        (`deferred`): the first step that needs it compiles it, and that compile is counted apart from compiles
        no plan foresaw (`deferred_compiles`). The sampler and prompt programs are fed the forward's own outputs,
        so they compile for the same input shardings real steps have. Padding inputs write only into the null
        block.

        With `compile_threads` > 1 the programs are traced here, one after another (tracing holds the GIL), and
        compiled by that many threads at once (XLA compiles without the GIL); the runs that follow find them in
        jit's cache. Each program is then run once, in the same order on every process."""
        tick = progress.update if progress is not None else (lambda n: None)
        every = SamplerFlags.all_variants(shape.max_logprobs)
        variants = every if sampler_variants is None else sampler_variants
        self.deferred = {("sampler", B, flags) for B in shape.buckets.seqs for flags in every if flags not in variants}
        if sampler_variants is not None:
            self.deferred |= {("prompt logprobs", T) for T in shape.buckets.tokens}
        forwards = [(T, B, decode_only) for T, B in shape.buckets.forward_shapes()
                    for decode_only in ((True, False) if shape.decode_kernel and T == B else (False,))]
        forward_inputs = {key: empty_inputs(key[0], key[1], shape, decode_only=key[2]) for key in forwards}

        precompiled = precompile([self.forward_program(forward_inputs[key]) for key in forwards], compile_threads, tick)
        rows, hidden = {}, {}
        for key in forwards:  # each forward once: their outputs feed the sampler and prompt programs' compiles
            fn, args = self.forward_program(forward_inputs[key])
            if self.ticking:
                self.kv, self.carry, h, r = fn(*args)
            else:
                self.kv, h, r = fn(*args)
            T, B, decode_only = key
            if not decode_only and T == B:
                rows[B] = r
            if not decode_only and B == 1:
                hidden[T] = h
            if not precompiled:
                tick(1)
        sampler_calls = [(self.fns.sample_rows, (self.params, rows[B], empty_inputs(B, B, shape, penalties=flags.penalties,
                                                                                    constrained=flags.constrained).sampling,
                                                 flags, self.feed_rows, self.fed_tokens))
                         for B in shape.buckets.seqs for flags in variants]
        prompt_calls = [(self.fns.prompt_rows, (self.params, hidden[T], forward_inputs[(T, 1, False)].prompt_targets,
                                                shape.max_logprobs)) for T in shape.buckets.tokens
                        if ("prompt logprobs", T) not in self.deferred]
        precompiled = precompile(sampler_calls + prompt_calls, compile_threads, tick)
        for fn, args in sampler_calls + prompt_calls:
            jax.block_until_ready(fn(*args))
            if not precompiled:
                tick(1)
        jax.block_until_ready(self.kv)

    def forward_program(self, x: StepInputs) -> tuple:
        """(the jitted forward a step of `x`'s shape runs, its arguments): on a ticking pipeline the tick program,
        every stage at that shape."""
        if self.ticking:
            stage_meta = jax.tree.map(lambda a: np.stack([a] * self.layout.pp), x.meta)
            return (self.fns.forward_tick, (self.params, self.kv, self.carry, x.token_ids, stage_meta,
                                            x.logits_indices, self.fed_tokens, x.token_source))
        return (self.fns.forward, (self.params, self.kv, x.token_ids, x.meta, x.logits_indices, self.fed_tokens,
                                   x.token_source))

    @staticmethod
    def warmup_size(shape: PlanShape, sampler_variants: list[SamplerFlags] | None = None) -> int:
        """How many programs `warmup` compiles."""
        b = shape.buckets
        decode_variants = sum(T == B for T, B in b.forward_shapes()) if shape.decode_kernel else 0
        every = sampler_variants is None  # then prompt logprobs too, one program per T
        variants = SamplerFlags.all_variants(shape.max_logprobs) if every else sampler_variants
        return len(b.forward_shapes()) + decode_variants + len(b.seqs) * len(variants) + (len(b.tokens) if every else 0)

    def _first_use(self, key: tuple) -> None:
        """Count a deferred program's compile, which the step about to run makes."""
        if key in self.deferred:
            self.deferred.discard(key)
            self.deferred_compiles += 1
            log.info("compiling a program warm-up deferred to its first use: %s", key)
