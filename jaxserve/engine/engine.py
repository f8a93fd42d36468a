"""The engine: requests in, RequestOutputs out. One step is schedule -> run -> update.

`Engine.generate` / `chat` / `stream` are the synchronous Python API (engine/offline.py, built on the request and
step methods here); `AsyncEngine` (async_engine/engine.py) drives
`add_request` / `step` / `abort_request` from a background thread for the server.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import random
import time
from collections import deque

import jax

from jaxserve.config import CacheConfig, EngineConfig, MeshShape, SchedulerConfig, SpeculativeConfig, resolve_dtype
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.grammar import GrammarCompiler, grammar_ended
from jaxserve.core.ngram_proposer import NgramProposer
from jaxserve.core.output_processor import SequenceText, position_logprobs, record_prompt_logprobs, request_output
from jaxserve.core.request import Request, Sequence
from jaxserve.core.scheduler import Scheduler, SchedulerOutput
from jaxserve.engine.adapters import EngineAdapters, LoRAAPI, check_lora_options
from jaxserve.engine.beam_search import BeamSearchAPI
from jaxserve.engine.inputs import (
    Prompt,
    check_engine_options,
    check_max_model_len,
    fit_context_to_cache,
    model_for_context,
    prompt_token_ids,
    resolve_token_rules,
    split_prompt,
    step_limits,
    truncate_prompt,
    validate_lengths,
)
from jaxserve.engine.offline import OfflineAPI
from jaxserve.engine.pooling import pool, pooling_output, step_params
from jaxserve.engine.steps import InFlightStep, StepRecord
from jaxserve.loader.chat_content import check_content_format, resolve_content_format
from jaxserve.loader.checkpoint import open_checkpoint
from jaxserve.loader.generation_config import generation_defaults
from jaxserve.loader.tokenizer import TokenizerChoice, read_chat_template
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import ClassificationRequestOutput, EmbeddingRequestOutput, RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.runner.buckets import Buckets
from jaxserve.runner.capacity import capacity_line, size_kv_cache
from jaxserve.runner.compilation_cache import DEFAULT_COMPILATION_CACHE, enable_compilation_cache
from jaxserve.runner.model_runner import ModelRunner, StepResult
from jaxserve.runner.plan import PlanShape, build_step_inputs
from jaxserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class Engine(OfflineAPI, BeamSearchAPI, LoRAAPI):
    def __init__(self, model: str | None = None, *, dtype: str = "auto", max_model_len: int | None = None,
                 block_size: int = 16, num_kv_blocks: int | None = None, kv_cache_memory_fraction: float = 0.9,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None, seed: int = 0,
                 mesh=None,
                 max_logprobs: int = 20, enable_prefix_caching: bool = True, warmup: bool = True,
                 recompile_guard: str = "warn", compilation_cache_dir: str | None = DEFAULT_COMPILATION_CACHE,
                 tokenizer=None, attention_impl: str = "auto", tensor_parallel_size: int | None = None,
                 pipeline_parallel_size: int | None = None, pp_layer_partition: list[int] | None = None,
                 quantization: str | None = None, load_format: str = "auto", async_scheduling: bool = True,
                 chat_template: str | None = None, chat_template_content_format: str = "auto",
                 enable_lora: bool = False, max_loras: int = 1,
                 max_lora_rank: int = 16, lora_modules: dict[str, str] | None = None,
                 speculative_config: dict | SpeculativeConfig | None = None, hf_overrides: dict | None = None,
                 generation_config: str = "auto", override_generation_config: dict | None = None,
                 revision: str | None = None, tokenizer_revision: str | None = None,
                 download_dir: str | None = None, layer_loop: str = "auto", kv_cache_dtype: str = "auto",
                 devices=None):
        """`tokenizer`: a tokenizer object, or a Hugging Face directory or hub id to load one from (vLLM's
        `tokenizer`); None serves the model's own. `revision`, `tokenizer_revision`: hub branches, tags or commits.
        `download_dir`: where hub models and tokenizers are downloaded to (None: the Hugging Face cache).
        `layer_loop`: "scan", "unrolled" or "auto" (unrolled on GPU: runner/layer_loop.py). `kv_cache_dtype`:
        "auto" (the model's dtype), "bfloat16", or "fp8"/"fp8_e4m3"/"fp8_e5m2" (runner/kv_cache.py). `devices`: the
        devices the mesh is built from (None: the first tp x pp of `jax.devices()`); data parallelism gives each
        replica its own (async_engine/data_parallel.py). `max_num_seqs`, `max_num_batched_tokens`: the most sequences and tokens
        in one step (None: 64 and 512 on CPU, 256 and 8192 on GPU/TPU; engine_inputs.step_limits).
        `chat_template_content_format`: "auto", "string" or "openai" (loader/chat_content.py)."""
        speculative = SpeculativeConfig.from_dict(speculative_config)
        devices = None if devices is None else list(devices)
        platform = (devices or jax.devices())[0].platform  # an empty list is refused by the mesh, by name
        max_num_seqs, max_num_batched_tokens = step_limits(max_num_seqs, max_num_batched_tokens, platform)
        check_engine_options(block_size, max_num_seqs, max_num_batched_tokens, kv_cache_memory_fraction,
                             recompile_guard, quantization, kv_cache_dtype)
        enable_lora, max_loras = check_lora_options(enable_lora, max_loras, max_lora_rank, lora_modules)
        template = None if chat_template is None else read_chat_template(chat_template)  # before the load
        check_content_format(chat_template_content_format)
        enable_compilation_cache(compilation_cache_dir)
        choice = TokenizerChoice(tokenizer, tokenizer_revision, download_dir)
        ckpt = open_checkpoint(model, load_format, hf_overrides, revision, choice, download_dir)
        cfg = ckpt.config
        self.model_name = ckpt.name
        self.tokenizer = ckpt.tokenizer
        if template is not None:  # replaces the tokenizer's own
            self.tokenizer.chat_template = template
        self.chat_content_format = resolve_content_format(chat_template_content_format,
                                                          getattr(self.tokenizer, "chat_template", None))
        self.generation_defaults = generation_defaults(ckpt.generation_defaults, generation_config,
                                                       override_generation_config)
        # What the final hidden state feeds: an LM head, none (embeddings only) or a classifier (loader/heads.py).
        self.declared_pooling, self.head = ckpt.pooling, ckpt.head
        requested_len, max_model_len = max_model_len, check_max_model_len(max_model_len, cfg.max_position_embeddings)
        cfg = model_for_context(cfg, max_model_len)
        dtype = resolve_dtype(dtype, platform)
        self.mesh_shape = MeshShape.of(mesh, tensor_parallel_size, pipeline_parallel_size)
        if enable_lora:  # the layers get adapter slots beside their weights (models/lora.py)
            cfg = dataclasses.replace(cfg, lora_slots=max_loras, lora_rank=max_lora_rank)
        started = time.perf_counter()
        self.runner = ModelRunner(cfg, ckpt.tensors, dtype, block_size, self.mesh_shape, attention_impl,
                                  pp_layer_partition, quantization, layer_loop, kv_cache_dtype, devices)
        log.info("Weights loaded in %.1f s", time.perf_counter() - started)
        self.adapters = EngineAdapters(self.runner, cfg, max_loras, max_lora_rank, enable_lora)
        for name, path in (lora_modules or {}).items():
            self.adapters.preload(name, path)
        # A single stream's drafted step (1 + k tokens and rows) gets a bucket of its own, unpadded.
        spec_step = () if speculative is None else (1 + speculative.num_speculative_tokens,)
        self.plan_shape = PlanShape(Buckets.for_limits(max_num_batched_tokens, max_num_seqs, spec_step), block_size,
                                    cfg.vocab_size, max_model_len, max_logprobs, self.runner.decode_kernel)
        self.runner.set_token_feed(self.plan_shape.buckets.seqs[-1])
        # Overlap needs the step's read-back to stay this process's own: with several processes, followers run
        # each step whole and the host copy can be a collective (parallel/multihost.py). Drafting needs a
        # sequence's latest tokens on the host, which overlap would always leave one step behind (as in vLLM,
        # speculative decoding runs its steps one after the other).
        self.async_scheduling = async_scheduling and jax.process_count() == 1 and speculative is None
        self._launched: deque[InFlightStep] = deque()  # dispatched, not read back yet (oldest first)
        started = time.perf_counter()
        num_kv_blocks = size_kv_cache(self.runner, self.plan_shape, num_kv_blocks, kv_cache_memory_fraction)
        log.info("KV cache sized and allocated in %.1f s (a profiling step at the largest bucket, compiled first)",
                 time.perf_counter() - started)
        max_model_len = fit_context_to_cache(max_model_len, requested_len, (num_kv_blocks - 1) * block_size)
        self.plan_shape = dataclasses.replace(self.plan_shape, max_model_len=max_model_len)
        log.info(capacity_line(num_kv_blocks, block_size, max_model_len, self.runner.kv_dtype))
        self.config = EngineConfig(
            model=cfg,
            cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks),
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len),
            dtype=dtype, seed=seed, max_logprobs=max_logprobs, quantization=quantization,
        )
        self.blocks = BlockManager(num_kv_blocks, block_size, enable_prefix_caching)
        self.speculative_config = speculative
        self.scheduler = Scheduler(self.config.scheduler, self.blocks, self.adapters.slots,
                                   NgramProposer.for_config(speculative))
        self._requests: dict[str, Request] = {}
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, self.eos_token_ids())
        self._texts: dict[int, SequenceText] = {}
        self._rng = random.Random(seed)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._request_ids = itertools.count()
        self.step_records: deque[StepRecord] = deque(maxlen=10_000)
        self._num_steps = 0
        # Set to a list to capture (sequence token ids so far, logits) of every sampled row: parity tests use it.
        self.logits_log: list[tuple[list[int], object]] | None = None
        self.recompile_guard = recompile_guard
        self._compiles_at_warmup: int | None = None
        if warmup:
            self.warmup()
        log.info("Loaded %s (%s, %s%s, mesh %dx%d)", self.model_name, cfg.architecture, dtype,
                 f", {quantization} quantization" if quantization else "", *self.mesh_shape)

    def warmup(self, desc: str = "Compiling step buckets", compile_threads: int | None = None) -> None:
        """Compile every step program now (a progress bar titled `desc`), so serving never stalls on a compile.
        `compile_threads`: programs compiled at once (None: one per host core, at most 8)."""
        from tqdm.auto import tqdm

        total = self.runner.warmup_size(self.plan_shape)
        threads = compile_threads or min(8, os.cpu_count() or 1)
        started = time.perf_counter()
        with tqdm(total=total, desc=desc, unit="program") as bar:
            self.runner.warmup(self.plan_shape, bar, threads)
        log.info("Warm-up: %d step programs compiled (or read from the compilation cache) in %.1f s, %d at a time",
                 total, time.perf_counter() - started, threads)
        self._compiles_at_warmup = self.runner.num_compiles

    @property
    def compiles_after_warmup(self) -> int:
        if self._compiles_at_warmup is None:
            return 0
        return self.runner.num_compiles - self._compiles_at_warmup

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    # ---- requests -------------------------------------------------------------------------------------

    def prepare_request(self, request_id: str, prompt: Prompt, params: SamplingParams | PoolingParams, *,
                        priority: int = 0, lora_request: LoRARequest | None = None) -> Request:
        """Tokenize and validate (no device work, safe from any thread). Raises ValueError for bad input.
        PoolingParams make it a pooling request: an embedding or a classification (engine/pooling.py)."""
        pooling = params if isinstance(params, PoolingParams) else None
        prompt, cache_salt = split_prompt(prompt)
        params = step_params(params, self.head, self.model_name, self.config.model.hidden_size, self.declared_pooling)
        given = prompt_token_ids(self.tokenizer, prompt, self.config.model.vocab_size)
        ids = truncate_prompt(given, (pooling or params).truncate_prompt_tokens, self.max_model_len)
        params = validate_lengths(params, len(ids), self.max_model_len, self.config,
                                  self.generation_defaults.get("max_tokens"))
        lora_request = self.adapters.check(lora_request)
        allowed_mask, bad_words = resolve_token_rules(params, self.tokenizer, self.config, self.eos_token_ids())
        shared = dict(lora_request=lora_request, pooling=pooling, allowed_mask=allowed_mask, bad_words=bad_words,
                      cache_salt=cache_salt)
        seqs = [self._new_sequence(request_id, i, ids, params, priority, **shared) for i in range(params.num_sequences)]
        if params.constrained:  # compiled here, off the engine thread; an invalid grammar is a ValueError
            matcher = self.grammars.matcher(params.structured_outputs)
            for i, seq in enumerate(seqs):
                seq.matcher = matcher.deep_copy() if i else matcher
                seq.grammar_waits_for = params.structured_outputs.starts_after_token
        text = prompt if isinstance(prompt, str) and len(ids) == len(given) else None  # None: decoded when needed
        return Request(request_id, text, seqs, params, pooling)

    def _new_sequence(self, request_id: str, index: int, ids: list[int], params: SamplingParams, priority: int,
                      **shared) -> Sequence:
        """`shared`: Sequence fields every sequence of the request has alike (adapter, pooling, token rules)."""
        seed = self._rng.getrandbits(32) if params.seed is None else (params.seed + index * 0x9E3779B9) & 0xFFFFFFFF
        seq = Sequence(next(self._seq_ids), request_id, index, list(ids), len(ids), params, seed,
                       arrival=next(self._arrivals), priority=priority, eos_token_ids=self.eos_token_ids(),
                       max_model_len=self.max_model_len, **shared)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs.append(None)  # the first prompt token has no context to be predicted from
        return seq

    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.tokenizer.eos_token_id
        return tuple(self.config.model.eos_token_ids) or (() if eos is None else (eos,))

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
        return bool(self._requests) or bool(self._launched)

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
        self._purge_removed_adapters()
        # One step in flight at most when scheduling (a call that raised leaves two): one placeholder a sequence.
        # None when it samples for a grammar: the next mask needs the token it samples. (An engine that drafts
        # never overlaps steps: see async_scheduling.)
        self._read_back_all_but(0 if self._grammar_in_flight() else 1, touched)
        launched = self._launch()
        if launched is not None and launched.recompiled:
            self._on_recompile(launched.sched)  # may raise: every launched step is queued, so nothing is lost
        self._read_back_all_but(1 if launched is not None and self.async_scheduling else 0, touched)
        return [self._emit(req) for req in touched.values() if req.finished or not finished_only]

    def _launch(self) -> InFlightStep | None:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return None
        self.adapters.write_pending()  # adapters the scheduler just gave a slot
        inputs, statics = build_step_inputs(sched, self.blocks, self.plan_shape)
        if self.logits_log is not None:
            statics = dataclasses.replace(statics, return_logits=True)
        compiles_before = self.runner.num_compiles
        # Multi-process runs read the step back at once: followers run each step whole (cluster/follower.py).
        pending = self.runner.launch(inputs, statics) if self.async_scheduling else self.runner.execute(inputs, statics)
        step = InFlightStep(sched, pending, recompiled=self.runner.num_compiles != compiles_before)
        self._record(sched)
        self.scheduler.advance(sched)
        self._launched.append(step)
        return step

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
            self._account(step.sched, step.pending, touched)

    def _account(self, sched: SchedulerOutput, result: StepResult, touched: dict[str, Request]) -> None:
        tokens = result.tokens.tolist()
        sampled = [_chunk_samples(c, tokens, row) for row, c in zip(sched.first_rows(), sched.chunks)]
        if self.logits_log is not None:
            self._log_logits(sched, sampled, result)
        if result.prompt is not None:
            record_prompt_logprobs(sched.chunks, result.prompt, self._texts)

        def on_token(seq: Sequence, token: int, row: int) -> None:
            self._on_token(seq, token, result, row)
            touched[seq.request_id] = self._requests[seq.request_id]

        self.scheduler.resolve(sched, sampled, on_token)

    def _log_logits(self, sched: SchedulerOutput, sampled: list, result: StepResult) -> None:
        """(the sequence's tokens before a sampled one, the logits it was sampled from), for each token kept."""
        for row, c, tokens in zip(sched.first_rows(), sched.chunks, sampled):
            if c.samples and not c.seq.finished:
                kept = len(c.accepted(tokens)) if c.draft else 1
                self.logits_log.extend((c.seq.token_ids[: c.end] + c.draft[:i], result.logits[row + i])
                                       for i in range(kept))

    def _on_recompile(self, sched: SchedulerOutput) -> None:
        if self._compiles_at_warmup is None or self.recompile_guard == "off":
            return
        msg = (f"step {self._num_steps} compiled a new program after warm-up ({sched.num_tokens} tokens, "
               f"{len(sched.chunks)} sequences): a shape or sampler variant is missing from the warm-up buckets")
        if self.recompile_guard == "error":
            raise RuntimeError(msg)
        log.warning(msg)

    def _record(self, sched: SchedulerOutput) -> None:
        chunks = tuple((c.seq.request_id, c.start, c.num_tokens) for c in sched.chunks)
        self.step_records.append(StepRecord(self._num_steps, chunks))
        self._num_steps += 1

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
            "num_compiles": self.runner.num_compiles,
            "compiles_after_warmup": self.compiles_after_warmup,
            **self._lora_stats(),
        }


def _chunk_samples(chunk, tokens: list[int], row: int) -> int | list[int] | None:
    """What the scheduler reads of a chunk's sampled rows (from `row` on): every row's token when it fed drafts,
    else its one."""
    if chunk.draft:
        return tokens[row : row + chunk.num_rows]
    return tokens[row] if chunk.samples else None

