"""A follower's life after its engine is built: launch each step process 0 sends and read each back when it
says, in its order, until it says stop.

The follower built the same Engine as the leader (same options, checked when they joined), so its weights,
cache and compiled programs match; it never schedules anything itself. Signals: the first SIGTERM or Ctrl-C
asks the leader to shut everyone down (the leader drains its requests, then sends STOP) and keeps following
meanwhile, since leaving now would strand the leader inside a collective; a second one, or no STOP within
`STOP_GRACE_SECONDS`, exits at once.
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import time
from collections import deque

import jax

from jaxserve.cluster import wire
from jaxserve.cluster.distributed import Cluster, fatal
from jaxserve.runner.plan import inputs_treedef
from jaxserve.runner.step import StepStatics

log = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 60.0  # the leader's drain (10 s by default) and its shutdown, with room to spare


class _ShutdownRequest:
    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self.deadline: float | None = None

    def __call__(self, signum, frame) -> None:
        if self.deadline is not None:
            fatal(f"second {signal.Signals(signum).name}: exiting without waiting for process 0")
        self.deadline = time.monotonic() + STOP_GRACE_SECONDS
        log.warning("%s: asking process 0 to shut every process down", signal.Signals(signum).name)
        self.cluster.follower.request_shutdown()

    def overdue(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


def install_signal_handlers(cluster: Cluster) -> _ShutdownRequest:
    """Called right after joining, so a signal during loading or compiling also reaches the leader."""
    request = _ShutdownRequest(cluster)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, request)
    return request


def follow(engine, cluster: Cluster, shutdown: _ShutdownRequest) -> None:
    """Run the leader's steps until a clean STOP (returns), or exit the process on an abort or a lost leader."""
    treedefs = {flag: inputs_treedef(engine.plan_shape, flag) for flag in (False, True)}
    frames = cluster.follower.frames
    log.info("following process 0 at %s", cluster.options.coordinator)
    num_steps, launched = 0, deque()
    while True:
        try:
            kind, payload = frames.get(timeout=1.0)
        except queue.Empty:
            if shutdown.overdue():
                fatal(f"process 0 did not stop the cluster within {STOP_GRACE_SECONDS:.0f} s of the shutdown request")
            continue
        if kind == wire.STEP:
            leaves, statics = wire.decode_step(payload, StepStatics)
            launched.append(engine.runner.launch(jax.tree_util.tree_unflatten(treedefs[statics.decode_only], leaves),
                                                 statics))
            num_steps += 1
        elif kind == wire.TICK:  # the leader queues for reading back only the steps leaving the last stage
            inputs = statics = None
            if payload:
                leaves, statics = wire.decode_step(payload, StepStatics)
                inputs = jax.tree_util.tree_unflatten(treedefs[statics.decode_only], leaves)
                num_steps += 1
            _, pending = engine.runner.tick(inputs, statics)
            if pending is not None:
                launched.append(pending)
        elif kind == wire.READ:
            if not launched:
                fatal("process 0 asked to read back a step this process never launched")
            engine.runner.collect(launched.popleft())  # its outputs are process 0's to use
        elif kind == wire.LORA:
            engine.adapters.write_factors(*wire.decode_adapter(payload))
        elif kind == wire.STOP:
            # Steps process 0 never read back, and the pipeline's last tick: it waited for them too
            jax.block_until_ready([*launched, engine.runner.carry])
            _released(cluster, payload)
            log.info("process 0 released this process after %d steps", num_steps)
            return


def await_load(cluster: Cluster, shutdown: _ShutdownRequest) -> bool:
    """Wait until process 0 builds its engine (LOAD: True, build ours) or releases this process having run
    nothing (a clean STOP: False). No time limit: process 0 may be reading a long input first, and its
    heartbeats tell that it is alive. An abort (process 0 refused the job) exits with status 1, through jax's
    exit barrier, which process 0 waits at. Needs `join(..., wait_for_load=True)`, so that an abort sent before
    this call comes here too (the channel's reader stops queueing aborts once it has queued LOAD)."""
    while True:
        try:
            kind, payload = cluster.follower.frames.get(timeout=1.0)
        except queue.Empty:
            if shutdown.overdue():
                fatal(f"process 0 did not stop the cluster within {STOP_GRACE_SECONDS:.0f} s of the shutdown "
                      f"request")
            continue
        if kind == wire.LOAD:
            return True
        if kind == wire.STOP:
            stop = json.loads(payload)
            cluster.follower.close()
            if not stop.get("clean"):
                log.critical("process 0 stopped every process: %s", stop.get("reason") or "no reason given")
                raise SystemExit(1)
            return False
        fatal(f"process 0 sent {kind!r} where this process expected LOAD or STOP")


def await_release(cluster: Cluster, timeout: float) -> None:
    """Wait for process 0's STOP (commands other than serving, e.g. `check`, end this way)."""
    try:
        kind, payload = cluster.follower.frames.get(timeout=timeout)
    except queue.Empty:
        fatal(f"process 0 did not release this process within {timeout:.0f} s")
    if kind != wire.STOP:
        fatal(f"process 0 sent {kind!r} where this process expected to be released")
    _released(cluster, payload)


def _released(cluster: Cluster, payload: bytes) -> None:
    stop = json.loads(payload)
    if not stop.get("clean"):
        fatal(f"process 0 stopped the cluster: {stop.get('reason')}")
    cluster.follower.close()
