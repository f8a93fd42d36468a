"""The step channel without jax.distributed: the wire format round trip, and join / loss / heartbeat behaviour of
LeaderChannel and FollowerChannel over loopback sockets (each test well under a second)."""

import socket
import threading
import time

import jax
import numpy as np
import pytest

from jaxserve.cluster import channel, wire
from jaxserve.cluster.channel import FollowerChannel, JoinError, LeaderChannel
from jaxserve.runner.buckets import Buckets
from jaxserve.runner.plan import PlanShape, empty_inputs, inputs_treedef
from jaxserve.runner.sampler import SamplerFlags
from jaxserve.runner.step import StepStatics


def free_port_pair() -> int:
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def test_step_round_trip_keeps_every_array_and_the_statics():
    shape = PlanShape(Buckets.for_limits(32, 4), 8, 1000, 64, 5)
    inputs = empty_inputs(16, 4, shape, penalties=True, constrained=True)  # every optional array present
    inputs.token_ids[:] = np.arange(16)
    inputs.sampling.temperature[:] = 0.5
    inputs.sampling.allowed[1, :] = 0x5555
    statics = StepStatics(SamplerFlags.for_constrained(penalties=True, num_logprobs=5), 5, True)
    leaves = jax.tree_util.tree_leaves(inputs)
    kind, payload = wire.STEP, wire.encode_step(leaves, statics)
    got_leaves, got_statics = wire.decode_step(payload, StepStatics)
    assert got_statics == statics and isinstance(got_statics.sampler, SamplerFlags)
    assert [(a.dtype, a.shape) for a in got_leaves] == [(a.dtype, a.shape) for a in leaves]
    assert all(np.array_equal(a, b) for a, b in zip(got_leaves, leaves))
    rebuilt = jax.tree_util.tree_unflatten(inputs_treedef(shape, got_statics.decode_only), got_leaves)
    assert np.array_equal(rebuilt.token_ids, np.arange(16)) and kind == b"STEP"


def test_a_decode_only_step_is_rebuilt_with_its_static_flag():
    """The flag is part of the pytree structure, which is not sent: the statics' copy must restore it, or a
    follower would compile a different program than the leader."""
    shape = PlanShape(Buckets.for_limits(32, 4), 8, 1000, 64, 5, decode_kernel=True)
    inputs = empty_inputs(4, 4, shape, decode_only=True)
    leaves, statics = wire.decode_step(wire.encode_step(jax.tree_util.tree_leaves(inputs), StepStatics(decode_only=True)),
                                       StepStatics)
    rebuilt = jax.tree_util.tree_unflatten(inputs_treedef(shape, statics.decode_only), leaves)
    assert rebuilt.meta.decode_only and jax.tree_util.tree_structure(rebuilt) == jax.tree_util.tree_structure(inputs)


def test_adapter_factors_round_trip_with_their_slot_and_names():
    factors = {"wq_lora_a": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
               "wq_lora_b": np.ones((2, 4, 5), np.float16), "empty": np.zeros((0, 3), np.float32)}
    slot, got = wire.decode_adapter(wire.encode_adapter(3, factors))
    assert slot == 3 and list(got) == list(factors)
    assert all(got[k].dtype == v.dtype and np.array_equal(got[k], v) for k, v in factors.items())


def test_a_stranger_on_the_port_is_not_read_as_a_frame():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"GET / HTTP/1.1\r\n\r\n")
        with pytest.raises(ValueError, match="not a jaxserve peer"):
            wire.read_frame(b)


def hello(pid, n=2, **fingerprint):
    return {"process_id": pid, "num_processes": n, "host": "node-b", "pid": 4242, "fingerprint": fingerprint}


def join_pair(port, fingerprint=None, follower_fingerprint=None, liveness=30.0):
    """Leader gathers in a thread while the follower connects; -> (leader, follower or the follower's error)."""
    leader = LeaderChannel("127.0.0.1", port, 2, liveness_seconds=liveness)
    done = {}
    thread = threading.Thread(target=lambda: done.setdefault("peers", _gather(leader, fingerprint or {})))
    thread.start()
    try:
        follower = FollowerChannel.connect("127.0.0.1", port, 5, hello(1, **(follower_fingerprint or {})),
                                           liveness_seconds=liveness)
    except JoinError as exc:
        follower = exc
    thread.join(5)
    return leader, follower, done["peers"]


def _gather(leader, fingerprint):
    try:
        return leader.gather(5, fingerprint)
    except JoinError as exc:
        return exc


def test_leader_names_the_process_that_never_joined():
    leader = LeaderChannel("127.0.0.1", free_port_pair(), 3)
    start = time.monotonic()
    with pytest.raises(JoinError, match=r"process 1, process 2 of 3 did not join within 0 s"):
        leader.gather(0.3, {})
    assert time.monotonic() - start < 2
    leader.stop(clean=False)


def test_follower_names_the_unreachable_leader():
    with pytest.raises(JoinError, match=r"could not reach process 0 at 127.0.0.1:\d+ within 0 s"):
        FollowerChannel.connect("127.0.0.1", free_port_pair(), 0.3, hello(1))


def test_processes_started_with_different_options_are_refused_with_the_difference():
    _, follower, peers = join_pair(free_port_pair(), {"mesh": "4x2"}, {"mesh": "8x1"})
    assert isinstance(peers, JoinError) and "mesh='8x1' (process 0: '4x2')" in str(peers)
    assert isinstance(follower, JoinError) and "refused" in str(follower) and "8x1" in str(follower)


def test_steps_flow_and_a_closed_follower_is_reported_as_lost(monkeypatch):
    # no pings: the loss must be heard from the close itself, not when a ping wakes the follower's blocked reader
    monkeypatch.setattr(channel, "HEARTBEAT_SECONDS", 60.0)
    leader, follower, peers = join_pair(free_port_pair())
    assert peers[1].host == "node-b" and peers[1].pid == 4242
    lost, leader_lost = [], []
    leader.start(lambda peer, why: lost.append((peer.process_id, why)), lambda peer: None)
    follower.start(leader_lost.append, leader_lost.append)
    leader.broadcast(wire.frame(wire.STEP, b"payload"), lambda *a: None)
    assert follower.frames.get(timeout=2) == (wire.STEP, b"payload")
    follower.close()  # as if the process died: its socket closes
    deadline = time.monotonic() + 3
    while not lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lost and lost[0][0] == 1 and "exited or was killed" in lost[0][1]
    leader.stop(clean=False)


def test_silence_counts_as_loss_and_stop_releases_the_follower():
    leader, follower, _ = join_pair(free_port_pair(), liveness=0.5)
    leader_lost = []
    follower.start(leader_lost.append, leader_lost.append)  # the leader's ping thread is not started: it falls silent
    deadline = time.monotonic() + 3
    while not leader_lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leader_lost and "sent nothing for 0 s" in leader_lost[0]
    leader.stop(clean=True)
    follower.close()


def test_an_abort_reaches_the_follower_at_once_with_its_reason():
    leader, follower, _ = join_pair(free_port_pair())
    aborted = []
    follower.start(lambda why: None, aborted.append)
    leader.stop(clean=False, reason="process 2 was lost")
    deadline = time.monotonic() + 3
    while not aborted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborted == ["process 2 was lost"] and follower.frames.empty()
    follower.close()


def test_closing_twice_sends_one_stop_and_the_second_close_returns_at_once():
    """A command that releases its followers itself is closed again at exit: that must not wait out the step
    lock the first close kept (10 s), which would eat into the followers' wait at jax's exit barrier."""
    from types import SimpleNamespace

    from jaxserve.cluster.distributed import Cluster, ClusterOptions

    stops = []
    leader = SimpleNamespace(stop=lambda clean, reason="": stops.append((clean, reason)))
    cluster = Cluster(ClusterOptions("127.0.0.1:1234", 2, 0), leader=leader)
    cluster.close(clean=True)
    started = time.monotonic()
    cluster.close()
    assert time.monotonic() - started < 1 and stops == [(True, "")]


def test_an_abort_after_load_reaches_the_follower_at_once():
    """Before LOAD a batch follower's main thread reads aborts from the queue; after it, the main thread builds an
    engine (collectives), so the reader must act on an abort itself."""
    port = free_port_pair()
    leader = LeaderChannel("127.0.0.1", port + 1, 2)
    hello = {"process_id": 1, "num_processes": 2, "host": "h", "pid": 1, "fingerprint": {}}
    joined = threading.Thread(target=lambda: setattr(leader, "peers_", leader.gather(5, {})))
    joined.start()
    follower = FollowerChannel.connect("127.0.0.1", port + 1, 5, hello)
    joined.join()
    follower.main_thread_waits = True
    aborted = threading.Event()
    follower.start(on_lost=lambda why: None, on_abort=lambda reason: aborted.set())
    leader.start(lambda peer, why: None, lambda peer: None)
    leader.broadcast(wire.frame(wire.LOAD), lambda peer, why: None)
    leader.stop(clean=False, reason="the model is missing")
    assert aborted.wait(5) and follower.frames.get(timeout=1)[0] == wire.LOAD
    assert not follower.main_thread_waits


def test_followers_launch_and_read_back_in_the_leader_s_order():
    """With async scheduling process 0 launches step N+1 before it reads step N back, and a read-back may be a
    collective: the leader announces each launch (STEP), each pipeline tick (TICK, empty when no step enters)
    and each read-back (READ), and a follower does them in that order, reading back the steps that left its
    pipeline; at STOP it waits for the steps never read back."""
    import json
    import queue
    from types import SimpleNamespace

    from jaxserve.cluster.follower import follow
    from jaxserve.cluster.leader import BroadcastingRunner

    shape = PlanShape(Buckets.for_limits(32, 4), 8, 1000, 64, 5)
    events, sent = [], queue.Queue()

    class Runner:  # records what it is asked to do, in order
        carry = None  # a pipeline's carried activations (none here)

        def __init__(self):
            self.staged = []  # a 2-stage pipeline's one step between its stages

        def launch(self, inputs, statics):
            events.append(("launch", int(inputs.token_ids[0])))
            return SimpleNamespace(step=int(inputs.token_ids[0]))

        def tick(self, inputs, statics, tag=None):
            step = None if inputs is None else int(inputs.token_ids[0])
            events.append(("tick", step))
            self.staged.append(step)
            leaving = self.staged.pop(0) if len(self.staged) == 2 else None
            return (tag, SimpleNamespace(step=leaving)) if leaving is not None else (None, None)

        def collect(self, pending):
            events.append(("collect", pending.step))
            return pending.step

    cluster = SimpleNamespace(step_lock=threading.Lock(), broadcast=lambda data: sent.put(data), last_launched=None)
    leader = BroadcastingRunner(Runner(), cluster)
    steps = []
    for first_token in (7, 8):
        inputs = empty_inputs(16, 4, shape)
        inputs.token_ids[0] = first_token
        steps.append(leader.launch(inputs, StepStatics()))
    assert leader.collect(steps[0]) == 7 and leader.collect(steps[1]) == 8
    inputs = empty_inputs(16, 4, shape)
    inputs.token_ids[0] = 9
    assert leader.tick(inputs, StepStatics(), tag="nine") == (None, None)  # in the pipeline's first stage
    tag, pending = leader.tick(None, None)  # no new step: the step of 9 leaves
    assert tag is None and leader.collect(pending) == 9
    ticked = [("tick", 9), ("tick", None), ("collect", 9)]
    assert events == [("launch", 7), ("launch", 8), ("collect", 7), ("collect", 8), *ticked]

    frames = queue.Queue()
    while not sent.empty():
        data = sent.get()
        kind, _ = wire._HEADER.unpack(data[:wire._HEADER.size])
        frames.put((kind, data[wire._HEADER.size:]))
    assert [kind for kind, _ in list(frames.queue)] == [wire.STEP, wire.STEP, wire.READ, wire.READ, wire.TICK,
                                                        wire.TICK, wire.READ]
    frames.put((wire.STEP, frames.queue[0][1]))  # a third step, launched and never read back
    frames.put((wire.STOP, json.dumps({"clean": True}).encode()))
    events.clear()
    closed = []
    follower_cluster = SimpleNamespace(follower=SimpleNamespace(frames=frames, close=lambda: closed.append(True)),
                                       options=SimpleNamespace(coordinator="127.0.0.1:1234"))
    follow(SimpleNamespace(runner=Runner(), plan_shape=shape), follower_cluster, SimpleNamespace(overdue=lambda: False))
    assert events == [("launch", 7), ("launch", 8), ("collect", 7), ("collect", 8), *ticked, ("launch", 7)] and closed
