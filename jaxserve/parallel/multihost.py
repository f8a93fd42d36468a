"""Host-side helpers that also hold when the mesh spans several processes (`jax.distributed`).

Each is a collective in the multi-process case, so every process must call them at the same point of the same
program: the engine calls them where every process runs the same code (its constructor, `ModelRunner.execute`).
"""

from __future__ import annotations

import socket
import zlib

import jax
import numpy as np
from jax.experimental import multihost_utils


def host_copy(tree):
    """`jax.device_get` for arrays that may span other processes' devices.

    A replicated array is read from a local copy (no communication). Anything else is gathered with
    `process_allgather`, so a step output that GSPMD left sharded still reaches the host whole.
    """
    def local(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return multihost_utils.process_allgather(x, tiled=True)

    return jax.device_get(jax.tree.map(local, tree))


def agree_on_min(value: int) -> int:
    """The smallest of every process's `value` (e.g. KV blocks that fit): each process must allocate the same
    cache and compile the same programs, and the process with the least free memory sets the limit."""
    if jax.process_count() == 1:
        return value
    return int(np.min(multihost_utils.process_allgather(np.asarray(value, np.int32))))


def processes_on_this_host() -> int:
    """How many of the cluster's processes run on this machine, this one included: several when a cluster is tried
    on one host, and then they share its memory. Compares host names (their CRC-32: int32 collectives only)."""
    if jax.process_count() == 1:
        return 1
    mine = np.asarray(zlib.crc32(socket.gethostname().encode()) - (1 << 31), np.int32)
    return int(np.sum(multihost_utils.process_allgather(mine) == mine))
