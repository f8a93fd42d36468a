"""BeamSearchStream: one prompt's beam search on an AsyncEngine, for the servers (engine/beam_search.py is the
offline API's, batch/beam_searches.py the batch runner's). No jax here: the servers import it."""

from __future__ import annotations

import asyncio
import logging

from jaxserve.async_engine.request_stream import RequestStream
from jaxserve.core.beam_search import BeamSearch, as_request_output, top_logprobs_of
from jaxserve.errors import RequestTimedOut
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import BeamSearchParams

logger = logging.getLogger(__name__)


class BeamSearchStream:
    """One prompt's beam search on an AsyncEngine. Iterate with `async for` (one finished RequestOutput);
    `close()` stops it and aborts the round in flight. Start it with `BeamSearchStream.start`, which raises
    ValueError for bad input before anything runs. `abort()` stops it as an aborted request ends: the consumer's
    iteration ends without an output."""

    def __init__(self, engine, search: BeamSearch, request_id: str, prompt: str | None, round_streams,
                 priority: int, lora_request: LoRARequest | None):
        self.request_id = request_id
        self._engine, self._search, self._prompt = engine, search, prompt
        self._priority, self._lora = priority, lora_request
        self._round_streams: list[RequestStream] = round_streams
        self._task = asyncio.ensure_future(self._run())
        self._task.add_done_callback(lambda _: engine.admission.done(request_id))
        self._returned = False
        self._aborted = False
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
        engine.admission.track(request_id)  # in flight between rounds too, so a graceful shutdown lets it finish
        try:
            first = await _start_round(engine, search, request_id, 0, priority, lora_request)
        except BaseException:
            engine.admission.done(request_id)
            raise
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
            if self._aborted and self._task.cancelled():
                raise StopAsyncIteration from None
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
        elif not self._task.cancelled():
            self._task.exception()  # a failure nobody will read now: retrieved, so asyncio does not log it
        _close(self._round_streams)

    def abort(self) -> None:
        self._aborted = True
        self.close()

    def add_done_callback(self, callback) -> None:
        """`callback()` once the search has ended, however it ended."""
        self._task.add_done_callback(lambda _: callback())

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
    """Queue a round's requests. Rounds after the first continue a search already admitted: a full queue or a
    graceful shutdown's drain does not refuse them."""
    streams: list[RequestStream] = []
    try:
        for round_id, prompt in search.round_requests(request_id, round_index):
            streams.append(await engine.add_request(prompt, search.round_params, round_id, priority=priority,
                                                    lora_request=lora_request, continuing=round_index > 0))
    except BaseException:
        _close(streams)
        raise
    return streams


def _close(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


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
        _close(streams)
