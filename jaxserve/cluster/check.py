"""`jaxserve check`: is this mesh usable? The check vLLM's docs send people to before serving on several nodes.

It lists every process and device and where each sits in the mesh, then runs the two collectives serving
depends on (an all-reduce over `tp`, a ppermute over `pp`), checks their results and reports their bandwidth.
Each collective runs under a deadline: processes that joined the coordinator but whose devices cannot reach each
other (the multi-NIC / wrong-interface trouble) make collectives hang, and the check says so instead.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from functools import partial

import jax
import numpy as np

from jaxserve.parallel.multihost import host_copy
from jaxserve.parallel.sharding import PIPELINE_AXIS, TENSOR_AXIS, make_mesh, per_device_spec, replicated

ITERATIONS = 5


class CollectiveTimeout(RuntimeError):
    pass


@dataclass(frozen=True)
class Measurement:
    name: str
    bytes_per_device: int
    seconds: float  # per call, after a first (compiling) call
    bus_factor: float  # nccl-tests' bus bandwidth: algorithm bandwidth x this (all-reduce: 2(n-1)/n)

    def line(self) -> str:
        algbw = self.bytes_per_device / self.seconds / 1e9
        return (f"{self.name}: {self.bytes_per_device / 2**20:.1f} MiB per device in {self.seconds * 1e3:.2f} ms: "
                f"{algbw:.2f} GB/s algorithm, {algbw * self.bus_factor:.2f} GB/s bus bandwidth")


def topology_lines(mesh, hosts: dict[int, str]) -> list[str]:
    """One line per process: its host, its devices, and their (stage, tp rank) places in the mesh."""
    place = {d.id: (s, r) for (s, r), d in np.ndenumerate(mesh.devices)}
    lines = []
    for proc in range(jax.process_count()):
        devices = [d for d in jax.devices() if d.process_index == proc]
        where = ", ".join(f"{d.id}->pp{place[d.id][0]}/tp{place[d.id][1]}" if d.id in place else f"{d.id}->unused"
                          for d in devices)
        kind = devices[0].device_kind if devices else "no devices"
        lines.append(f"  process {proc} on {hosts.get(proc, '?')}: {len(devices)} x {kind}: {where}")
    return lines


def _run_with_deadline(fn, timeout: float, what: str):
    """Run fn in a thread; a collective stuck on an unreachable peer cannot be interrupted, only abandoned."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 (re-raised in the caller's thread)
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name=f"jaxserve-check-{what}")
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise CollectiveTimeout(
            f"the {what} did not finish within {timeout:.0f} s: the processes joined the coordinator but their "
            f"devices cannot exchange data. Check that every node can reach the others on the interface the "
            f"collectives use (set NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME to it) and that no firewall blocks them")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _time(fn, x) -> float:
    jax.block_until_ready(fn(x))  # compile and warm up
    start = time.perf_counter()
    for _ in range(ITERATIONS):
        x = fn(x)
    jax.block_until_ready(x)
    return (time.perf_counter() - start) / ITERATIONS


def _per_device_input(mesh, elements: int):
    """[pp, tp, elements] float32, device (s, r) holding the value s * tp + r + 1 everywhere."""
    pp, tp = mesh.devices.shape
    spec = per_device_spec()
    sharding = jax.sharding.NamedSharding(mesh, spec)
    values = (np.arange(pp * tp, dtype=np.float32) + 1).reshape(pp, tp, 1)
    return jax.make_array_from_callback((pp, tp, elements), sharding,
                                        lambda idx: np.broadcast_to(values[idx[:2]], (1, 1, elements)).copy()), spec


def all_reduce_over_tp(mesh, bytes_per_device: int, timeout: float) -> Measurement:
    pp, tp = mesh.devices.shape
    x, spec = _per_device_input(mesh, bytes_per_device // 4)
    # Dividing by tp keeps the values fixed from call to call, so the timed loop checks itself.
    body = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, TENSOR_AXIS) / tp, mesh=mesh, in_specs=spec,
                                 out_specs=spec))
    out = _run_with_deadline(lambda: _gathered_first(body(x)), timeout, "all-reduce over tp")
    expected = (np.arange(pp * tp, dtype=np.float32) + 1).reshape(pp, tp).mean(axis=1, keepdims=True)
    _expect(out, np.broadcast_to(expected, (pp, tp)), "all-reduce over tp")
    seconds = _run_with_deadline(partial(_time, body, x), timeout, "all-reduce over tp")
    return Measurement(f"all-reduce over tp ({tp} devices, {_reach(mesh.devices)})", bytes_per_device, seconds,
                       2 * (tp - 1) / tp)


def ppermute_over_pp(mesh, bytes_per_device: int, timeout: float) -> Measurement:
    pp, tp = mesh.devices.shape
    x, spec = _per_device_input(mesh, bytes_per_device // 4)
    ring = [(s, (s + 1) % pp) for s in range(pp)]  # each stage hands its block to the next, as the pipeline does
    body = jax.jit(jax.shard_map(lambda a: jax.lax.ppermute(a, PIPELINE_AXIS, ring), mesh=mesh, in_specs=spec,
                                 out_specs=spec))
    out = _run_with_deadline(lambda: _gathered_first(body(x)), timeout, "ppermute over pp")
    _expect(out, np.roll((np.arange(pp * tp, dtype=np.float32) + 1).reshape(pp, tp), 1, axis=0), "ppermute over pp")
    seconds = _run_with_deadline(partial(_time, body, x), timeout, "ppermute over pp")
    return Measurement(f"ppermute over pp ({pp} stages, {_reach(mesh.devices.T)})", bytes_per_device, seconds, 1.0)


def _reach(groups) -> str:
    """Whether any group (a row of `groups`) spans processes: those collectives cross the network."""
    across = any(len({d.process_index for d in row}) > 1 for row in groups)
    return "across processes" if across else "within each process"


def _gathered_first(x) -> np.ndarray:
    """[pp, tp]: each device's first element, read on every process (each checks the whole mesh's result)."""
    first = jax.jit(lambda a: a[:, :, 0], out_shardings=replicated(x.sharding.mesh))(x)
    return np.asarray(host_copy(first))


def _expect(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if not np.allclose(got, want):
        raise RuntimeError(f"the {what} returned wrong values ({got.tolist()} instead of {want.tolist()}): the "
                           f"devices or their links corrupt data")


def run_checks(tp: int, pp: int, bytes_per_device: int, timeout: float) -> tuple[object, list[Measurement]]:
    mesh = make_mesh(tp, pp)
    results = [all_reduce_over_tp(mesh, bytes_per_device, timeout)] if tp > 1 else []
    if pp > 1:
        results.append(ppermute_over_pp(mesh, bytes_per_device, timeout))
    return mesh, results
