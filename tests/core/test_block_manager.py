import pytest

from jaxserve.core.block_manager import NULL_BLOCK, BlockManager

BS = 4


def make(num_blocks=9, caching=True):
    return BlockManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=caching)


def run_prompt(bm, seq_id, tokens):
    """What the scheduler does for a new prompt: match, allocate the rest, compute, commit."""
    hit = bm.match_prefix(seq_id, tokens)
    assert bm.allocate(seq_id, len(tokens))
    bm.record_lookup(len(tokens), hit)
    bm.commit(seq_id, tokens, len(tokens))
    bm.check_invariants()
    return hit


def test_capacity_properties():
    bm = make(num_blocks=9)
    assert bm.total_blocks == 8 and bm.num_free_blocks == 8 and bm.usage == 0.0
    assert bm.num_blocks_needed(1, 9) == 3
    assert bm.allocate(1, 9)
    assert bm.num_blocks_needed(1, 12) == 0 and bm.num_blocks_needed(1, 13) == 1
    assert bm.usage == pytest.approx(3 / 8)


def test_allocate_free_round_trip_restores_free_blocks():
    bm = make()
    assert bm.allocate(1, 5) and bm.allocate(2, 10)
    assert len(bm.block_table(1)) == 2 and len(bm.block_table(2)) == 3
    assert bm.allocate(1, 8)  # still fits in its two blocks
    assert len(bm.block_table(1)) == 2
    assert bm.num_free_blocks == 3
    bm.free(1)
    bm.free(2)
    bm.check_invariants()
    assert bm.num_free_blocks == 8 and bm.block_table(1) == []


def test_allocate_fails_atomically():
    bm = make(num_blocks=5)  # 4 usable
    assert bm.allocate(1, 3 * BS)
    assert not bm.can_allocate(2, 2 * BS)
    assert not bm.allocate(2, 2 * BS)
    assert bm.block_table(2) == [] and bm.num_free_blocks == 1
    assert not bm.allocate(1, 5 * BS)
    assert len(bm.block_table(1)) == 3
    bm.check_invariants()


def test_null_block_never_handed_out():
    bm = make(num_blocks=5, caching=False)
    for round_ in range(3):
        assert bm.allocate(round_, 4 * BS)
        assert NULL_BLOCK not in bm.block_table(round_)
        assert sorted(bm.block_table(round_)) == [1, 2, 3, 4]
        bm.free(round_)
    bm.check_invariants()


def test_prefix_sharing():
    bm = make()
    prefix = list(range(100, 100 + 3 * BS))
    assert run_prompt(bm, 1, prefix + [1, 2]) == 0
    assert run_prompt(bm, 2, prefix + [7, 8, 9]) == 3 * BS
    shared = bm.block_table(1)[:3]
    assert bm.block_table(2)[:3] == shared
    assert bm.block_table(2)[3] != bm.block_table(1)[3]
    assert all(bm._refcount[b] == 2 for b in shared)
    bm.free(1)
    assert all(bm._refcount[b] == 1 for b in shared)
    bm.check_invariants()


def test_match_never_covers_all_tokens():
    bm = make()
    tokens = list(range(3 * BS))
    run_prompt(bm, 1, tokens)
    bm.free(1)
    # Exactly three cached blocks, but the last token must be recomputed to get logits: two blocks reused.
    assert bm.match_prefix(2, tokens) == 2 * BS
    assert bm.match_prefix(3, tokens + [0]) == 3 * BS
    assert bm.match_prefix(4, tokens[:1]) == 0
    bm.check_invariants()


def test_match_requires_a_sequence_without_blocks():
    bm = make()
    bm.allocate(1, BS)
    with pytest.raises(ValueError, match="seq 1"):
        bm.match_prefix(1, list(range(2 * BS)))


def test_lru_evicts_least_recently_freed_first():
    bm = make(num_blocks=4)  # 3 usable
    a, b, c = ([i] * BS + [0] for i in (1, 2, 3))  # one full block each, plus a token to compute
    for seq_id, tokens in enumerate((a, b, c)):
        run_prompt(bm, seq_id, tokens[:BS])
        bm.free(seq_id)
    assert bm.num_free_blocks == 3  # all three cached and evictable
    # Re-matching `a` pulls its block out of the LRU, so it survives the evictions below.
    assert bm.match_prefix(10, a) == BS
    assert bm.allocate(11, BS)  # evicts b (freed before c)
    bm.check_invariants()
    assert bm.match_prefix(12, b) == 0
    assert bm.match_prefix(13, c) == BS
    bm.free(13)
    assert bm.allocate(14, BS)  # c was just freed again, but it is the only evictable block
    assert bm.match_prefix(15, c) == 0
    assert not bm.allocate(16, BS)
    bm.check_invariants()


def test_free_is_tail_first_so_prefix_is_evicted_last():
    bm = make(num_blocks=4)  # 3 usable
    tokens = list(range(3 * BS))
    run_prompt(bm, 1, tokens)
    first, second, third = bm.block_table(1)
    bm.free(1)
    assert bm.allocate(2, BS)
    assert bm.block_table(2) == [third]
    assert bm.match_prefix(3, tokens + [0]) == 2 * BS
    assert bm.block_table(3) == [first, second]
    bm.check_invariants()


def test_hashes_are_chained():
    bm = make()
    shared_block = [5] * BS
    run_prompt(bm, 1, [1] * BS + shared_block + [0])
    bm.free(1)
    # Same second block after a different first block: no hit at all.
    assert bm.match_prefix(2, [2] * BS + shared_block + [0]) == 0
    # A different second block after the same first block: only the first block hits.
    assert bm.match_prefix(3, [1] * BS + [6] * BS + [0]) == BS


def test_duplicate_blocks_keep_the_existing_mapping():
    bm = make()
    tokens = list(range(2 * BS)) + [0]
    # Both sequences compute the same prompt at the same time (no hit for the second either).
    assert bm.match_prefix(1, tokens) == 0 and bm.match_prefix(2, tokens) == 0
    bm.allocate(1, len(tokens))
    bm.allocate(2, len(tokens))
    bm.commit(1, tokens, len(tokens))
    bm.commit(2, tokens, len(tokens))
    bm.check_invariants()
    bm.free(2)  # its duplicate blocks are uncached: straight back to the free list
    bm.check_invariants()
    assert bm.match_prefix(3, tokens) == 2 * BS
    assert bm.block_table(3) == bm.block_table(1)[:2]


def test_commit_is_incremental_through_decode():
    bm = make()
    tokens = list(range(BS + 2))
    run_prompt(bm, 1, tokens)
    for t in range(BS):  # decode tokens one at a time until the second block is full and more
        tokens.append(50 + t)
        assert bm.allocate(1, len(tokens))
        bm.commit(1, tokens, len(tokens))
    bm.free(1)
    assert bm.match_prefix(2, tokens[: 2 * BS] + [0]) == 2 * BS
    bm.check_invariants()


def test_caching_disabled_gives_no_hits():
    bm = make(caching=False)
    tokens = list(range(3 * BS))
    assert run_prompt(bm, 1, tokens) == 0
    bm.free(1)
    assert bm.match_prefix(2, tokens + [0]) == 0
    assert bm.num_free_blocks == bm.total_blocks
    assert bm.prefix_cache_hits == 0


def test_hit_and_query_counters_count_tokens():
    bm = make()
    tokens = list(range(2 * BS + 1))
    run_prompt(bm, 1, tokens)
    run_prompt(bm, 2, tokens)
    assert bm.prefix_cache_queries == 2 * len(tokens)
    assert bm.prefix_cache_hits == 2 * BS


def test_reset_prefix_cache():
    bm = make()
    tokens = list(range(2 * BS + 1))
    run_prompt(bm, 1, tokens)
    run_prompt(bm, 2, list(range(50, 50 + 2 * BS + 1)))
    bm.free(1)
    assert bm.reset_prefix_cache()
    bm.check_invariants()
    assert bm.match_prefix(3, tokens) == 0
    bm.free(2)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.total_blocks
