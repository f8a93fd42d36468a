"""Beam-search batch lines (`use_beam_search`): each prompt's search runs as rounds of one-token engine requests
among the job's other requests, and ends in the one output the HTTP server would render (engine/beam_search.py
runs the same rounds for the server)."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxserve.core.beam_search import BeamSearch, as_request_output, top_logprobs_of
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import PositionLogprobs, RequestOutput
from jaxserve.sampling_params import BeamSearchParams


@dataclass
class _Search:
    engine_id: str  # the id its final output carries, as the prompt's request would
    prompt: str | None
    search: BeamSearch
    priority: int
    lora_request: LoRARequest | None
    round: int = 0
    logprobs: list[PositionLogprobs | None] = field(default_factory=list)  # this round's, per beam


class BeamSearches:
    """The batch runner's beam searches. `start` validates a prompt's search and queues its first round (a
    ValueError for bad input, before anything is queued); `owns` tells the runner which engine outputs are
    rounds; `round_finished` takes each finished round request and returns the search's final output when it
    completes the search."""

    def __init__(self, engine):
        self.engine = engine
        self._rounds: dict[str, tuple[_Search, int]] = {}  # round request id -> its search and beam

    def start(self, prompts: dict[str, str | list[int]], params: BeamSearchParams, priority: int,
              lora_request: LoRARequest | None) -> None:
        """`prompts`: engine id -> prompt, one search each. Every search and first round is checked before any is
        queued, so a refusal leaves nothing behind."""
        searches = [_Search(engine_id, prompt if isinstance(prompt, str) else None,
                            self.engine.prepare_beam_search(prompt, params), priority, lora_request)
                    for engine_id, prompt in prompts.items()]
        first_rounds = [self._prepare_round(search) for search in searches]
        for search, requests in zip(searches, first_rounds):
            self._queue(search, requests)

    def owns(self, request_id: str) -> bool:
        return request_id in self._rounds

    def round_finished(self, output: RequestOutput) -> RequestOutput | None:
        search, beam = self._rounds.pop(output.request_id)
        search.logprobs[beam] = top_logprobs_of(output)
        if any(logprobs is None for logprobs in search.logprobs):
            return None  # other beams of this round are still running
        search.search.advance(search.logprobs)
        if not search.search.done:
            search.round += 1
            self._queue(search, self._prepare_round(search))
            return None
        tokenizer = self.engine.tokenizer
        result = search.search.result(tokenizer)
        return as_request_output(search.engine_id, search.prompt, search.search.prompt_ids, result, tokenizer,
                                 search.search.params.skip_special_tokens)

    def _prepare_round(self, search: _Search) -> list:
        return [self.engine.prepare_request(round_id, prompt, search.search.round_params, priority=search.priority,
                                            lora_request=search.lora_request)
                for round_id, prompt in search.search.round_requests(search.engine_id, search.round)]

    def _queue(self, search: _Search, requests: list) -> None:
        search.logprobs = [None] * len(requests)
        for beam, request in enumerate(requests):
            self.engine.add_prepared_request(request)
            self._rounds[request.request_id] = (search, beam)
