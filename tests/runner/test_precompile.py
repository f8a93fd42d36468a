"""runner.model_runner.precompile: programs traced here and compiled on threads are what the later calls run."""

import logging

import jax
import jax.numpy as jnp

from jaxserve.runner.model_runner import precompile


def test_calls_after_a_parallel_precompile_neither_trace_nor_compile(caplog):
    traces = []

    @jax.jit
    def double(x):
        traces.append(x.shape)
        return x * 2

    calls = [(double, (jnp.ones(n),)) for n in (1, 2, 3, 4)]
    ticks = []
    assert precompile(calls, 3, ticks.append) == 4
    assert ticks == [1, 1, 1, 1] and len(traces) == 4
    with jax.log_compiles(True), caplog.at_level(logging.DEBUG, logger="jax"):
        outs = [fn(*args) for fn, args in calls]
    assert len(traces) == 4  # no call traced again...
    assert not [r for r in caplog.records if "Compiling" in r.getMessage()]  # ...nor compiled
    assert [o.tolist() for o in outs] == [[2.0] * n for n in (1, 2, 3, 4)]


def test_one_thread_leaves_the_compiles_to_the_calls():
    calls = [(jax.jit(lambda x: x + 1), (jnp.ones(2),))]
    assert precompile(calls, 1, lambda n: None) == 0
