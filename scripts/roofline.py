"""What a GPU figure is measured against, counted the way the field counts it:

- a device's rated limits (HBM bandwidth, dense bf16 FLOP/s; vendors' datasheets, no sparsity);
- the bytes one decode step reads: every layer weight, the final norm, the LM head and the KV cache it attends
  to. The input embedding table is not read, only one row of it per token, so it is left out (unless the LM
  head is tied to it: then the LM head reads all of it);
- the FLOPs of a prefill: 2 per matmul weight per token, plus causal attention's QK and PV products, plus the
  LM head on the one row each prompt samples from.

No jax here: the counts take parameter names and sizes, so a test can check them by hand on a tiny model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# device_kind (as jax reports it) -> (HBM bytes/s, dense bf16 FLOP/s). The longest matching name wins.
RATED = {
    "H200": (4.8e12, 989e12),
    "H100 80GB HBM3": (3.35e12, 989e12),  # SXM
    "H100 PCIe": (2.0e12, 756e12),
    "H100 NVL": (3.9e12, 835e12),
    "A100-SXM4-80GB": (2.039e12, 312e12),
    "A100-SXM4-40GB": (1.555e12, 312e12),
    "A100 80GB PCIe": (1.935e12, 312e12),
    "L40S": (864e9, 362e12),
    "L4": (300e9, 121e12),
    "TPU v4": (1.2e12, 275e12),
    "TPU v5 lite": (819e9, 197e12),
    "TPU v5p": (2.765e12, 459e12),
    "TPU v6 lite": (1.64e12, 918e12),
}


def rated_limits(device_kind: str) -> tuple[float, float] | None:
    """(bytes/s, bf16 FLOP/s) from the datasheet, or None for a device not in the table (CPUs among them)."""
    names = [name for name in RATED if name in device_kind]
    return RATED[max(names, key=len)] if names else None


@dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step reads, by part."""

    layer_weights: int
    final_norm: int
    lm_head: int
    kv: int
    embedding_not_read: int  # the input table a step reads one row of, left out of the total

    @property
    def total(self) -> int:
        return self.layer_weights + self.final_norm + self.lm_head + self.kv

    def describe(self) -> str:
        gb = lambda n: f"{n / 1e9:.3f} GB"  # noqa: E731
        return (f"layer weights {gb(self.layer_weights)} + final norm {self.final_norm / 1e3:.1f} kB + LM head "
                f"{gb(self.lm_head)} + KV {self.kv / 1e6:.2f} MB = {gb(self.total)} (input embedding "
                f"{gb(self.embedding_not_read)} not counted: a step reads one row of it per token)")


def decode_step_bytes(param_bytes: dict[str, int], tied_embeddings: bool, kv_bytes_per_token: float,
                      context_tokens: list[int], block_size: int) -> StepBytes:
    """`param_bytes`: bytes of each top-level parameter group ("embed", "layers", "final_norm", "lm_head"; any
    other group, a classifier say, counts as layer weights: a step reads it). `context_tokens`: each sequence's
    context in the step; the paged cache is read whole blocks at a time."""
    groups = dict(param_bytes)
    embed = groups.pop("embed", 0)
    final_norm = groups.pop("final_norm", 0)
    lm_head = embed if tied_embeddings else groups.pop("lm_head", 0)
    kv_tokens = sum(math.ceil(n / block_size) * block_size for n in context_tokens)
    return StepBytes(layer_weights=sum(groups.values()), final_norm=final_norm, lm_head=lm_head,
                     kv=round(kv_tokens * kv_bytes_per_token), embedding_not_read=0 if tied_embeddings else embed)


def prefill_flops(layer_matmul_params: int, num_layers: int, num_heads: int, head_dim: int, hidden_size: int,
                  vocab_size: int, prompt_lens: list[int]) -> float:
    """FLOPs of prefilling `prompt_lens`: 2 per layer matmul weight per token; causal attention, whose QK^T and
    PV products each cost 2 * heads * head_dim per (query, key) pair, P(P+1)/2 pairs per layer for a P-token
    prompt; the LM head once per prompt (only the last position samples)."""
    tokens = sum(prompt_lens)
    pairs = sum(p * (p + 1) // 2 for p in prompt_lens)
    return (2.0 * layer_matmul_params * tokens + 4.0 * num_layers * num_heads * head_dim * pairs
            + 2.0 * hidden_size * vocab_size * len(prompt_lens))


def is_matmul_weight(name: str, ndim: int) -> bool:
    """A layer parameter that multiplies activations (not a norm gain, a bias or a quantization scale)."""
    return ndim >= 2 and not any(part in name for part in ("norm", "scale", "bias"))
