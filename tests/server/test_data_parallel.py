"""Data parallelism (serve -dp N): replicas served as one AsyncEngine, each request on the least loaded replica."""

import asyncio
import socket
from types import SimpleNamespace

import openai
import pytest

from jaxserve.async_engine.data_parallel import DataParallelAsyncEngine, merge_stats
from jaxserve.async_engine.engine import AsyncEngine, EngineDeadError, QueueFull
from jaxserve.lora_request import LoRARequest
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.app import build_app
from tests.server.fake_engine import FakeEngine
from tests.server.helpers import metric_value, serve_in_thread


@pytest.fixture
def fakes(tokenizer):
    return [FakeEngine(tokenizer, total_blocks=64), FakeEngine(tokenizer, total_blocks=64)]


@pytest.fixture
def engine(fakes):
    served = DataParallelAsyncEngine.serving(fakes, max_waiting_requests=4)
    yield served
    served.shutdown()


async def _hold(engine, request_ids, **params):
    """Start requests and leave them in flight (their streams unread)."""
    params = {"max_tokens": 200, "ignore_eos": True, **params}
    return [await engine.add_request("Hello", SamplingParams(**params), rid) for rid in request_ids]


def test_requests_go_to_the_least_loaded_replica(engine):
    async def run():
        streams = await _hold(engine, ["a", "b", "c", "d"])
        loads = [replica.num_in_flight for replica in engine.replicas]
        for stream in streams:
            stream.close()
        return loads

    assert asyncio.run(run()) == [2, 2]


def test_each_replica_serves_requests_whole(engine, fakes):
    async def run():
        async def one(rid):
            return [out async for out in engine.generate("Hello", SamplingParams(max_tokens=3), rid)][-1]
        return await asyncio.gather(*(one(f"r{i}") for i in range(4)))

    outputs = asyncio.run(run())
    assert all(out.finished and len(out.outputs[0].token_ids) == 3 for out in outputs)
    assert all(fake.prompts for fake in fakes), "a replica got no request"
    assert sorted(rid for fake in fakes for rid in fake.prompts) == ["r0", "r1", "r2", "r3"]


def test_a_request_id_is_unique_across_replicas(engine):
    async def run():
        streams = await _hold(engine, ["same"])
        with pytest.raises(ValueError, match="'same' is already in use"):
            await _hold(engine, ["same"])  # the other replica, less loaded, would have taken it
        streams[0].close()

    asyncio.run(run())


def test_a_full_replica_passes_the_request_on(tokenizer):
    """A replica whose queue is full (one waiting request each here) hands the request to the next."""
    replicas = [AsyncEngine(FakeEngine(tokenizer), max_waiting_requests=1) for _ in range(2)]
    engine = DataParallelAsyncEngine(replicas)
    try:
        async def run():
            replicas[0].admission.admit("waiting-on-0")  # fewest in flight (1 < 2), yet its queue is full
            for busy in ("busy-1", "busy-2"):  # in flight on replica 1, none of them waiting
                replicas[1].admission.track(busy)
            stream = await engine.add_request("Hello", SamplingParams(max_tokens=2), "r")
            placed = [replica.uses_request_id("r") for replica in replicas]
            stream.close()
            replicas[1].admission.admit("waiting-on-1", bounded=False)
            with pytest.raises(QueueFull):
                await engine.add_request("Hello", SamplingParams(max_tokens=2), "s")
            return placed

        assert asyncio.run(run()) == [False, True]
    finally:
        engine.shutdown()


def test_abort_reaches_the_replica_holding_the_request(engine, fakes):
    async def run():
        streams = await _hold(engine, ["x", "y"])
        await engine.abort("y")
        async for _ in streams[1]:  # ends, after any outputs already delivered
            pass
        streams[0].close()

    asyncio.run(run())
    assert sorted("y" in fake.aborted for fake in fakes) == [False, True]  # on its own replica, once


def test_a_dead_replica_takes_no_requests_and_health_says_so(engine, fakes):
    fakes[0].fail_next_step = True

    async def run():
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("Hello", SamplingParams(max_tokens=3), "dies"):
                pass
        assert not engine.is_healthy  # one replica down: the server is taken out of rotation
        finals = []
        for i in range(3):
            finals.append([out async for out in engine.generate("Hello", SamplingParams(max_tokens=2), f"ok{i}")][-1])
        return finals

    assert all(out.finished for out in asyncio.run(run()))
    assert set(fakes[1].prompts) == {"ok0", "ok1", "ok2"}


def test_a_full_queue_is_the_answer_while_the_other_replica_is_dead(tokenizer):
    """One replica dead, the other's queue full: a 503 to retry (QueueFull), not the dead one's error."""
    fakes = [FakeEngine(tokenizer), FakeEngine(tokenizer)]
    replicas = [AsyncEngine(fake, max_waiting_requests=1) for fake in fakes]
    engine = DataParallelAsyncEngine(replicas)
    fakes[0].fail_next_step = True
    try:
        async def run():
            with pytest.raises(EngineDeadError):
                async for _ in replicas[0].generate("Hello", SamplingParams(max_tokens=2), "dies"):
                    pass
            replicas[1].admission.admit("waiting-on-1", bounded=False)
            with pytest.raises(QueueFull):
                await engine.add_request("Hello", SamplingParams(max_tokens=2), "r")

        asyncio.run(run())
    finally:
        engine.shutdown()


def test_an_adapter_one_replica_refuses_is_unloaded_from_the_others(engine, fakes, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")

    def refuse(lora_request, load_inplace=False):
        raise ValueError("adapter rank 64 is over --max-lora-rank 16")

    fakes[1].add_lora = refuse
    with pytest.raises(ValueError, match="over --max-lora-rank"):
        asyncio.run(engine.add_lora(LoRARequest("big", 1, str(tmp_path))))
    engine.shutdown()  # the removal is applied between steps: after the shutdown it has been
    assert fakes[0].removed_loras == ["big"]


def test_adapters_and_shutdown_reach_every_replica(engine, fakes, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    lora = LoRARequest("adapter", 1, str(tmp_path))
    assert asyncio.run(engine.add_lora(lora, load_inplace=True)) == lora
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        asyncio.run(engine.add_lora(LoRARequest("missing", 2, str(tmp_path / "none"))))
    engine.remove_lora("adapter")
    engine.stop_admitting()
    assert engine.is_draining and all(replica.is_draining for replica in engine.replicas)
    engine.shutdown()
    assert [fake.replaced_loras for fake in fakes] == [["adapter"], ["adapter"]]
    assert [fake.removed_loras for fake in fakes] == [["adapter"], ["adapter"]]


def test_stats_add_up_across_replicas():
    parts = [{"total_blocks": 64, "free_blocks": 60, "block_size": 16, "num_running": 2,
              "spec_decode_num_accepted_tokens_per_pos": [3, 1], "running_lora_adapters": ["a"], "max_loras": 2},
             {"total_blocks": 64, "free_blocks": 50, "block_size": 16, "num_running": 1,
              "spec_decode_num_accepted_tokens_per_pos": [2, 2, 1], "running_lora_adapters": ["b", "a"],
              "max_loras": 2}]
    assert merge_stats(parts) == {"total_blocks": 128, "free_blocks": 110, "block_size": 16, "num_running": 3,
                                  "spec_decode_num_accepted_tokens_per_pos": [5, 3, 1],
                                  "running_lora_adapters": ["a", "b"], "max_loras": 2}


def test_served_over_http_with_the_whole_cache_in_metrics(engine):
    with serve_in_thread(build_app(engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        whole = client.completions.create(model="fake-model", prompt="Hello", max_tokens=4, temperature=0)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="fake-model", prompt="Hello", max_tokens=4, temperature=0, stream=True))
        blocks = metric_value(url, "jaxserve:kv_cache_total_blocks")
    assert whole.choices[0].text == streamed and whole.choices[0].finish_reason == "length"
    assert blocks == 128  # both replicas' caches


def test_serve_dp_builds_one_async_engine_over_the_replicas(tokenizer, monkeypatch):
    """`serve -dp 2`: the app gets the replicas behind one front, the waiting bound shared out."""
    from jaxserve.cli.main import build_parser
    from jaxserve.server import launch

    built = {}
    monkeypatch.setattr(launch, "build_app", lambda engine, **options: built.update(options, engine=engine))
    monkeypatch.setattr(launch, "DrainingServer", lambda *a, **k: SimpleNamespace(run=lambda sockets: None))
    args = build_parser()[0].parse_args(["serve", "-dp", "2", "--max-waiting-requests", "10"])
    assert args.data_parallel_size == 2
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        assert launch.serve_engine([FakeEngine(tokenizer), FakeEngine(tokenizer)], args, sock) == 0
    served = built["engine"]
    served.shutdown()
    assert isinstance(served, DataParallelAsyncEngine) and len(served.replicas) == 2
    assert [replica.admission.max_waiting_requests for replica in served.replicas] == [5, 5]
