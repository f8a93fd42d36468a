"""Turn a scheduler decision into the step's padded host arrays (numpy) and its static choices."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import chain

import jax
import numpy as np

from jaxserve.core.block_manager import BlockManager
from jaxserve.core.grammar import bitmask_width, fill_masks
from jaxserve.core.request import PLACEHOLDER
from jaxserve.core.scheduler import ScheduledChunk, SchedulerOutput
from jaxserve.core.token_rules import ALWAYS, bad_word_bans
from jaxserve.runner.attention import AttentionMetadata
from jaxserve.runner.buckets import Buckets
from jaxserve.runner.sampler import BIAS_SLOTS, SamplerFlags, SamplingTensors
from jaxserve.runner.step import StepInputs, StepStatics

# The additive bias that rules a token out (min_tokens' EOS and stop tokens, bad words): -inf, so that no penalty
# brings it back (a repetition penalty multiplies a seen token's negative logit by a factor that may be tiny).
BAN = float("-inf")


@dataclass(frozen=True)
class PlanShape:
    """The fixed parts of every step's shapes."""

    buckets: Buckets
    block_size: int
    vocab_size: int
    max_model_len: int  # penalty history width
    max_logprobs: int
    decode_kernel: bool = False  # the attention runs a decode kernel on steps of one token per sequence

    @property
    def max_blocks_per_seq(self) -> int:
        """The block-table width: blocks of the longest sequence."""
        return -(-self.max_model_len // self.block_size)


def build_step_inputs(out: SchedulerOutput, blocks: BlockManager, shape: PlanShape) -> tuple[StepInputs, StepStatics]:
    """Whole-array numpy work wherever it can be (a few operations per step, not per sequence): at 256 sequences
    a step's host work is a fifth of a GPU step, and it runs between steps (BENCHMARKS.md)."""
    chunks = out.chunks
    # B covers the sequences (block-table rows) and the sampled rows, one per chunk plus one per draft token.
    T, B = shape.buckets.shape(out.num_tokens, out.num_rows)
    decode_only = shape.decode_kernel and T == B and all(c.num_tokens == 1 for c in chunks)
    first_rows = out.first_rows()
    constrained = [(row, c) for row, c in zip(first_rows, chunks) if c.samples and c.seq.grammar_active]
    # (first sampler row, matcher, draft): a chunk's rows are masked by its grammar after the drafts before each
    grammar_rows = [(row, c.seq.matcher, c.draft) for row, c in constrained]
    allowed_rows = [(row, c) for row, c in zip(first_rows, chunks) if c.samples and c.seq.allowed_mask is not None]
    masked = bool(grammar_rows or allowed_rows)
    inputs = empty_inputs(T, B, shape, penalties=any(c.seq.params.needs_penalties for c in chunks),
                          decode_only=decode_only, constrained=masked)
    meta, bs = inputs.meta, blocks.block_size
    fed_rows, fed_from = [], []  # rows whose last token is a placeholder, sampled by the step in flight
    for row, chunk in enumerate(chunks):
        seq = chunk.seq
        table = blocks.block_table(seq.seq_id)
        meta.block_tables[row, : len(table)] = table
        if seq.pending_index is not None and seq.pending_index < chunk.start + chunk.num_tokens:
            fed_rows.append(row)
            fed_from.append(seq.pending_row)
    counts = np.fromiter((c.num_tokens for c in chunks), np.int64, len(chunks))
    N = int(counts.sum())
    ends = np.cumsum(counts)  # one past each chunk's last token in the flat batch
    rows = np.repeat(np.arange(len(chunks)), counts)
    starts = np.fromiter((c.start for c in chunks), np.int64, len(chunks))
    positions = np.arange(N) - np.repeat(ends - counts - starts, counts)
    meta.positions[:N] = positions
    meta.token_seq[:N] = rows
    meta.lora_slots[:N] = np.repeat([c.seq.lora_slot for c in chunks], counts)
    meta.slot_mapping[:N] = meta.block_tables[rows, positions // bs] * bs + positions % bs
    inputs.token_ids[:N] = list(chain.from_iterable(c.input_ids() for c in chunks))
    inputs.token_source[ends[fed_rows] - 1] = fed_from
    assert not np.any((inputs.token_ids[:N] == PLACEHOLDER) & (inputs.token_source[:N] < 0)), \
        "a placeholder token id would reach the model"
    # Each token's next token, where the sequence has one (prompt_logprobs); 0 past a sequence's last token.
    inputs.prompt_targets[:N] = list(chain.from_iterable(_next_tokens(c) for c in chunks))
    if out.num_draft_tokens:
        # Row j of a chunk with r rows samples after its token r - j from the end (a draft token, or its last).
        num_rows = np.fromiter((c.num_rows for c in chunks), np.int64, len(chunks))
        row_chunk = np.repeat(np.arange(len(chunks)), num_rows)
        row_offset = np.arange(out.num_rows) - np.repeat(first_rows, num_rows)
        inputs.logits_indices[: out.num_rows] = ends[row_chunk] - num_rows[row_chunk] + row_offset
        _fill_sampling(inputs.sampling, [chunks[i] for i in row_chunk], row_offset.tolist())
    else:  # one row per chunk, after its last token
        inputs.logits_indices[: len(chunks)] = ends - 1
        _fill_sampling(inputs.sampling, chunks, [0] * len(chunks))
    if grammar_rows:
        assert all(c.seq.pending_index is None for _, c in constrained), \
            "a grammar mask planned before the token it follows was read back"
        fill_masks(grammar_rows, inputs.sampling.allowed)
        for row, chunk in constrained:
            inputs.sampling.grammar_masked[row : row + chunk.num_rows] = True
    for row, chunk in allowed_rows:  # after the grammar's masks: a token must pass both
        inputs.sampling.allowed[row : row + chunk.num_rows] &= chunk.seq.allowed_mask
    return inputs, _statics(chunks, shape.max_logprobs, decode_only, constrained=masked)


def _next_tokens(chunk: ScheduledChunk) -> list[int]:
    following = chunk.seq.token_ids[chunk.start + 1 : chunk.start + chunk.num_tokens + 1]
    return following + [0] * (chunk.num_tokens - len(following))


def empty_inputs(T: int, B: int, shape: PlanShape, penalties: bool = False, decode_only: bool = False,
                 constrained: bool = False) -> StepInputs:
    """All-padding inputs: tokens write into the null block, rows sample greedily with no extras."""
    V = shape.vocab_size
    P = shape.max_model_len if penalties else 0
    W = bitmask_width(V) if constrained else 0
    f32 = lambda v: np.full(B, v, np.float32)  # noqa: E731
    sampling = SamplingTensors(
        temperature=f32(0.0), top_k=np.zeros(B, np.int32), top_p=f32(1.0), min_p=f32(0.0),
        seeds=np.zeros(B, np.uint32), counters=np.zeros(B, np.int32),
        bias_ids=np.full((B, BIAS_SLOTS), V, np.int32), bias_values=np.zeros((B, BIAS_SLOTS), np.float32),
        bias_after=np.full((B, BIAS_SLOTS), ALWAYS, np.int32),
        history=np.full((B, P), V, np.int32), history_is_output=np.zeros((B, P), bool),
        history_fed_pos=np.full(B, -1, np.int32), fed_row=np.zeros(B, np.int32),
        presence=f32(0.0), frequency=f32(0.0), repetition=f32(1.0), allowed=np.full((B, W), -1, np.int32),
        grammar_masked=np.zeros(B, bool),
    )
    return StepInputs(np.zeros(T, np.int32), empty_meta(T, B, shape, decode_only), np.zeros(B, np.int32), sampling,
                      np.zeros(T, np.int32), np.full(T, -1, np.int32))


def empty_meta(T: int, B: int, shape: PlanShape, decode_only: bool = False) -> AttentionMetadata:
    """All-padding metadata: every token at position 0 of row 0, written into the null block."""
    return AttentionMetadata(np.zeros(T, np.int32), np.zeros(T, np.int32), np.zeros(T, np.int32),
                             np.zeros((B, shape.max_blocks_per_seq), np.int32), np.full(T, -1, np.int32), decode_only)


def _fill(into: np.ndarray, values: np.ndarray) -> np.ndarray:
    into[tuple(slice(0, n) for n in values.shape)] = values
    return into


def padded_meta(meta: AttentionMetadata, T: int, B: int, shape: PlanShape, decode_only: bool) -> AttentionMetadata:
    """A step's metadata, built for buckets up to (T, B), padded to (T, B) as `empty_meta` pads: a pipeline tick
    runs the steps in its stages at one shape. `decode_only`: the tick's, which is False for a decode step whose
    neighbours in the pipeline are not decodes. No copy when the shape is already (T, B)."""
    if meta.decode_only != decode_only:
        meta = dataclasses.replace(meta, decode_only=decode_only)
    if (meta.positions.shape[0], meta.block_tables.shape[0]) == (T, B):
        return meta
    return jax.tree.map(_fill, empty_meta(T, B, shape, decode_only), meta)


def padded(inputs: StepInputs, T: int, B: int, shape: PlanShape, decode_only: bool) -> StepInputs:
    """A step's inputs padded to (T, B) as `empty_inputs` pads, their metadata as `padded_meta` does."""
    if inputs.meta.decode_only != decode_only:
        inputs = dataclasses.replace(inputs, meta=dataclasses.replace(inputs.meta, decode_only=decode_only))
    if (inputs.token_ids.shape[0], inputs.logits_indices.shape[0]) == (T, B):
        return inputs
    s = inputs.sampling
    empty = empty_inputs(T, B, shape, penalties=s.history.shape[1] > 0, decode_only=decode_only,
                         constrained=s.allowed.shape[1] > 0)
    return jax.tree.map(_fill, empty, inputs)


def inputs_treedef(shape: PlanShape, decode_only: bool):
    """The pytree structure of a step's inputs, which other processes receive as bare arrays: it holds the static
    `decode_only`, so a follower picks it by the step's `StepStatics.decode_only`."""
    return jax.tree_util.tree_structure(empty_inputs(1, 1, shape, decode_only=decode_only))


def bias_entries(chunk: ScheduledChunk, offset: int = 0) -> list[tuple[int, float, int]]:
    """The row's additive biases as (token, value, after): see SamplingTensors.bias_after. `offset`: how many draft
    tokens precede the position it samples."""
    seq, p = chunk.seq, chunk.seq.params
    bias = dict(p.logit_bias or {})
    if seq.num_output_tokens + offset < p.min_tokens:
        banned = list(p.stop_token_ids or []) + list(seq.eos_token_ids)  # with ignore_eos too, as vLLM bans it
        bias.update({t: BAN for t in banned})
    in_flight = []  # bans that hold only if the token in flight is `after`; a token may have a bias too
    if seq.bad_words:
        in_flight_token = seq.pending_index is not None
        for token, after in bad_word_bans(seq.bad_words, _output_tail(chunk, offset), in_flight_token):
            if after == ALWAYS:
                bias[token] = BAN
            else:
                in_flight.append((token, BAN, after))
    return [(token, value, ALWAYS) for token, value in bias.items()] + in_flight


def _output_tail(chunk: ScheduledChunk, offset: int) -> list[int]:
    """The generated tokens (and drafts before the sampled position) a bad word's prefix could match: the last
    ones only, not a copy of the whole output every step."""
    seq = chunk.seq
    end = seq.num_tokens if seq.pending_index is None else seq.pending_index
    start = max(seq.num_prompt_tokens, end - max(map(len, seq.bad_words)))
    return seq.token_ids[start:end] + chunk.draft[:offset]


def _fill_sampling(t: SamplingTensors, row_chunks: list[ScheduledChunk], offsets: list[int]) -> None:
    """One row per sampled position: `row_chunks[r]` is its chunk, `offsets[r]` the draft tokens before it. A
    row's random stream is keyed by the output position it samples (the counter), as one-at-a-time decoding
    keys it."""
    n = len(row_chunks)
    params = [c.seq.params for c in row_chunks]
    t.temperature[:n] = [p.temperature for p in params]
    t.top_p[:n] = [p.top_p for p in params]
    t.min_p[:n] = [p.min_p for p in params]
    t.top_k[:n] = [p.top_k for p in params]
    t.seeds[:n] = [c.seq.seed for c in row_chunks]  # 32 bits already (engine/inputs.sequence_seed)
    t.counters[:n] = [c.seq.num_output_tokens + j for c, j in zip(row_chunks, offsets)]
    for row, (chunk, j) in enumerate(zip(row_chunks, offsets)):
        seq, p = chunk.seq, params[row]
        if seq.pending_index is not None:  # sampled by the step in flight: the sampler reads it on the device
            t.fed_row[row] = seq.pending_row
        if chunk.samples and (p.logit_bias or seq.bad_words or p.min_tokens > seq.num_output_tokens + j):
            for slot, entry in enumerate(bias_entries(chunk, j)):
                t.bias_ids[row, slot], t.bias_values[row, slot], t.bias_after[row, slot] = entry
        if p.needs_penalties:  # over the tokens before the position it samples: the drafts before it count
            t.presence[row], t.frequency[row], t.repetition[row] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
            length = seq.num_tokens + j
            t.history[row, :length] = seq.token_ids + chunk.draft[:j] if j else seq.token_ids
            t.history_is_output[row, seq.num_prompt_tokens : length] = True
            if seq.pending_index is not None:
                t.history_fed_pos[row] = seq.pending_index
            holes = np.flatnonzero(t.history[row, :length] == PLACEHOLDER)
            assert list(holes) in ([], [seq.pending_index]), "a token the penalties cannot see (two steps in flight)"


def _statics(chunks: list[ScheduledChunk], max_logprobs: int, decode_only: bool, constrained: bool) -> StepStatics:
    sampling = [c.seq.params for c in chunks if c.samples]
    num_logprobs = max_logprobs if any(p.needs_logprobs for p in sampling) else -1
    penalties = any(c.seq.params.needs_penalties for c in chunks)
    top_filter = any(p.needs_top_filter and not p.greedy for p in sampling)
    if constrained:
        flags = SamplerFlags.for_constrained(penalties, num_logprobs)
    else:
        flags = SamplerFlags(all(p.greedy for p in sampling), top_filter, penalties, num_logprobs)
    wants_prompt_logprobs = any(c.seq.params.prompt_logprobs is not None for c in chunks)
    return StepStatics(sampler=flags, prompt_logprobs=max_logprobs if wants_prompt_logprobs else -1,
                       decode_only=decode_only, return_hidden=any(c.samples and c.seq.pooling is not None for c in chunks))
