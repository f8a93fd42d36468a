"""Beam search through the engines: rounds of one-token requests (beam_search.py holds the search itself).

`BeamSearchAPI.beam_search` is the offline API (vLLM's `LLM.beam_search`): every round of every prompt runs as
one batch. `BeamSearchStream` is the serving side: one prompt's rounds as AsyncEngine requests, ending in one
finished RequestOutput with a choice per beam, consumed like a RequestStream.
"""

from __future__ import annotations

import asyncio
import logging

from jaxserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, as_request_output, top_logprobs_of
from jaxserve.engine_inputs import normalise_prompts, prompt_token_ids, validate_lengths
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.request_errors import RequestTimedOut
from jaxserve.request_stream import RequestStream
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def check_beam_width(params: BeamSearchParams, eos_token_ids: tuple[int, ...], max_logprobs: int) -> None:
    """Each round ranks the top `candidates_per_beam` logprobs of every beam, which the engine must return."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    needed = params.candidates_per_beam(len(eos_token_ids))
    if needed > max_logprobs:
        raise ValueError(f"beam_width={params.beam_width} ranks {needed} logprobs per beam, above the engine's "
                         f"max_logprobs={max_logprobs}: lower beam_width or start the engine with max_logprobs "
                         f">= {needed}")


class BeamSearchAPI:
    """Mixed into Engine. Needs: tokenizer, config, max_model_len, eos_token_ids, _run_all."""

    def prepare_beam_search(self, prompt: str | list[int], params: BeamSearchParams) -> BeamSearch:
        """Tokenize and validate one prompt's search (no device work, safe from any thread): a ValueError for a
        beam too wide for the engine's logprobs, a bad token id, or beams that cannot fit the context or cache."""
        eos = self.eos_token_ids()
        check_beam_width(params, eos, self.config.max_logprobs)
        ids = prompt_token_ids(self.tokenizer, prompt, self.config.model.vocab_size)
        # As for a request of beam_width sequences: each beam may grow to prompt + max_tokens.
        validate_lengths(SamplingParams(n=params.beam_width, max_tokens=params.max_tokens), len(ids),
                         self.max_model_len, self.config)
        return BeamSearch(ids, params, eos, self.max_model_len)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = True,
                    lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
        """The best `params.beam_width` sequences of each prompt (prompts as `generate` takes them), in input
        order (vLLM's `LLM.beam_search`)."""
        from tqdm.auto import tqdm

        prompts = normalise_prompts(prompts)
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts; give one or one each")
        searches = [self.prepare_beam_search(prompt, params) for prompt in prompts]  # all checked before any runs
        round_params = params.step_params(len(self.eos_token_ids()))
        with tqdm(total=max(s.max_new_tokens for s in searches), desc="Beam search", disable=not use_tqdm) as bar:
            while live := [(search, lora) for search, lora in zip(searches, loras) if not search.done]:
                beams = [(prompt, lora) for search, lora in live for prompt in search.prompts()]
                outputs = self._run_all([prompt for prompt, _ in beams], round_params, use_tqdm=False,
                                        lora_request=[lora for _, lora in beams])
                start = 0
                for search, _ in live:
                    end = start + len(search.running)
                    search.advance([top_logprobs_of(output) for output in outputs[start:end]])
                    start = end
                bar.update(1)
        return [search.result(self.tokenizer) for search in searches]


class BeamSearchStream:
    """One prompt's beam search on an AsyncEngine. Iterate with `async for` (one finished RequestOutput);
    `close()` stops it and aborts the round in flight. Start it with `BeamSearchStream.start`, which raises
    ValueError for bad input before anything runs."""

    def __init__(self, engine, search: BeamSearch, request_id: str, prompt: str | None, round_streams,
                 priority: int, lora_request: LoRARequest | None):
        self.request_id = request_id
        self._engine, self._search, self._prompt = engine, search, prompt
        self._priority, self._lora = priority, lora_request
        self._round_streams: list[RequestStream] = round_streams
        self._task = asyncio.ensure_future(self._run())
        self._returned = False
        # The engine's request timeout bounds the whole search (each round request also has it, but is short).
        self._timed_out: RequestTimedOut | None = None
        timeout = engine.request_timeout
        self._deadline = None if timeout is None else asyncio.get_running_loop().call_later(timeout, self._expire,
                                                                                          timeout)

    @classmethod
    async def start(cls, engine, prompt: str | list[int], params: BeamSearchParams, request_id: str,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> "BeamSearchStream":
        """`engine`: an AsyncEngine. The first round is queued here, so its refusals (prompt too long, queue
        full, unknown adapter) reach the caller."""
        search = await asyncio.to_thread(engine.engine.prepare_beam_search, prompt, params)
        first = await _start_round(engine, search, request_id, 0, priority, lora_request)
        return cls(engine, search, request_id, prompt if isinstance(prompt, str) else None, first, priority,
                   lora_request)

    def __aiter__(self) -> "BeamSearchStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._returned:
            raise StopAsyncIteration
        self._returned = True
        try:
            output = await self._task
        except asyncio.CancelledError:
            if self._timed_out is not None and self._task.cancelled():
                raise self._timed_out from None
            raise
        if output is None:  # a round was aborted (a shutdown): end like an aborted RequestStream
            raise StopAsyncIteration
        return output

    @property
    def finished(self) -> bool:
        return self._task.done()

    def close(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        if not self._task.done():
            self._task.cancel()
        for stream in self._round_streams:
            stream.close()

    def _expire(self, timeout: float) -> None:
        if not self._task.done():
            logger.warning("beam search %s ran past the %g s request timeout: stopping it", self.request_id, timeout)
            self._timed_out = RequestTimedOut(timeout)
            self.close()

    async def _run(self) -> RequestOutput | None:
        search, round_index = self._search, 0
        while True:
            finals = await _finals(self._round_streams)
            if finals is None:
                return None
            search.advance([top_logprobs_of(output) for output in finals])
            if search.done:
                break
            round_index += 1
            self._round_streams = await _start_round(self._engine, search, self.request_id, round_index,
                                                     self._priority, self._lora)
        inner = self._engine.engine
        params = search.params
        return as_request_output(self.request_id, self._prompt, search.prompt_ids, search.result(inner.tokenizer),
                                 inner.tokenizer, params.skip_special_tokens)


async def _start_round(engine, search: BeamSearch, request_id: str, round_index: int, priority: int,
                       lora_request: LoRARequest | None) -> list[RequestStream]:
    round_params = search.params.step_params(len(engine.engine.eos_token_ids()))
    streams: list[RequestStream] = []
    try:
        for beam, prompt in enumerate(search.prompts()):
            streams.append(await engine.add_request(prompt, round_params, f"{request_id}-r{round_index}-b{beam}",
                                                    priority=priority, lora_request=lora_request))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


async def _finals(streams: list[RequestStream]) -> list[RequestOutput] | None:
    """Each round request's finished output, in order; None if any ended unfinished (aborted)."""

    async def final(stream: RequestStream) -> RequestOutput | None:
        last = None
        async for output in stream:
            last = output
        return last if last is not None and last.finished else None

    try:
        finals = await asyncio.gather(*(final(stream) for stream in streams))
        return None if any(output is None for output in finals) else list(finals)
    finally:
        for stream in streams:
            stream.close()
