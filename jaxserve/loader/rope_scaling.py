"""RoPE scalings whose numbers the loader works out from a few config values (HF config.json or GGUF metadata):
YaRN's per-frequency factors, and the default logit scales of YaRN and LongRoPE, as transformers computes them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxserve.config import RopeScaling


def longrope_attention_factor(factor: float, original_len: int) -> float:
    """LongRoPE's default cos/sin scale for a context extended `factor` times past `original_len`."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original_len))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's cos/sin scale for a context extended `factor` times: 0.1 mscale ln(factor) + 1."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_scaling(width: int, theta: float, factor: float, original: int, attention_factor: float | None = None,
                 **ramp: Any) -> RopeScaling:
    """YaRN as per-frequency factors, with its default logit scale 0.1 ln(factor) + 1 (static, as in transformers
    and vLLM: applied at every length)."""
    if attention_factor is None:
        attention_factor = yarn_mscale(factor)
    return RopeScaling(factor=factor, original_max_position_embeddings=original, rope_type="frequency_factors",
                       frequency_factors=yarn_frequency_factors(width, theta, factor, original, **ramp),
                       attention_factor=float(attention_factor))


def yarn_frequency_factors(rope_width: int, theta: float, factor: float, original_len: int, beta_fast: float = 32.0,
                           beta_slow: float = 1.0, truncate: bool = True) -> tuple[float, ...]:
    """YaRN (Qwen2.5/Qwen3 long context) as per-frequency divisors: frequencies that turn more than `beta_fast`
    times over the original context keep their speed, those turning fewer than `beta_slow` times are divided by
    `factor`, and a linear ramp over frequency indices blends the two between."""
    def index_turning(turns: float) -> float:  # the frequency index whose wave turns `turns` times in original_len
        return rope_width * math.log(original_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = index_turning(beta_fast), index_turning(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_width - 1)
    ramp = np.clip((np.arange(rope_width // 2) - low) / max(high - low, 0.001), 0.0, 1.0)  # 0: keep, 1: divide
    return tuple((1.0 / ((1 - ramp) + ramp / factor)).tolist())
