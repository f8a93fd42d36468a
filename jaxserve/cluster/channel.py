"""The TCP channel between process 0 (the leader) and the followers: join, step broadcast, liveness.

Why a socket of our own (and not jax's key-value store or `broadcast_one_to_all`): it names who is missing or
lost. Every follower says hello before `jax.distributed.initialize`, so a process that never starts is named by
its id (and the ones that came by host) instead of ending in a coordination-service abort that names no one; a
process that dies closes its connection,
which the other side sees at once (EOF), even while its main thread is stuck inside a collective that will never
finish. Heartbeats in both directions catch a peer whose machine vanished without closing anything.

Threads: the leader's `_watch` thread reads every follower's frames (heartbeats, shutdown requests, EOF) and
its `_ping` thread keeps idle followers fed; a follower's reader thread queues the leader's frames for the main
thread and its heartbeat thread says it is alive. A lost peer calls `on_lost`, which ends the process.
"""

from __future__ import annotations

import json
import queue
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from jaxserve.cluster import wire

HEARTBEAT_SECONDS = 2.0
LIVENESS_SECONDS = 30.0  # silence after which a peer counts as lost (its host froze or the network split)
HELLO_SECONDS = 10.0  # a connection that says nothing this long after connecting is not a follower


@dataclass(frozen=True)
class Peer:
    process_id: int
    host: str
    pid: int
    fingerprint: dict

    def describe(self) -> str:
        return f"process {self.process_id} (host {self.host}, pid {self.pid})"


class JoinError(RuntimeError):
    """Not every process joined in time, or one was started with different options; the message says which."""


def _connected_socket(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a step's frame must not wait for the next one
    return sock


class _Link:
    """One connection: whole frames written under a lock (the heartbeat thread shares it), last-heard time."""

    def __init__(self, sock: socket.socket):
        self.sock = _connected_socket(sock)
        self.lock = threading.Lock()
        self.last_heard = time.monotonic()

    def send(self, data: bytes, wait: float | None = None) -> None:
        """`wait`: give up (TimeoutError, an OSError) if another thread's send holds the link that long, e.g.
        a step stuck writing to a peer that stopped reading."""
        if not self.lock.acquire(timeout=-1 if wait is None else wait):
            raise TimeoutError("the connection is busy")
        try:
            self.sock.sendall(data)
        finally:
            self.lock.release()

    def close(self) -> None:
        # shutdown first: close() alone releases the socket only once no thread is inside a call on it, so
        # with a reader blocked in recv the peer would hear nothing until that call returned (the next ping)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed or never connected
        try:
            self.sock.close()
        except OSError:
            pass


class LeaderChannel:
    def __init__(self, host: str, port: int, num_processes: int, liveness_seconds: float = LIVENESS_SECONDS):
        self.num_processes = num_processes
        self.liveness_seconds = liveness_seconds
        self.server = _listen(host, port)
        self.links: dict[int, _Link] = {}
        self.peers: dict[int, Peer] = {}
        self._last_sent = time.monotonic()
        self._closing = threading.Event()

    # --- join ------------------------------------------------------------------------------------------------
    def gather(self, timeout: float, fingerprint: dict) -> dict[int, Peer]:
        """Wait for every follower's hello; then check they run with the leader's options and tell them so."""
        deadline = time.monotonic() + timeout
        while len(self.peers) < self.num_processes - 1:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.server], [], [], left)[0]:
                raise JoinError(self._missing_message(timeout))
            self._accept_one()
        problems = [f"{p.describe()}: {d}" for p in self.peers.values() if (d := _differences(fingerprint, p.fingerprint))]
        if problems:
            message = "processes were started with different options; " + "; ".join(problems)
            self.stop(clean=False, reason=message)
            raise JoinError(message)
        for pid, link in self.links.items():
            try:
                link.send(wire.json_frame(wire.HELO, {"ok": True}))
            except OSError:
                raise JoinError(f"{self.peers[pid].describe()} disconnected while the processes joined") from None
        return dict(sorted(self.peers.items()))

    def _accept_one(self) -> None:
        sock, _ = self.server.accept()
        try:
            sock.settimeout(HELLO_SECONDS)
            kind, payload = wire.read_frame(sock)
            hello = json.loads(payload) if kind == wire.HELO else {}
            pid = int(hello.get("process_id", -1))
            if not 0 < pid < self.num_processes or pid in self.peers or hello.get("num_processes") != self.num_processes:
                raise ValueError(f"unexpected hello {hello}")
            sock.settimeout(None)
        except (OSError, ValueError, wire.ChannelClosed):
            sock.close()  # a stranger, a duplicate id or a mismatched process count: not one of ours
            return
        self.links[pid] = _Link(sock)
        self.peers[pid] = Peer(pid, str(hello.get("host")), int(hello.get("pid", 0)), hello.get("fingerprint", {}))

    def _missing_message(self, timeout: float) -> str:
        missing = [i for i in range(1, self.num_processes) if i not in self.peers]
        joined = ", ".join(p.describe() for p in self.peers.values()) or "none"
        names = ", ".join(f"process {i}" for i in missing)
        return (f"{names} of {self.num_processes} did not join within {timeout:.0f} s (followers that joined: "
                f"{joined}). Start it with the same --coordinator and --num-processes and its --process-id, and "
                f"check that it can reach this host (firewall, wrong address or network interface)")

    # --- serving ---------------------------------------------------------------------------------------------
    def start(self, on_lost: Callable[[Peer, str], None], on_term: Callable[[Peer], None]) -> None:
        threading.Thread(target=self._watch, args=(on_lost, on_term), name="jaxserve-leader-watch",
                         daemon=True).start()
        threading.Thread(target=self._ping, args=(on_lost,), name="jaxserve-leader-ping", daemon=True).start()

    def broadcast(self, data: bytes, on_lost: Callable[[Peer, str], None]) -> None:
        for pid, link in list(self.links.items()):
            try:
                link.send(data)
            except OSError as exc:
                if not self._closing.is_set():  # stop() shut the connection under a send: no loss
                    on_lost(self.peers[pid], f"the connection to it broke ({exc.strerror or exc})")
        self._last_sent = time.monotonic()

    def stop(self, clean: bool, reason: str = "") -> None:
        """Tell every follower to exit (best effort: some may be gone already) and close the connections. Only
        the first call acts, so an explicit stop and the exit-time one do not both send."""
        if self._closing.is_set():
            return
        self._closing.set()
        data = wire.json_frame(wire.STOP, {"clean": clean, "reason": reason})
        for link in self.links.values():
            try:
                link.sock.settimeout(2.0)  # a follower that stopped reading must not hold the leader's exit
                link.send(data, wait=2.0)
            except OSError:
                pass
            link.close()
        self.server.close()

    def _watch(self, on_lost, on_term) -> None:
        by_sock = {link.sock: pid for pid, link in self.links.items()}
        while not self._closing.is_set():
            try:
                ready = select.select(list(by_sock), [], [], 1.0)[0]
            except (OSError, ValueError):  # sockets closed under us: we are stopping
                return
            for sock in ready:
                pid = by_sock[sock]
                try:
                    kind, _ = wire.read_frame(sock)
                except (OSError, ValueError, wire.ChannelClosed) as exc:
                    if not self._closing.is_set():
                        on_lost(self.peers[pid], f"its connection closed ({_reason(exc)})")
                    return
                self.links[pid].last_heard = time.monotonic()
                if kind == wire.TERM:
                    on_term(self.peers[pid])
            self._check_silence(on_lost)

    def _check_silence(self, on_lost) -> None:
        now = time.monotonic()
        for pid, link in self.links.items():
            if now - link.last_heard > self.liveness_seconds and not self._closing.is_set():
                on_lost(self.peers[pid], f"it sent no heartbeat for {self.liveness_seconds:.0f} s")

    def _ping(self, on_lost) -> None:
        while not self._closing.wait(HEARTBEAT_SECONDS / 2):
            if time.monotonic() - self._last_sent >= HEARTBEAT_SECONDS:
                self.broadcast(wire.frame(wire.PING), on_lost)


class FollowerChannel:
    def __init__(self, sock: socket.socket, liveness_seconds: float = LIVENESS_SECONDS):
        self.link = _Link(sock)
        self.liveness_seconds = liveness_seconds
        self.frames: queue.Queue = queue.Queue()
        self._closing = threading.Event()
        # True while the main thread runs no collective and will read `frames` (a batch follower before LOAD):
        # an abort is then queued for it, so that this process exits through jax.distributed's exit barrier as
        # the leader does, rather than from the reader thread (which leaves the leader waiting at that barrier).
        self.main_thread_waits = False

    @classmethod
    def connect(cls, host: str, port: int, timeout: float, hello: dict, **kw) -> FollowerChannel:
        """Connect (retrying: the leader may start later), say hello, wait for the leader's answer."""
        sock = _connect_retrying(host, port, timeout)
        sock.sendall(wire.json_frame(wire.HELO, hello))
        sock.settimeout(timeout)  # the leader answers once every process has joined
        try:
            kind, payload = wire.read_frame(sock)
        except TimeoutError:
            raise JoinError(f"process 0 at {host}:{port} accepted the connection but not every process joined "
                            f"within {timeout:.0f} s") from None
        except wire.ChannelClosed:
            raise JoinError(f"process 0 at {host}:{port} closed the connection while processes joined") from None
        if kind == wire.STOP:
            raise JoinError(f"process 0 refused this process: {json.loads(payload).get('reason')}")
        sock.settimeout(None)
        return cls(sock, **kw)

    def start(self, on_lost: Callable[[str], None], on_abort: Callable[[str], None]) -> None:
        """`on_abort(reason)`: the leader stopped the cluster for a failure; acted on here, at once, since the
        main thread may be loading or compiling and would see the STOP only much later."""
        threading.Thread(target=self._read, args=(on_lost, on_abort), name="jaxserve-follower-read",
                         daemon=True).start()
        threading.Thread(target=self._beat, name="jaxserve-follower-beat", daemon=True).start()

    def request_shutdown(self) -> None:
        try:
            self.link.send(wire.frame(wire.TERM))
        except OSError:
            pass

    def close(self) -> None:
        self._closing.set()
        self.link.close()

    def _read(self, on_lost, on_abort) -> None:
        self.link.sock.settimeout(self.liveness_seconds)
        while not self._closing.is_set():
            try:
                kind, payload = wire.read_frame(self.link.sock)
            except TimeoutError:
                return on_lost(f"it sent nothing for {self.liveness_seconds:.0f} s")
            except (OSError, ValueError, wire.ChannelClosed) as exc:
                if not self._closing.is_set():
                    on_lost(f"its connection closed ({_reason(exc)})")
                return
            if kind == wire.STOP and not json.loads(payload).get("clean") and not self.main_thread_waits:
                return on_abort(json.loads(payload).get("reason") or "no reason given")
            if kind == wire.LOAD:  # from here the main thread builds an engine: a later abort must act at once
                self.main_thread_waits = False
            if kind != wire.PING:
                self.frames.put((kind, payload))
            if kind == wire.STOP:
                return  # the leader closes the connection next: that EOF is no loss

    def _beat(self) -> None:
        while not self._closing.wait(HEARTBEAT_SECONDS):
            try:
                self.link.send(wire.frame(wire.LIVE))
            except OSError:
                return  # the reader sees the broken connection and reports it


def _listen(host: str, port: int) -> socket.socket:
    """Listen where followers can reach us: on the loopback address when the coordinator is local, else on every
    interface (as jax's coordinator does), since the coordinator's name may not be bindable (NAT, DNS alias)."""
    loopback = host in ("localhost", "::1") or host.startswith("127.")
    dual = not loopback and socket.has_dualstack_ipv6()
    try:
        return socket.create_server((host if loopback else "", port), backlog=64,
                                    family=socket.AF_INET6 if dual or ":" in host else socket.AF_INET,
                                    dualstack_ipv6=dual)
    except OSError as exc:
        raise JoinError(f"process 0 cannot listen on port {port} for its followers ({exc.strerror}); the step "
                        f"channel uses the coordinator port + 1, so pick a --coordinator port with both free") from None


def _connect_retrying(host: str, port: int, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection((host, port), timeout=min(5.0, max(0.1, deadline - time.monotonic())))
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise JoinError(f"could not reach process 0 at {host}:{port} within {timeout:.0f} s ({exc.strerror or exc});"
                                " check that it runs, the --coordinator address, and the firewall") from None
            time.sleep(0.2)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, (wire.ChannelClosed, ConnectionResetError, BrokenPipeError)):
        return "the process exited or was killed"
    return str(exc) or type(exc).__name__


def _differences(mine: dict, theirs: dict) -> str:
    keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    return ", ".join(f"{k}={theirs.get(k)!r} (process 0: {mine.get(k)!r})" for k in keys)
