"""serve -dp N with real engines: replicas on disjoint devices, one cache size, the same greedy tokens on each."""

import asyncio

import pytest

from jaxserve.async_engine.data_parallel import DataParallelAsyncEngine
from jaxserve.cli.engine_options import build_engines
from jaxserve.cli.main import build_parser
from jaxserve.engine import engine as engine_module
from jaxserve.errors import UserError
from jaxserve.sampling_params import SamplingParams


def serve_args(*options):
    return build_parser()[0].parse_args(["serve", *options])


def test_replicas_sit_on_their_own_devices_and_agree(tiny_checkpoint, shared_checkpoints, monkeypatch, capsys):
    """Two replicas of a 2x1 mesh take devices 0-1 and 2-3; the second gets the first's cache size (no profiling
    of its own); both are warmed up (nothing compiles while serving); the same prompt gives the same greedy tokens
    on either."""
    monkeypatch.setattr("jaxserve.runner.capacity.CPU_KV_CAP_BYTES", 1 << 20)  # a small cache for the first
    built = []
    real_engine = engine_module.Engine
    # The name build_engines imports; patching engine_module.Engine misses it once an earlier test's monkeypatch of
    # "jaxserve.engine.Engine" has been undone (the undo sets the lazily imported attribute for good).
    monkeypatch.setattr("jaxserve.engine.Engine", lambda *a, **kw: built.append(kw) or real_engine(*a, **kw))
    # One sequence at a time: the fewest buckets, so the fewest warm-up compiles (each replica compiles its own).
    args = serve_args(str(tiny_checkpoint("llama")), "-dp", "2", "--mesh", "2x1", "--max-num-seqs", "1",
                      "--max-num-batched-tokens", "16", "--max-model-len", "64")
    engines = build_engines(args)
    progress = capsys.readouterr().err
    assert "Compiling replica 1's step buckets" in progress and "Compiling replica 2's step buckets" in progress
    assert [[d.id for d in e.runner.mesh.devices.flat] for e in engines] == [[0, 1], [2, 3]]
    blocks = engines[0].config.cache.num_blocks
    assert [kw["num_kv_blocks"] for kw in built] == [None, blocks] and engines[1].config.cache.num_blocks == blocks
    assert [e.config.seed for e in engines] == [0, 1]  # unseeded requests sample differently on each replica

    served = DataParallelAsyncEngine.serving(engines, max_waiting_requests=8)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    async def run():
        async def one(prompt, rid):
            return [out async for out in served.generate(prompt, params, rid)][-1].outputs[0].token_ids

        # Started together, they alternate between the two replicas: each prompt runs once on each.
        return await asyncio.gather(*(one(p, f"{p}-{i}") for p in ("Hello", "The sky is") for i in range(2)))

    try:
        tokens = asyncio.run(run())
    finally:
        served.shutdown()
    assert [e.stats()["num_steps"] > 0 for e in engines] == [True, True]
    assert [e.compiles_after_warmup for e in engines] == [0, 0]
    assert tokens[0] == tokens[1] and tokens[2] == tokens[3] and tokens[0] != tokens[2]


@pytest.mark.parametrize("options, message", [
    (["-dp", "3", "--mesh", "2x2"], "3 data-parallel replicas of mesh 2x2 need 12 devices but only 8 are available"),
    (["-dp", "2", "--num-processes", "2", "--coordinator", "127.0.0.1:1", "--process-id", "0"],
     "cannot be combined with several processes"),
])
def test_data_parallel_mistakes_are_one_sentence(tiny_checkpoint, options, message):
    with pytest.raises(UserError, match=message) as info:
        build_engines(serve_args(str(tiny_checkpoint("llama")), *options))
    assert "\n" not in str(info.value)
