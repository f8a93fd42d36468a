"""The step inputs of a drafted chunk (runner/plan.py): one sampler row per position it samples, each with the
random stream, min_tokens bans and penalty history of that position."""

import numpy as np

from jaxserve.config import SchedulerConfig
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.request import Sequence
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.token_rules import ALWAYS, allowed_bitmask
from jaxserve.runner.buckets import Buckets
from jaxserve.runner.plan import BAN, PlanShape, build_step_inputs
from tests.core.test_speculative_scheduling import FixedProposer

V = 1000


def drafted_step(bad_words=(), allowed_mask=None, **params):
    from jaxserve.sampling_params import SamplingParams

    blocks = BlockManager(64, 4)
    s = Scheduler(SchedulerConfig(8, 64, 64), blocks, proposer=FixedProposer([60, 61, 62]))
    other = Sequence(1, "b", 0, [7, 8], 2, SamplingParams(max_tokens=10), seed=9, arrival=0, max_model_len=64)
    seq = Sequence(0, "a", 0, [1, 2, 3, 4, 5], 5, SamplingParams(max_tokens=10, **params), seed=5, arrival=1,
                   max_model_len=64, eos_token_ids=(2,), bad_words=bad_words, allowed_mask=allowed_mask)
    for q in (other, seq):
        s.add(q)
    s.update(s.schedule(), [40, 50])  # both prompts' steps: other samples 40, seq samples 50
    out = s.schedule()
    assert [c.draft for c in out.chunks] == [[60, 61, 62], [60, 61, 62]]
    return build_step_inputs(out, blocks, PlanShape(Buckets.for_limits(64, 8), 4, V, 64, 5))[0]


def test_rows_sample_after_each_draft_with_their_own_position():
    inputs = drafted_step(min_tokens=3, repetition_penalty=1.2)
    # chunk 0 (other): tokens 40 60 61 62 at flat 0..3; chunk 1 (seq): 50 60 61 62 at flat 4..7; a row each.
    assert inputs.token_ids[:8].tolist() == [40, 60, 61, 62, 50, 60, 61, 62]
    assert inputs.logits_indices[:8].tolist() == list(range(8))
    t = inputs.sampling
    assert t.counters[:8].tolist() == [1, 2, 3, 4, 1, 2, 3, 4]  # the output position each row samples
    assert t.seeds[:8].tolist() == [9] * 4 + [5] * 4
    # min_tokens=3 bans EOS (2) for outputs 1 and 2, not 3 and 4.
    banned = [bool(np.any((t.bias_ids[r] == 2) & (t.bias_values[r] == BAN))) for r in range(4, 8)]
    assert banned == [True, True, False, False]
    # Each penalised row's history: the sequence so far and the drafts before its position.
    for j in range(4):
        length = 6 + j
        assert t.history[4 + j, :length].tolist() == [1, 2, 3, 4, 5, 50, 60, 61, 62][:length]
        assert (t.history[4 + j, length:] == V).all()
        assert t.history_is_output[4 + j].tolist() == [False] * 5 + [True] * (1 + j) + [False] * (64 - 6 - j)


def test_bad_words_and_allowed_tokens_follow_the_drafts_before_each_row():
    mask = allowed_bitmask([60, 61, 62, 99], V)
    t = drafted_step(bad_words=((50, 60, 99), (61, 98)), allowed_mask=mask).sampling
    bans = [t.bias_ids[r][t.bias_values[r] == BAN].tolist() for r in range(4, 8)]
    # seq's rows sample after 50 | 50 60 (bans 99) | 50 60 61 (bans 98) | 50 60 61 62; nothing is in flight.
    assert bans == [[], [99], [98], []]
    assert (t.bias_after[4:8] == ALWAYS).all()
    assert (t.allowed[4:8] == mask).all() and (t.allowed[:4] == -1).all()


def test_a_constrained_rows_masks_follow_the_drafts_before_them(smol_tokenizer):
    """Each drafted row of a constrained sequence is masked by its grammar after the drafts before that row (the
    matcher is left as it was); a draft is cut where the grammar would refuse it."""
    from jaxserve.core.grammar import GrammarCompiler, bitmask_width
    from jaxserve.sampling_params import SamplingParams, StructuredOutputsParams
    tokenizer = smol_tokenizer
    vocab = len(tokenizer)
    grammar = GrammarCompiler(tokenizer, vocab, (tokenizer.eos_token_id,))
    matcher = grammar.matcher(StructuredOutputsParams(choice=["yes please", "no thanks"]))
    yes = tokenizer.encode("yes please")
    refused = tokenizer.encode("no")[0]  # after "yes", the grammar refuses it
    blocks = BlockManager(64, 4)
    s = Scheduler(SchedulerConfig(8, 64, 64), blocks, proposer=FixedProposer(yes[1:] + [refused]))
    seq = Sequence(0, "a", 0, [1, 2, 3], 3, SamplingParams(max_tokens=10), seed=5, arrival=0, max_model_len=64)
    seq.matcher = matcher
    s.add(seq)
    s.update(s.schedule(), [yes[0]])
    assert matcher.consume_token(yes[0])  # as the engine does with a sampled token
    out = s.schedule()
    assert out.chunks[0].draft == yes[1:]
    inputs = build_step_inputs(out, blocks, PlanShape(Buckets.for_limits(64, 8), 4, vocab, 64, 5))[0]
    reference = matcher.deep_copy()
    for i, token in enumerate([*yes[1:], None]):
        expected = np.full((1, bitmask_width(vocab)), -1, np.int32)
        grammar_mask(reference, expected)
        assert np.array_equal(inputs.sampling.allowed[i], expected[0]), f"row {i}"
        if token is not None:
            assert reference.consume_token(token)
    assert matcher.validate_tokens(yes[1:]) == len(yes) - 1  # rolled back: the drafts can still follow


def grammar_mask(matcher, out: np.ndarray) -> None:
    import llguidance.numpy

    llguidance.numpy.fill_next_token_bitmask(matcher, out, 0)


def test_a_ban_that_depends_on_the_token_in_flight_names_it_and_where_it_is():
    """Async scheduling: the next step is planned while the token before it is on the device (row 1 of the
    step in flight); a bad word that token may begin is banned only if it does (SamplingTensors.bias_after)."""
    from jaxserve.sampling_params import SamplingParams

    blocks = BlockManager(64, 4)
    s = Scheduler(SchedulerConfig(8, 64, 64), blocks)
    other = Sequence(1, "b", 0, [7, 8], 2, SamplingParams(max_tokens=10), seed=9, arrival=0, max_model_len=64)
    seq = Sequence(0, "a", 0, [1, 2, 3], 3, SamplingParams(max_tokens=10), seed=5, arrival=1, max_model_len=64,
                   bad_words=((5,), (50, 99), (40, 50, 98)))
    for q in (other, seq):
        s.add(q)
    s.advance(s.schedule())  # both prompts dispatched: seq's first token is in flight, in row 1
    assert seq.pending_row == 1
    t = build_step_inputs(s.schedule(), blocks, PlanShape(Buckets.for_limits(64, 8), 4, V, 64, 5))[0].sampling
    row = 1
    bans = {(int(token), int(after)) for token, value, after in zip(t.bias_ids[row], t.bias_values[row],
                                                                     t.bias_after[row]) if value == BAN}
    assert bans == {(5, ALWAYS), (99, 50)} and t.fed_row[row] == 1
    assert not (t.bias_values[0] == BAN).any()  # the other sequence has no bad words
