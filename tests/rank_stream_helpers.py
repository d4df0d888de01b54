"""Faults and waits of test_rank_stream_breaks.py: a frame lost between the engine and one rank on the
zmq path (either way), a rank restarted, a swap round trip checked byte for byte."""
from __future__ import annotations

import time

import numpy as np

from cache_manager.queue import wire
from cache_manager.queue.session import TASKS
from tests.service_helpers import block_bytes, views


def wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def drop_one_task_frame(server, rank: int) -> None:
    """The next task frame for ``rank`` leaves (its counter is spent) and is lost on the way, as
    frames queued on a zmq pipe are when the connection drops and reconnects."""
    real = server._task_sender.send_task
    lost: list[bool] = []

    def lossy(session, payload):
        if session is not None and session.rank == rank and not lost:
            lost.append(True)
            session.advance(TASKS)
            return None
        return real(session, payload)

    server._task_sender.send_task = lossy


def drop_one_result_frame(server, rank: int) -> None:
    """The next result frame from ``rank`` on the zmq control port is lost before the engine reads it."""
    real = server._handle
    lost: list[bool] = []
    prefix = f"rank{rank}.r".encode()

    def lossy(frames):
        if not lost and len(frames) == 2 and frames[0].startswith(prefix):
            try:
                body = wire.parse_body(wire.open_frame(frames[1], server._secret).payload)
            except wire.BadFrame:
                body = {}
            if body.get("type") == "result":
                lost.append(True)
                return None
        return real(frames)

    server._handle = lossy


def restarted(svc, rank: int, old_pid: int, timeout: float) -> bool:
    """A new process serves ``rank`` (up, answering a ping) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    if not wait_for(lambda: svc.pids()[rank] != old_pid and not svc.tracker.is_down(rank), timeout):
        return False
    answers = svc.control("ping").result(timeout=max(1.0, deadline - time.monotonic()))
    return answers[rank]["pid"] == svc.pids()[rank] != old_pid


def swap_is_bit_exact(svc, block: int, slot: int, into: int) -> bool:
    """Block ``block`` out to host slot ``slot`` and back into block ``into``: byte for byte on every rank."""
    want = block_bytes(svc, [block])
    svc.swap_to_cpu([block], [slot]).result(timeout=30)
    for view in views(svc).values():
        view[[into]] = 0
    svc.swap_to_gpu([into], [slot]).result(timeout=30)
    got = block_bytes(svc, [into])
    return all(np.array_equal(got[k], want[k]) for k in want)
