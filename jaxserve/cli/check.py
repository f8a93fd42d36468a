"""`jaxserve check --mesh TPxPP [--coordinator ... --num-processes N --process-id I]`: options and report.

No jax at import time (the CLI imports this module for `--help`).
"""

from __future__ import annotations

import argparse
import socket

from jaxserve.cli.args import (
    UserError,
    add_distributed_arguments,
    add_mesh_arguments,
    mesh_of,
    positive_float,
)
from jaxserve.config import MeshShape


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    add_mesh_arguments(parser, help="the mesh to check, as given to serve (default: every device in one tp group)")
    parser.add_argument("--size-mib", type=positive_float, default=16.0, metavar="MIB",
                        help="data per device in each collective (bigger: steadier bandwidth numbers)")
    add_distributed_arguments(parser)
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))


def run_check(args: argparse.Namespace) -> int:
    from jaxserve.cli.cluster import start_cluster

    args.mesh = mesh_of(args)
    session = start_cluster(args, args.mesh, check_mesh=False)
    import jax

    from jaxserve.cluster import check
    tp, pp = args.mesh or MeshShape(jax.device_count(), 1)
    if tp * pp > jax.device_count() or (session is not None and tp * pp != jax.device_count()):
        raise UserError(f"mesh {tp}x{pp} needs {tp * pp} devices; the {jax.process_count()} process(es) have "
                        f"{jax.device_count()}: give --mesh with tp x pp = {jax.device_count()}")
    hosts = {0: socket.gethostname()} if session is None or session.cluster.is_leader else {}
    if session is not None:
        hosts |= {pid: peer.host for pid, peer in session.cluster.peers.items()}
    try:
        mesh, results = check.run_checks(tp, pp, int(args.size_mib * 2**20), args.distributed_timeout)
    except check.CollectiveTimeout as exc:
        from jaxserve.cluster.distributed import fatal

        fatal(str(exc))  # the stuck collective cannot be left any other way
    if session is not None and not session.cluster.is_leader:
        from jaxserve.cluster.follower import await_release

        print(f"process {jax.process_index()}: every collective passed; process 0 prints the report", flush=True)
        await_release(session.cluster, args.distributed_timeout)
        return 0
    print(f"jaxserve check: {jax.process_count()} process(es), {jax.device_count()} {jax.devices()[0].platform} "
          f"devices, mesh {tp}x{pp} (tp x pp)")
    print("\n".join(check.topology_lines(mesh, hosts)))
    for measurement in results:
        print("  " + measurement.line())
    print("OK: every process joined and every collective returned the right values", flush=True)
    if session is not None:
        session.cluster.close(clean=True)
    return 0
