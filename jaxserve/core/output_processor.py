"""From sampled tokens to what callers see: incremental text, stop strings, logprobs, RequestOutputs.

Host side, no jax. Text that could be the start of a stop string is held back from unfinished outputs, so a
streamed prefix is never taken back.
"""

from __future__ import annotations

from ..outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from .detokenizer import IncrementalDetokenizer, find_stop, holdback
from .request import Request, Sequence


class SequenceText:
    """The decoded text of one sequence, cut at a stop string when one appears."""

    def __init__(self, tokenizer, seq: Sequence):
        p = seq.params
        self.detok = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, p.skip_special_tokens,
                                            p.spaces_between_special_tokens)
        self.text = ""
        self.stops = p.stop or []
        self.num_tokens = 0

    def add_token(self, seq: Sequence, token: int) -> str | None:
        """Decode the new token; return the stop string it completed, if any (none within min_tokens, as vLLM)."""
        self.num_tokens += 1
        if seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str):
            # EOS or a stop token id ended it: not part of the text unless asked for, and no stop string's stop
            if seq.params.include_stop_str_in_output:
                self.detok.push([token])
                self.text = self.detok.text
            return None
        delta = self.detok.push([token])
        self.text = self.detok.text
        if not delta or not self.stops or self.num_tokens <= seq.params.min_tokens:
            return None
        found = find_stop(self.text, len(delta), self.stops)
        if found is None:
            return None
        start, stop = found
        self.text = self.text[: start + len(stop)] if seq.params.include_stop_str_in_output else self.text[:start]
        return stop

    def finish(self, seq: Sequence) -> None:
        if seq.finish_reason == "length":
            self.text = self.text + self.detok.flush()

    def visible(self, seq: Sequence) -> str:
        if seq.finished or not self.stops:
            return self.text
        return self.text[: len(self.text) - holdback(self.text, self.stops)]


def position_logprobs(detok: IncrementalDetokenizer, token: int, logprob: float, rank: int,
                      top_ids, top_logprobs, num: int) -> PositionLogprobs:
    entry = {int(token): Logprob(float(logprob), int(rank), detok.decode_token(token))}
    for r, (tid, lp) in enumerate(zip(top_ids[:num], top_logprobs[:num]), start=1):
        if int(tid) not in entry:
            entry[int(tid)] = Logprob(float(lp), r, detok.decode_token(tid))
    return entry


def record_prompt_logprobs(chunks, prompt: tuple, texts: dict[int, SequenceText]) -> None:
    """Append a step's prompt logprobs (per-token arrays over the step's flat batch) to the sequences that asked."""
    logprobs, ranks, top_ids, top_logprobs = prompt
    offset = 0
    for chunk in chunks:
        seq, num = chunk.seq, chunk.seq.params.prompt_logprobs
        if seq.finished:  # aborted while the step ran: its text is gone
            offset += chunk.num_tokens
            continue
        for i in range(chunk.num_tokens):
            target = chunk.start + i + 1  # the prompt position this token's logits predict
            if num is not None and target < seq.num_prompt_tokens and len(seq.prompt_logprobs) == target:
                t = offset + i
                seq.prompt_logprobs.append(position_logprobs(texts[seq.seq_id].detok, seq.token_ids[target],
                                                             logprobs[t], ranks[t], top_ids[t], top_logprobs[t], num))
        offset += chunk.num_tokens


def request_output(req: Request, texts: dict[int, SequenceText]) -> RequestOutput:
    seqs = req.sequences
    n = req.params.n
    if len(seqs) > n:  # best_of: keep the n most likely samples, known only once all are done
        seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:n] if req.finished else []
    outputs = [
        CompletionOutput(
            index=i,
            text=texts[s.seq_id].visible(s),
            token_ids=list(s.output_token_ids),
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
            logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
            cumulative_logprob=s.cumulative_logprob if s.params.needs_logprobs else None,
        )
        for i, s in enumerate(seqs)
    ]
    first = req.sequences[0]
    return RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=list(first.prompt_token_ids),
        outputs=outputs,
        finished=req.finished,
        prompt_logprobs=list(first.prompt_logprobs) if req.params.prompt_logprobs is not None else None,
        num_cached_tokens=first.num_cached_tokens,
    )
