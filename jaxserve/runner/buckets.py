"""Compile buckets: every step's arrays are padded up to one of a short, explicit list of sizes, so the
number of compiled programs is bounded and known in advance. (numpy-free, jax-free.)"""

from __future__ import annotations

from dataclasses import dataclass


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2lo, 4lo, ... up to and including hi (hi itself is always a bucket)."""
    sizes, n = [], lo
    while n < hi:
        sizes.append(n)
        n *= 2
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
    seqs: tuple[int, ...]  # B: sequences in a step
    blocks: tuple[int, ...]  # MB: width of the block table (context length / block_size)

    @classmethod
    def for_limits(cls, max_num_batched_tokens: int, max_num_seqs: int, max_blocks_per_seq: int) -> "Buckets":
        max_seqs = min(max_num_seqs, max_num_batched_tokens)
        return cls(
            tokens=powers_of_two(min(8, max_num_batched_tokens), max_num_batched_tokens),
            seqs=powers_of_two(1, max_seqs),
            blocks=powers_of_two(min(4, max_blocks_per_seq), max_blocks_per_seq),
        )

    def shape(self, num_tokens: int, num_seqs: int, max_blocks: int) -> tuple[int, int, int]:
        return round_up(num_tokens, self.tokens), round_up(num_seqs, self.seqs), round_up(max_blocks, self.blocks)
