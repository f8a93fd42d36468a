"""AsyncEngine over the fake engine: streaming, validation before streaming, aborts, admission, failures."""

import asyncio
import threading
import time

import pytest

from jaxserve.async_engine.engine import AsyncEngine, EngineDeadError, QueueFull
from jaxserve.errors import RequestTimedOut
from jaxserve.sampling_params import BeamSearchParams, SamplingParams
from tests.server.fake_engine import FakeEngine


@pytest.fixture
def fake(tokenizer):
    return FakeEngine(tokenizer)


@pytest.fixture
def engine(fake):
    async_engine = AsyncEngine(fake, max_waiting_requests=4)
    yield async_engine
    async_engine.shutdown()


async def _collect(engine, request_id, prompt="Hello", **params):
    return [out async for out in engine.generate(prompt, SamplingParams(**params), request_id)]


def test_generate_streams_cumulative_outputs_until_finished(engine):
    outputs = asyncio.run(_collect(engine, "r1", max_tokens=4, temperature=0))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3, 4]
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
    assert all(not o.finished for o in outputs[:-1])
    assert engine.stats()["num_waiting_for_first_output"] == 0


def test_validation_error_is_raised_before_anything_is_queued(engine, fake):
    async def run():
        with pytest.raises(ValueError, match="maximum context length of 256"):
            await engine.add_request("Hello", SamplingParams(max_tokens=1000), "too-long")

    asyncio.run(run())
    assert not fake.has_unfinished_requests()
    assert engine.stats()["num_waiting_for_first_output"] == 0


def test_duplicate_request_id_is_refused(engine):
    async def run():
        stream = await engine.add_request("Hello", SamplingParams(max_tokens=50), "same")
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("Hello", SamplingParams(max_tokens=5), "same")
        stream.close()

    asyncio.run(run())


def test_stopping_early_aborts_the_request(engine, fake):
    async def run():
        async for output in engine.generate("Hello", SamplingParams(max_tokens=200), "early"):
            if len(output.outputs[0].token_ids) >= 2:
                break
        await asyncio.sleep(0.1)  # let the loop thread apply the abort

    asyncio.run(run())
    assert fake.aborted == ["early"]
    assert engine.stats()["free_blocks"] == fake.total_blocks


def test_queue_full_when_too_many_wait_for_their_first_output(fake):
    fake.step_delay = 0.2
    engine = AsyncEngine(fake, max_waiting_requests=2)

    async def run():
        streams = [await engine.add_request("Hi", SamplingParams(max_tokens=1), f"r{i}") for i in range(2)]
        with pytest.raises(QueueFull, match="2 requests are already waiting"):
            await engine.add_request("Hi", SamplingParams(max_tokens=1), "r2")
        for stream in streams:
            [out async for out in stream]
        # Once they have produced output, there is room again.
        assert len(await _collect(engine, "r3", max_tokens=1)) == 1

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


def test_step_failure_fails_in_flight_requests_and_marks_unhealthy(engine, fake, caplog):
    async def run():
        stream = await engine.add_request("Hello", SamplingParams(max_tokens=100), "doomed")
        first = await stream.__anext__()
        assert not first.finished
        fake.fail_next_step = True
        with pytest.raises(EngineDeadError, match="simulated device failure"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("Hello", SamplingParams(max_tokens=1), "after")

    asyncio.run(run())
    assert not engine.is_healthy
    assert "engine step failed" in caplog.text and "simulated device failure" in caplog.text


def test_shutdown_ends_streams_and_refuses_new_requests(fake):
    engine = AsyncEngine(fake)

    async def run():
        stream = await engine.add_request("Hello", SamplingParams(max_tokens=200), "long")
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("Hello", SamplingParams(max_tokens=1), "late")

    asyncio.run(run())
    assert fake.aborted == ["long"] and not engine.is_healthy


def test_abort_from_another_task_ends_the_stream(engine, fake):
    async def run():
        stream = await engine.add_request("Hello", SamplingParams(max_tokens=200), "victim")
        await stream.__anext__()
        await engine.abort("victim")
        remaining = [out async for out in stream]
        assert all(not out.finished for out in remaining)

    asyncio.run(run())
    assert fake.aborted == ["victim"]


def test_shutdown_ends_every_thread_it_started(fake):
    """A daemon thread left running at interpreter exit can be killed while it frees jax arrays, which aborts
    the process (exit 134): shutdown must end the step watchdog too, not leave it asleep for seconds."""
    engine = AsyncEngine(fake, step_timeout=60.0)  # the watchdog would sleep min(60 / 4, 5) s between checks
    started = time.monotonic()
    engine.shutdown()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("jaxserve-") and t.is_alive()]
    assert alive == [] and time.monotonic() - started < 2


def test_beam_search_ends_in_one_output_with_a_choice_per_beam(engine, fake, tokenizer):
    async def run():
        stream = await engine.beam_search("Hello", BeamSearchParams(beam_width=2, max_tokens=4), "beam")
        return [output async for output in stream]

    [output] = asyncio.run(run())
    assert output.finished and output.request_id == "beam" and output.prompt == "Hello"
    assert output.prompt_token_ids == tokenizer.encode("Hello")
    assert [len(choice.token_ids) for choice in output.outputs] == [4, 4]
    assert output.outputs[0].cumulative_logprob >= output.outputs[1].cumulative_logprob
    assert sorted(fake.prompts) == sorted(f"beam-r{r}-b{b}" for r in range(4) for b in range(1 if r == 0 else 2))


def test_closing_a_beam_search_stops_its_rounds(engine, fake):
    fake.step_delay = 0.02

    async def run():
        stream = await engine.beam_search("Hello", BeamSearchParams(beam_width=2, max_tokens=200), "beam")
        await asyncio.sleep(0.1)
        stream.close()
        rounds_at_close = len(fake.prompts)
        await asyncio.sleep(0.2)
        return rounds_at_close

    rounds_at_close = asyncio.run(run())
    assert 1 < rounds_at_close < 400 and len(fake.prompts) <= rounds_at_close + 2
    assert not fake.has_unfinished_requests()


def test_aborting_a_beam_search_by_its_id_ends_its_stream_quietly(engine, fake):
    fake.step_delay = 0.02

    async def run():
        stream = await engine.beam_search("Hello", BeamSearchParams(beam_width=2, max_tokens=200), "beam")
        await asyncio.sleep(0.1)
        await engine.abort("beam")
        outputs = [output async for output in stream]
        rounds_at_abort = len(fake.prompts)
        await asyncio.sleep(0.2)
        return outputs, rounds_at_abort

    outputs, rounds_at_abort = asyncio.run(run())
    assert outputs == [] and 1 < rounds_at_abort < 400 and len(fake.prompts) == rounds_at_abort
    assert not fake.has_unfinished_requests() and engine.num_in_flight == 0 and not engine._searches


def test_an_abort_while_a_beam_search_starts_stops_it(engine, fake):
    async def run():
        starting = asyncio.ensure_future(engine.beam_search("Hello", BeamSearchParams(beam_width=2, max_tokens=200),
                                                            "beam"))
        await asyncio.sleep(0)  # it is preparing the search on a worker thread
        await engine.abort("beam")
        stream = await starting
        return [output async for output in stream]

    assert asyncio.run(run()) == []
    assert not fake.has_unfinished_requests() and engine.num_in_flight == 0 and not engine._searches


def test_the_request_timeout_bounds_the_whole_beam_search(fake):
    fake.step_delay = 0.02
    engine = AsyncEngine(fake, request_timeout=0.3)

    async def run():
        stream = await engine.beam_search("Hello", BeamSearchParams(beam_width=2, max_tokens=200), "slow")
        with pytest.raises(RequestTimedOut):
            [output async for output in stream]

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(fake.prompts) > 3  # it ran several rounds first: each round is well within the timeout
    assert not fake.has_unfinished_requests()


def test_a_beam_search_under_way_finishes_through_a_drain_and_a_small_queue(fake):
    from jaxserve.errors import EngineShuttingDown

    fake.step_delay = 0.01
    engine = AsyncEngine(fake, max_waiting_requests=1)  # each later round queues 3 requests at once

    async def run():
        stream = await engine.beam_search("Hello", BeamSearchParams(beam_width=3, max_tokens=12), "beams")
        await asyncio.sleep(0.05)
        engine.stop_admitting()  # a graceful shutdown begins: in flight between its rounds, the search goes on
        in_flight = engine.num_in_flight
        with pytest.raises(EngineShuttingDown):
            await engine.beam_search("Hello", BeamSearchParams(beam_width=2), "late")
        return in_flight, [output async for output in stream]

    try:
        in_flight, [output] = asyncio.run(run())
    finally:
        engine.shutdown()
    assert in_flight >= 1 and engine.num_in_flight == 0
    assert output.finished and [len(choice.token_ids) for choice in output.outputs] == [12, 12, 12]


def test_beam_search_refusals_come_before_anything_runs(engine, fake):
    async def run():
        with pytest.raises(ValueError, match="maximum context length"):
            await engine.beam_search("word " * 300, BeamSearchParams(beam_width=2), "long")

    asyncio.run(run())
    assert not fake.has_unfinished_requests() and engine.stats()["num_waiting_for_first_output"] == 0
