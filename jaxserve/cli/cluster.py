"""The CLI's way into multi-process serving: options (flags or environment), joining, and each process's role.

`start_cluster(args, mesh)` runs before the engine is built (jax.distributed must start before jax's backends);
`session.take_role(engine)` runs after: process 0 gets its engine back, now broadcasting each step, while a
follower runs the follower loop and exits when released, so commands need no multi-node code of their own.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
from dataclasses import dataclass

from jaxserve.cluster.distributed import (
    Cluster,
    ClusterOptions,
    JoinError,
    check_mesh_fits,
    join,
)
from jaxserve.config import MeshShape
from jaxserve.errors import UserError

log = logging.getLogger(__name__)

# Options that may differ between processes. Every other option must be the same everywhere, since it shapes
# the weights or the compiled programs (checked when the processes join); server options matter only on
# process 0 and are left out too, as is the chat template (only process 0 sees prompts) and the compilation
# cache (each node's own directory).
PER_PROCESS_OPTIONS = {"process_id", "coordinator", "num_processes", "distributed_executor_backend",
                       "distributed_timeout", "log_level", "config", "seed", "chat_template", "compilation_cache_dir",
                       "generation_config", "download_dir", "hf_token",
                       "argv"}  # the raw command line, kept by cli.main; its parsed options are compared
ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES", "process_id": "JAX_PROCESS_ID"}
# Kubernetes LeaderWorkerSet: every pod of a group gets the leader pod's address, the group's size and its own index
# (0 for the leader), so the same pod template starts every process.
LWS_ENV = {"coordinator": "LWS_LEADER_ADDRESS", "num_processes": "LWS_GROUP_SIZE", "process_id": "LWS_WORKER_INDEX"}
COORDINATOR_PORT_ENV = "JAX_COORDINATOR_PORT"  # jax's own name for the port of an address found in the environment
DETECTED = ("slurm", "ompi", "gcetpu", "gketpu")  # jax's names of the clusters whose processes it finds itself
DEFAULT_COORDINATOR_PORT = 8476  # for LWS_LEADER_ADDRESS (jax finds its own ports); the step channel takes the next


def _converted(variable: str, convert):
    try:
        return convert(os.environ[variable])
    except ValueError:
        raise UserError(f"environment variable {variable}={os.environ[variable]!r} is not valid") from None


def _coordinator_port() -> int:
    return _converted(COORDINATOR_PORT_ENV, int) if os.environ.get(COORDINATOR_PORT_ENV) else DEFAULT_COORDINATOR_PORT


def _lws_setting(name: str):
    if not os.environ.get(LWS_ENV[name]):
        return None
    if name == "coordinator":
        return f"{os.environ[LWS_ENV[name]]}:{_coordinator_port()}"
    return _converted(LWS_ENV[name], int)


def _setting(args: argparse.Namespace, name: str):
    """One cluster setting: the flag, else JAX_*, else the LeaderWorkerSet's LWS_* variable, else None."""
    value = getattr(args, name, None)
    if value is None and os.environ.get(ENV[name]):
        value = _converted(ENV[name], str if name == "coordinator" else int)
    if value is None:
        value = _lws_setting(name)
    return value


@functools.cache  # the environment is the process's: detect once (Cloud TPU asks a metadata server)
def _detected_cluster() -> tuple[str, int, int] | None:
    """(coordinator, processes, process id) as `jax.distributed.initialize()` would find them in a SLURM job, an
    Open MPI run or a multi-host Cloud TPU slice; None elsewhere. Asked only when no flag or variable says how
    many processes there are. jax keeps this detection private, so a jax that moved it means none is found."""
    try:
        from jax._src.clusters import ClusterEnv

        # Only these (jax's Kubernetes detection would query the API server of every pod it runs in).
        present = [env.name for env in ClusterEnv._cluster_types if env.name in DETECTED and env.is_env_present()]
        if not present:
            return None
        found = ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, present[0], 60)
    except Exception as exc:  # noqa: BLE001 (a private API: any change in it means no detection, said once)
        log.debug("no cluster detection from jax (%s)", exc)
        return None
    coordinator, num, pid = found[:3]
    if coordinator is None or num is None or pid is None or num <= 1:
        return None
    if ":" not in coordinator.rpartition("]")[2]:
        coordinator = f"{coordinator}:{_coordinator_port()}"
    elif coordinator.endswith(":65535"):  # a SLURM job-id port may be the last one; the step channel needs the next
        coordinator = coordinator.removesuffix("65535") + "65534"
    return coordinator, int(num), int(pid)


def _settings(args: argparse.Namespace) -> tuple[str | None, int | None, int | None, str]:
    """(coordinator, processes, process id, where they came from)."""
    num = _setting(args, "num_processes")
    if num is None and (detected := _detected_cluster()) is not None:
        return (*detected, "the cluster jax detected")
    from_lws = any(getattr(args, name, None) is None and not os.environ.get(ENV[name]) and os.environ.get(variable)
                   for name, variable in LWS_ENV.items())
    source = "the LeaderWorkerSet's LWS_* variables" if from_lws else "the options"
    return _setting(args, "coordinator"), num, _setting(args, "process_id"), source


def cluster_options(args: argparse.Namespace) -> ClusterOptions | None:
    """None for a single process. Each setting from its flag, else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
    JAX_PROCESS_ID, else a LeaderWorkerSet's LWS_LEADER_ADDRESS (+ JAX_COORDINATOR_PORT, default 8476) /
    LWS_GROUP_SIZE / LWS_WORKER_INDEX; with none of those, the cluster jax.distributed would detect."""
    coordinator, num, pid, _ = _settings(args)
    if num is None or num <= 1:
        return None
    if coordinator is None or pid is None:
        raise UserError(f"--num-processes {num} needs --coordinator HOST:PORT (the address of process 0) and "
                        f"--process-id (0 on that host, 1..{num - 1} elsewhere) on every process")
    try:
        return ClusterOptions(coordinator, num, pid, float(getattr(args, "distributed_timeout", 300.0)))
    except ValueError as exc:
        raise UserError(str(exc)) from None


def is_leader(args: argparse.Namespace) -> bool:
    """Whether this process serves HTTP: a single process, process 0, or the process that launches Ray actors."""
    if _setting(args, "num_processes") is None and (detected := _detected_cluster()) is not None:
        return detected[2] == 0
    return _setting(args, "process_id") in (None, 0)


def fingerprint(args: argparse.Namespace) -> dict:
    """The options every process must share: all but the per-process and the HTTP server's own (serve's parser
    names those in `server_only_options`). In the form the other processes' arrive in (a JSON round trip: tuples
    become lists, a MeshShape its TPxPP text), so equal options compare equal."""
    ignored = PER_PROCESS_OPTIONS | set(getattr(args, "server_only_options", ())) | {"server_only_options"}
    return json.loads(json.dumps({k: v for k, v in sorted(vars(args).items()) if k not in ignored}, default=str))


@dataclass
class Session:
    cluster: Cluster
    shutdown: object | None = None  # a follower's signal handler

    def take_role(self, engine):
        if self.cluster.is_leader:
            from jaxserve.cluster.leader import lead

            return lead(engine, self.cluster)
        from jaxserve.cluster.follower import follow

        follow(engine, self.cluster, self.shutdown)
        raise SystemExit(0)


def start_cluster(args: argparse.Namespace, mesh: str | None, check_mesh: bool = True,
                  shared: dict | None = None, wait_for_load: bool = False) -> Session | None:
    """Join the other processes (starting them as Ray actors first with --distributed-executor-backend ray).
    `shared`: what every process must agree on, when the command line is not it (default: its options);
    `wait_for_load`: see `distributed.join`."""
    ray = None
    if getattr(args, "distributed_executor_backend", "mp") == "ray" and _setting(args, "process_id") is None:
        from jaxserve.cli.ray import launch_followers

        ray = launch_followers(args)
        args.coordinator, args.num_processes, args.process_id = ray.coordinator, ray.num_processes, 0
    options = cluster_options(args)
    if options is None:
        return None
    log.info("process %d of %d, coordinator %s (from %s)", options.process_id, options.num_processes,
             options.coordinator, _settings(args)[3])
    try:
        cluster = join(options, fingerprint(args) if shared is None else shared, wait_for_load=wait_for_load)
    except JoinError as exc:
        raise UserError(str(exc)) from None
    cluster.launched = ray
    session = Session(cluster)
    if not cluster.is_leader:
        from jaxserve.cluster.follower import install_signal_handlers

        session.shutdown = install_signal_handlers(cluster)
    if check_mesh:
        _check_mesh(mesh)
    return session


def _check_mesh(mesh: MeshShape | None) -> None:
    try:
        check_mesh_fits(*MeshShape.of(mesh))
    except ValueError as exc:
        raise UserError(str(exc)) from None
