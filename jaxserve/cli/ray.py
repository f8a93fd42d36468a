"""`--distributed-executor-backend ray`: process 0 starts the other processes as Ray actors.

For people who already run Ray clusters (`ray start --head` on one node, `ray start --address=HEAD:6379` on the
others): run `jaxserve serve MODEL --mesh 8x2 --distributed-executor-backend ray` on the head node only. This
process joins the Ray cluster, reserves one bundle per follower in a placement group (one node each when the
cluster has a node per process), picks the coordinator address (this node's IP, free ports), and starts each
follower as an actor that runs the same command line with `--process-id I`. After that everything is the
multi-controller path: the actors join over the step channel and `jax.distributed` like processes started by
hand. Actors belong to this process, so Ray ends them when it exits, cleanly or not.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from dataclasses import dataclass

from jaxserve.errors import UserError

log = logging.getLogger(__name__)

# Environment the followers inherit from process 0: what selects and tunes jax, XLA and the collectives.
FORWARDED_ENV = ("JAX_PLATFORMS", "XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE")
FORWARDED_PREFIXES = ("NCCL_", "GLOO_", "TPU_")


@dataclass
class RayFollowers:
    coordinator: str
    num_processes: int
    actors: list
    placement_group: object


class _FollowerActor:
    """Runs `jaxserve` inside the actor's process: that process becomes the follower."""

    def run(self, argv: list[str]) -> int:
        from jaxserve.cli.main import main

        return main(argv)


def launch_followers(args: argparse.Namespace) -> RayFollowers:
    import ray

    _connect(ray)
    host = ray.util.get_node_ip_address()
    num = args.num_processes or len([n for n in ray.nodes() if n["Alive"]])
    if num < 2:
        raise UserError("the ray backend runs one process per node; this Ray cluster has one node, so give "
                        "--num-processes N (N >= 2) to run several processes on it")
    coordinator = args.coordinator or f"{host}:{_free_port_pair(host)}"
    pg, first = _reserve(ray, num, host, _follower_bundle(ray, host), args.distributed_timeout)
    actor_class = ray.remote(_FollowerActor)
    actors = []
    for i in range(1, num):
        actor = actor_class.options(
            scheduling_strategy=ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=first + i - 1),
            runtime_env={"env_vars": _forwarded_env()}, **_actor_resources(pg.bundle_specs[first + i - 1]),
        ).remote()
        actor.run.remote(_follower_argv(args.argv, coordinator, num, i))
        actors.append(actor)
    log.info("started %d Ray follower actor%s; coordinator %s", num - 1, "s" * (num > 2), coordinator)
    return RayFollowers(coordinator, num, actors, pg)


def _connect(ray) -> None:
    try:
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True, configure_logging=False)
    except (ConnectionError, RuntimeError) as exc:
        raise UserError(f"no running Ray cluster to join ({exc}); start one with `ray start --head` (and "
                        f"`ray start --address=HEAD:6379` on the other nodes), or set RAY_ADDRESS") from None


def _follower_bundle(ray, host: str) -> dict:
    """One follower's share: a node's accelerators, as many as this (head) node has; nodes are alike."""
    here = next((n for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == host), {"Resources": {}})
    bundle = {"CPU": 1.0}
    for accelerator in ("GPU", "TPU"):
        if here["Resources"].get(accelerator):
            bundle[accelerator] = float(here["Resources"][accelerator])
    return bundle


def _reserve(ray, num: int, host: str, bundle: dict, timeout: float):
    """-> (placement group, index of the first follower bundle). A node per process when the cluster has them:
    bundle 0 pins this node, so STRICT_SPREAD leaves it to process 0. Fewer nodes: followers share (tests)."""
    from ray.util.placement_group import placement_group

    if len([n for n in ray.nodes() if n["Alive"]]) >= num:
        bundles, strategy, first = [{f"node:{host}": 0.001}] + [bundle] * (num - 1), "STRICT_SPREAD", 1
    else:
        log.warning("the Ray cluster has fewer nodes than the %d processes: followers share nodes", num)
        bundles, strategy, first = [bundle] * (num - 1), "PACK", 0
    pg = placement_group(bundles, strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise UserError(f"Ray could not reserve {num - 1} x {bundle} ({strategy}) within {timeout:.0f} s; check "
                        f"`ray status` for free nodes and resources") from None
    return pg, first


def _actor_resources(bundle: dict) -> dict:
    return {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0),
            "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}}


def _follower_argv(argv: list[str], coordinator: str, num: int, process_id: int) -> list[str]:
    """The leader's own arguments again (as `cli.main` received them, not `sys.argv`, which differs when main is
    called in-process), as process `process_id`: later flags win in argparse."""
    return list(argv) + ["--distributed-executor-backend", "mp", "--coordinator", coordinator,
                         "--num-processes", str(num), "--process-id", str(process_id)]


def _forwarded_env() -> dict:
    return {k: v for k, v in os.environ.items() if k in FORWARDED_ENV or k.startswith(FORWARDED_PREFIXES)}


def _free_port_pair(host: str) -> int:
    """A port p with p + 1 also free on this node (jax's coordinator and the step channel)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind((host, 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind((host, port + 1))
                except OSError:
                    continue
        return port
    raise UserError(f"found no two neighbouring free ports on {host}; give --coordinator HOST:PORT")
