"""Checking and normalising what callers hand the engine (host side, no jax): `InputProcessor` turns a prompt and
its parameters into a checked Request, from any thread; the functions beside it are its rules and the engine's
constructor's."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import numbers
import random

import numpy as np

from jaxserve.config import EngineConfig, ModelConfig, SchedulerConfig
from jaxserve.core.beam_search import BeamSearch
from jaxserve.core.request import Request, Sequence
from jaxserve.core.token_rules import allowed_bitmask, bad_words_token_ids, check_some_token_allowed
from jaxserve.engine.pooling import step_params
from jaxserve.errors import InvalidRequestField
from jaxserve.loader.tokenizer import apply_chat_template
from jaxserve.lora_request import LoRARequest
from jaxserve.pooling_params import PoolingParams
from jaxserve.runner.sampler import BIAS_SLOTS
from jaxserve.sampling_params import BeamSearchParams, SamplingParams, check_beam_width

log = logging.getLogger(__name__)


def as_token_ids(value) -> list[int] | None:
    """Token ids given as a list, a tuple or a 1-D numpy array of integers (numpy's too: a tokenizer's output) ->
    a list of ints; None for anything else."""
    if isinstance(value, np.ndarray):
        return value.tolist() if value.ndim == 1 and np.issubdtype(value.dtype, np.integer) else None
    if isinstance(value, (list, tuple)) and all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value):
        return [int(t) for t in value]
    return None


def normalise_prompts(prompts) -> list:
    """A prompt (a str, token ids, or vLLM's dict: see split_prompt) or a sequence of prompts -> a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if ids := as_token_ids(prompts):  # one prompt's token ids ([] is no prompts)
        return [ids]
    if isinstance(prompts, (list, tuple)):
        normalised = [p if isinstance(p, (str, dict)) else as_token_ids(p) for p in prompts]
        if None not in normalised:
            return normalised
    raise ValueError("prompts must be a str, a list of str, a list of token ids, a list of token-id lists, or "
                     "prompt dicts ({'prompt': text} or {'prompt_token_ids': ids})")


PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
Prompt = str | list[int] | dict  # text, token ids, or vLLM's prompt dict (split_prompt)


def split_prompt(prompt) -> tuple[str | list[int], str | None]:
    """vLLM's prompt dicts, {"prompt": text} or {"prompt_token_ids": ids}, each with an optional "cache_salt"
    (requests with different salts never share prefix-cache blocks) -> (text or ids, salt). Others pass as they are."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = sorted(set(prompt) - set(PROMPT_DICT_KEYS))
    if unknown:
        raise ValueError(f"prompt dict key {unknown[0]!r} is not supported; the keys are {', '.join(PROMPT_DICT_KEYS)}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict needs exactly one of 'prompt' (text) and 'prompt_token_ids'")
    salt = prompt.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return prompt.get("prompt", prompt.get("prompt_token_ids")), salt


def normalise_conversations(messages) -> list[list[dict]]:
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        return [messages]
    if isinstance(messages, list) and messages and all(isinstance(c, list) for c in messages):
        return messages
    raise ValueError("messages must be a list of {'role', 'content'} dicts, or a list of such conversations")


def prompt_token_ids(tokenizer, prompt, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt)["input_ids"])
    elif (ids := as_token_ids(prompt)) is not None:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    else:
        raise ValueError("a prompt must be a str or a list of int token ids")
    if not ids:
        raise ValueError("the prompt is empty; give at least one token")
    return ids


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int, pooling: PoolingParams | None = None
                    ) -> list[int]:
    """The prompt's last `keep` tokens (vLLM's truncate_prompt_tokens; -1: the longest prompt the context holds
    with room for one more token). A pooling request keeps its first `keep` (vLLM 0.34's pooling tokenizers
    truncate on the right; its truncation_side "left": the last), and needs no room after its prompt (-1: the
    whole context)."""
    if keep is None:
        return ids
    longest = max_model_len if pooling else max_model_len - 1
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens={keep} is more than the model's maximum context length "
                         f"{max_model_len}; ask for at most {longest} (or -1)")
    keep = longest if keep == -1 else keep
    return ids[:keep] if pooling and pooling.truncation_side == "right" else ids[-keep:]


def sequence_seed(seed: int, index: int) -> int:
    """The 32 bits the sampler keys sequence `index` of a request seeded `seed` with: a seed's bits above 32 are
    mixed in (seeds 7 and 7 + 2**32 sample differently), and a seed below 2**32 keys its first sequence as itself."""
    high = seed >> 32
    mixed = seed ^ (high * 0x85EBCA6B) if high else seed
    return (mixed + index * 0x9E3779B9) & 0xFFFFFFFF


def _fitted_max_tokens(params: SamplingParams, prompt_len: int, max_model_len: int, max_tokens_cap: int | None
                       ) -> SamplingParams:
    room = max_model_len - prompt_len
    if params.max_tokens is None:
        return params.replace(max_tokens=min(room, max_tokens_cap or max_model_len))
    if params.max_tokens > max_model_len:
        raise InvalidRequestField(
            f"max_tokens={params.max_tokens} is more than the model's maximum context length of {max_model_len} "
            f"tokens; ask for at most {room} with this {prompt_len}-token prompt (or leave max_tokens out: the room "
            "left)", "max_tokens")
    if params.max_tokens > room:
        return params.replace(max_tokens=room, min_tokens=min(params.min_tokens, room))
    return params


def validate_lengths(params: SamplingParams, prompt_len: int, max_model_len: int, config: EngineConfig,
                     max_tokens_cap: int | None = None, pooling: bool = False) -> SamplingParams:
    """Check the request fits the context and the cache; fill in max_tokens=None as 'up to the context length', or
    `max_tokens_cap` (generation config's max_new_tokens) if less. A max_tokens beyond the room the prompt leaves
    is cut to it, as vLLM's does (the output then ends at the context's end, finish_reason "length"): one request
    in an offline batch asking too much would otherwise fail them all. Only one no context could hold is refused."""
    if prompt_len > max_model_len or prompt_len == max_model_len and not pooling:
        raise ValueError(
            f"the prompt has {prompt_len} tokens but the model's maximum context length is {max_model_len}; "
            "shorten the prompt"
        )
    if not pooling:  # a pooling request's one step computes the prompt alone: its sample is never kept
        params = _fitted_max_tokens(params, prompt_len, max_model_len, max_tokens_cap)
    for field in ("logprobs", "prompt_logprobs"):
        value = getattr(params, field)
        if value is not None and value > config.max_logprobs:
            also = " (chat's top_logprobs)" if field == "logprobs" else ""
            raise ValueError(f"{field}={value}{also} exceeds the maximum of {config.max_logprobs}; the engine's "
                             "max_logprobs (serve --max-logprobs) sets it")
    vocab = config.model.vocab_size
    for field, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids or [])):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestField(f"{field} has token id {bad[0]}, outside the vocabulary (0..{vocab - 1})", field)
    capacity = (config.cache.num_blocks - 1) * config.cache.block_size
    # The request's sequences (n, or best_of) share the cache as vLLM's do: while it is short they are preempted and
    # recomputed in turn (one alone always fits: max_model_len fits the cache), so only their starts must fit at
    # once, whatever max_tokens allows each to grow to. Checked before the sequences are made, so a request for a
    # billion of them is refused at once rather than exhausting host memory.
    needed = params.num_sequences * (prompt_len + (0 if pooling else 1))
    if needed > capacity:
        raise ValueError(
            f"the request's {params.num_sequences} sequences need {needed} tokens of KV cache to start "
            f"({params.num_sequences} x {prompt_len} prompt{'' if pooling else ' + 1'}) but the whole cache holds "
            f"{capacity}; lower n, or raise num_kv_blocks"
        )
    return params


def resolve_token_rules(params: SamplingParams, tokenizer, config: EngineConfig,
                        eos_token_ids: tuple[int, ...]) -> tuple[np.ndarray | None, tuple]:
    """allowed_token_ids as a bitmask and bad_words as token ids (core/token_rules.py); the bias slots that logit_bias,
    the min_tokens bans (stop tokens and `eos_token_ids`, the sequence's) and the bad words share must hold them
    all: a row that overflowed them would fail the step, and every request with it."""
    vocab = config.model.vocab_size
    mask = None if params.allowed_token_ids is None else allowed_bitmask(params.allowed_token_ids, vocab)
    bad_words = bad_words_token_ids(tokenizer, params.bad_words or [], vocab)
    entries = len(params.logit_bias or {}) + len(params.stop_token_ids or []) + len(eos_token_ids) + len(bad_words)
    if entries > BIAS_SLOTS:
        raise ValueError(f"logit_bias, stop_token_ids and bad_words together need {entries} token entries (bad words "
                         f"count once per spelling); at most {BIAS_SLOTS} fit")
    check_some_token_allowed(params.allowed_token_ids, bad_words, params.min_tokens,
                             {*(params.stop_token_ids or ()), *eos_token_ids})
    return mask, bad_words


# Per-step limits (max_num_seqs, max_num_batched_tokens) when not given. On CPU a step of 64 sequences and 512
# tokens keeps a few-core host's steps, and so its streams' token gaps, short. On GPU and TPU: vLLM's 256 and
# 8192, the settings the GPU figures in BENCHMARKS.md were measured with (at CPU's, a GPU step is mostly idle).
CPU_STEP_LIMITS = (SchedulerConfig.max_num_seqs, SchedulerConfig.max_num_batched_tokens)  # 64, 512
ACCELERATOR_STEP_LIMITS = (256, 8192)


def step_limits(max_num_seqs: int | None, max_num_batched_tokens: int | None, platform: str) -> tuple[int, int]:
    """The engine's per-step limits: those given, the platform's default for the others."""
    seqs, tokens = CPU_STEP_LIMITS if platform == "cpu" else ACCELERATOR_STEP_LIMITS
    return (seqs if max_num_seqs is None else max_num_seqs,
            tokens if max_num_batched_tokens is None else max_num_batched_tokens)


def model_for_context(cfg: ModelConfig, max_model_len: int) -> ModelConfig:
    """The model as this engine runs it; says so when LongRoPE's long factors are chosen (vLLM warns alike)."""
    if cfg.rope_scaling is not None and cfg.rope_scaling.uses_long_factors(max_model_len):
        original = cfg.rope_scaling.original_max_position_embeddings
        log.warning("max_model_len %d is beyond the model's original %d positions: LongRoPE's long factors are used "
                    "for every sequence, which costs some quality on short ones; pass max_model_len <= %d for the "
                    "short factors", max_model_len, original, original)
    return cfg.for_context(max_model_len)


def fit_context_to_cache(max_model_len: int, requested: int | None, cache_tokens: int) -> int:
    """The context length served: one sequence of it must fit the KV cache, or every request that leaves
    max_tokens out (asking for the whole context) would be refused. An explicit max_model_len that does not fit
    is an error, as in vLLM; the model's own length is lowered to what fits, with a warning."""
    if max_model_len <= cache_tokens:
        return max_model_len
    if requested is not None:
        raise ValueError(f"max_model_len={max_model_len} does not fit the KV cache, which holds {cache_tokens} tokens; "
                         f"pass max_model_len <= {cache_tokens}, or give the cache more room (kv_cache_memory_fraction, "
                         f"num_kv_blocks)")
    log.warning("the model's context length %d does not fit the KV cache (%d tokens): serving max_model_len %d; give "
                "the cache more room (kv_cache_memory_fraction, num_kv_blocks) for longer contexts", max_model_len,
                cache_tokens, cache_tokens)
    return cache_tokens


def check_max_model_len(requested: int | None, model_max: int) -> int:
    if requested is None:
        return model_max
    if requested < 1 or requested > model_max:
        raise ValueError(f"max_model_len={requested} is outside 1..{model_max} (the model's max_position_embeddings)")
    return requested


def eos_token_ids(tokenizer, model: ModelConfig) -> tuple[int, ...]:
    """The model's end tokens (generation_config.json may name several), else the tokenizer's."""
    eos = tokenizer.eos_token_id
    return tuple(model.eos_token_ids) or (() if eos is None else (eos,))


class InputProcessor:
    """What callers hand the engine, made into checked requests: prompts tokenized (chat messages through the
    template), lengths, token rules and adapters checked, grammars compiled, one Sequence per sample with its
    seed. No device work: the server calls it on its own thread, so a bad request fails before anything is
    queued, and a grammar compiles without holding up a step."""

    def __init__(self, tokenizer, config: EngineConfig, *, model_name: str, head, declared_pooling,
                 generation_defaults: dict, adapters, grammars, chat_content_format: str, seed: int):
        """`adapters`: the engine's EngineAdapters (`check` gives a request the LoRARequest its name runs with);
        `grammars`: a core.grammar.GrammarCompiler."""
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = model_name
        self.head = head
        self.declared_pooling = declared_pooling
        self.generation_defaults = generation_defaults
        self.adapters = adapters
        self.grammars = grammars
        self.chat_content_format = chat_content_format
        self._rng = random.Random(seed)  # seeds of sequences whose request gives none
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    def eos_token_ids(self) -> tuple[int, ...]:
        return eos_token_ids(self.tokenizer, self.config.model)

    def prepare_request(self, request_id: str, prompt: Prompt, params: SamplingParams | PoolingParams, *,
                        priority: int = 0, lora_request: LoRARequest | None = None) -> Request:
        """ValueError for bad input. PoolingParams make it a pooling request: an embedding or a classification
        (engine/pooling.py)."""
        pooling = params if isinstance(params, PoolingParams) else None
        prompt, cache_salt = split_prompt(prompt)
        params = step_params(params, self.head, self.model_name, self.config.model.hidden_size, self.declared_pooling)
        given = prompt_token_ids(self.tokenizer, prompt, self.config.model.vocab_size)
        ids = truncate_prompt(given, (pooling or params).truncate_prompt_tokens, self.max_model_len, pooling)
        params = validate_lengths(params, len(ids), self.max_model_len, self.config,
                                  self.generation_defaults.get("max_tokens"), pooling is not None)
        lora_request = self.adapters.check(lora_request)
        allowed_mask, bad_words = resolve_token_rules(params, self.tokenizer, self.config, self.eos_token_ids())
        shared = dict(lora_request=lora_request, pooling=pooling, allowed_mask=allowed_mask, bad_words=bad_words,
                      cache_salt=cache_salt)
        seqs = [self._new_sequence(request_id, i, ids, params, priority, **shared) for i in range(params.num_sequences)]
        if params.constrained:  # an invalid grammar is a ValueError
            matcher = self.grammars.matcher(params.structured_outputs)
            for i, seq in enumerate(seqs):
                seq.matcher = matcher.deep_copy() if i else matcher
                seq.grammar_waits_for = params.structured_outputs.starts_after_token
        text = prompt if isinstance(prompt, str) and len(ids) == len(given) else None  # None: decoded when needed
        return Request(request_id, text, seqs, params, pooling)

    def _new_sequence(self, request_id: str, index: int, ids: list[int], params: SamplingParams, priority: int,
                      **shared) -> Sequence:
        """`shared`: Sequence fields every sequence of the request has alike (adapter, pooling, token rules)."""
        seed = self._rng.getrandbits(32) if params.seed is None else sequence_seed(params.seed, index)
        seq = Sequence(next(self._seq_ids), request_id, index, list(ids), len(ids), params, seed,
                       arrival=next(self._arrivals), priority=priority, eos_token_ids=self.eos_token_ids(),
                       max_model_len=self.max_model_len, **shared)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs.append(None)  # the first prompt token has no context to be predicted from
        return seq

    def prepare_beam_search(self, prompt: str | list[int] | dict, params: BeamSearchParams) -> BeamSearch:
        """One prompt's search (core/beam_search.py), checked: a ValueError for a beam too wide for the engine's
        logprobs, a bad token id, or beams that cannot fit the context or cache."""
        eos = self.eos_token_ids()
        check_beam_width(params, eos, self.config.max_logprobs)
        prompt, cache_salt = split_prompt(prompt)
        if cache_salt is not None:
            raise ValueError("cache_salt cannot be combined with beam search; leave one out")
        ids = prompt_token_ids(self.tokenizer, prompt, self.config.model.vocab_size)
        # As for a request of beam_width sequences: each beam may grow to prompt + max_tokens.
        checked = validate_lengths(SamplingParams(n=params.beam_width, max_tokens=params.max_tokens), len(ids),
                                   self.max_model_len, self.config, self.generation_defaults.get("max_tokens"))
        return BeamSearch(ids, dataclasses.replace(params, max_tokens=checked.max_tokens), eos, self.max_model_len)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **rendering) -> list[int]:
        """Token ids of the messages through the chat template; `rendering`: continue_final_message,
        chat_template_kwargs, tools, documents (loader/tokenizer.apply_chat_template)."""
        # A template of the call's own is read for its content format, as vLLM's LLM.chat reads it ("auto")
        rendering.setdefault("content_format", "auto" if rendering.get("chat_template") else self.chat_content_format)
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt, **rendering)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (temperature, top_p, ...), as vLLM. Its
        max_new_tokens leaves max_tokens None, which a request fills with the room in the context up to that cap."""
        defaults = self.generation_defaults
        return SamplingParams(**{**defaults, "max_tokens": None} if "max_tokens" in defaults else defaults)
