"""Per-request sampling settings, with vLLM's field names and defaults.

Host-side only: imports no jax. Every invalid value raises ValueError naming the field and what it allows,
so an HTTP caller gets a sentence they can act on.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Any

# Below this temperature sampling is greedy (argmax); dividing logits by ~0 would only produce inf/nan.
GREEDY_TEMPERATURE = 1e-5
# OpenAI clamps logit_bias values to this range; larger values would swamp every other logit anyway.
LOGIT_BIAS_LIMIT = 100.0
INT32_MAX = 2**31 - 1


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but `n=True` is a caller's mistake, not a count. Integral admits numpy ints.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _require_int(name: str, value: Any) -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")


def _require_optional_int(name: str, value: Any) -> None:
    if value is not None and not _is_int(value):
        raise ValueError(f"{name} must be an integer or None, got {value!r}")


def check_truncate_prompt_tokens(value: Any) -> None:
    """vLLM's truncate_prompt_tokens: None (no truncation), -1 (to the context) or a positive count."""
    _require_optional_int("truncate_prompt_tokens", value)
    if value is not None and value != -1 and value < 1:
        raise ValueError(f"truncate_prompt_tokens must be a positive integer, -1 (as long as the context allows) or "
                         f"None, got {value}")


def _require_number(name: str, value: Any) -> float:
    # NaN would slip through every range check (all comparisons are False), so demand finite numbers.
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _require_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a boolean, got {value!r}")


def _normalise_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise ValueError("stop must not contain empty strings")
    return list(stop)


def _normalise_stop_token_ids(ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or not all(_is_int(i) for i in ids):
        raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
    return [int(i) for i in ids]


def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to bias, got {bias!r}")
    normalised = {}
    for key, value in bias.items():
        normalised[_logit_bias_token_id(key)] = _clamp_bias(key, value)
    return normalised


def _normalise_allowed_token_ids(ids: Any) -> list[int] | None:
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
        raise ValueError(f"allowed_token_ids must be a list of token ids (integers >= 0), got {ids!r}")
    if not ids:
        raise ValueError("allowed_token_ids is empty: no token could be sampled; leave it out to allow every token")
    return [int(i) for i in ids]


def _normalise_bad_words(words: Any) -> list[str]:
    if words is None:
        return []
    if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
        raise ValueError(f"bad_words must be a list of non-empty strings, got {words!r}")
    return list(words)


def _logit_bias_token_id(key: Any) -> int:
    # OpenAI JSON sends token ids as string keys ("50256"); isdigit alone also passes "²", which int() refuses.
    if _is_int(key) or (isinstance(key, str) and key.strip().isascii() and key.strip().isdigit()):
        if int(key) >= 0:
            return int(key)
    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")


def _clamp_bias(key: Any, value: Any) -> float:
    bias = _require_number(f"logit_bias[{key!r}]", value)
    return min(max(bias, -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)



KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of the constraints: `json` (a JSON schema, dict or its JSON text), `regex`, `choice` (the output
    is one of these strings), `grammar` (Lark or GBNF text), or `json_object=True` (any JSON object).
    `disable_additional_properties`: objects in the schema may hold only the properties they list (a server-wide
    setting in vLLM, per request here)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_additional_properties: bool = False
    # vLLM's whitespace and backend options, accepted so its clients work, without effect: JSON is always generated
    # on one line, and there is one backend.
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    whitespace_pattern: str | None = None
    # The request field it came from (e.g. "guided_regex"), so an invalid grammar is reported under that name.
    source: str | None = field(default=None, compare=False)
    # The grammar starts after the output's first occurrence of this token (a reasoning model's </think>, set by
    # the server's reasoning parser): the reasoning before it is free. None: from the first token.
    starts_after_token: int | None = None

    def __post_init__(self) -> None:
        chosen = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(chosen) if chosen else 'none'}")
        if not isinstance(self.disable_additional_properties, bool):
            raise ValueError(f"structured outputs disable_additional_properties must be true or false, got "
                             f"{self.disable_additional_properties!r}")
        if self.json is not None:
            schema = _schema(self.json)
            if self.disable_additional_properties:
                schema = closed_objects(schema)
            object.__setattr__(self, "json", schema)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs {name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured outputs choice must be a non-empty list of non-empty strings, got "
                                 f"{self.choice!r}")
            object.__setattr__(self, "choice", list(self.choice))
        if self.json_object not in (None, True):
            raise ValueError(f"structured outputs json_object must be true, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @property
    def name(self) -> str:
        """How errors call it: the request field it came from, else e.g. "structured outputs regex"."""
        return self.source or f"structured outputs {self.kind}"

    @classmethod
    def of(cls, value: Any, source: str | None = None) -> StructuredOutputsParams | None:
        """From None, an instance, or a dict of its fields (a request body's `structured_outputs`)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object with one of {', '.join(KINDS)}, got {value!r}")
        known = {f.name for f in fields(cls)} - {"source", "starts_after_token"}  # set by the server, not clients
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unsupported fields {', '.join(unknown)}; it takes one of "
                             f"{', '.join(KINDS)}, and options {', '.join(sorted(known - set(KINDS)))}")
        return cls(**value, source=source)


# How deep a schema's objects and arrays may nest (vLLM's bound; OpenAI allows 10 levels): compiling a grammar
# costs steeply with depth, and deeper schemas overflow the recursive walks over them.
MAX_SCHEMA_NESTING = 64


def _schema(value: Any) -> dict:
    too_deep = f"structured outputs json is nested too deeply: objects and arrays may nest at most " \
               f"{MAX_SCHEMA_NESTING} levels"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured outputs json is not valid JSON text: {e}") from None
        except RecursionError:
            raise ValueError(too_deep) from None
    if not isinstance(value, dict):
        raise ValueError(f"structured outputs json must be a JSON schema object, got {value!r}")
    level = [value]  # level by level, not recursively: the depth is what is in question
    for _ in range(MAX_SCHEMA_NESTING):
        level = [child for node in level for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
        if not level:
            return value
    raise ValueError(too_deep)


# JSON Schema's keywords whose values are subschemas: one schema, a list of them, or a map of names to them.
_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
              "contains", "propertyNames", "not", "if", "then", "else")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: dict) -> dict:
    """A copy of the schema in which every object that lists its properties and does not say otherwise has
    `additionalProperties: false` (as vLLM decides it; a bare {"type": "object"} stays free-form). The walk
    follows the keywords that hold subschemas, so a property that happens to be named "properties" is a name,
    not a keyword."""
    schema = copy.deepcopy(schema)

    def close(node: Any) -> None:
        if not isinstance(node, dict):
            return
        if ("properties" in node or "patternProperties" in node) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for key in _SUBSCHEMA:
            close(node.get(key))
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                for sub in node[key]:
                    close(sub)
        for key in _SUBSCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                for sub in node[key].values():
                    close(sub)

    close(schema)
    return schema


@dataclass
class SamplingParams:
    """How to sample one request's completions (vLLM's fields and defaults)."""

    n: int = 1
    best_of: int | None = None  # None means n
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1, normalised to 0) disables
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per generated token
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled (None: any).
    allowed_token_ids: list[int] | None = None
    # Words never generated, at the start of the text or after a space (core/token_rules.py).
    bad_words: list[str] | None = None  # normalised to a list
    # Keep only the prompt's last k tokens (-1: the most the context holds beside one generated token).
    truncate_prompt_tokens: int | None = None
    # Constrain the output to a JSON schema, regex, choice or grammar (a dict of its fields is accepted too).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_penalties()
        self._check_filters()
        self._check_lengths()
        self._check_flags()
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        self.logit_bias = _normalise_logit_bias(self.logit_bias)
        self.allowed_token_ids = _normalise_allowed_token_ids(self.allowed_token_ids)
        self.bad_words = _normalise_bad_words(self.bad_words)
        self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        if self.seed == -1:  # vLLM's spelling of "no seed": a fresh random stream each time
            self.seed = None

    def _check_counts(self) -> None:
        _require_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        _require_optional_int("best_of", self.best_of)
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        _require_optional_int("seed", self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require_optional_int(name, value)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be None or >= 0, got {value}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _require_number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if _require_number("repetition_penalty", self.repetition_penalty) <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    def _check_filters(self) -> None:
        if _require_number("temperature", self.temperature) < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        top_p = _require_number("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _require_int("top_k", self.top_k)
        if self.top_k == -1:
            self.top_k = 0  # vLLM's other spelling of "disabled"
        # The step holds top_k as int32: a larger value would fail inside the engine loop, not here.
        if not 0 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or from 1 to {INT32_MAX}, got {self.top_k}")
        if not 0.0 <= _require_number("min_p", self.min_p) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    def _check_lengths(self) -> None:
        _require_optional_int("max_tokens", self.max_tokens)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        _require_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

    def _check_flags(self) -> None:
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            _require_bool(name, getattr(self, name))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def needs_top_filter(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def constrained(self) -> bool:
        return self.structured_outputs is not None

    @property
    def needs_logprobs(self) -> bool:
        """Whether the sampled tokens' logprobs are computed: asked for, or needed to keep best_of's n best."""
        return self.logprobs is not None or self.num_sequences > self.n

    @property
    def num_sequences(self) -> int:
        """How many sequences to generate: best_of when set, else n."""
        return self.best_of if self.best_of is not None else self.n

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def clone(self) -> SamplingParams:
        """An independent copy: normalisation rebuilds the mutable fields (lists, logit_bias)."""
        return self.replace()


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams, with transformers' `early_stopping`. The search is deterministic: beams are
    ranked by the model's own logprobs (no temperature, penalties or sampling)."""

    beam_width: int
    max_tokens: int | None = 16  # None: up to the context length
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True: stop once beam_width hypotheses finished; "never": the exact bound
    temperature: float = 0.0  # vLLM's signature; as there, beams are ranked by the raw logprobs whatever it is
    include_stop_str_in_output: bool = False  # vLLM's signature; EOS is the only stop
    skip_special_tokens: bool = True

    def __post_init__(self):
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 (or None), got {self.max_tokens!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")

    constrained = False  # no grammar applies (asked as of SamplingParams by the servers' reasoning parsers)

    def candidates_per_beam(self, num_eos_ids: int) -> int:
        """How many continuations a round keeps (transformers' `beams_to_keep`): enough that beam_width live ones
        remain even if every EOS token is among the best."""
        return max(2, 1 + (0 if self.ignore_eos else num_eos_ids)) * self.beam_width

    def step_params(self, num_eos_ids: int) -> SamplingParams:
        """One round's request for one beam: a single greedy token and the top logprobs the round ranks."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=self.candidates_per_beam(num_eos_ids),
                              ignore_eos=True, skip_special_tokens=self.skip_special_tokens)


def check_beam_width(params: BeamSearchParams, eos_token_ids: tuple[int, ...], max_logprobs: int) -> None:
    """Each round ranks the top `candidates_per_beam` logprobs of every beam, which the engine must return."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    needed = params.candidates_per_beam(len(eos_token_ids))
    if needed > max_logprobs:
        raise ValueError(f"beam_width={params.beam_width} ranks {needed} logprobs per beam, above the engine's "
                         f"max_logprobs={max_logprobs}: lower beam_width or start the engine with max_logprobs "
                         f">= {needed}")
