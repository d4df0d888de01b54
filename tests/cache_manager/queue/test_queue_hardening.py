"""EngineCacheQueue under attack, over real zmq sockets on loopback: a Tap (tests/queue_helpers.py)
sits between real clients and the real server (a message-level man in the middle on 127.0.0.2)
and replays, reorders or moves the exact bytes the real peers produced.

Malformed authenticated frames are in test_queue_malformed_frames.py, exceptions injected into
the long-lived loops in test_queue_loop_faults.py, the secret file in test_queue_secret_file.py.

Each test asserts what happened (what was delivered, what was dropped and counted), and that
every thread is alive and the queue still works afterwards.
"""
from __future__ import annotations

import threading
import time

import pytest
import zmq

from cache_manager.queue import wire
from cache_manager.queue import EngineCacheQueueClient
from cache_manager.queue.session import UP, stream
from tests import queue_helpers
from tests.queue_helpers import (SECRET, TIMEOUT, Rank, Tap, raw_socket, reasons, recv_all, registered, result,
                                 wait_for)

server = queue_helpers.server  # the shared fixture, under its name here


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(0)


# -- replay, reorder, cross-connection (real peers' bytes through the tap) ----------------
def test_a_replayed_or_reordered_task_frame_never_runs(server):
    tap = Tap(server)
    ranks = [Rank(0, 2, tap.address), Rank(1, 2, tap.address)]
    try:
        assert registered(server, {0, 1})
        assert server.broadcast({"task_id": "a"}) == []
        assert wait_for(lambda: all(r.ids() == ["a"] for r in ranks))
        frame_a = tap.frames("down", "tasks", b"rank0.t.")[0]
        tasks0, tasks1 = tap.identity("tasks", b"rank0.t."), tap.identity("tasks", b"rank1.t.")
        tap.replay("down", "tasks", tasks0, frame_a)  # the same bytes again, on the same connection
        tap.replay("down", "tasks", tasks1, frame_a)  # rank 0's frame on rank 1's connection
        assert wait_for(lambda: [r.client.dropped_frames for r in ranks] == [1, 1])
        assert server.broadcast({"task_id": "b"}) == []
        assert wait_for(lambda: all(r.ids() == ["a", "b"] for r in ranks))

        tap.swap_next.add(tasks0)  # the tap swaps the next two task frames of rank 0
        server.broadcast({"task_id": "c"})
        server.broadcast({"task_id": "d"})
        assert wait_for(lambda: "c" in ranks[0].ids() and ranks[0].client.dropped_frames == 2)
        time.sleep(0.05)
        assert ranks[0].ids() == ["a", "b", "c"], "the frame that arrived before its turn was dropped"
        assert all(r.client.loop_errors == 0 for r in ranks)
    finally:
        for r in ranks:
            r.close()
        tap.close()


def test_replayed_result_and_barrier_frames_are_dropped(server, ctx):
    tap = Tap(server)
    ranks = [Rank(0, 2, tap.address), Rank(1, 2, tap.address)]
    try:
        assert registered(server, {0, 1})
        ranks[0].client.send_result(result("r1", 0))
        assert wait_for(lambda: len(server.results) == 1)
        channel = tap.identity("control", b"rank0.r")
        captured = tap.frames("up", "control", b"rank0.r")[-1]
        before = server.dropped_frames
        tap.replay("up", "control", channel, captured)  # on the result connection it came on
        attacker = raw_socket(ctx, server.address)
        attacker.send(captured)  # from a connection of its own
        assert wait_for(lambda: server.dropped_frames == before + 2)
        ranks[0].client.send_result(result("r2", 0))  # the stream goes on after the replay
        assert wait_for(lambda: len(server.results) == 2)
        assert [r.task_id for r in server.results] == ["r1", "r2"]

        out = {}
        workers = [threading.Thread(target=lambda r=r: out.__setitem__(r, ranks[r].client.barrier("b", r + 5, 2)))
                   for r in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(TIMEOUT)
        assert out == {0: (True, 5), 1: (True, 5)}
        done = tap.frames("down", "control", b"rank0.")[-1]  # rank 0's barrier_done
        tap.replay("down", "control", tap.identity("control", b"rank0."), done)
        assert wait_for(lambda: ranks[0].client.dropped_frames == 1)
        assert recv_all(attacker, 100) == [], "the attacker received something"
        assert server.loop_errors == 0 and server.io_thread_alive()
    finally:
        for r in ranks:
            r.close()
        tap.close()


def test_a_replayed_hello_neither_registers_nor_displaces(server, ctx):
    tap = Tap(server)
    ranks = [Rank(0, 2, tap.address), Rank(1, 2, tap.address)]
    try:
        assert registered(server, {0, 1})
        hello, ready = tap.frames("up", "control", b"rank0.")[:2]
        task_hello = tap.frames("up", "tasks", b"rank0.t.")[0]
        before = dict(server.drop_reasons)
        attacker, attacker_tasks = raw_socket(ctx, server.address), raw_socket(ctx, f"tcp://127.0.0.1:{server.task_port}")
        for frame in (hello, ready):
            attacker.send(frame)
        attacker_tasks.send(task_hello)
        assert wait_for(lambda: reasons(server).get("refused", 0) == before.get("refused", 0) + 2)
        assert server.drop_reasons.get("unauthenticated", 0) == before.get("unauthenticated", 0) + 1
        assert server.registered_ranks() == {0, 1}
        assert server.broadcast({"task_id": "t"}) == []
        assert wait_for(lambda: all(r.ids() == ["t"] for r in ranks))
        assert recv_all(attacker, 100) == [] and recv_all(attacker_tasks) == [], "the attacker received something"

        # A client with the real secret cannot take a live rank over either.
        with pytest.raises(TimeoutError):
            EngineCacheQueueClient(0, 2, SECRET, server.address, hello_timeout=0.3)
        assert server.broadcast({"task_id": "u"}) == []
        assert wait_for(lambda: ranks[0].ids() == ["t", "u"])
    finally:
        for r in ranks:
            r.close()
        tap.close()


def test_a_forgotten_rank_restarts_and_its_old_hello_cannot_claim_it(server, ctx):
    tap = Tap(server)
    old = Rank(0, 2, tap.address)
    other = Rank(1, 2, server.address)
    new = None
    try:
        assert registered(server, {0, 1})
        hello, ready = tap.frames("up", "control", b"rank0.")[:2]
        old.close()
        server.forget_rank(0)  # the engine saw the process die
        assert server.registered_ranks() == {1}
        attacker = raw_socket(ctx, server.address)
        attacker.send(hello)  # answered (nobody holds rank 0), but only the secret completes it
        assert attacker.poll(int(TIMEOUT * 1000))
        attacker.recv()
        attacker.send(ready)  # the old session's ready: not this connection's session
        time.sleep(0.1)
        assert server.registered_ranks() == {1}
        new = Rank(0, 2, server.address)
        assert registered(server, {0, 1})
        assert server.broadcast({"task_id": "after-restart"}) == []
        assert wait_for(lambda: new.ids() == ["after-restart"] and other.ids() == ["after-restart"])
        assert recv_all(attacker, 50) == []
    finally:
        for r in (other, new):
            if r is not None:
                r.close()
        tap.close()


def test_frames_from_a_connection_that_never_authenticated_do_nothing(server, ctx):
    tap = Tap(server)
    ranks = [Rank(0, 2, tap.address), Rank(1, 2, tap.address)]
    try:
        assert registered(server, {0, 1})
        ranks[0].client.send_result(result("real0", 0))  # binds rank 0's result channel 2
        assert wait_for(lambda: len(server.results) == 1)
        session = wire.open_frame(tap.frames("down", "control", b"rank0.")[0], SECRET).session
        forged = [  # well-MACed with the real secret, on a connection with no handshake
            wire.encode({"type": "result", **result("forged", 0).__dict__}, SECRET),
            wire.encode({"type": "result", **result("forged", 0).__dict__}, SECRET, session, stream(2, UP), 1),
            wire.encode({"type": "barrier", "name": "b", "value": 0, "timeout": 1}, SECRET, session, 0, 1),
            wire.encode({"type": "ready"}, SECRET, session, 0, 0),
            wire.encode({"type": "hello", "channel": "results"}, SECRET, session, stream(2, UP), 0),  # bound already
        ]
        attacker = raw_socket(ctx, server.address)
        before = server.dropped_frames
        for frame in forged:
            attacker.send(frame)
        assert wait_for(lambda: server.dropped_frames == before + len(forged))
        assert ranks[1].client.barrier("b", 1, timeout=0.3) == (False, None), "the forged barrier counted"
        assert [r.task_id for r in server.results] == ["real0"]
        assert recv_all(attacker, 50) == []
        ranks[0].client.send_result(result("real1", 0))
        assert wait_for(lambda: [r.task_id for r in server.results] == ["real0", "real1"])
    finally:
        for r in ranks:
            r.close()
        tap.close()
