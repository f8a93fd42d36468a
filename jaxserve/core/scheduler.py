"""Continuous batching with a per-step token budget (pure Python; no jax).

Each step: the running sequences go first (one token for a decode, the rest of a prompt chunk otherwise),
then waiting ones are admitted in (priority, arrival) order while the token budget, the sequence limit and
the KV blocks allow. A prompt longer than the budget is prefilled in chunks across steps, so decodes never
stall behind it. When blocks run out, the latest-arrived running sequence is preempted by recompute: its
blocks are freed and it goes back to the waiting queue, keeping its generated tokens.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ..config import SchedulerConfig
from .adapter_slots import AdapterSlots
from .block_manager import BlockManager
from .request import PLACEHOLDER, Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first token position computed this step
    num_tokens: int
    samples: bool = False  # the chunk reaches the sequence's last token, so the step samples its next one

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> "ScheduledChunk":
        start = seq.num_computed_tokens
        return cls(seq, start, num_tokens, samples=start + num_tokens == seq.num_tokens)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, adapters: AdapterSlots | None = None):
        self.config = config
        self.blocks = block_manager
        self.adapters = adapters or AdapterSlots(0)  # LoRA slots; without LoRA no sequence names an adapter
        self.waiting: list[Sequence] = []  # kept sorted by (priority, arrival)
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.order)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.pending_index is not None and seq.reaches_length_limit(seq.num_tokens):
                i += 1  # its token in flight is its last: it finishes when that step is read back
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.allocate(seq.seq_id, seq.num_computed_tokens + n):
                victim = self.running[-1]  # the lowest priority, latest arrival: not scheduled yet this step
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.chunks.append(ScheduledChunk.of(seq, n))
                budget -= n
                i += 1
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        i = 0  # the next waiting sequence to try: one whose LoRA adapter finds no slot is passed over
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[i]
            if not self.adapters.admit(seq):
                i += 1
                continue
            # A request asking for prompt logprobs must compute every prompt position, so it takes no cache hits.
            if seq.num_computed_tokens == 0 and seq.params.prompt_logprobs is None:
                seq.num_computed_tokens = self.blocks.match_prefix(seq.seq_id, seq.token_ids, seq.cache_root)
                seq.num_cached_tokens = max(seq.num_cached_tokens, min(seq.num_computed_tokens, seq.num_prompt_tokens))
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.allocate(seq.seq_id, seq.num_computed_tokens + n):
                self.blocks.free(seq.seq_id)  # give back what the prefix match took; retry next step
                seq.num_computed_tokens = 0
                return
            self.waiting.pop(i)
            seq.status = SequenceStatus.RUNNING
            # Running sequences stay in (priority, arrival) order too: they are scheduled in that order and the
            # last one is the preemption victim, so a victim is never one already scheduled in this step.
            bisect.insort(self.running, seq, key=lambda s: s.order)
            out.chunks.append(ScheduledChunk.of(seq, n))
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed_tokens = 0
        self.num_preemptions += 1
        self.add(seq)

    def advance(self, out: SchedulerOutput) -> None:
        """Account for a step as it is dispatched: its tokens count as computed, and each sampling sequence gets
        a PLACEHOLDER for the token the step will sample, so the next step can be scheduled before this one's
        tokens are read back (async scheduling). `resolve` fills the placeholders in."""
        for row, chunk in enumerate(out.chunks):
            seq = chunk.seq
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            # Full blocks of known tokens join the prefix cache now, not when the step is read back: a step that
            # reuses them is dispatched later, so the device runs it after this one has written them.
            known = seq.num_computed_tokens if seq.pending_index is None else seq.pending_index
            self.blocks.commit(seq.seq_id, seq.token_ids, min(seq.num_computed_tokens, known), seq.cache_root)
            if chunk.samples:
                seq.pending_index, seq.pending_row = seq.num_tokens, row
                seq.token_ids.append(PLACEHOLDER)

    def resolve(self, out: SchedulerOutput, sampled: list[int | None]) -> list[tuple[Sequence, int]]:
        """Account for a step's results, steps in dispatch order: register its now-computed blocks, put each
        sampled token in its placeholder's place, stop what is done. Returns (sequence, token, row of the step)
        for each sequence that received a token."""
        progressed = []
        for row, (chunk, token) in enumerate(zip(out.chunks, sampled)):
            seq = chunk.seq
            if seq.finished:  # aborted or stopped while the step ran
                continue
            computed = chunk.start + chunk.num_tokens
            if seq.status is SequenceStatus.RUNNING:  # not preempted since: it still holds its blocks
                self.blocks.commit(seq.seq_id, seq.token_ids, computed, seq.cache_root)
            if not chunk.samples:
                continue
            seq.token_ids[computed] = token
            if seq.pending_index == computed:  # no later step holds a placeholder of this sequence
                seq.pending_index = seq.pending_row = None
            progressed.append((seq, token, row))
            stop = seq.stop_after(token, computed)
            if stop is not None:
                self.finish(seq, *stop)
        return progressed

    def update(self, out: SchedulerOutput, sampled: list[int | None]) -> list[Sequence]:
        """`advance` then `resolve`: a step whose results are read back before the next is scheduled."""
        self.advance(out)
        return [seq for seq, _, _ in self.resolve(out, sampled)]

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        if seq.finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.seq_id)
        self.adapters.release(seq)
        if seq.pending_index is not None:  # the token of a step still in flight will not be part of it
            del seq.token_ids[seq.pending_index :]
            seq.pending_index = seq.pending_row = None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
