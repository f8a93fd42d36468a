"""Process 0's side: every step the engine runs is first sent to the followers, which run it too.

The broadcast sits in front of `ModelRunner.launch` (and `tick`, on a pipeline whose stages stay busy across
steps), the one place a step's inputs are complete: the padded numpy arrays (`StepInputs`) and the static
choices (`StepStatics`). Sending before launching lets the followers start at once; they would wait in the
step's first collective anyway. Each read-back is announced
too (READ), since copying a step's outputs to the host may be a collective: with async scheduling the leader
launches step N+1 before it reads step N back, and the followers do both in that same order.
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from jaxserve.cluster import wire
from jaxserve.cluster.distributed import Cluster

log = logging.getLogger(__name__)


class BroadcastingRunner:
    """A ModelRunner whose `launch` and `collect` first tell the followers to do the same."""

    def __init__(self, runner, cluster: Cluster):
        self._runner = runner
        self._cluster = cluster

    def launch(self, inputs, statics):
        with self._cluster.step_lock:  # so that an exit releases the followers between frames, never inside one
            self._cluster.broadcast(wire.frame(wire.STEP, _step_payload(inputs, statics)))
            pending = self._runner.launch(inputs, statics)
            self._cluster.last_launched = pending
            return pending

    def tick(self, inputs, statics, tag=None):
        """A pipeline tick (ModelRunner.tick); the followers' runners keep the same steps in the same stages."""
        with self._cluster.step_lock:
            self._cluster.broadcast(wire.frame(wire.TICK, b"" if inputs is None else _step_payload(inputs, statics)))
            leaving, pending = self._runner.tick(inputs, statics, tag)
            # The newest outputs: the devices run programs in order, so once they are ready every tick is done.
            self._cluster.last_launched = self._runner.carry if pending is None else pending
            return leaving, pending

    def collect(self, pending):
        with self._cluster.step_lock:
            self._cluster.broadcast(wire.frame(wire.READ))
            return self._runner.collect(pending)

    def execute(self, inputs, statics):
        return self.collect(self.launch(inputs, statics))

    def __getattr__(self, name):  # everything else (mesh, kv, num_compiles, ...) is the runner's own
        return getattr(self._runner, name)


def _step_payload(inputs, statics) -> bytes:
    return wire.encode_step([np.asarray(x) for x in jax.tree_util.tree_leaves(inputs)], statics)


def lead(engine, cluster: Cluster):
    """Make `engine` drive the followers from now on (its construction ran on every process alike). From here an
    exit releases them cleanly (`Cluster.close`)."""
    engine.runner = BroadcastingRunner(engine.runner, cluster)
    # Adapters loaded from now on are read here only: their factors travel to the followers, which write them into
    # the same slot before the step that uses it (frames arrive in order), so no node needs the adapter's files.
    engine.adapters.before_write = lambda slot, factors: cluster.broadcast(
        wire.frame(wire.LORA, wire.encode_adapter(slot, factors)))
    cluster.serving = True
    log.info("leading %d follower%s: %s", len(cluster.peers), "s" * (len(cluster.peers) > 1),
             ", ".join(p.describe() for p in cluster.peers.values()))
    return engine
