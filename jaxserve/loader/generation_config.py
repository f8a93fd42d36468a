"""The sampling defaults requests inherit: a generation_config.json's sampling fields (as vLLM reads them), chosen
and overridden as vLLM's `--generation-config` and `--override-generation-config` say."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from jaxserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# generation_config.json's output limit. As in vLLM it becomes "max_tokens" in the defaults: a cap. An unset
# max_tokens gets the room left in the context or the cap, whichever is less (engine_inputs.validate_lengths);
# over HTTP an explicit one is capped too (server/protocol.py).
MAX_NEW_TOKENS = "max_new_tokens"
GENERATION_CONFIG_SOURCES = ("auto", "vllm")  # or a directory holding a generation_config.json


def sampling_defaults(generation: dict[str, Any], source: Path) -> dict[str, Any]:
    """The sampling fields of a generation_config.json that requests inherit, each checked now: a bad value in the
    model's file must not turn every request that omits the field into a 400. Nulls are skipped (HF writes
    them), a whole-number float top_k becomes an int, and a value SamplingParams refuses is dropped with a
    warning."""
    defaults = {}
    for key in (*SAMPLING_DEFAULT_KEYS, MAX_NEW_TOKENS):
        value = generation.get(key)
        if value is None:
            continue
        [(field, value)] = _as_sampling_fields({key: value}).items()
        try:
            SamplingParams(**{field: value})
        except (ValueError, TypeError) as exc:
            log.warning("ignoring %s=%r from %s: %s", key, value, source, exc)
            continue
        defaults[field] = value
    return defaults


def generation_defaults(model_defaults: dict[str, Any], generation_config: str = "auto",
                        overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The defaults requests inherit: the model's own ("auto"), none ("vllm": OpenAI's defaults, as vLLM's
    --generation-config vllm), or those of the generation_config.json in the directory named; then `overrides`
    (vLLM's --override-generation-config) over them, each checked now."""
    if generation_config == "auto":
        base = dict(model_defaults)
    elif generation_config == "vllm":
        base = {}
    else:
        base = sampling_defaults(_read(generation_config), Path(generation_config))
    return base | _as_sampling_fields(check_overrides(overrides))


def check_overrides(overrides: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's --override-generation-config, checked: sampling defaults SamplingParams accepts."""
    overrides = dict(overrides or {})
    known = (*SAMPLING_DEFAULT_KEYS, MAX_NEW_TOKENS)
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise ValueError(f"override_generation_config: {unknown[0]!r} is not a sampling default jaxserve takes from "
                         f"a generation config; give any of {', '.join(known)}")
    try:
        SamplingParams(**_as_sampling_fields(overrides))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"override_generation_config: {exc}") from None
    return overrides  # as given (max_new_tokens stays so named): it may be checked again where it is used


def _as_sampling_fields(overrides: dict[str, Any]) -> dict[str, Any]:
    """Overrides as SamplingParams fields: max_new_tokens is max_tokens, a whole-number float count an int."""
    fields = {}
    for key, value in overrides.items():
        if key in ("top_k", MAX_NEW_TOKENS) and isinstance(value, float) and value.is_integer():
            value = int(value)
        fields["max_tokens" if key == MAX_NEW_TOKENS else key] = value
    return fields


def _read(generation_config: str) -> dict[str, Any]:
    path = Path(generation_config).expanduser()
    path = path / "generation_config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"generation_config={generation_config!r} is not one of "
                         f"{', '.join(map(repr, GENERATION_CONFIG_SOURCES))} or a directory holding a "
                         "generation_config.json")
    try:
        value = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds no JSON object")
    return value
