"""Multi-controller serving: every process runs the same program under `jax.distributed`.

Process 0 (the leader) runs the scheduler and the server and sends each step's inputs to the others (the
followers), which run the same jitted step in the same order; see `leader.py` and `follower.py`. This module
joins the processes: first over our own step channel (channel.py), which names any process that is missing,
then `jax.distributed.initialize`, which then cannot stall on an absent peer.

Ports: jax's coordination service listens on the --coordinator port, the step channel on that port + 1.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field

from jaxserve.cluster.channel import FollowerChannel, JoinError, LeaderChannel, Peer

log = logging.getLogger(__name__)

SHUTDOWN_SECONDS = 15  # jax.distributed's exit barrier: a clean exit of every process takes far less


@dataclass(frozen=True)
class ClusterOptions:
    coordinator: str  # HOST:PORT of process 0
    num_processes: int
    process_id: int
    timeout: float = 300.0  # seconds to wait for every process to join

    def __post_init__(self):
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process id {self.process_id} is outside 0..{self.num_processes - 1}; give each of "
                             f"the {self.num_processes} processes its own --process-id")
        split_address(self.coordinator)

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"coordinator address {address!r} is not HOST:PORT (e.g. 10.0.0.1:8476, the address of "
                         f"process 0); the port and the next one must be free there")
    return host.strip("[]"), int(port)


@dataclass
class Cluster:
    """This process's place in the joined cluster and its link to the others."""

    options: ClusterOptions
    leader: LeaderChannel | None = None
    follower: FollowerChannel | None = None
    peers: dict[int, Peer] = field(default_factory=dict)
    launched: object | None = None  # Ray followers this process started: held, since Ray ends unreferenced actors
    serving: bool = False  # leader: the engine runs, so an exit now is a normal end (clean STOP)
    step_lock: threading.Lock = field(default_factory=threading.Lock)  # leader: held while a step is sent
    closed: bool = False  # leader: the followers were released (the step lock stays held from then on)
    last_launched: object | None = None  # leader: the outputs of the newest step launched (it may still run)
    followers_wait_for_load: bool = False  # join(wait_for_load=True): followers build nothing before LOAD
    exit_status: int = 1  # leader: this process's status if it leaves before serving (a signal's, 128 + its number)

    @property
    def is_leader(self) -> bool:
        return self.options.is_leader

    def leader_lost(self, why: str) -> None:
        fatal(f"process 0 (the leader, at {self.options.coordinator}) was lost: {why}. Exiting")

    def leader_aborted(self, reason: str) -> None:
        fatal(f"process 0 stopped every process: {reason}")

    def follower_lost(self, peer: Peer, why: str) -> None:
        message = (f"{peer.describe()} was lost: {why}. The mesh cannot run without it, so every process stops; "
                   f"restart them all")
        self.leader.stop(clean=False, reason=message)
        fatal(message)

    def follower_asked_to_stop(self, peer: Peer) -> None:
        log.warning("%s received a shutdown signal: shutting every process down", peer.describe())
        os.kill(os.getpid(), signal.SIGTERM)  # the leader's own SIGTERM path: the server drains, then STOP

    def broadcast(self, data: bytes) -> None:
        self.leader.broadcast(data, self.follower_lost)

    def close(self, clean: bool | None = None, reason: str = "it exited before serving (see its log)") -> None:
        """Leader: release the followers. Runs at exit (registered after jax, so before jax.distributed's exit
        barrier, which the followers reach only once released). Clean once serving began: the followers then
        exit normally and meet at that barrier; before that, the leader failed and the followers abort,
        told `reason`."""
        if self.leader is None or self.closed:  # the exit-time call after an explicit one: nothing left to do
            return
        self.closed = True
        clean = self.serving if clean is None else clean
        # Let a step in flight (the engine thread may still be sending one, and with async scheduling one may be
        # launched and not read back) finish on every process first: a follower released mid-step would wait in
        # that step's collectives for a leader that is gone. Never released: no step may start after the STOP.
        self.step_lock.acquire(timeout=10)
        if self.last_launched is not None:
            import jax

            jax.block_until_ready(self.last_launched)  # the devices run steps in order: every earlier one is done
        self.leader.stop(clean=clean, reason="" if clean else reason)
        if not clean and not self.followers_wait_for_load:
            # The followers were building their engines, so they leave at once on this abort (their main thread
            # cannot be waited for), and jax.distributed's exit barrier would wait SHUTDOWN_SECONDS for them, then
            # abort this process natively. Leave as they do.
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(self.exit_status)


_FATAL = threading.Lock()


def fatal(message: str) -> None:
    """End this process now. Not `sys.exit`: the main thread may be inside a collective that can never finish,
    and jax's exit barrier would wait for a peer that is gone. One report: a second caller (another thread that
    saw the same loss) waits here for the exit."""
    _FATAL.acquire()
    if logging.getLogger().handlers:
        log.critical(message)
        for handler in logging.getLogger().handlers:
            handler.flush()
    else:
        print(f"jaxserve: error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


def hello(options: ClusterOptions, fingerprint: dict) -> dict:
    return {"process_id": options.process_id, "num_processes": options.num_processes, "host": socket.gethostname(),
            "pid": os.getpid(), "fingerprint": fingerprint}


def join(options: ClusterOptions, fingerprint: dict, liveness_seconds: float | None = None,
         wait_for_load: bool = False) -> Cluster:
    """Meet every process on the step channel, then start `jax.distributed`. Raises JoinError naming the
    process that did not come (or whose options differ). Must run before jax creates its backends.
    `wait_for_load`: followers build nothing until the leader sends LOAD (follower.await_load)."""
    host, port = split_address(options.coordinator)
    kw = {} if liveness_seconds is None else {"liveness_seconds": liveness_seconds}
    cluster = Cluster(options, followers_wait_for_load=wait_for_load)
    if options.is_leader:
        cluster.leader = LeaderChannel(host, port + 1, options.num_processes, **kw)
        log.info("waiting up to %.0f s for %d more processes on %s:%d", options.timeout,
                 options.num_processes - 1, host, port + 1)
        cluster.peers = cluster.leader.gather(options.timeout, fingerprint)
        cluster.leader.start(cluster.follower_lost, cluster.follower_asked_to_stop)
    else:
        cluster.follower = FollowerChannel.connect(host, port + 1, options.timeout, hello(options, fingerprint), **kw)
        cluster.follower.main_thread_waits = wait_for_load  # until LOAD, no collective can hold the main thread
        cluster.follower.start(cluster.leader_lost, cluster.leader_aborted)
    for peer in cluster.peers.values():
        log.info("%s joined", peer.describe())
    initialize_jax(options)
    if cluster.is_leader:
        atexit.register(cluster.close)  # after jax's own exit hook, so it runs first (atexit is last-in first-out)
        exit_on_signals(cluster)
    return cluster


def exit_on_signals(cluster: Cluster) -> None:
    """Leader: until the server or the batch job takes the signals over, SIGTERM and SIGINT (Ctrl-C) exit the
    process with the signal's own status (143, 130), unwinding it, so one arriving while the model loads or
    compiles still releases the followers at exit (`Cluster.close`, which tells them why) rather than cutting their
    connection mid-load."""
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers belong to the main thread; the default action still ends the process

    def exit_on_signal(signum, frame):
        log.warning("%s before serving began: stopping every process", signal.Signals(signum).name)
        cluster.exit_status = 128 + signum
        raise SystemExit(cluster.exit_status)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, exit_on_signal)


def initialize_jax(options: ClusterOptions) -> None:
    import jax

    # CPU meshes across processes need a collectives library; gloo ships with jaxlib (0.10 default, said anyway).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # jax's preemption service (on by default) takes SIGTERM over in C++ and only records it, for
    # multihost_utils.reached_preemption_sync_point, which jaxserve never asks: a SIGTERM before jaxserve's own
    # handlers were in place (the model loading, compiling) was lost and every process ran on. jaxserve handles
    # SIGTERM itself: it drains, then stops every process.
    try:
        jax.config.update("jax_enable_preemption_service", False)
    except AttributeError:  # a jax without the service: nothing takes the signal
        pass
    jax.distributed.initialize(options.coordinator, num_processes=options.num_processes,
                               process_id=options.process_id, initialization_timeout=max(10, int(options.timeout)),
                               shutdown_timeout_seconds=SHUTDOWN_SECONDS)
    log.info("process %d of %d: %d local devices, %d in all", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())


def check_mesh_fits(tp: int, pp: int) -> None:
    """A multi-process mesh must use every device: a process holding none would have nothing to run."""
    import jax

    n, local = jax.device_count(), jax.local_device_count()
    if tp * pp != n:
        raise ValueError(f"mesh {tp}x{pp} has {tp * pp} devices but the {jax.process_count()} processes have {n} "
                         f"({local} each); choose a mesh with tp x pp = {n}")
    if local % tp and tp % local:
        log.warning("tp=%d does not fit the %d devices of each process: tensor-parallel groups will span "
                    "processes, whose links are slower than a node's own", tp, local)


__all__ = ["Cluster", "ClusterOptions", "JoinError", "check_mesh_fits", "fatal", "join"]
