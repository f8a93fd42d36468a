"""Request and response schemas of the OpenAI-compatible API (pydantic), as OpenAI and vLLM clients send them.

Unknown request fields are ignored, as vLLM does, so clients written for newer API versions still work, and named
in a warning in the log (a misspelt option shows there); fields that would change what a right answer is and
which this server does not implement are refused by name.
Chat schemas live in `chat_protocol.py`, those of /v1/models and /tokenize in `utility_protocol.py`; this file
holds the shared pieces and completions.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import time
from typing import Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from jaxserve.errors import InvalidRequestField
from jaxserve.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

logger = logging.getLogger("jaxserve.server")
# Every stop string is looked for after every token, on the engine's thread: a huge list would slow every request.
MAX_STOP_STRINGS = 256
PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


# Where the request being read came from, for the ignored-fields warning: "" over HTTP (the access log's next line
# names the request), " on line N (custom_id ...)" in a batch job, where a thousand lines share one log.
REQUEST_ORIGIN: contextvars.ContextVar[str] = contextvars.ContextVar("request_origin", default="")


@contextlib.contextmanager
def request_origin(origin: str):
    token = REQUEST_ORIGIN.set(origin)
    try:
        yield
    finally:
        REQUEST_ORIGIN.reset(token)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestModel(OpenAIModel):
    """A request body (or a part of one): fields it does not know are named in a warning, as vLLM does. Response
    models skip the check, which costs microseconds per model built (a streamed token builds dozens).

    A null sent for an optional field means its default, as OpenAI's API types them ("integer or null") and vLLM
    reads them: the OpenAI SDK sends `"n": null` for a caller's `n=None`."""

    EXTRA_FIELDS_USED: ClassVar[frozenset[str]] = frozenset()  # extras a model with extra="allow" reads itself

    @model_validator(mode="wrap")
    @classmethod
    def _log_ignored_fields(cls, data: Any, handler):
        if isinstance(data, dict):
            ignored = data.keys() - cls._known_keys()
            if ignored:
                logger.warning("these fields of the request%s were ignored: %s", REQUEST_ORIGIN.get(),
                               ", ".join(sorted(map(str, ignored))))
            nulls_as_defaults = cls._null_means_default()
            if any(data.get(key, ...) is None for key in nulls_as_defaults):
                data = {key: value for key, value in data.items() if value is not None or key not in nulls_as_defaults}
        return handler(data)

    @classmethod
    @functools.cache  # per class
    def _null_means_default(cls) -> frozenset[str]:
        """The names (and aliases) of the fields with a default whose type has no None of its own."""
        keys = set()
        for name, field in cls.model_fields.items():
            if not field.is_required() and not _admits_none(field.annotation):
                keys |= {name, field.alias} - {None}
        return frozenset(keys)

    @classmethod
    @functools.cache  # per class
    def _known_keys(cls) -> frozenset[str]:
        aliases = {field.alias for field in cls.model_fields.values() if field.alias}
        return frozenset(cls.model_fields) | aliases | cls.EXTRA_FIELDS_USED


def _admits_none(annotation: Any) -> bool:
    return annotation is Any or annotation is None or type(None) in get_args(annotation)


# --- errors -------------------------------------------------------------------------------------------------
class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# --- shared -------------------------------------------------------------------------------------------------
class StreamOptions(RequestModel):
    include_usage: bool = True  # as vLLM: `"stream_options": {}` asks for the usage chunk
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # with --enable-prompt-tokens-details

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> "UsageInfo":
        details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


def choice_usage(output, completion) -> UsageInfo:
    """A streamed chunk's usage under continuous_usage_stats, as vLLM reports it: the chunk's prompt and the tokens
    its choice has generated so far."""
    return UsageInfo.of(len(output.prompt_token_ids), len(completion.token_ids))


class SamplingFields(RequestModel):
    """Sampling fields common to completions and chat (OpenAI's, then vLLM's extras)."""

    # Constrained output, as OpenAI (response_format), vLLM (structured_outputs) and older vLLM (guided_*) ask.
    response_format: dict[str, Any] | None = None
    # What errors call response_format: the field the client sent ("text.format" where /v1/responses made it)
    _response_format_name: str = PrivateAttr("response_format")
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # as vLLM's: a 64-bit integer (-1: no seed)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    use_beam_search: bool = False  # vLLM's: `n` beams, all returned, best first
    length_penalty: float = 1.0  # beam search: scores are cumulative logprob / length ** length_penalty
    cache_salt: str | None = Field(None, min_length=1)  # only requests with the same salt share prefix-cache blocks
    prompt_logprobs: int | None = Field(None, ge=0)  # vLLM's: each prompt token's logprob and its top alternatives
    return_token_ids: bool | None = None  # vLLM's: responses carry the prompt's and each choice's token ids
    # vLLM's: logprobs name tokens "token_id:N" (as --return-tokens-as-token-ids does for every request)
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: the response's id is "cmpl-<request_id>" ("chatcmpl-..." for chat) instead of a random one
    request_id: str | None = Field(None, min_length=1)

    @property
    def include_usage_chunk(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def usage_in_every_chunk(self) -> bool:
        return self.include_usage_chunk and self.stream_options.continuous_usage_stats

    def _sampling_params(self, model_defaults: dict[str, Any] | None, **specific: Any) -> SamplingParams:
        """Build SamplingParams; invalid values raise ValueError naming the field.

        A field the body leaves unset takes the model's generation_config.json value (`model_defaults`), then
        OpenAI's default, as vLLM does: a model tuned to sample at temperature 0.6 does so unless asked otherwise.
        Its `max_new_tokens` (defaults' "max_tokens") caps max_tokens, as in vLLM: an unset max_tokens stays None,
        which the engine fills with the room left in the context or the cap, whichever is less.
        """
        def unset_or(name: str, fallback: float) -> float:
            value = getattr(self, name)
            return value if value is not None else (model_defaults or {}).get(name, fallback)

        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true (as in vLLM); leave one out")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given with stream: true (as in vLLM)")
        cap = (model_defaults or {}).get("max_tokens")
        if cap is not None and specific.get("max_tokens") is not None:
            specific["max_tokens"] = min(specific["max_tokens"], cap)

        return SamplingParams(
            n=self.n,
            temperature=unset_or("temperature", 1.0),
            top_p=unset_or("top_p", 1.0),
            top_k=unset_or("top_k", 0),
            min_p=unset_or("min_p", 0.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=unset_or("repetition_penalty", 1.0),
            logit_bias=self.logit_bias,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            structured_outputs=self._structured_outputs(),
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            **specific,
        )

    def beam_search_params(self, params: SamplingParams) -> BeamSearchParams | SamplingParams:
        """With use_beam_search, the search the body asks for (n beams; `params`' length and EOS settings);
        otherwise `params`. A ValueError names a field the search cannot honour: beams are ranked by the model's
        own logprobs, so penalties, biases, token rules and grammars would be ignored (temperature, top_p, top_k,
        min_p and seed do not apply: the search is deterministic)."""
        if not self.use_beam_search:
            return params
        conflicts = {"best_of": getattr(self, "best_of", None) not in (None, self.n),
                     "logprobs": params.logprobs is not None or params.prompt_logprobs is not None,
                     "stop": bool(params.stop), "stop_token_ids": bool(params.stop_token_ids),
                     "min_tokens": params.min_tokens > 0, "presence_penalty": self.presence_penalty != 0,
                     "frequency_penalty": self.frequency_penalty != 0,
                     "repetition_penalty": self.repetition_penalty not in (None, 1.0),
                     "logit_bias": bool(self.logit_bias), "allowed_token_ids": params.allowed_token_ids is not None,
                     "bad_words": bool(params.bad_words),
                     "truncate_prompt_tokens": params.truncate_prompt_tokens is not None,
                     "cache_salt": self.cache_salt is not None}
        if params.constrained:
            source = params.structured_outputs.source or "structured_outputs"
            conflicts["tool_choice" if source.startswith("tools") else source] = True
        for name, conflicting in conflicts.items():
            if conflicting:
                raise ValueError(f"{name} cannot be combined with use_beam_search; remove one of them")
        return BeamSearchParams(beam_width=self.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                length_penalty=self.length_penalty, skip_special_tokens=params.skip_special_tokens)

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one output constraint the body asks for, in whichever spelling; a ValueError naming the field."""
        asked = {name: getattr(self, name) for name in OUTPUT_CONSTRAINT_FIELDS
                 if getattr(self, name) is not None}
        if _response_format_kind(self.response_format) == "text":
            asked.pop("response_format", None)
        if len(asked) > 1:
            raise ValueError(f"{next(iter(asked))} cannot be combined with {', '.join(list(asked)[1:])}: ask for one "
                             f"output constraint")
        if not asked:
            return None
        (name, value), = asked.items()
        try:
            if name == "response_format":
                return _from_response_format(value, self._response_format_name)
            if name == "structured_outputs":
                return StructuredOutputsParams.of(value, source=name)
            return StructuredOutputsParams(**{GUIDED_FIELDS[name]: value}, source=name)
        except ValueError as e:
            label = self._response_format_name if name == "response_format" else name
            raise InvalidRequestField(f"{label} is invalid: {e}", label.split(".")[0]) from None


# vLLM's older request fields -> the StructuredOutputsParams field each sets.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# Every field that asks for an output constraint; a request may give one of them.
OUTPUT_CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS)


def _response_format_kind(value: dict[str, Any] | None) -> str:
    return (value or {}).get("type", "text")


def _from_response_format(value: dict[str, Any], source: str) -> StructuredOutputsParams:
    """OpenAI's response_format: {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}, "strict": ...}}. `source`: the field's name in errors."""
    kind = _response_format_kind(value)
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, source=source)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            raise ValueError('type "json_schema" needs the schema in json_schema.schema')
        return StructuredOutputsParams(json=schema, source=source)
    raise ValueError(f"type {kind!r} is not supported; use text, json_object or json_schema")


# --- completions --------------------------------------------------------------------------------------------
def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class CompletionRequest(SamplingFields):
    # Checked by hand: pydantic's report on a four-way union failure is four confusing errors.
    prompt: Any
    max_tokens: int | None = 16  # OpenAI's legacy default; None means up to the context length
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: false encodes text prompts without the tokenizer's own BOS (or EOS)

    @field_validator("prompt")
    @classmethod
    def _known_prompt_shape(cls, prompt: Any) -> Any:
        if isinstance(prompt, str) or _is_token_ids(prompt):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
            if any(not p for p in prompt):
                raise ValueError("prompt must not contain empty prompts")
            return prompt
        raise ValueError(f"prompt must be {PROMPT_SHAPES}")

    def to_sampling_params(self, model_defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.stream and self.best_of not in (None, self.n):
            raise ValueError("best_of cannot be streamed (the best are known only at the end); leave one out")
        # Echoing the prompt with logprobs needs the prompt's logprobs too (each view keeps its own top-N).
        asked = [n for n in (self.logprobs if self.echo else None, self.prompt_logprobs) if n is not None]
        max_tokens = 1 if self.echo_only else self.max_tokens  # the one token generated is not shown
        return self._sampling_params(model_defaults, max_tokens=max_tokens, best_of=self.best_of,
                                     logprobs=self.logprobs, prompt_logprobs=max(asked, default=None))

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) alone, vLLM's echo_without_generation (scoring and
        perplexity tools, lm-evaluation-harness among them, ask for prompt logprobs so)."""
        return self.echo and self.max_tokens == 0

    def prompts(self, tokenizer=None) -> list[str | list[int]]:
        """The prompt field as a list of single prompts (text or token ids); under `add_special_tokens: false`,
        text encoded here by `tokenizer` without its special tokens (the engine's encoding adds them)."""
        prompt = self.prompt
        prompts = [prompt] if isinstance(prompt, str) or _is_token_ids(prompt) else list(prompt)
        if self.add_special_tokens:
            return prompts
        return [tokenizer(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else p for p in prompts]


class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIModel):
    """One entry of vLLM's prompt_logprobs, keyed by token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token: None for the first (nothing predicts it), else {token id: its entry} for the prompt's own token
# and the top alternatives.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, when the request asks for them
    # vLLM's, with return_token_ids (streamed: the prompt's in a choice's first chunk, each chunk's new tokens)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(CompletionResponse):
    """One SSE chunk: choices carry text deltas; the optional last chunk has no choices and the usage."""
