"""Where the suite's XLA time goes, per test: `python -m pytest -n 2 -p tests.compile_timer --compile-times=DIR`.
With the "=": pytest reads a separate `DIR` as a test path when it chooses the run's root directory, and from
another root the real-model tests lost their xdist group (each worker started its own server).

Each process (the controller and every xdist worker) listens to jax's own duration events (tracing, lowering to
MLIR, the backend's compile, seconds a persistent-cache hit saved) and writes what each test spent to
DIR/<worker>.json; the controller then prints the tests that compiled longest. py-spy cannot show this: XLA's CPU
compiler runs its LLVM passes in native threads. Subprocesses a test starts are not counted.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import pytest

EVENTS = {"/jax/core/compile/backend_compile_duration": "compile",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/compilation_cache/compile_time_saved_sec": "cache_saved"}
SHOWN = 25


class CompileTimer:
    def __init__(self, directory: Path):
        self.directory = directory
        self.per_test: dict[str, collections.Counter] = {}
        self.current: str | None = None

    def listen(self, event: str, seconds: float, **_) -> None:
        if self.current is not None and event in EVENTS:
            self.per_test.setdefault(self.current, collections.Counter())[EVENTS[event]] += seconds

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.current = item.nodeid
        yield
        self.current = None

    def pytest_sessionfinish(self, session):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (self.directory / f"{worker}.json").write_text(json.dumps(self.per_test))

    def pytest_terminal_summary(self, terminalreporter):
        merged: dict[str, dict] = {}
        for path in self.directory.glob("*.json"):
            merged.update(json.loads(path.read_text()))
        total = collections.Counter()
        for times in merged.values():
            total.update(times)
        terminalreporter.section(f"XLA time by test (seconds; {self.directory})")
        terminalreporter.line("  ".join(f"{name} {total[name]:.0f}" for name in EVENTS.values()))
        for nodeid, times in sorted(merged.items(), key=lambda kv: -kv[1].get("compile", 0))[:SHOWN]:
            terminalreporter.line(f"{times.get('compile', 0):7.1f} {nodeid}")


def pytest_addoption(parser):
    parser.addoption("--compile-times", metavar="DIR", help="write each test's XLA trace/lower/compile seconds here")


def pytest_configure(config):
    directory = config.getoption("--compile-times")
    if not directory:
        return
    import jax.monitoring

    timer = CompileTimer(Path(directory))
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist): start from an empty directory
        timer.directory.mkdir(parents=True, exist_ok=True)
        for stale in timer.directory.glob("*.json"):
            stale.unlink()
    jax.monitoring.register_event_duration_secs_listener(timer.listen)
    config.pluginmanager.register(timer, "compile_timer")
