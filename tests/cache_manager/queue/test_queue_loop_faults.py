"""EngineCacheQueue with exceptions injected into the server's I/O loop and the client's poll,
and the bounds of every peer-facing socket, over real zmq sockets on loopback.
"""
from __future__ import annotations

import time

import zmq

from cache_manager.queue import wire
from cache_manager.queue.local_link import MAX_BACKLOG_FRAMES
from cache_manager.queue.zmq_sockets import MAX_HELLO_FRAME_BYTES, MAX_RESULT_FRAME_BYTES
from cache_manager.queue.session import TASKS
from tests import queue_helpers
from tests.queue_helpers import Rank, registered, result, wait_for

server = queue_helpers.server  # the shared fixture, under its name here


# -- exceptions injected into long-lived loops --------------------------------------------
def raise_once(obj, name: str, monkeypatch) -> list:
    """Make ``obj.name`` raise on its next call only; returns the list of calls that raised."""
    real, raised = getattr(obj, name), []

    def patched(*args, **kwargs):
        if not raised:
            raised.append(args)
            raise RuntimeError(f"injected fault in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, patched)
    return raised


def test_an_exception_in_the_server_io_loop_costs_one_iteration(server, monkeypatch):
    ranks = [Rank(0, 2, server.address), Rank(1, 2, server.address)]
    try:
        assert registered(server, {0, 1})
        expire = raise_once(server, "_expire_barriers", monkeypatch)  # the loop itself
        handle = raise_once(server, "_result", monkeypatch)  # one frame's handling
        ranks[0].client.send_result(result("lost", 0))  # wakes the loop; its handling raises
        assert wait_for(lambda: expire and handle and server.loop_errors == 2)
        assert server.io_thread_alive() and server.results == []

        assert server.broadcast({"task_id": "t"}) == []
        assert wait_for(lambda: all(r.ids() == ["t"] for r in ranks))
        for r in ranks:
            r.client.send_result(result("t", r.client.rank))
        assert wait_for(lambda: sorted(r.rank for r in server.results) == [0, 1])
        t0 = time.monotonic()
        assert ranks[0].client.barrier("alone", 1, timeout=0.3) == (False, None)  # deadlines still fire
        assert time.monotonic() - t0 < 2
        assert server.loop_errors == 2
    finally:
        for r in ranks:
            r.close()


def test_an_exception_in_the_client_poll_costs_one_frame(server, monkeypatch):
    rank = Rank(0, 2, server.address)
    try:
        assert wait_for(lambda: 0 in server.registered_ranks())
        real_open, raised = rank.client._open, []

        def open_then_fail(frame, channel):
            body = real_open(frame, channel)
            if channel == TASKS and not raised:
                raised.append(body)
                raise RuntimeError("injected fault in the client's task handling")
            return body

        monkeypatch.setattr(rank.client, "_open", open_then_fail)
        server.broadcast({"task_id": "lost"})
        server.broadcast({"task_id": "kept"})
        assert wait_for(lambda: rank.ids() == ["kept"])
        assert rank.client.loop_errors == 1 and rank.thread.is_alive()
    finally:
        rank.close()


# -- transport bounds ---------------------------------------------------------------------
def test_every_peer_facing_socket_bounds_what_it_receives(server):
    rank = Rank(0, 2, server.address)
    try:
        rank.client.send_result(result("r", 0))
        sockets = [server._router, server._task_sender.socket, rank.client._sock, rank.client._task_sock, *rank.client._channels]
        for sock in sockets:
            assert sock.getsockopt(zmq.RCVHWM) > 0
            assert 0 < sock.getsockopt(zmq.MAXMSGSIZE) <= wire.MAX_FRAME_BYTES
        # The engine takes what ranks send (results, hellos), not a task's 16 MiB (test_queue_flood.py).
        assert server._router.getsockopt(zmq.MAXMSGSIZE) == MAX_RESULT_FRAME_BYTES
        assert server._task_sender.socket.getsockopt(zmq.MAXMSGSIZE) == MAX_HELLO_FRAME_BYTES
        # A rank that stops reading fails its tasks once its pipe is full (EAGAIN), never grows the engine.
        assert server._task_sender.socket.getsockopt(zmq.SNDHWM) == MAX_BACKLOG_FRAMES
    finally:
        rank.close()
