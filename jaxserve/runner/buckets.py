"""Compile buckets: every step's arrays are padded up to one of a short, explicit list of sizes, so the set of
compiled programs is bounded and known in advance (warm-up compiles all of it). No jax, no numpy."""

from __future__ import annotations

from dataclasses import dataclass


def geometric(lo: int, hi: int, factor: int) -> tuple[int, ...]:
    """lo, lo*factor, ... below hi, then hi itself (always a bucket)."""
    sizes, n = [], lo
    while n < hi:
        sizes.append(n)
        n *= factor
    sizes.append(hi)
    return tuple(sizes)


def round_up(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest compile bucket {buckets[-1]}")


@dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...]  # T: tokens in a step
    seqs: tuple[int, ...]  # B: sequences in a step, and its sampler rows (one per sequence and draft token)

    @classmethod
    def for_limits(cls, max_num_batched_tokens: int, max_num_seqs: int, extra: tuple[int, ...] = (),
                   rows_per_seq: int = 1) -> "Buckets":
        """`extra`: sizes steps often have that the geometric series would pad (speculative decoding's 1 + k
        tokens of a single stream). `rows_per_seq`: sampler rows a sequence may take (speculative decoding's 1 + k:
        every sequence may draft k tokens, however few sequences a step may hold)."""
        max_seqs = min(max_num_seqs * rows_per_seq, max_num_batched_tokens)
        # Small sequence counts grow by 4x: padding rows cost little (a block-table row and an LM-head row each).
        # Tokens grow by 2x from 16, which keeps prefill padding under half.
        wide = geometric(16, max_num_batched_tokens, 2) if max_num_batched_tokens > 16 else (max_num_batched_tokens,)
        extra = {n for n in extra if n <= max_seqs}
        tokens = tuple(sorted(set(geometric(1, max_seqs, 4)) | set(wide) | extra))
        # Every token bucket up to max_seqs is also a sequence bucket: then a step's B never rounds past its T (a
        # step has at least one token per sequence), so every step's (T, B) is one warm-up compiled, and a
        # decode-only step gets T == B instead of paying for padding tokens.
        return cls(tokens=tokens, seqs=tuple(t for t in tokens if t <= max_seqs))

    def shape(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        return round_up(num_tokens, self.tokens), round_up(num_seqs, self.seqs)

    def forward_shapes(self) -> list[tuple[int, int]]:
        """Every (T, B) a step can have; pairs with more sequences than tokens cannot occur."""
        return [(t, b) for t in self.tokens for b in self.seqs if b <= t]
