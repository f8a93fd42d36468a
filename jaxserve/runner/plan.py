"""Turn a scheduler decision into the step's padded host arrays (numpy) and its static choices."""

from __future__ import annotations

import numpy as np

from jaxserve.core.block_manager import BlockManager
from jaxserve.core.scheduler import SchedulerOutput
from jaxserve.runner.attention import AttentionMetadata
from jaxserve.runner.buckets import Buckets, powers_of_two, round_up
from jaxserve.runner.sampler import SamplerFlags, SamplingTensors
from jaxserve.runner.step import StepInputs, StepStatics

BAN = -1e9  # additive bias that rules a token out (min_tokens bans EOS and stop tokens)
_WIDTHS = powers_of_two(8, 1 << 20)


def _width(n: int) -> int:
    return 0 if n == 0 else round_up(n, _WIDTHS)


def build_step_inputs(out: SchedulerOutput, blocks: BlockManager, buckets: Buckets, vocab_size: int,
                      max_logprobs: int) -> tuple[StepInputs, StepStatics]:
    bs = blocks.block_size
    chunks = out.chunks
    tables = [blocks.block_table(c.seq.seq_id) for c in chunks]
    T, B, MB = buckets.shape(out.num_tokens, len(chunks), max(len(t) for t in tables))
    token_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slots = np.zeros(T, np.int32)  # padding writes into the null block
    token_seq = np.zeros(T, np.int32)
    targets = np.zeros(T, np.int32)
    block_tables = np.zeros((B, MB), np.int32)
    logits_indices = np.zeros(B, np.int32)
    offset = 0
    for row, (chunk, table) in enumerate(zip(chunks, tables)):
        seq, n = chunk.seq, chunk.num_tokens
        pos = np.arange(chunk.start, chunk.start + n)
        ids = np.asarray(seq.token_ids[chunk.start : chunk.start + n + 1], np.int32)
        table_arr = np.asarray(table, np.int32)
        token_ids[offset : offset + n] = ids[:n]
        positions[offset : offset + n] = pos
        slots[offset : offset + n] = table_arr[pos // bs] * bs + pos % bs
        token_seq[offset : offset + n] = row
        targets[offset : offset + len(ids) - 1] = ids[1:]
        block_tables[row, : len(table)] = table_arr
        logits_indices[row] = offset + n - 1
        offset += n
    meta = AttentionMetadata(positions, slots, token_seq, block_tables)
    sampling, flags = _sampling_tensors(out, B, vocab_size, max_logprobs)
    wants_prompt_logprobs = any(c.seq.params.prompt_logprobs is not None for c in chunks)
    statics = StepStatics(sampler=flags, prompt_logprobs=max_logprobs if wants_prompt_logprobs else -1)
    return StepInputs(token_ids, meta, logits_indices, sampling, targets), statics


def _bias_rows(out: SchedulerOutput) -> list[dict[int, float]]:
    rows = []
    for c in out.chunks:
        p, seq = c.seq.params, c.seq
        bias = dict(p.logit_bias or {})
        if seq.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(seq.eos_token_ids))
            bias.update({t: BAN for t in banned})
        rows.append(bias)
    return rows


def _sampling_tensors(out: SchedulerOutput, B: int, V: int, max_logprobs: int):
    chunks = out.chunks
    f32 = lambda v: np.full(B, v, np.float32)  # noqa: E731
    temperature, top_p, min_p = f32(0.0), f32(1.0), f32(0.0)
    presence, frequency, repetition = f32(0.0), f32(0.0), f32(1.0)
    top_k = np.zeros(B, np.int32)
    seeds = np.zeros(B, np.uint32)
    counters = np.zeros(B, np.int32)
    bias_rows = _bias_rows(out)
    W = _width(max((len(b) for b in bias_rows), default=0))
    bias_ids = np.full((B, W), V, np.int32)
    bias_values = np.zeros((B, W), np.float32)
    penalised = [c.seq.params.needs_penalties for c in chunks]
    P = _width(max((c.seq.num_tokens for c, pen in zip(chunks, penalised) if pen), default=0))
    history = np.full((B, P), V, np.int32)
    is_output = np.zeros((B, P), bool)
    for row, chunk in enumerate(chunks):
        seq, p = chunk.seq, chunk.seq.params
        temperature[row], top_p[row], min_p[row], top_k[row] = p.temperature, p.top_p, p.min_p, p.top_k
        seeds[row], counters[row] = seq.seed & 0xFFFFFFFF, seq.num_output_tokens
        for j, (tok, val) in enumerate(bias_rows[row].items()):
            bias_ids[row, j], bias_values[row, j] = tok, val
        if penalised[row]:
            presence[row], frequency[row], repetition[row] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
            history[row, : seq.num_tokens] = seq.token_ids
            is_output[row, seq.num_prompt_tokens : seq.num_tokens] = True
    sampling_rows = [c.seq.params for c in chunks if c.samples]
    flags = SamplerFlags(
        all_greedy=all(p.greedy for p in sampling_rows),
        top_filter=any(p.needs_top_filter and not p.greedy for p in sampling_rows),
        num_logprobs=max_logprobs if any(p.logprobs for p in sampling_rows) else 0,
    )
    tensors = SamplingTensors(temperature, top_k, top_p, min_p, seeds, counters, bias_ids, bias_values,
                              history, is_output, presence, frequency, repetition)
    return tensors, flags
