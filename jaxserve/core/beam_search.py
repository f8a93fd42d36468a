"""Beam search (vLLM's `LLM.beam_search` and the servers' `use_beam_search`), outside the engine's step.

Each round asks the engine for one token of every live beam, as an ordinary request whose prompt is the beam so
far and which returns its top logprobs; the prefix cache makes the re-sent prefix nearly free (as in vLLM). The
search itself follows transformers' `generate(num_beams=...)`, so the two agree on the same weights: every round
keeps the `beams_to_keep` best continuations over all beams by cumulative logprob; those ending in EOS (or at the
length limit) among the best `beam_width` become finished hypotheses, scored by cumulative logprob / generated
length ** length_penalty, and the best `beam_width` others go on. The search stops when no live beam can beat the
worst of `beam_width` finished ones (`early_stopping`, as transformers defines it), or at the length limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from jaxserve.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One finished beam, as vLLM returns it: `tokens` and `text` include the prompt."""

    tokens: list[int]
    logprobs: list[PositionLogprobs]  # per generated token: its own logprob and rank
    cum_logprob: float
    score: float  # cum_logprob / generated length ** length_penalty: what the beams are ranked by
    text: str = ""
    finish_reason: str = "length"  # "stop" (EOS) | "length"
    num_prompt_tokens: int = 0

    @property
    def generated_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """The best beam_width sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class _Beam:
    generated: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: np.float32 = np.float32(0.0)  # summed in float32, as transformers does, so ties break alike


@dataclass
class _Finished:
    score: np.float32
    beam: _Beam
    reason: str


class BeamSearch:
    """The search over one prompt: `prompts()` are the live beams to extend, `advance()` takes each one's top
    logprobs (in the same order), and `done` / `result()` say when it ended and what it found."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_token_ids: tuple[int, ...],
                 max_model_len: int):
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.eos_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.keep = params.candidates_per_beam(len(self.eos_ids))
        room = max_model_len - len(self.prompt_ids)
        self.max_new_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.running = [_Beam()]
        self.finished: list[_Finished] = []
        self.improvable = True

    @property
    def done(self) -> bool:
        full = len(self.finished) == self.params.beam_width
        return not self.running or not self.improvable or (self.params.early_stopping is True and full)

    def prompts(self) -> list[list[int]]:
        return [self.prompt_ids + beam.generated for beam in self.running]

    def round_requests(self, request_id: str, round_index: int) -> list[tuple[str, list[int]]]:
        """A round's engine requests, (id, prompt) per live beam: every driver names them alike."""
        return [(f"{request_id}-r{round_index}-b{beam}", prompt) for beam, prompt in enumerate(self.prompts())]

    @property
    def round_params(self) -> SamplingParams:
        """Each round request's params: one greedy token and the `keep` top logprobs the round ranks."""
        return self.params.step_params(len(self.eos_ids))

    def advance(self, top_logprobs: list[PositionLogprobs]) -> None:
        """One round: `top_logprobs[i]` holds the next-token logprobs (at least `keep` of them) of running[i]."""
        ranked = sorted(self._candidates(top_logprobs), key=lambda c: c[0], reverse=True)[:self.keep]
        generated = len(self.running[0].generated) + 1
        at_limit = generated >= self.max_new_tokens
        next_running: list[_Beam] = []
        for rank, (total, beam, token, logprob) in enumerate(ranked):
            ends = at_limit or token in self.eos_ids
            if not ends:
                if len(next_running) < self.params.beam_width:
                    next_running.append(self._extend(beam, token, logprob, total))
            elif rank < self.params.beam_width and self.improvable:  # only the best beam_width may finish
                self._add_finished(self._extend(beam, token, logprob, total), generated,
                                   "stop" if token in self.eos_ids else "length")
        self.running = next_running
        self._check_improvable(generated)

    def result(self, tokenizer) -> BeamSearchOutput:
        """The best beam_width hypotheses, best first (live beams stand in if too few finished)."""
        hypotheses = list(self.finished)
        for beam in self.running[:self.params.beam_width - len(hypotheses)]:
            hypotheses.append(_Finished(self._score(beam.cum_logprob, len(beam.generated)), beam, "length"))
        hypotheses.sort(key=lambda h: h.score, reverse=True)
        return BeamSearchOutput([self._sequence(h, tokenizer) for h in hypotheses])

    # ---- internals -------------------------------------------------------------------------------------

    def _candidates(self, top_logprobs: list[PositionLogprobs]):
        if len(top_logprobs) != len(self.running):
            raise ValueError(f"got logprobs for {len(top_logprobs)} beams, {len(self.running)} are running")
        for beam, position in zip(self.running, top_logprobs):
            best = sorted(position.items(), key=lambda item: item[1].logprob, reverse=True)[:self.keep]
            for token, entry in best:
                logprob = np.float32(entry.logprob)
                yield beam.cum_logprob + logprob, beam, token, entry

    @staticmethod
    def _extend(beam: _Beam, token: int, entry: Logprob, total: np.float32) -> _Beam:
        own = {token: Logprob(entry.logprob, entry.rank, entry.decoded_token)}
        return _Beam(beam.generated + [token], beam.logprobs + [own], total)

    def _score(self, cum_logprob: np.float32, length: int) -> np.float32:
        return np.float32(cum_logprob / np.float32(max(length, 1) ** self.params.length_penalty))

    def _add_finished(self, beam: _Beam, length: int, reason: str) -> None:
        self.finished.append(_Finished(self._score(beam.cum_logprob, length), beam, reason))
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.params.beam_width:]

    def _check_improvable(self, generated: int) -> None:
        """transformers' early-stop heuristic: can the best live beam still beat the worst finished one?"""
        if not self.running or len(self.finished) < self.params.beam_width:
            return
        length = generated
        if self.params.early_stopping == "never" and self.params.length_penalty > 0:
            length = self.max_new_tokens  # a positive penalty favours length: bound by the longest possible
        best_possible = self._score(self.running[0].cum_logprob, length)
        self.improvable = self.improvable and best_possible > self.finished[-1].score

    def _sequence(self, hypothesis: _Finished, tokenizer) -> BeamSearchSequence:
        tokens = self.prompt_ids + hypothesis.beam.generated
        text = tokenizer.decode(tokens, skip_special_tokens=self.params.skip_special_tokens)
        return BeamSearchSequence(tokens, hypothesis.beam.logprobs, float(hypothesis.beam.cum_logprob),
                                  float(hypothesis.score), text, hypothesis.reason, len(self.prompt_ids))


def top_logprobs_of(output: RequestOutput) -> PositionLogprobs:
    """A one-token round request's logprobs at its only generated position."""
    logprobs = output.outputs[0].logprobs
    if not logprobs:
        raise RuntimeError(f"beam search round {output.request_id} returned no logprobs")
    return logprobs[0]


def as_request_output(request_id: str, prompt: str | None, prompt_ids: list[int], result: BeamSearchOutput,
                      tokenizer, skip_special_tokens: bool) -> RequestOutput:
    """The search's result in the shape the servers render: one finished choice per beam, best first."""
    outputs = [CompletionOutput(index=i, text=tokenizer.decode(seq.generated_ids,
                                                               skip_special_tokens=skip_special_tokens),
                                token_ids=seq.generated_ids, finish_reason=seq.finish_reason,
                                cumulative_logprob=seq.cum_logprob)
               for i, seq in enumerate(result.sequences)]
    return RequestOutput(request_id, prompt, list(prompt_ids), outputs, finished=True)
