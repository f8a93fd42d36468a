"""The byte format of the leader -> follower step channel: length-prefixed frames, each a 4-byte kind and a payload.

A step's payload is a JSON header (the static choices and each array's dtype and shape) followed by the arrays'
raw bytes. No pickle: a follower must never run code because of what arrives on a socket, and numpy buffers
need no encoding beyond their bytes. The pytree structure is not sent; the receiver rebuilds it from a template
of its own (every process runs the same code, so the structures agree).

Imports no jax: the pytree helpers are passed in by the caller.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
import typing
from typing import Any

import numpy as np

# Frame kinds. Leader -> follower: STEP (launch a step), TICK (one tick of a pipeline whose stages stay busy across
# steps: the step entering it, or an empty payload for none; ModelRunner.tick), READ (read back the oldest step
# launched and not read back yet: the leader reads its steps back in launch order, one step behind with async
# scheduling, and a read-back can be a collective every process joins at the same point), PING (idle heartbeat),
# STOP (payload: {"clean": bool, "reason": str}), LOAD (build the engine now: commands whose leader may decide to
# run nothing, like `batch`, send it first), LORA (write a LoRA adapter's factors into a device slot before the next
# step: only process 0 reads adapters). Follower -> leader: HELO (payload: JSON facts about the process), LIVE
# (heartbeat), TERM (it got a signal).
STEP, TICK, READ, PING, STOP, LOAD, LORA = b"STEP", b"TICK", b"READ", b"PING", b"STOP", b"LOAD", b"LORA"
HELO, LIVE, TERM = b"HELO", b"LIVE", b"TERM"
KINDS = {STEP, TICK, READ, PING, STOP, LOAD, LORA, HELO, LIVE, TERM}

_HEADER = struct.Struct("!4sQ")
_JSON_LEN = struct.Struct("!I")
MAX_FRAME = 1 << 32  # a bigger frame means a corrupt stream (or a stranger on the port), not a real step


class ChannelClosed(ConnectionError):
    """The other end closed the connection (or it broke)."""


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return _HEADER.pack(kind, len(payload)) + payload


def json_frame(kind: bytes, obj: Any) -> bytes:
    return frame(kind, json.dumps(obj).encode())


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ChannelClosed("connection closed by the other end")
        got += k
    return bytes(buf)


def read_frame(sock: socket.socket) -> tuple[bytes, bytes]:
    """-> (kind, payload). Raises ChannelClosed on EOF, ValueError on a stream that is not ours."""
    kind, size = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if kind not in KINDS or size >= MAX_FRAME:
        raise ValueError(f"unexpected frame {kind!r} of {size} bytes: not a jaxserve peer")
    return kind, _recv_exact(sock, size) if size else b""


# --- payloads: a JSON header, then arrays --------------------------------------------------------------------
def _encode_arrays(header: dict, arrays: list[np.ndarray]) -> bytes:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    text = json.dumps({**header, "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}).encode()
    return b"".join([_JSON_LEN.pack(len(text)), text, *(a.tobytes() for a in arrays)])


def _decode_arrays(payload: bytes) -> tuple[dict, list[np.ndarray]]:
    (n,) = _JSON_LEN.unpack_from(payload)
    header = json.loads(payload[_JSON_LEN.size : _JSON_LEN.size + n])
    offset, arrays = _JSON_LEN.size + n, []
    for dtype, shape in header["arrays"]:
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        arrays.append(np.frombuffer(payload, dt, count, offset).reshape(shape))
        offset += count * dt.itemsize
    return header, arrays


def encode_step(leaves: list[np.ndarray], statics: Any) -> bytes:
    return _encode_arrays({"statics": dataclasses.asdict(statics)}, leaves)


def decode_step(payload: bytes, statics_type: type) -> tuple[list[np.ndarray], Any]:
    header, leaves = _decode_arrays(payload)
    return leaves, from_dict(statics_type, header["statics"])


def encode_adapter(slot: int, factors: dict[str, np.ndarray]) -> bytes:
    return _encode_arrays({"slot": slot, "names": list(factors)}, list(factors.values()))


def decode_adapter(payload: bytes) -> tuple[int, dict[str, np.ndarray]]:
    header, arrays = _decode_arrays(payload)
    return header["slot"], dict(zip(header["names"], arrays))


def from_dict(cls: type, values: dict) -> Any:
    """Rebuild a (nested) frozen dataclass from `dataclasses.asdict` output."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value, kind = values[f.name], hints.get(f.name)
        kwargs[f.name] = from_dict(kind, value) if dataclasses.is_dataclass(kind) else value
    return cls(**kwargs)
