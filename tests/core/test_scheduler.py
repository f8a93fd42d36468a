"""Scheduler unit tests: pure Python, no jax, milliseconds."""

import subprocess
import sys

from jaxserve.config import SchedulerConfig
from jaxserve.core.block_manager import BlockManager
from jaxserve.core.request import Sequence
from jaxserve.core.scheduler import Scheduler
from jaxserve.sampling_params import SamplingParams

_ids = iter(range(10**6))


def seq(prompt_len=4, max_tokens=4, priority=0, rid=None, start=None):
    i = next(_ids)
    start = 1000 * i if start is None else start  # distinct prompts unless asked: no accidental prefix hits
    return Sequence(i, rid or f"r{i}", 0, list(range(start, start + prompt_len)), prompt_len,
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0, arrival=i, priority=priority,
                    max_model_len=1000)


def make(num_blocks=64, block_size=4, max_seqs=8, budget=64, caching=True):
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(max_seqs, budget, 1000), bm), bm


def run_step(s, token=7):
    out = s.schedule()
    s.update(out, [token if c.samples else None for c in out.chunks])
    return out


def test_host_side_imports_no_jax():
    code = ("import sys, jaxserve.core.scheduler, jaxserve.core.output_processor, jaxserve.sampling_params; "
            "assert 'jax' not in sys.modules, 'core imported jax'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prefill_then_decode_and_blocks_freed_at_the_end():
    s, bm = make()
    a = seq(prompt_len=6, max_tokens=3)
    s.add(a)
    out = run_step(s)
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(0, 6)] and out.chunks[0].samples
    assert len(bm.block_table(a.seq_id)) == 2
    run_step(s)
    run_step(s)
    assert a.finished and a.finish_reason == "length" and a.output_token_ids == [7, 7, 7]
    assert bm.num_free_blocks == bm.total_blocks
    bm.check_invariants()


def test_token_budget_chunks_long_prompts_and_keeps_decodes_going():
    s, _ = make(budget=8)
    short = seq(prompt_len=2, max_tokens=10)
    s.add(short)
    run_step(s)  # short is now decoding
    long = seq(prompt_len=20, max_tokens=2)
    s.add(long)
    chunks = []
    for _ in range(3):
        out = run_step(s)
        assert any(c.seq is short for c in out.chunks), "the decode must run in every step"
        chunks += [(c.start, c.num_tokens, c.samples) for c in out.chunks if c.seq is long]
        assert out.num_tokens <= 8
    assert chunks == [(0, 7, False), (7, 7, False), (14, 6, True)]


def test_fcfs_and_priority_order_of_admission():
    s, _ = make(max_seqs=1)
    a, b, urgent = seq(), seq(), seq(priority=-1)
    for x in (a, b, urgent):
        s.add(x)
    out = s.schedule()
    assert [c.seq for c in out.chunks] == [urgent]
    assert s.waiting == [a, b]


def test_preemption_frees_the_latest_and_resumes_it_first_with_its_tokens():
    # 3 usable blocks of 4 tokens: two sequences of 4-token prompts fit, but not once both grow past a block.
    s, bm = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq(prompt_len=4, max_tokens=6), seq(prompt_len=4, max_tokens=6)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled: 1 block each, each sampled one token
    run_step(s)  # a needs a 2nd block (ok, 3rd block), b needs one too -> preempts b (latest arrival)
    assert s.num_preemptions == 1 and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert b.output_token_ids == [7], "the preempted sequence keeps what it generated"
    late = seq(prompt_len=2)
    s.add(late)
    assert s.waiting[0] is b, "a preempted sequence goes back in front of later arrivals"
    while not a.finished:
        run_step(s)
    out = s.schedule()
    assert out.chunks[0].seq is b and out.chunks[0].num_tokens == b.num_tokens  # recompute prompt + outputs
    bm.check_invariants()


def test_prefix_cache_hit_skips_computed_blocks():
    s, bm = make(block_size=4)
    a = seq(prompt_len=10, max_tokens=1, start=0)
    s.add(a)
    run_step(s)
    assert a.finished
    b = seq(prompt_len=10, max_tokens=1, start=0)  # same tokens 0..9
    s.add(b)
    out = s.schedule()
    assert (out.chunks[0].start, out.chunks[0].num_tokens) == (8, 2)
    assert b.num_cached_tokens == 8 and bm.prefix_cache_hits == 8


def test_a_prefix_lookup_counts_once_when_its_request_is_admitted():
    """As vLLM counts them: a request that waits for room looks the cache up at every step, but its prompt is one
    query; a preempted request's lookups on readmission are not counted again."""
    s, bm = make(num_blocks=5, block_size=4)  # 4 usable blocks: 16 tokens
    a, b = seq(prompt_len=12, max_tokens=2), seq(prompt_len=8, max_tokens=1)
    s.add(a)
    s.add(b)
    for _ in range(3):  # b cannot fit beside a: it is looked up and turned away each step until a finishes
        run_step(s)
    while s.has_unfinished():
        run_step(s)
    assert a.finished and b.finished and bm.prefix_cache_queries == 12 + 8


def test_prompt_logprobs_requests_compute_every_prompt_position():
    s, bm = make(block_size=4)
    a = seq(prompt_len=10, max_tokens=1, start=0)
    s.add(a)
    run_step(s)
    b = seq(prompt_len=10, max_tokens=1, start=0)
    b.params = b.params.replace(prompt_logprobs=1)
    s.add(b)
    out = s.schedule()
    assert (out.chunks[0].start, out.chunks[0].num_tokens) == (0, 10) and bm.prefix_cache_hits == 0


def test_finish_and_abort_free_blocks():
    s, bm = make()
    a = seq(prompt_len=9)
    s.add(a)
    run_step(s)
    s.finish(a, "abort")
    assert a.finished and bm.num_free_blocks == bm.total_blocks
    assert not s.has_unfinished()


def test_a_higher_priority_arrival_never_preempts_a_sequence_already_scheduled_in_the_step():
    """Running sequences are kept in (priority, arrival) order: a priority-0 request admitted after a priority-5
    one runs first, and when blocks run out the victim is the priority-5 one, never one scheduled this step
    (which would run on an emptied block table)."""
    s, bm = make(num_blocks=5, block_size=4, budget=64)  # 4 usable blocks
    low = seq(prompt_len=5, max_tokens=50, priority=5)
    s.add(low)
    run_step(s)
    high = seq(prompt_len=7, max_tokens=50, priority=0)
    s.add(high)
    run_step(s)
    assert s.running == [high, low]
    for _ in range(6):
        out = run_step(s)
        scheduled = [c.seq for c in out.chunks]
        assert not set(out.preempted) & set(scheduled)
        assert all(bm.block_table(q.seq_id) for q in scheduled)  # every scheduled sequence holds its blocks
    assert low in out.preempted or low.status.value == "waiting"
    assert high.num_output_tokens >= 6


def test_a_chunk_read_back_after_its_sequence_came_back_from_preemption_commits_only_what_it_holds():
    """Stages busy across steps read a prompt's chunk back a few steps after it was dispatched: its sequence may
    have been preempted meanwhile and admitted again with a new, shorter block table. Reading the old chunk back
    committed its end on the new table (a ValueError out of the engine's step: 16 computed tokens need 4
    blocks, but it holds 3), or registered blocks the new table had not computed."""
    s, bm = make(num_blocks=8, block_size=4, budget=8)
    a = seq(prompt_len=24, max_tokens=2)
    s.add(a)
    first, second = s.schedule(max_tokens=8), None
    s.advance(first)  # [0, 8) in the pipeline
    second = s.schedule(max_tokens=8)
    s.advance(second)  # [8, 16) too
    s._preempt(a)  # the cache ran short: its 4 blocks freed (still cached)
    b = seq(prompt_len=20, max_tokens=2)
    s.add(b)
    s.waiting.remove(a)  # b first: it takes the 3 blocks never used and a's two last ones
    s.advance(s.schedule(max_tokens=20))
    s.finish(b, "abort")
    s.add(a)
    again = s.schedule(max_tokens=4)
    assert [(c.seq, c.start, c.num_tokens) for c in again.chunks] == [(a, 8, 4)]  # its first 8 tokens cached
    s.advance(again)
    for out in (first, second, again):
        s.resolve(out, [None] * len(out.chunks))
    assert len(bm.block_table(a.seq_id)) == 3
    bm.check_invariants()
