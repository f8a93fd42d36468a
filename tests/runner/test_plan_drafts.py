"""The step inputs of a drafted chunk (runner/plan.py): one sampler row per position it samples, each with the
random stream, min_tokens bans and penalty history of that position."""

import numpy as np

from jaxserve.config import SchedulerConfig
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.request import Sequence
from jaxserve.core.scheduler import Scheduler
from jaxserve.runner.buckets import Buckets
from jaxserve.runner.plan import BAN, PlanShape, build_step_inputs
from tests.core.test_speculative_scheduling import FixedProposer

V = 1000


def drafted_step(**params):
    from jaxserve.sampling_params import SamplingParams

    blocks = BlockManager(64, 4)
    s = Scheduler(SchedulerConfig(8, 64, 64), blocks, proposer=FixedProposer([60, 61, 62]))
    other = Sequence(1, "b", 0, [7, 8], 2, SamplingParams(max_tokens=10), seed=9, arrival=0, max_model_len=64)
    seq = Sequence(0, "a", 0, [1, 2, 3, 4, 5], 5, SamplingParams(max_tokens=10, **params), seed=5, arrival=1,
                   max_model_len=64, eos_token_ids=(2,))
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
