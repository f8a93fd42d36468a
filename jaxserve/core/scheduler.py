"""Continuous batching with a per-step token budget (pure Python; no jax).

Each step: the running sequences go first (one token for a decode, the rest of a prompt chunk otherwise),
then waiting ones are admitted in (priority, arrival) order while the token budget, the sequence limit and
the KV blocks allow. A prompt longer than the budget is prefilled in chunks across steps, so decodes never
stall behind it. When blocks run out, the latest-arrived running sequence is preempted by recompute: its
blocks are freed and it goes back to the waiting queue, keeping its generated tokens.

Speculative decoding (with a proposer): a decoding sequence may also feed draft tokens, guesses of what follows
its last token; the step samples after each of them, and `resolve` keeps the drafts that match what was sampled
plus the one sample after them. Drafts only use the rows (sampled positions) that the step's sequences and the
waiting ones that could still be admitted leave free, so speculation never delays an admission.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass, field
from itertools import accumulate

from ..config import SchedulerConfig
from .adapter_slots import AdapterSlots
from .block_manager import BlockManager
from .ngram_proposer import NgramProposer
from .request import PLACEHOLDER, Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first token position computed this step
    num_tokens: int
    samples: bool = False  # the chunk reaches the sequence's last token, so the step samples its next one
    # Speculative decoding: guessed tokens fed after the sequence's last one (counted in num_tokens); the step
    # samples after each, one row apiece.
    draft: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int, draft: list[int] | None = None) -> "ScheduledChunk":
        start, draft = seq.num_computed_tokens, draft or []
        return cls(seq, start, num_tokens, samples=start + num_tokens - len(draft) == seq.num_tokens, draft=draft)

    @property
    def num_rows(self) -> int:
        """Rows it takes in the step's sampler: one, plus one per draft token."""
        return 1 + len(self.draft)

    @property
    def end(self) -> int:
        """One past the last of the sequence's own tokens it computes (drafts not counted)."""
        return self.start + self.num_tokens - len(self.draft)

    def input_ids(self) -> list[int]:
        own = self.seq.token_ids[self.start : self.start + self.num_tokens - len(self.draft)]
        return own + self.draft if self.draft else own

    def accepted(self, sampled: list[int]) -> list[int]:
        """The tokens a step's samples make final: each draft token equal to the sample before it, then the sample
        after the last of them. Sampling every position as usual and keeping a draft token only where the sample
        equals it is rejection sampling for a draft that is certain of its guess, so the tokens follow the model's
        own distribution; seeded, they are the very tokens decoding one at a time would give."""
        kept = 0
        while kept < len(self.draft) and self.draft[kept] == sampled[kept]:
            kept += 1
        return list(sampled[: kept + 1])


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Kept as chunks are added: the row layout is read several times a step, on the host's hot path.
    num_draft_tokens: int = 0

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self.num_draft_tokens += len(chunk.draft)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_rows(self) -> int:
        return len(self.chunks) + self.num_draft_tokens

    def first_rows(self) -> range | list[int]:
        """Each chunk's first row in the step's sampler (rows are laid out chunk after chunk)."""
        if not self.num_draft_tokens:
            return range(len(self.chunks))
        return [0, *accumulate(c.num_rows for c in self.chunks)][:-1]


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, adapters: AdapterSlots | None = None,
                 proposer: NgramProposer | None = None):
        self.config = config
        self.blocks = block_manager
        self.adapters = adapters or AdapterSlots(0)  # LoRA slots; without LoRA no sequence names an adapter
        self.proposer = proposer  # drafts tokens for speculative decoding; None: off
        # The step's largest sequence bucket (runner/buckets.py) bounds its sampler rows: room for every sequence's
        # drafts, as vLLM's (a step of max_num_seqs sequences may still draft k tokens each).
        rows_per_seq = 1 + (proposer.k if proposer else 0)
        self.max_rows = min(config.max_num_seqs * rows_per_seq, config.max_num_batched_tokens)
        self.waiting: list[Sequence] = []  # kept sorted by (priority, arrival)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_drafts = 0  # speculative decoding: chunks that fed drafts, their draft tokens, those accepted
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # [i]: drafts whose token i was accepted (vLLM's per-position counter): how far drafts usually hold
        self.accepted_per_position = [0] * (proposer.k if proposer else 0)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.order)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, max_seqs: int | None = None, max_tokens: int | None = None) -> SchedulerOutput:
        """The next step. `max_seqs`, `max_tokens`: at most that many sequences and tokens in it, below the
        configured limits (a pipeline whose stages stay busy across steps spreads its work over its stages'
        steps); sequences `staged` in such a pipeline are skipped."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens if max_tokens is None else max_tokens
        limit = self.config.max_num_seqs if max_seqs is None else max_seqs
        budget = self._schedule_running(out, budget, limit)
        if not out.preempted:
            self._admit_waiting(out, budget, limit)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, limit: int) -> int:
        # Rows drafts may take: those the running sequences and the admissible waiting ones leave.
        admissible = min(len(self.waiting), self.config.max_num_seqs - len(self.running))
        spare_rows = self.max_rows - len(self.running) - max(admissible, 0)
        i = 0
        while i < len(self.running) and budget > 0 and len(out.chunks) < limit:
            seq = self.running[i]
            if seq.staged or (seq.pending_index is not None and seq.reaches_length_limit(seq.num_tokens)):
                i += 1  # its next token is still being computed, or its token in flight is its last (it finishes
                continue  # when that step is read back)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            draft = self._draft(seq, min(budget - 1, spare_rows)) if n == 1 and self.proposer else []
            if draft and self.blocks.allocate(seq.seq_id, seq.num_computed_tokens + 1 + len(draft)):
                out.add(ScheduledChunk.of(seq, 1 + len(draft), draft))
                budget -= 1 + len(draft)
                spare_rows -= len(draft)
                i += 1
                continue
            while not self.blocks.allocate(seq.seq_id, seq.num_computed_tokens + n):
                victim = self.running[-1]  # the lowest priority, latest arrival: not scheduled yet this step
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.add(ScheduledChunk.of(seq, n))
                budget -= n
                i += 1
        return budget

    def _draft(self, seq: Sequence, max_len: int) -> list[int]:
        """Draft tokens for a decoding sequence, never past its max_tokens or the context; none while its last
        token is still in flight."""
        if seq.pending_index is not None:
            return []
        room = min(seq.params.max_tokens - seq.num_output_tokens, seq.max_model_len - seq.num_tokens) - 1
        draft = self.proposer.propose(seq.token_ids, min(max_len, room))
        return _fit_grammar(seq, draft) if draft and seq.matcher is not None else draft

    def _admit_waiting(self, out: SchedulerOutput, budget: int, limit: int) -> None:
        i = 0  # the next waiting sequence to try: one whose LoRA adapter finds no slot is passed over
        while (i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(out.chunks) < limit):
            seq = self.waiting[i]
            if seq.staged or not self.adapters.admit(seq):  # staged: preempted while its token is computed
                i += 1
                continue
            # A request asking for prompt logprobs must compute every prompt position, so it takes no cache hits.
            looks_up = seq.num_computed_tokens == 0 and seq.params.prompt_logprobs is None
            if looks_up:
                seq.num_computed_tokens = self.blocks.match_prefix(seq.seq_id, seq.token_ids, seq.cache_root)
                seq.num_cached_tokens = max(seq.num_cached_tokens, min(seq.num_computed_tokens, seq.num_prompt_tokens))
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.allocate(seq.seq_id, seq.num_computed_tokens + n):
                self.blocks.free(seq.seq_id)  # give back what the prefix match took; retry next step
                seq.num_computed_tokens = 0
                return
            self.waiting.pop(i)
            if looks_up and seq.num_preemptions == 0:  # counted once, at its first admission (as vLLM counts)
                self.blocks.record_lookup(seq.num_tokens, seq.num_computed_tokens)
            seq.status = SequenceStatus.RUNNING
            # Running sequences stay in (priority, arrival) order too: they are scheduled in that order and the
            # last one is the preemption victim, so a victim is never one already scheduled in this step.
            bisect.insort(self.running, seq, key=lambda s: s.order)
            out.add(ScheduledChunk.of(seq, n))
            budget -= n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def advance(self, out: SchedulerOutput) -> None:
        """Account for a step as it is dispatched: its tokens count as computed, and each sampling sequence gets
        a PLACEHOLDER for the token the step will sample, so the next step can be scheduled before this one's
        tokens are read back (async scheduling). `resolve` fills the placeholders in. Draft tokens count as
        computed only once `resolve` accepts them."""
        for row, chunk in zip(out.first_rows(), out.chunks):
            seq = chunk.seq
            seq.num_computed_tokens = chunk.end
            # Full blocks of known tokens join the prefix cache now, not when the step is read back: a step that
            # reuses them is dispatched later, so the device runs it after this one has written them.
            known = seq.num_computed_tokens if seq.pending_index is None else seq.pending_index
            self.blocks.commit(seq.seq_id, seq.token_ids, min(seq.num_computed_tokens, known), seq.cache_root)
            if chunk.samples:
                seq.pending_index, seq.pending_row = seq.num_tokens, row
                seq.token_ids.append(PLACEHOLDER)
            if chunk.draft:
                self.num_drafts += 1
                self.num_draft_tokens += len(chunk.draft)

    def _count_accepted(self, accepted: int) -> None:
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def resolve(self, out: SchedulerOutput, sampled: list[int | Tokens[int] | None],
                on_token: Callable[[Sequence, int, int], None] | None = None) -> list[tuple[Sequence, int, int]]:
        """Account for a step's results, steps in dispatch order: register its now-computed blocks, put the sampled
        tokens in place (a chunk with drafts gets a list, its rows' samples), stop what is done. `on_token(seq,
        token, row)` runs after each token's own stop checks and may finish the sequence, which drops the tokens
        after it. Returns (sequence, token, row of the step) for each token a sequence received."""
        progressed = []
        for row, chunk, tokens in zip(out.first_rows(), out.chunks, sampled):
            seq = chunk.seq
            if seq.finished:  # aborted or stopped while the step ran
                continue
            at = computed = chunk.end  # where the step's first sampled token goes
            if chunk.draft:  # read back before the next step was scheduled (engine.py), so nothing follows it
                assert seq.pending_index == at, "a step was scheduled before the drafts in flight were checked"
                tokens = chunk.accepted(tokens)
                seq.token_ids[at:] = tokens
                computed = seq.num_computed_tokens = at + len(tokens) - 1  # the accepted drafts' K/V is valid
                self._count_accepted(len(tokens) - 1)
            if seq.status is SequenceStatus.RUNNING:
                # Preempted since and admitted again (a pipeline reads a chunk back steps after dispatching it), its
                # new table holds only what was dispatched into it, all committed at dispatch (`advance`).
                self.blocks.commit(seq.seq_id, seq.token_ids, min(computed, seq.num_computed_tokens), seq.cache_root)
            if not chunk.samples:
                continue
            if not chunk.draft:
                seq.token_ids[at] = tokens
                tokens = (tokens,)
            if seq.pending_index == at:  # no later step holds a placeholder of this sequence
                seq.pending_index = seq.pending_row = None
            for i, token in enumerate(tokens):
                index = at + i
                progressed.append((seq, token, row + i))
                stop = seq.stop_after(token, index)
                if stop is not None:
                    self.finish(seq, *stop)
                if on_token is not None:
                    on_token(seq, token, row + i)
                if seq.finished:
                    del seq.token_ids[index + 1 :]
                    break
        return progressed

    def update(self, out: SchedulerOutput, sampled: list[int | Tokens[int] | None]) -> list[Sequence]:
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


def _fit_grammar(seq: Sequence, draft: list[int]) -> list[int]:
    """The part of a draft a constrained sequence can check: the tokens its grammar accepts, or, while the grammar
    waits for its start token (after reasoning), those before that token, since the rows after it would need the
    grammar's masks from its first token on. The step masks each row with the grammar after the drafts before it."""
    if seq.grammar_waits_for is not None:
        return draft[: draft.index(seq.grammar_waits_for)] if seq.grammar_waits_for in draft else draft
    return draft[: seq.matcher.validate_tokens(draft)]
