"""The whole suite's (tests/ and pallas_kernels/): how hard XLA optimises what each test compiles, the order tests
run in, and cached bytecode."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Bytecode cached for the suite's processes (the workers and the ~100 servers, jobs and scripts tests start): with
# PYTHONDONTWRITEBYTECODE set (the development machines' image sets it), each compiled jaxserve's and the tests'
# sources again (~0.3 s a process). Measured on the tests that start most processes: 90.5 s -> 85.9 s of CPU.
# __pycache__ is git-ignored.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    sys.dont_write_bytecode = False

# XLA's CPU optimisations cost more compile time than they save on a tiny random model, which runs a few steps of
# kilobyte-sized matmuls, and on the interpreted Pallas kernels' tests: without them (jax's
# `jax_disable_most_optimizations`: no LLVM optimisation, no costly passes) those tests compile about a quarter
# faster (the kernel tests, a third). The real model (135M parameters) runs twice as slow unoptimised, so a test that
# uses one of these fixtures, or is marked `xla_optimised`, compiles optimised. Set per test before any of its
# fixtures (a session server started for it keeps the setting), in jax and in the environment the processes a test
# starts inherit (on the CPU only). A compile option: part of the persistent compilation cache's key, never mixed up
# there.
REAL_MODEL_FIXTURES = ("smollm2_gguf_path", "smol_engine", "real_server", "hf_smollm2")


def runs_enough_to_optimise(item) -> bool:
    if os.environ.get("PALLAS_COMPILED") == "1":  # a GPU session's compiled run: as users compile
        return True
    return item.get_closest_marker("xla_optimised") is not None or any(
        name in REAL_MODEL_FIXTURES for name in getattr(item, "fixturenames", ()))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    optimise = runs_enough_to_optimise(item)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0" if optimise else "1"
    jax = sys.modules.get("jax")
    if jax is not None and jax.config.read("jax_disable_most_optimizations") == optimise:
        # jax's in-memory caches do not key on the setting: a function compiled under the other one would be
        # reused, and a test comparing it with a fresh program would compare two compilers' roundings.
        jax.config.update("jax_disable_most_optimizations", not optimise)
        jax.clear_caches()


SCRIPT_TESTS = Path(__file__).parent / "tests"  # tests/test_*.py: the scripts run end to end, each in a process


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """The scripts' end-to-end tests first: they are the longest single tests (up to a minute each), and xdist hands
    out tests in this order, so last they left one worker running them while the other had finished. Within each
    file, the tests that compile optimised first (a stable sort, files otherwise kept in order): a worker switches at
    most twice a file, not at every test that differs from its neighbour."""
    files: dict = {}
    for item in items:
        files.setdefault(item.path, len(files))
    items.sort(key=lambda item: (item.path.parent != SCRIPT_TESTS, files[item.path], not runs_enough_to_optimise(item)))
