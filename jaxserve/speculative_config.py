"""Speculative decoding settings, as vLLM's `speculative_config` spells them (host side, no jax).

Only the n-gram ("prompt lookup") method is served: it drafts from the sequence's own tokens, so it needs no
second model and suits outputs that copy from their input (summaries, code edits, extraction, RAG answers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_NGRAM_NAMES = ("ngram", "[ngram]")  # vLLM once took the method as the draft "model" name
_VLLM_ONLY = ("eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "deepseek_mtp", "mtp", "suffix")
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    method: str = "ngram"

    @classmethod
    def from_dict(cls, options: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """vLLM's dict (`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}`) -> config;
        ValueError naming the bad key or value. A lookup bound left out takes the other's value; both left out
        are 5, vLLM's defaults."""
        if options is None or isinstance(options, SpeculativeConfig):
            return options
        if not isinstance(options, dict):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}}, got {type(options).__name__}")
        unknown = sorted(set(options) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(unknown)}; known: {', '.join(_KEYS)}")
        method = options.get("method") or options.get("model")
        if method not in _NGRAM_NAMES:
            hint = " (a draft-model method vLLM has)" if method in _VLLM_ONLY else ""
            raise ValueError(f"speculative_config method {method!r}{hint} is not supported; jaxserve drafts with "
                             "method 'ngram' (prompt lookup)")
        if "num_speculative_tokens" not in options:
            raise ValueError("speculative_config needs num_speculative_tokens, the tokens drafted per step (e.g. 4)")
        low, high = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
        low, high = (5, 5) if low is None and high is None else (low or high, high or low)
        for name, value in (("num_speculative_tokens", options["num_speculative_tokens"]),
                            ("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min={low} exceeds prompt_lookup_max={high}")
        return cls(options["num_speculative_tokens"], low, high)
