"""scripts/bench_pipeline_model.py: its step-time model on step times known in closed form (the script end to end
on a tiny shape: tests/test_gpu_session.py; its figures, on SmolLM2's shape, are in BENCHMARKS.md)."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "scripts" / "bench_pipeline_model.py"


def test_the_model_splits_steps_into_layers_and_a_fixed_part():
    """Steps of 2 ms fixed (1 ms of it the vocabulary's, 1024 tokens) plus 1.25 ms a layer at 2 sequences: 8
    layers on 4 stages of 2, a batch of 8 in 4 micro-batches of 2. Data parallelism: 4 replicas of 2 sequences,
    12 ms a step. Fill-drain: 7 ticks of 2 layers, then the fixed part once: 19.5 ms for 8 tokens. Stages busy: a
    batch of 2 every tick of 2 layers + the vocabulary's part split over the 4 stages + the rest: 3.75 ms."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_pipeline_model import model
    finally:
        sys.path.remove(str(SCRIPT.parent))

    def seconds(layers: int, batch: int, vocab: int) -> float:
        return 1e-3 + (vocab or 1024) / 1024 * 1e-3 + layers * 1e-3 * (1 + batch / 8)

    r = model(seconds, num_layers=8, vocab=1024, batch=8, pp=4)
    assert (r["micro"], r["stage_layers"]) == (4, 2)
    assert r["data_parallel"] == pytest.approx(8 / 12e-3)
    assert r["fill_drain"] == pytest.approx(8 / 19.5e-3)
    assert r["busy"] == pytest.approx(2 / 3.75e-3)
    # A recorded schedule that completes a step on 3 ticks of 4 only: three quarters of the tokens
    three_quarters = model(seconds, num_layers=8, vocab=1024, batch=8, pp=4, recorded=dict(tokens_per_tick=1.5,
                                                                                      step_batch=2))
    assert three_quarters["busy"] == pytest.approx(1.5 / 3.75e-3)


def test_stages_must_divide_the_batch():
    done = subprocess.run([sys.executable, str(SCRIPT), "--batch", "6", "--stages", "4"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--stages 4: each needs 1 < PP <= 30 (the layers)" in done.stderr, done.stderr


def test_an_engine_times_only_the_batches_it_runs_unpadded(tiny_checkpoint):
    """One engine per model shape times several batches, but a batch its buckets would pad (8 on an engine of 16
    sequences, whose buckets are 1, 4, 16) gets an engine of its own: a padded step is the larger step's time."""
    from jaxserve import Engine

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_pipeline_model import engine_buckets, engine_limits, shared_engines
    finally:
        sys.path.remove(str(SCRIPT.parent))

    # the buckets the grouping reads are the ones such an engine runs
    engine = Engine(str(tiny_checkpoint("llama")), **engine_limits(16), num_kv_blocks=8, warmup=False)
    assert engine.plan_shape.buckets == engine_buckets(16)

    assert shared_engines({16, 32, 64}) == [{16, 32, 64}]  # the 8B run's batches: all buckets of one engine
    assert engine_buckets(16).shape(8, 8) != (8, 8) and shared_engines({8, 16}) == [{16}, {8}]
