"""The engine: requests in, RequestOutputs out. One step is schedule -> run -> update.

`Engine.generate` / `chat` / `stream` are the synchronous Python API (engine/offline.py, built on the request and
step methods here); `AsyncEngine` (async_engine/engine.py) drives
`add_request` / `step` / `abort_request` from a background thread for the server.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Iterator

import jax

from jaxserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig, resolve_dtype
from jaxserve.core.beam_search import BeamSearch, BeamSearchOutput
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.grammar import GrammarCompiler, grammar_ended
from jaxserve.core.ngram_proposer import NgramProposer
from jaxserve.core.output_processor import SequenceText, position_logprobs, record_prompt_logprobs, request_output
from jaxserve.core.request import Request, Sequence
from jaxserve.core.scheduler import Scheduler, SchedulerOutput
from jaxserve.engine.adapters import EngineAdapters, lora_slots
from jaxserve.engine.inputs import (
    InputProcessor,
    Prompt,
    check_max_model_len,
    eos_token_ids,
    fit_context_to_cache,
    model_for_context,
    step_limits,
)
from jaxserve.engine.offline import OfflineAPI
from jaxserve.engine.pooling import pool, pooling_output
from jaxserve.engine.steps import InFlightStep, StepObserver
from jaxserve.engine_args import EngineArgs, engine_signature
from jaxserve.loader.chat_content import resolve_content_format
from jaxserve.loader.checkpoint import open_checkpoint
from jaxserve.loader.generation_config import generation_defaults
from jaxserve.loader.tokenizer import TokenizerChoice, read_chat_template
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import ClassificationRequestOutput, EmbeddingRequestOutput, RequestOutput, ScoringRequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.runner.buckets import Buckets
from jaxserve.runner.capacity import capacity_line, size_kv_cache
from jaxserve.runner.compilation_cache import enable_compilation_cache
from jaxserve.runner.host_allocator import allocator_advice
from jaxserve.runner.model_runner import ModelRunner, StepResult
from jaxserve.runner.plan import PlanShape, build_step_inputs
from jaxserve.runner.sampler import SamplerFlags
from jaxserve.sampling_params import BeamSearchParams, SamplingParams

log = logging.getLogger(__name__)


class Engine:
    """Requests in, outputs out. Built from collaborators, each given what it needs: the ModelRunner (weights,
    cache, compiled step programs), the Scheduler and BlockManager (core/), the InputProcessor (requests checked
    from any thread), EngineAdapters (LoRA), and the OfflineAPI facade that `generate`, `chat`, `embed`, `score`,
    `stream` and `beam_search` hand their work to."""

    def __init__(self, model: str | None = None, **options):
        """`Engine(model, **options)`: the model (an HF hub id, an HF directory or a .gguf file; None: the built-in
        SmolLM2-135M-Instruct) and any of `EngineArgs`' options (engine_args.py says what each means; vLLM's names
        where vLLM has the option). An unknown option is a TypeError; a bad value a ValueError naming it."""
        args = self.args = EngineArgs.of(model, **options)
        max_num_seqs, max_num_batched_tokens = args.max_num_seqs, args.max_num_batched_tokens
        dtype, max_model_len, num_kv_blocks = args.dtype, args.max_model_len, args.num_kv_blocks
        speculative = SpeculativeConfig.from_dict(args.speculative_config)
        devices = None if args.devices is None else list(args.devices)
        platform = (devices or jax.devices())[0].platform  # an empty list is refused by the mesh, by name
        max_num_seqs, max_num_batched_tokens = step_limits(max_num_seqs, max_num_batched_tokens, platform)
        enable_lora, max_loras = lora_slots(args.enable_lora, args.max_loras, args.lora_modules)
        template = None if args.chat_template is None else read_chat_template(args.chat_template)  # before the load
        enable_compilation_cache(args.compilation_cache_dir)
        choice = TokenizerChoice(args.tokenizer, args.tokenizer_revision, args.download_dir)
        ckpt = open_checkpoint(args.model, args.load_format, args.hf_overrides, args.revision, choice, args.download_dir)
        cfg = ckpt.config
        self.model_name = ckpt.name
        self.tokenizer = ckpt.tokenizer
        if template is not None:  # replaces the tokenizer's own
            self.tokenizer.chat_template = template
        self.chat_content_format = resolve_content_format(args.chat_template_content_format,
                                                          getattr(self.tokenizer, "chat_template", None))
        self.generation_defaults = generation_defaults(ckpt.generation_defaults, args.generation_config,
                                                       args.override_generation_config)
        # What the final hidden state feeds: an LM head, none (embeddings only) or a classifier (loader/heads.py).
        self.declared_pooling, self.head = ckpt.pooling, ckpt.head
        requested_len, max_model_len = max_model_len, check_max_model_len(max_model_len, cfg.max_position_embeddings)
        cfg = model_for_context(cfg, max_model_len)
        dtype = resolve_dtype(dtype, platform)
        self.mesh_shape = args.mesh_shape
        if args.enable_expert_parallel:  # whole experts split over tp (checked against the model and mesh there)
            cfg = dataclasses.replace(cfg, expert_parallel=True)
        if enable_lora:  # the layers get adapter slots beside their weights (models/lora.py)
            cfg = dataclasses.replace(cfg, lora_slots=max_loras, lora_rank=args.max_lora_rank)
        started = time.perf_counter()
        self.runner = ModelRunner(cfg, ckpt.tensors, dtype, args.block_size, self.mesh_shape, args.attention_impl,
                                  args.pp_layer_partition, args.quantization, args.layer_loop, args.kv_cache_dtype,
                                  devices)
        log.info("Weights loaded in %.1f s", time.perf_counter() - started)
        self.adapters = EngineAdapters(self.runner, cfg, max_loras, args.max_lora_rank, enable_lora)
        for name, path in (args.lora_modules or {}).items():
            self.adapters.preload(name, path)
        # Several processes overlap steps too: followers launch and read back each step when process 0 does
        # (cluster/leader.py), as a read-back can be a collective. Drafting needs a sequence's latest tokens on the
        # host, which overlap would always leave one step behind (as in vLLM, speculative decoding runs its steps
        # one after the other).
        self.async_scheduling = args.async_scheduling and speculative is None
        self._launched: deque[InFlightStep] = deque()  # dispatched, not read back yet (oldest first)
        # A pipeline keeps its stages busy across steps where steps overlap (async scheduling): each step() plans a
        # step for the sequences no stage is working on and moves every step one stage on (vLLM's virtual engines;
        # the followers of several processes tick with process 0). Without overlap a step runs its micro-batches
        # through the stages within itself (fill-drain, parallel/pipeline.py).
        self.stage_ticks = self.async_scheduling and self.runner.layout.pp > 1
        # A tick's step takes at most a pp-th of the sequences and of the token budget (_tick), and so do its buckets.
        share = self.runner.layout.pp if self.stage_ticks else 1
        self.step_seqs = -(-max_num_seqs // share)
        self.step_tokens = min(max_num_batched_tokens, max(-(-max_num_batched_tokens // share), self.step_seqs))
        # A sequence may take 1 + k tokens and sampler rows; a single stream's drafted step gets a bucket of its
        # own, unpadded.
        rows_per_seq = 1 + (speculative.num_speculative_tokens if speculative else 0)
        spec_step = (rows_per_seq,) if speculative else ()
        self.plan_shape = PlanShape(Buckets.for_limits(self.step_tokens, self.step_seqs, spec_step, rows_per_seq),
                                    args.block_size, cfg.vocab_size, max_model_len, args.max_logprobs,
                                    self.runner.decode_kernel)
        self.runner.set_token_feed(self.plan_shape.buckets.seqs[-1])
        if self.stage_ticks:
            self.runner.start_ticks(self.plan_shape)
        started = time.perf_counter()
        num_kv_blocks, how = size_kv_cache(self.runner, self.plan_shape, num_kv_blocks, args.kv_cache_memory_fraction,
                                           max_num_seqs, args.kv_cache_memory_bytes)
        log.info("KV cache sized %s and allocated in %.1f s", how, time.perf_counter() - started)
        max_model_len = fit_context_to_cache(max_model_len, requested_len, (num_kv_blocks - 1) * args.block_size)
        self.plan_shape = dataclasses.replace(self.plan_shape, max_model_len=max_model_len)
        if self.stage_ticks:
            self.runner.start_ticks(self.plan_shape)
        log.info(capacity_line(num_kv_blocks, args.block_size, max_model_len, self.runner.kv_dtype))
        self.config = EngineConfig(
            model=cfg,
            cache=CacheConfig(block_size=args.block_size, num_blocks=num_kv_blocks),
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len),
            dtype=dtype, seed=args.seed, max_logprobs=args.max_logprobs, quantization=args.quantization,
        )
        self.blocks = BlockManager(num_kv_blocks, args.block_size, args.enable_prefix_caching)
        self.speculative_config = speculative
        self.scheduler = Scheduler(self.config.scheduler, self.blocks, self.adapters.slots,
                                   NgramProposer.for_config(speculative))
        self._requests: dict[str, Request] = {}
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, eos_token_ids(self.tokenizer, cfg))
        self.inputs = InputProcessor(self.tokenizer, self.config, model_name=self.model_name, head=self.head,
                                     declared_pooling=self.declared_pooling,
                                     generation_defaults=self.generation_defaults, adapters=self.adapters,
                                     grammars=self.grammars, chat_content_format=self.chat_content_format,
                                     seed=args.seed)
        self.offline = OfflineAPI(self, self.inputs)
        self._texts: dict[int, SequenceText] = {}
        self._num_steps = 0
        self.observers: list[StepObserver] = []  # each told of every step read back (engine/steps.py)
        self.recompile_guard = args.recompile_guard
        self._compiles_at_warmup: int | None = None
        if args.warmup:
            self.warmup()
        if (advice := allocator_advice(platform)) is not None:  # once the engine is up: nothing to say on a failure
            log.info(advice)
        log.info("Loaded %s (%s, %s%s, mesh %dx%d; %s)", self.model_name, cfg.architecture, dtype,
                 f", {self.runner.quantization} quantization" if self.runner.quantization else "", *self.mesh_shape,
                 "steps overlap: async scheduling" + (", pipeline stages busy across steps" if self.stage_ticks
                                                      else "") if self.async_scheduling else "one step at a time")

    def warmup(self, desc: str = "Compiling step buckets", compile_threads: int | None = None) -> None:
        """Compile every step program now (a progress bar titled `desc`), so serving never stalls on a compile.
        `compile_threads`: programs compiled at once (None: one per host core, at most 8)."""
        from tqdm.auto import tqdm

        variants = SamplerFlags.warm_variants(penalties=SamplingParams(**self.generation_defaults).needs_penalties)
        total = self.runner.warmup_size(self.plan_shape, variants)
        threads = compile_threads or min(8, os.cpu_count() or 1)
        started = time.perf_counter()
        with tqdm(total=total, desc=desc, unit="program") as bar:
            self.runner.warmup(self.plan_shape, bar, threads, variants)
        log.info("Warm-up: %d step programs compiled (or read from the compilation cache) in %.1f s, %d at a time; "
                 "%d more (logprobs, penalties, structured output, prompt logprobs) compile when first needed",
                 total, time.perf_counter() - started, threads, len(self.runner.deferred))
        self._compiles_at_warmup = self._unforeseen_compiles()

    def _unforeseen_compiles(self) -> int:
        """Compiles warm-up's plan did not foresee (a deferred program's first use is foreseen)."""
        return self.runner.num_compiles - self.runner.deferred_compiles

    @property
    def compiles_after_warmup(self) -> int:
        """Programs compiled after warm-up that its plan did not foresee: a shape or variant the buckets miss
        (what the recompile guard watches)."""
        if self._compiles_at_warmup is None:
            return 0
        return self._unforeseen_compiles() - self._compiles_at_warmup

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    # ---- requests -------------------------------------------------------------------------------------

    def prepare_request(self, request_id: str, prompt: Prompt, params: SamplingParams | PoolingParams, *,
                        priority: int = 0, lora_request: LoRARequest | None = None) -> Request:
        """Tokenize and validate (no device work, safe from any thread); ValueError for bad input."""
        return self.inputs.prepare_request(request_id, prompt, params, priority=priority, lora_request=lora_request)

    def prepare_beam_search(self, prompt: str | list[int] | dict, params: BeamSearchParams) -> BeamSearch:
        return self.inputs.prepare_beam_search(prompt, params)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **rendering) -> list[int]:
        return self.inputs.encode_chat(messages, add_generation_prompt, **rendering)

    def eos_token_ids(self) -> tuple[int, ...]:
        return self.inputs.eos_token_ids()

    def add_prepared_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        lora = request.sequences[0].lora_request
        if lora is not None and not self.adapters.is_current(lora):  # unloaded since it was prepared
            raise ValueError(f"adapter {lora.lora_name!r} was unloaded")
        self._requests[request.request_id] = request
        for seq in request.sequences:
            self._texts[seq.seq_id] = SequenceText(self.tokenizer, seq)
            self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, *,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        self.add_prepared_request(self.prepare_request(request_id, prompt, params, priority=priority,
                                                       lora_request=lora_request))

    def abort_request(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.sequences:
            self.scheduler.finish(seq, "abort")
            self._texts.pop(seq.seq_id, None)

    def has_unfinished_requests(self) -> bool:
        """Whether `step()` has work left: a request not finished, or a launched step not yet read back (async
        scheduling and a pipeline's ticks launch ahead). So `while engine.has_unfinished_requests(): engine.step()`
        drains both; right after a `generate` whose last request ended on a stop string it can be True for the
        step launched before the stop was seen, whose reading returns no outputs (its KV blocks are already free)."""
        return bool(self._requests) or bool(self._launched) or not self.runner.pipeline_empty

    # ---- whole calls (vLLM's LLM): the OfflineAPI facade runs them on this engine -----------------------------

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """Run prompts (a str, a list of str, token-id lists or vLLM's prompt dicts) to completion, in input order;
        `sampling_params`: one for every prompt or one each; `lora_request`: the LoRA adapter of every prompt, or
        one per prompt; `priority`: one per prompt, lower first (vLLM's `LLM.generate`, whose parameter names these
        are)."""
        return self.offline.generate(prompts, sampling_params, use_tqdm, lora_request, priority)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None, chat_template: str | None = None,
             chat_template_content_format: str | None = None) -> list[RequestOutput]:
        """Replies to one conversation (a list of messages) or a list of conversations (vLLM's `LLM.chat`;
        `chat_template`, Jinja text, renders these instead of the engine's template)."""
        return self.offline.chat(messages, sampling_params, use_tqdm, add_generation_prompt=add_generation_prompt,
                                 continue_final_message=continue_final_message,
                                 chat_template_kwargs=chat_template_kwargs, tools=tools, lora_request=lora_request,
                                 chat_template=chat_template,
                                 chat_template_content_format=chat_template_content_format)

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:
        """The request's output after every step that advanced it; a caller that stops reading aborts it."""
        return self.offline.stream(prompt, sampling_params)

    def embed(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, use_tqdm: bool = True,
              lora_request=None) -> list[EmbeddingRequestOutput]:
        return self.offline.embed(prompts, pooling_params, use_tqdm, lora_request)

    def classify(self, prompts, **options) -> list[ClassificationRequestOutput]:
        """A sequence classifier's probabilities for each prompt (vLLM's `LLM.classify`; OfflineAPI.classify)."""
        return self.offline.classify(prompts, **options)

    def encode(self, prompts, pooling_params: PoolingParams | list[PoolingParams] | None = None, **options
               ) -> list[EmbeddingRequestOutput | ClassificationRequestOutput]:
        """Pooling with the task named by `pooling_task=` (vLLM's `LLM.encode`; OfflineAPI.encode)."""
        return self.offline.encode(prompts, pooling_params, **options)

    def score(self, text_1, text_2, **options) -> list[ScoringRequestOutput]:
        """Scores of text pairs (vLLM's `LLM.score`; OfflineAPI.score)."""
        return self.offline.score(text_1, text_2, **options)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = True,
                    lora_request=None) -> list[BeamSearchOutput]:
        return self.offline.beam_search(prompts, params, use_tqdm, lora_request)

    def default_sampling_params(self) -> SamplingParams:
        """What a request that sets nothing samples with: the model's generation config's defaults (vLLM's
        `LLM.get_default_sampling_params`, also by that name)."""
        return self.inputs.default_sampling_params()

    get_default_sampling_params = default_sampling_params

    def get_tokenizer(self):
        """The model's tokenizer (`self.tokenizer`), by vLLM's `LLM` method name."""
        return self.tokenizer

    # ---- LoRA adapters (vLLM's engine calls) ----------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest, load_inplace: bool = False) -> LoRARequest:
        """Read an adapter now rather than at its first request; ValueError if LoRA is off or it cannot be
        served. Returns the LoRARequest the engine runs that name with. `load_inplace`: the name may already be
        loaded (from other files, or the same files changed): the new files serve it from now on, requests
        running with the old ones finish with them (give the replacement a new `lora_int_id`)."""
        return self.adapters.replace(lora_request) if load_inplace else self.adapters.check(lora_request)

    def remove_lora(self, lora: str | int) -> bool:
        """Unload an adapter, by name or `lora_int_id` (False if none has it): requests naming it are refused
        from now on, running ones finish with it; its slot and host copy are freed once they have. Call it from
        the thread that steps the engine (AsyncEngine.remove_lora queues it there)."""
        removed = self.adapters.remove_named(lora)
        self._free_removed_adapters()
        return removed

    def list_loras(self) -> list[LoRARequest]:
        return self.adapters.known()

    def _free_removed_adapters(self) -> None:
        if self.adapters.has_removed:
            in_use = {seq.lora_request for request in self._requests.values() for seq in request.sequences}
            self.adapters.purge_removed(in_use)

    # ---- the step ---------------------------------------------------------------------------------------

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one step; return the outputs of the requests advanced by the steps read back during this call, or
        with `finished_only` those finished (building an output copies the request's tokens and text, which
        callers that wait for the end skip).

        With async scheduling the next step is scheduled and dispatched before the step in flight is read back,
        so the host work between steps (reading back, detokenizing, stop checks, scheduling, building inputs)
        overlaps the device's work instead of idling it: a call returns the outputs of the step launched by the
        call before. A step stays queued until it is read back, so an exception or an interrupt in between (a
        KeyboardInterrupt while waiting, recompile_guard="error") leaves nothing half done: the next call reads it.
        """
        touched: dict[str, Request] = {}
        self._free_removed_adapters()
        # One step in flight at most when scheduling (a call that raised leaves two): one placeholder a sequence.
        # None when it samples for a grammar: the next mask needs the token it samples. (An engine that drafts
        # never overlaps steps: see async_scheduling.)
        self._read_back_all_but(0 if self._grammar_in_flight() else 1, touched)
        # Left unread: only the step queued by this call, so no sequence shows a placeholder of an earlier one.
        queued = self._tick() if self.stage_ticks else self._launch()
        self._read_back_all_but(1 if queued and self.async_scheduling else 0, touched)
        return [self._emit(req) for req in touched.values() if req.finished or not finished_only]

    def _plan(self, max_seqs: int | None = None, max_tokens: int | None = None):
        """Schedule the next step and build its inputs: (SchedulerOutput, inputs, statics), or None if empty."""
        sched = self.scheduler.schedule(max_seqs, max_tokens)
        if sched.is_empty:
            return None
        self.adapters.write_pending()  # adapters the scheduler just gave a slot
        inputs, statics = build_step_inputs(sched, self.blocks, self.plan_shape)
        if any(observer.wants_logits for observer in self.observers):
            statics = dataclasses.replace(statics, return_logits=True)
        return sched, inputs, statics

    def _launch(self) -> bool:
        """Plan and dispatch a step (with async scheduling, without waiting for it) and queue it to be read back.
        False: nothing to run."""
        planned = self._plan()
        if planned is None:
            return False
        sched, inputs, statics = planned
        compiles_before = self._unforeseen_compiles()
        pending = self.runner.launch(inputs, statics) if self.async_scheduling else self.runner.execute(inputs, statics)
        self._launched.append(InFlightStep(sched, pending, self._num_steps))
        self.scheduler.advance(sched)
        self._num_steps += 1
        if self._unforeseen_compiles() != compiles_before:
            self._on_recompile(sched)  # may raise: every launched step is queued, so nothing is lost
        return True

    def _tick(self) -> bool:
        """One tick of a pipeline whose stages stay busy across steps: plan a step from the sequences no stage is
        working on and move every step one stage on; the step leaving the last stage is queued to be read back.
        Whether one was. A step takes at most a pp-th of the sequences, so that pp steps share them in steady
        decode, and a pp-th of the token budget: the stages run at the shape of the largest step among them, so a
        prompt's chunk as large as the whole budget would pad the decode steps beside it to its size."""
        if self.runner.unsampled is not None:  # a tick interrupted in its sampler: its step first, then ticks
            self._queue_leaving(*self.runner.sample_unsampled())
            return True
        pp = self.runner.layout.pp
        active = len(self.scheduler.running) + len(self.scheduler.waiting)
        planned = self._plan(max_seqs=min(self.step_seqs, max(1, -(-active // pp))), max_tokens=self.step_tokens)
        if planned is None and self.runner.pipeline_empty:
            return False  # nothing to run
        sched, inputs, statics = planned or (None, None, None)
        entering = None if sched is None else InFlightStep(sched, None, self._num_steps)
        compiles_before = self._unforeseen_compiles()
        try:
            leaving, pending = self.runner.tick(inputs, statics, tag=entering)
        except BaseException:
            if entering is not None and self.runner.unsampled is not None:  # the stages took it; the sampler of the
                self._entered(entering)  # step leaving them was interrupted (sampled at the next call)
            raise
        if leaving is not None:
            self._queue_leaving(leaving, pending)
        if entering is not None:
            self._entered(entering)
            if self._unforeseen_compiles() != compiles_before:
                self._on_recompile(sched)  # may raise: the step is in the pipeline, the one leaving it queued
        return leaving is not None

    def _entered(self, entering: InFlightStep) -> None:
        """The step just planned is inside the pipeline's first stage: its tokens count as dispatched."""
        sched = entering.sched
        entering.lora_slots = tuple({c.seq.lora_slot for c in sched.chunks if c.seq.lora_slot >= 0})
        self.scheduler.adapters.hold(entering.lora_slots)
        self.scheduler.advance(sched)
        for chunk in sched.chunks:
            chunk.seq.staged = chunk.samples
        self._num_steps += 1

    def _queue_leaving(self, leaving: InFlightStep, pending) -> None:
        """The step that left the pipeline's last stage, sampled (`pending`): queued to be read back."""
        leaving.pending = pending
        self.scheduler.adapters.drop(leaving.lora_slots)  # the last stage has run it: its adapters may go
        for chunk in leaving.sched.chunks:  # their next tokens are sampled: later steps may take them again
            if chunk.samples:  # (a prompt's earlier chunk leaving does not free its later, sampling one)
                chunk.seq.staged = False
        self._launched.append(leaving)

    def _grammar_in_flight(self) -> bool:
        """Whether a constrained sequence samples in a step in flight: then the next step waits for its token, which
        the next mask depends on. A grammar still waiting for its start token counts: the token may be it."""
        return any(c.seq.matcher is not None and c.samples for step in self._launched for c in step.sched.chunks)

    def _read_back_all_but(self, keep: int, touched: dict[str, Request]) -> None:
        """Read back and account for the launched steps, oldest first, leaving the newest `keep` in flight."""
        while len(self._launched) > keep:
            step = self._launched[0]
            if not isinstance(step.pending, StepResult):
                step.pending = self.runner.collect(step.pending)  # waits; if interrupted, the step stays queued
            self._launched.popleft()
            self._account(step, touched)

    def _account(self, step: InFlightStep, touched: dict[str, Request]) -> None:
        sched, result = step.sched, step.pending
        tokens = result.tokens.tolist()
        sampled = [_chunk_samples(c, tokens, row) for row, c in zip(sched.first_rows(), sched.chunks)]
        for observer in self.observers:  # before the tokens are taken: they see the sequences as the step did
            observer.on_step(step.index, sched, sampled, result)
        if result.prompt is not None:
            record_prompt_logprobs(sched.chunks, result.prompt, self._texts)

        def on_token(seq: Sequence, token: int, row: int) -> None:
            self._on_token(seq, token, result, row)
            touched[seq.request_id] = self._requests[seq.request_id]

        self.scheduler.resolve(sched, sampled, on_token)

    def _on_recompile(self, sched: SchedulerOutput) -> None:
        if self._compiles_at_warmup is None or self.recompile_guard == "off":
            return
        msg = (f"step {self._num_steps - 1} compiled a new program after warm-up ({sched.num_tokens} tokens, "
               f"{len(sched.chunks)} sequences): a shape or sampler variant is missing from the warm-up buckets")
        if self.recompile_guard == "error":
            raise RuntimeError(msg)
        log.warning(msg)

    def _on_token(self, seq: Sequence, token: int, result: StepResult, row: int) -> None:
        if seq.pooling is not None:  # its one-token budget ended it; the token itself is not used
            seq.pooled = pool(seq.pooling, result.hidden[row], self.head)
            return
        if seq.params.needs_logprobs:  # else the step skipped them
            seq.cumulative_logprob += float(result.logprobs[row])
        text = self._texts[seq.seq_id]
        if seq.params.logprobs is not None:
            seq.logprobs.append(position_logprobs(text.detok, token, result.logprobs[row], result.ranks[row],
                                                  result.top_ids[row], result.top_logprobs[row], seq.params.logprobs))
        stop = text.add_token(seq, token)
        if stop is not None and seq.finished:  # its last allowed token completed a stop string: the text ends there
            seq.finish_reason, seq.stop_reason = "stop", stop
        elif stop is not None:
            self.scheduler.finish(seq, "stop", stop)
        elif seq.grammar_waits_for is not None:
            if token == seq.grammar_waits_for:  # the grammar starts with the next token
                seq.grammar_waits_for = None
        elif seq.matcher is not None and not seq.finished and grammar_ended(seq.matcher, token, seq.request_id):
            self.scheduler.finish(seq, "stop")
        if seq.finished:
            text.finish(seq)

    def _emit(self, request: Request) -> RequestOutput | EmbeddingRequestOutput | ClassificationRequestOutput:
        output = request_output(request, self._texts) if request.pooling is None else pooling_output(request, self.head)
        if request.finished:
            del self._requests[request.request_id]
            for seq in request.sequences:
                self._texts.pop(seq.seq_id, None)
        return output

    def stats(self) -> dict:
        return {
            "total_blocks": self.blocks.total_blocks,
            "free_blocks": self.blocks.num_free_blocks,
            "block_size": self.blocks.block_size,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "spec_decode_num_drafts": self.scheduler.num_drafts,
            "spec_decode_num_draft_tokens": self.scheduler.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.scheduler.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.scheduler.accepted_per_position),
            "prefix_cache_queries": self.blocks.prefix_cache_queries,
            "prefix_cache_hits": self.blocks.prefix_cache_hits,
            "num_steps": self._num_steps,
            # Pipeline ticks (stages busy across steps), and in how many of them each stage had a step to work on
            "pipeline_ticks": self.runner.ticks,
            "pipeline_stage_busy_ticks": list(self.runner.stage_busy_ticks),
            "num_compiles": self.runner.num_compiles,
            "compiles_after_warmup": self.compiles_after_warmup,
            "deferred_compiles": self.runner.deferred_compiles,
            **self.adapters.usage(self.scheduler.running, self.scheduler.waiting),
        }


def _chunk_samples(chunk, tokens: list[int], row: int) -> int | list[int] | None:
    """What the scheduler reads of a chunk's sampled rows (from `row` on): every row's token when it fed drafts,
    else its one."""
    if chunk.draft:
        return tokens[row : row + chunk.num_rows]
    return tokens[row] if chunk.samples else None


Engine.__init__.__signature__ = engine_signature()  # help(Engine) lists every option (they are EngineArgs')
