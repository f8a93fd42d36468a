"""Speculative decoding on the host: the n-gram proposer, the settings, and the scheduler's draft bookkeeping
(pure Python, no jax). The device side is checked end to end in tests/engine/test_speculative.py."""

import pytest

from jaxserve.config import SchedulerConfig, SpeculativeConfig
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.ngram_proposer import NgramProposer
from jaxserve.core.request import Sequence
from jaxserve.core.scheduler import Scheduler
from jaxserve.sampling_params import SamplingParams


def test_proposer_continues_the_longest_recurring_ngram():
    p = NgramProposer(3, 1, 3)
    #              0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 3, 9, 9, 2, 3, 4, 1, 2, 3]
    # The 3-gram (1, 2, 3) recurs at 1 and is followed by 9 9 2; the 2-gram (2, 3) at 6 would give 4 1 2.
    assert p.propose(tokens, 10) == [9, 9, 2]
    assert p.propose(tokens, 2) == [9, 9]  # the caller's limit
    assert NgramProposer(3, 2, 2).propose(tokens, 10) == [4, 1, 2]  # only 2-grams: the latest occurrence
    assert p.propose([1, 2, 3, 4], 10) == []  # nothing recurs
    assert p.propose(tokens, 0) == []


def test_proposer_in_a_short_loop_drafts_a_whole_draft():
    # In "7 8 7 8 7 8" the latest occurrence of (7, 8) is followed by one token only; an earlier one by more.
    assert NgramProposer(4, 2, 2).propose([7, 8, 7, 8, 7, 8], 10) == [7, 8, 7, 8]


def test_config_takes_vllms_spelling_and_names_what_is_wrong():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 3, 3)
    assert SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    assert SpeculativeConfig.from_dict(None) is None
    for bad, says in (({"method": "eagle", "num_speculative_tokens": 2}, "'eagle' (a draft-model method"),
                      ({"method": "ngram"}, "needs num_speculative_tokens"),
                      ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
                       "prompt_lookup_min=4 exceeds prompt_lookup_max=2"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown key(s) draft_model"),
                      # a 0 given is refused as given, not replaced by the other bound
                      ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0, "prompt_lookup_max": 4},
                       "prompt_lookup_min must be a positive integer, got 0"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
                       "prompt_lookup_max must be a positive integer, got 0"),
                      ("ngram", "must be a dict")):
        with pytest.raises(ValueError, match=None) as e:
            SpeculativeConfig.from_dict(bad)
        assert says in str(e.value), (bad, str(e.value))


class FixedProposer:
    """Drafts `draft` (cut to the limit) for every sequence; records the limits it was given."""

    def __init__(self, draft):
        self.draft, self.limits = draft, []
        self.k = len(draft)

    def propose(self, token_ids, limit):
        self.limits.append(limit)
        return self.draft[:limit]


def seq(i, prompt, max_tokens=10, **params):
    return Sequence(i, f"r{i}", 0, list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                               **params),
                    seed=0, arrival=i, max_model_len=1000)


def make(draft, max_seqs=8, budget=64):
    blocks = BlockManager(64, 4)
    return Scheduler(SchedulerConfig(max_seqs, budget, 1000), blocks, proposer=FixedProposer(draft)), blocks


def prefill(s, a):
    s.add(a)
    s.update(s.schedule(), [50])  # the prompt's step samples token 50


def test_accepted_drafts_become_tokens_and_the_first_miss_is_replaced():
    s, blocks = make([60, 61, 62])
    a = seq(0, range(1, 8))
    prefill(s, a)
    out = s.schedule()
    (chunk,) = out.chunks
    assert (chunk.start, chunk.num_tokens, chunk.draft, chunk.input_ids()) == (7, 4, [60, 61, 62], [50, 60, 61, 62])
    assert out.num_rows == 4
    s.update(out, [[60, 61, 99, 70]])  # 60 and 61 match; the sample after 61 is 99, not the draft's 62
    assert a.output_token_ids == [50, 60, 61, 99]
    assert a.num_computed_tokens == 10  # the prompt, 50, 60 and 61 have K/V; 99 is next to compute
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (1, 3, 2)
    assert s.accepted_per_position == [1, 1, 0]  # positions 0 and 1 held, 2 missed
    assert len(blocks._seq_hashes[a.seq_id]) == 2  # blocks of computed tokens only: 10 // 4
    blocks.check_invariants()


def test_all_drafts_accepted_add_the_sample_after_the_last():
    s, _ = make([60, 61])
    a = seq(0, range(1, 5))
    prefill(s, a)
    s.update(s.schedule(), [[60, 61, 62]])
    assert a.output_token_ids == [50, 60, 61, 62] and a.num_computed_tokens == 7
    s.update(s.schedule(), [[99, 0, 0]])  # the next draft misses at once
    assert s.accepted_per_position == [1, 1] and s.num_drafts == 2


def test_drafts_never_run_past_max_tokens_and_a_stop_drops_what_follows():
    s, _ = make([60, 61, 62, 63])
    a = seq(0, range(1, 5), max_tokens=3)
    prefill(s, a)
    out = s.schedule()
    assert s.proposer.limits[-1] == 1  # 1 token so far: one draft and the sample after it make 3
    assert out.chunks[0].draft == [60]
    s.update(out, [[60, 61]])
    assert a.finished and a.finish_reason == "length" and a.output_token_ids == [50, 60, 61]

    s, blocks = make([60, 61, 62])
    b = seq(1, range(1, 5), stop_token_ids=[60])
    prefill(s, b)
    s.update(s.schedule(), [[60, 61, 62, 63]])  # 60 stops it: the accepted 61, 62, 63 are dropped
    assert b.finished and b.stop_reason == 60 and b.output_token_ids == [50, 60]
    assert blocks.num_free_blocks == blocks.total_blocks


def test_a_callback_that_stops_the_sequence_drops_the_later_tokens():
    s, _ = make([60, 61])
    a = seq(0, range(1, 5))
    prefill(s, a)
    seen = []

    def on_token(q, token, row):
        seen.append((token, row))
        if token == 60:
            s.finish(q, "stop", "a stop string")

    out = s.schedule()
    s.advance(out)
    s.resolve(out, [[60, 61, 62]], on_token)
    assert seen == [(60, 0)] and a.output_token_ids == [50, 60]


@pytest.mark.parametrize("max_seqs", [1, 4])
def test_every_sequence_has_rows_for_its_drafts(max_seqs):
    """Rows are sized 1 + k a sequence (as vLLM's), so a full batch still drafts: max_num_seqs=1 drafted nothing."""
    s, _ = make([60, 61, 62], max_seqs=max_seqs)
    a = seq(0, range(1, 5))
    prefill(s, a)
    for i in range(1, max_seqs):
        s.add(seq(i, range(10 * i, 10 * i + 4)))
    out = s.schedule()
    assert [len(c.draft) for c in out.chunks] == [3] + [0] * (max_seqs - 1) and out.num_rows == 4 + max_seqs - 1


def test_drafts_leave_rows_for_waiting_sequences():
    s, _ = make([60, 61, 62], max_seqs=4, budget=5)  # rows: at most the token budget
    a = seq(0, range(1, 5))
    prefill(s, a)
    for i in (1, 2):
        s.add(seq(i, range(10 * i, 10 * i + 1)))
    out = s.schedule()  # 5 rows: a's own, one for each waiting sequence, so two draft tokens
    assert [len(c.draft) for c in out.chunks] == [2, 0, 0] and out.num_rows == 5


class Grammar:
    """A matcher that accepts the first `valid` tokens of any draft."""

    def __init__(self, valid: int):
        self.valid = valid

    def validate_tokens(self, tokens: list[int]) -> int:
        return min(self.valid, len(tokens))


@pytest.mark.parametrize("valid, waits_for, expected", [
    (2, None, [60, 61]),  # cut where the grammar would refuse
    (0, None, []),
    (0, 61, [60]),  # waiting for its start token: drafts before it only (the grammar masks the rows after it)
    (0, 99, [60, 61, 62]),  # waiting, and the start token is not drafted: nothing to check
])
def test_drafts_under_a_grammar_keep_what_it_accepts(valid, waits_for, expected):
    s, _ = make([60, 61, 62])
    b = seq(3, range(1, 5))
    prefill(s, b)
    b.matcher, b.grammar_waits_for = Grammar(valid), waits_for
    assert s.schedule().chunks[0].draft == expected


def test_first_rows_lay_chunks_out_one_after_another():
    s, _ = make([60, 61])
    a, b = seq(0, range(1, 5)), seq(1, range(20, 24))
    s.add(a)
    s.add(b)
    s.update(s.schedule(), [50, 51])
    out = s.schedule()
    assert [c.num_rows for c in out.chunks] == [3, 3] and out.first_rows() == [0, 3]
