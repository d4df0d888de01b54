"""Fault matrix rows (DESIGN §3.8, §4) of the queue at TP=2 with real CTM processes: replayed and
malformed frames through a Tap (tests/queue_helpers.py), and an exception in the queue's I/O
loop.  Each asserts what the engine sees afterwards, byte for byte.  The rest of the matrix is
in test_fault_matrix.py and test_fault_processes.py.
"""
from __future__ import annotations

import os
import time

import pytest

from tests.fault_helpers import _deadlines_still_fire, _same, _wait_for
from tests.service_helpers import block_bytes, write_random_blocks


# ---------------------------------------------------------------- replayed and malformed frames
@pytest.fixture(scope="module")
def tapped():
    """TP=2 CTMs that reach the engine's queue through a Tap (tests/queue_helpers.py), a
    man in the middle that records the exact frames and can replay them."""
    import engine_hooks.service as service_module
    from tests.queue_helpers import Tap

    real_server = service_module.EngineCacheQueueServer
    made = {}

    def server_with_tap(*args, **kwargs):
        server = real_server(*args, **kwargs, local_links=False)  # the tap sees zmq frames only
        made["tap"] = tap = Tap(server)
        host, port = tap.address.rsplit(":", 1)
        made["svc"].extra_flags.update(pod_ip=host.rsplit("/", 1)[1], cache_queue_port=int(port))
        return server

    from engine_hooks import CacheTransferService
    from tests.service_helpers import NUM_CPU_BLOCKS, SMALL

    service_module.EngineCacheQueueServer = server_with_tap
    try:
        svc = made["svc"] = CacheTransferService(SMALL, tp=2, num_cpu_blocks=NUM_CPU_BLOCKS, task_timeout=20.0)
        svc.start()
    finally:
        service_module.EngineCacheQueueServer = real_server
    yield svc, made["tap"]
    svc.shutdown()
    made["tap"].close()


def _ctm_log(svc, rank: int) -> str:
    with open(svc.procs[rank].log_path, errors="replace") as f:
        return f.read()


def _round_trip(svc, block: int, slot: int, seed: int) -> None:
    want = write_random_blocks(svc, [block], seed)
    svc.swap_to_cpu([block], [slot]).result(timeout=20)
    write_random_blocks(svc, [block], seed + 1)
    svc.swap_to_gpu([block], [slot]).result(timeout=20)
    assert _same(block_bytes(svc, [block]), want)


def test_a_replayed_task_frame_never_runs_again(tapped):
    svc, tap = tapped
    write_random_blocks(svc, [3], seed=41)
    svc.swap_to_cpu([3], [0]).result(timeout=20)
    before = {r: len(tap.frames("down", "tasks", f"rank{r}.t".encode())) for r in range(2)}
    svc.swap_to_gpu([3], [0], timeout=60).result(timeout=20)  # a deadline far off: only the counter stops a replay
    frames = {r: tap.frames("down", "tasks", f"rank{r}.t".encode())[before[r]:] for r in range(2)}
    assert all(len(f) == 1 for f in frames.values()), frames
    reused = write_random_blocks(svc, [3], seed=42)  # the engine reuses block 3
    logged = [_ctm_log(svc, r).count("dropped frame") for r in range(2)]  # the log files are the session's
    for r in range(2):
        identity = tap.identity("tasks", f"rank{r}.t".encode())
        tap.replay("down", "tasks", identity, frames[r][0])  # the same bytes on the same connection
        tap.replay("down", "tasks", tap.identity("tasks", f"rank{1 - r}.t".encode()), frames[r][0])  # the other rank's
    _wait_for(lambda: all(_ctm_log(svc, r).count("dropped frame") >= logged[r] + 2 for r in range(2)), 5, "the drops")
    time.sleep(0.2)
    assert _same(block_bytes(svc, [3]), reused), "a replayed swap ran again"
    _round_trip(svc, 3, 1, seed=43)


def test_a_replayed_hello_from_another_connection_takes_nothing_over(tapped):
    import zmq

    svc, tap = tapped
    hello = tap.frames("up", "control", b"rank0")[0]  # rank 0's first frame: its hello
    ctx = zmq.Context()
    try:
        attacker = ctx.socket(zmq.DEALER)
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.connect(svc.server.address)
        dropped = svc.server.dropped_frames
        attacker.send(hello)
        attacker.send(b"CTMQ garbage that never authenticated")
        _wait_for(lambda: svc.server.dropped_frames >= dropped + 2, 5, "the drops")
        assert not attacker.poll(300), "the attacker was answered"
        assert svc.server.registered_ranks() == {0, 1}
        _round_trip(svc, 5, 2, seed=44)  # rank 0 still gets its tasks and answers them
        assert not attacker.poll(100), "the attacker received a task"
    finally:
        ctx.destroy(0)


def test_malformed_authenticated_frames_are_dropped_and_every_thread_lives(tapped):
    import zmq

    from cache_manager.queue import wire

    svc, tap = tapped
    secret = svc._secret
    nonce = os.urandom(16)
    hello = {"type": "hello", "channel": "control", "rank": 0, "pid": 1, "nonce": nonce}
    nested: object = 0
    for _ in range(100):
        nested = [nested]
    bodies = [{**hello, "rank": [0]}, {**hello, "rank": 7}, {**hello, "rank": True}, {**hello, "pid": float("inf")},
              {**hello, "pid": float("nan")}, {**hello, "pid": 10 ** 30 % 2 ** 64}, {**hello, "nonce": nested},
              {**hello, "channel": {"a": 1}}, {"type": "barrier", "name": "b", "value": 0, "timeout": float("inf")},
              {"type": ["hello"]}]
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(svc.server.address)
        dropped = svc.server.dropped_frames
        for body in bodies:
            sock.send(wire.encode(body, secret))
        _wait_for(lambda: svc.server.dropped_frames >= dropped + len(bodies), 5, "the drops")
        assert svc.server.dropped_frames == dropped + len(bodies)
        assert not sock.poll(200)
    finally:
        ctx.destroy(0)
    assert svc.server.loop_errors == 0 and svc.server.io_thread_alive()
    assert svc._supervisor.is_alive()
    _round_trip(svc, 6, 3, seed=45)


def test_an_exception_in_the_queue_io_loop_costs_one_iteration(tapped, monkeypatch):
    svc, _ = tapped
    server = svc.server
    real = server._expire_barriers
    calls = {"n": 0}

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected queue fault")
        return real(*args, **kwargs)

    errors = server.loop_errors
    monkeypatch.setattr(server, "_expire_barriers", failing_once)
    svc.control("ping").result(timeout=10)  # wakes the I/O loop
    _wait_for(lambda: server.loop_errors == errors + 1, 5, "the injected fault")
    assert server.io_thread_alive()
    _deadlines_still_fire(svc, rank=1)
    _round_trip(svc, 7, 4, seed=46)
