"""The per-step limits (max_num_seqs, max_num_batched_tokens): CPU-sized on CPU, vLLM's on GPU/TPU, and what the
user gives always wins."""

import pytest

from jaxserve import Engine
from jaxserve.cli import main as cli
from jaxserve.engine.inputs import step_limits


@pytest.mark.parametrize("platform, want", [("cpu", (64, 512)), ("gpu", (256, 8192)), ("tpu", (256, 8192))])
def test_the_platform_sets_what_is_not_given(platform, want):
    assert step_limits(None, None, platform) == want
    assert step_limits(8, None, platform) == (8, want[1])
    assert step_limits(None, 96, platform) == (want[0], 96)


def test_an_engine_on_cpu_takes_the_cpu_limits(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    engine = Engine(path, num_kv_blocks=16, warmup=False)
    assert (engine.config.scheduler.max_num_seqs, engine.config.scheduler.max_num_batched_tokens) == (64, 512)
    engine = Engine(path, num_kv_blocks=16, max_num_seqs=4, warmup=False)
    assert (engine.config.scheduler.max_num_seqs, engine.config.scheduler.max_num_batched_tokens) == (4, 512)
    assert engine.plan_shape.buckets.seqs[-1] == 4


def test_the_cli_leaves_unset_limits_to_the_engine(fake_engine_module):
    assert cli.main(["generate", "--prompt", "Count:", "--max-tokens", "2", "org/model"]) == 0
    assert fake_engine_module["max_num_seqs"] is None and fake_engine_module["max_num_batched_tokens"] is None
    assert cli.main(["generate", "--prompt", "Count:", "--max-tokens", "2", "org/model", "--max-num-seqs", "32"]) == 0
    assert fake_engine_module["max_num_seqs"] == 32
