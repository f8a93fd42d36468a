"""Paged KV-cache block manager with automatic prefix caching (vLLM v1 style). Pure Python, no jax.

Every usable block is in exactly one state:
  free       on the free list, holds nothing worth keeping;
  evictable  refcount 0 but its KV is cached under a hash, kept in an LRU until someone needs the space;
  referenced refcount > 0, in the block table of one or more sequences (> 1 when a cached prefix is shared).
Block 0 is the null block: padding tokens write their KV there, so it is never handed out.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

NULL_BLOCK = 0
# The parent hash of a sequence's first block, unless its KV differs for equal tokens (a LoRA adapter's
# sequences chain from their adapter's root: Sequence.cache_root).
ROOT_HASH = b""


def hash_block(parent_hash: bytes, block_token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: equal only when the whole prefix up to and including the block is equal.

    sha256 rather than Python's hash(): a collision would silently serve another prompt's KV.
    """
    tokens = np.asarray(block_token_ids, dtype=np.int64).tobytes()
    return hashlib.sha256(parent_hash + tokens).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Prompt tokens looked up in the prefix cache and those found, counted once a request is admitted with
        # them (record_lookup), as vLLM counts: a lookup retried until the cache has room counts once
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

        self._refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # first = least recently freed
        self._block_hash: dict[int, bytes] = {}  # cached block -> its hash
        self._cached: dict[bytes, int] = {}  # hash -> cached block
        self._tables: dict[int, list[int]] = {}  # seq_id -> block table
        # seq_id -> hashes of the sequence's full, committed blocks (kept even for duplicates that are not
        # cached themselves, because the next block's hash chains from them).
        self._seq_hashes: dict[int, list[bytes]] = {}

    # ---- capacity ----------------------------------------------------------------------------------

    @property
    def total_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.total_blocks

    def num_blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Additional blocks allocate(seq_id, num_tokens) would take."""
        blocks_for_tokens = -(-num_tokens // self.block_size)
        return max(0, blocks_for_tokens - len(self._tables.get(seq_id, ())))

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        return self.num_blocks_needed(seq_id, num_tokens) <= self.num_free_blocks

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block table ([] for an unknown sequence)."""
        return list(self._tables.get(seq_id, ()))

    # ---- allocation --------------------------------------------------------------------------------

    def match_prefix(self, seq_id: int, token_ids: Sequence[int], root: bytes = ROOT_HASH) -> int:
        """Reuse the longest cached chain of full blocks matching the start of token_ids.

        The sequence must hold no blocks yet. Returns the number of tokens covered, a multiple of block_size,
        and always leaves at least one token to compute (the step needs it to produce logits).
        """
        if not self.enable_prefix_caching:
            return 0
        if self._tables.get(seq_id):
            raise ValueError(f"match_prefix needs a sequence without blocks; seq {seq_id} already has some")
        max_blocks = (len(token_ids) - 1) // self.block_size
        blocks, hashes = self._find_cached_chain(token_ids, max_blocks, root)
        for block in blocks:
            self._take_reference(block)
        self._tables[seq_id] = blocks
        self._seq_hashes[seq_id] = hashes
        return len(blocks) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Grow the sequence's table to hold num_tokens tokens; on shortage change nothing and return False."""
        needed = self.num_blocks_needed(seq_id, num_tokens)
        if needed > self.num_free_blocks:
            return False
        table = self._tables.setdefault(seq_id, [])
        self._seq_hashes.setdefault(seq_id, [])
        for _ in range(needed):
            block = self._pop_free_block()
            self._refcount[block] = 1
            table.append(block)
        return True

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed_tokens: int, root: bytes = ROOT_HASH) -> None:
        """Register the sequence's newly full blocks (KV computed for the first num_computed_tokens) in the cache.

        When another block already caches the same hash, that mapping is kept and this block stays uncached.
        """
        if not self.enable_prefix_caching:
            return
        table = self._tables[seq_id]
        hashes = self._seq_hashes[seq_id]
        num_full_blocks = min(num_computed_tokens, len(token_ids)) // self.block_size
        if num_full_blocks > len(table):
            raise ValueError(
                f"seq {seq_id}: {num_computed_tokens} computed tokens need {num_full_blocks} blocks, "
                f"but it holds {len(table)}"
            )
        for index in range(len(hashes), num_full_blocks):
            start = index * self.block_size
            parent = hashes[-1] if hashes else root
            block_hash = hash_block(parent, token_ids[start : start + self.block_size])
            hashes.append(block_hash)
            if block_hash not in self._cached:
                self._cached[block_hash] = table[index]
                self._block_hash[table[index]] = block_hash

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references; blocks nobody holds become free or evictable."""
        table = self._tables.pop(seq_id, [])
        self._seq_hashes.pop(seq_id, None)
        # Tail first: the LRU then evicts a sequence's tail before its prefix, which others are likelier to share.
        for block in reversed(table):
            self._refcount[block] -= 1
            if self._refcount[block] > 0:
                continue
            if block in self._block_hash:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after new weights are loaded); evictable blocks become free.

        Running sequences keep their blocks; their hash chains no longer match anything cached.
        """
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._block_hash.clear()
        self._cached.clear()
        return True

    # ---- internals ---------------------------------------------------------------------------------

    def _find_cached_chain(self, token_ids: Sequence[int], max_blocks: int,
                           root: bytes) -> tuple[list[int], list[bytes]]:
        blocks: list[int] = []
        hashes: list[bytes] = []
        parent = root
        for index in range(max_blocks):
            start = index * self.block_size
            parent = hash_block(parent, token_ids[start : start + self.block_size])
            block = self._cached.get(parent)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
        return blocks, hashes

    def _take_reference(self, block: int) -> None:
        if self._refcount[block] == 0:
            # An evictable block comes back into use; it must no longer be a candidate for eviction.
            del self._evictable[block]
        self._refcount[block] += 1

    def _pop_free_block(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        del self._cached[self._block_hash.pop(block)]
        return block

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests)."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is on the free list twice"
        referenced = {b for b in range(1, self.num_blocks) if self._refcount[b] > 0}
        assert NULL_BLOCK not in free | evictable | referenced, "the null block was handed out"
        assert not (free & evictable or free & referenced or evictable & referenced), "a block is in two states"
        assert free | evictable | referenced == set(range(1, self.num_blocks)), "a block is lost"
        holders = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                holders[block] += 1
        assert holders == self._refcount, "refcounts differ from the block tables"
        assert all(b in self._block_hash for b in evictable), "an evictable block has no hash"
        assert not any(b in self._block_hash for b in free), "a free block still has a hash"
        assert {self._cached[h]: h for h in self._cached} == self._block_hash, "hash maps disagree"
