"""The CLI's way into multi-process serving: options (flags or environment), joining, and each process's role.

`start_cluster(args, mesh)` runs before the engine is built (jax.distributed must start before jax's backends);
`session.take_role(engine)` runs after: process 0 gets its engine back, now broadcasting each step, while a
follower runs the follower loop and exits when released, so commands need no multi-node code of their own.
"""

from __future__ import annotations

import argparse
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


def _from_env(args: argparse.Namespace, name: str, convert=str):
    value = getattr(args, name, None)
    if value is None and os.environ.get(ENV[name]):
        try:
            value = convert(os.environ[ENV[name]])
        except ValueError:
            raise UserError(f"environment variable {ENV[name]}={os.environ[ENV[name]]!r} is not valid") from None
    return value


def cluster_options(args: argparse.Namespace) -> ClusterOptions | None:
    """None for a single process. Flags win over JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID."""
    num = _from_env(args, "num_processes", int)
    if num is None or num <= 1:
        return None
    coordinator, pid = _from_env(args, "coordinator"), _from_env(args, "process_id", int)
    if coordinator is None or pid is None:
        raise UserError(f"--num-processes {num} needs --coordinator HOST:PORT (the address of process 0) and "
                        f"--process-id (0 on that host, 1..{num - 1} elsewhere) on every process")
    try:
        return ClusterOptions(coordinator, num, pid, float(getattr(args, "distributed_timeout", 300.0)))
    except ValueError as exc:
        raise UserError(str(exc)) from None


def is_leader(args: argparse.Namespace) -> bool:
    """Whether this process serves HTTP: a single process, process 0, or the process that launches Ray actors."""
    pid = _from_env(args, "process_id", int)
    return pid in (None, 0)


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
    if getattr(args, "distributed_executor_backend", "mp") == "ray" and _from_env(args, "process_id", int) is None:
        from jaxserve.cli.ray import launch_followers

        ray = launch_followers(args)
        args.coordinator, args.num_processes, args.process_id = ray.coordinator, ray.num_processes, 0
    options = cluster_options(args)
    if options is None:
        return None
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
