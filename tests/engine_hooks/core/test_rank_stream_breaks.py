"""DESIGN §4: a rank's stream to the engine breaks (a closed local link, a lost zmq frame either way)
-> the rank is declared down at once (not left alive but mute), its blocks are released, and it is
restarted; a SIGKILLed rank is restarted too.  Real CTM processes at TP=2, real faults: the engine's
end of a live rank's local link shut down under it, a task frame lost on its way to a rank, a
result frame lost on its way to the engine."""
from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import time

import pytest

import engine_hooks.service as service_module
from engine_hooks import RankDiedError, TaskFailedError
from engine_hooks.core.rank_recovery import RestartPolicy
from tests.rank_stream_helpers import (drop_one_result_frame, drop_one_task_frame, restarted, swap_is_bit_exact,
                                       wait_for)
from tests.service_helpers import fill_distinct, process_gone, segments_of, start_service

logger = logging.getLogger(__name__)

FAIL_WITHIN_S = 2.0  # "at once": the pending task's own timeout is 60 s
RESTART_WITHIN_S = 20.0  # a CTM's start (paddle's import) takes a few seconds on a loaded 2-core machine


@pytest.fixture
def zmq_only(monkeypatch):
    """Services started in this test offer no local link: every rank takes the zmq task port."""
    monkeypatch.setattr(service_module, "EngineCacheQueueServer",
                        functools.partial(service_module.EngineCacheQueueServer, local_links=False))


def _recovered(svc, victim: int, held, t0: float, match: str) -> tuple[float, float]:
    """The held task failed at once naming rank 1; the old process is gone, a new one serves,
    nothing stays held.  Returns (seconds to the failure, seconds to the restart)."""
    with pytest.raises(RankDiedError, match=match) as info:
        held.result(timeout=10)
    failed_after = time.monotonic() - t0
    assert info.value.rank == 1
    assert failed_after < FAIL_WITHIN_S, f"the task failed {failed_after:.2f}s after the break"
    assert wait_for(lambda: process_gone(victim), 5.0), "the mute rank's process still runs"
    held.released.result(timeout=5)  # released: the old process touches nothing any more
    assert svc.unreleased_tasks() == {}, "a block stays quarantined after the rank was declared down"
    assert restarted(svc, 1, victim, RESTART_WITHIN_S), "rank 1 was not restarted"
    restarted_after = time.monotonic() - t0
    assert svc.recovery.restarts == 1
    logger.warning("break -> task failed in %.3fs, rank restarted in %.2fs", failed_after, restarted_after)
    return failed_after, restarted_after


def test_a_local_link_closed_under_a_live_rank_downs_releases_and_restarts_it():
    svc = start_service()
    port = svc.port
    try:
        fill_distinct(svc, seed=1)
        assert svc.server.local_ranks() == {0, 1}
        held = svc.control("sleep", seconds=30, rank=1, timeout=60)  # in flight on rank 1
        assert wait_for(lambda: svc.tracker.queue_depth() == 0, 5.0)  # rank 0 answered; rank 1 sleeps
        victim = svc.pids()[1]
        t0 = time.monotonic()
        svc.server._reg.live[1].local.sock.shutdown(socket.SHUT_RDWR)  # the engine's end; the rank lives
        _recovered(svc, victim, held, t0, r"rank 1 .*stream .*broke")
        assert svc.server.local_ranks() == {0, 1}
        assert swap_is_bit_exact(svc, block=3, slot=2, into=9)
    finally:
        svc.shutdown()
    assert segments_of(port) == []


def test_a_task_frame_lost_on_the_zmq_path_downs_and_restarts_the_rank(zmq_only):
    svc = start_service()
    try:
        fill_distinct(svc, seed=2)
        assert svc.server.local_ranks() == set() and svc.server.registered_ranks() == {0, 1}
        victim = svc.pids()[1]
        drop_one_task_frame(svc.server, rank=1)
        lost = svc.control("ping", timeout=60)  # never reaches rank 1
        t0 = time.monotonic()
        after = svc.control("ping", timeout=60)  # reaches it with a counter past the one expected
        with pytest.raises(RankDiedError, match="rank 1"):
            lost.result(timeout=10)
        _recovered(svc, victim, after, t0, r"rank 1 .*died \(exit code 3\).*stream .*broke")
        assert swap_is_bit_exact(svc, block=4, slot=1, into=10)
    finally:
        svc.shutdown()


def test_a_result_frame_lost_on_the_zmq_path_downs_kills_and_restarts_the_rank(zmq_only):
    svc = start_service()
    try:
        fill_distinct(svc, seed=3)
        assert svc.server.local_ranks() == set()
        victim = svc.pids()[1]
        drop_one_result_frame(svc.server, rank=1)
        lost = svc.control("ping", timeout=60)  # rank 1's answer is lost on its way
        assert wait_for(lambda: svc.tracker.queue_depth() == 0, 5.0)  # rank 0 answered
        t0 = time.monotonic()
        after = svc.control("ping", timeout=60)  # rank 1's answer arrives past the counter expected
        with pytest.raises(RankDiedError, match="rank 1"):
            lost.result(timeout=10)
        _recovered(svc, victim, after, t0, r"rank 1 .*killed: its stream to the engine broke \(.*frames? lost")
        assert swap_is_bit_exact(svc, block=5, slot=3, into=11)
    finally:
        svc.shutdown()


def test_a_killed_rank_is_restarted_by_the_service_and_serves_bit_exact():
    svc = start_service()
    port = svc.port
    try:
        fill_distinct(svc, seed=4)
        svc.swap_to_cpu([7], [5]).result(timeout=20)  # host slot 5: rank 1's copy dies with its process
        held = svc.control("sleep", seconds=30, rank=1, timeout=60)
        assert wait_for(lambda: svc.tracker.queue_depth() == 0, 5.0)
        victim = svc.pids()[1]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _recovered(svc, victim, held, t0, r"rank 1 .*died \(signal 9\)")
        # An engine that did not hear of the restart gets a failure, never rank 1's new, empty slot.
        with pytest.raises(TaskFailedError, match=r"rank 1: host slots \[5\] lost their contents"):
            svc.swap_to_gpu([13], [5]).result(timeout=5)
        assert swap_is_bit_exact(svc, block=7, slot=5, into=13)  # swapped out again, the slot is good
        assert swap_is_bit_exact(svc, block=6, slot=4, into=12)
    finally:
        svc.shutdown()
    assert segments_of(port) == []


def test_without_auto_restart_a_broken_rank_is_still_declared_down_and_stays_down():
    svc = start_service(auto_restart=False)
    try:
        held = svc.control("sleep", seconds=30, rank=1, timeout=60)
        victim = svc.pids()[1]
        svc.server._reg.live[1].local.sock.shutdown(socket.SHUT_RDWR)
        with pytest.raises(RankDiedError, match="rank 1"):
            held.result(timeout=5)
        assert wait_for(lambda: process_gone(victim), 5.0)
        time.sleep(1.5)  # past the first backoff
        assert svc.pids()[1] == victim and svc.tracker.is_down(1)
        with pytest.raises(RankDiedError, match="rank 1"):
            svc.control("ping").result(timeout=5)
        svc.restart_rank(1)
        assert svc.control("ping").result(timeout=20)[1]["rank"] == 1
    finally:
        svc.shutdown()


def test_restarts_back_off_and_stop_after_the_policy_allows():
    policy = RestartPolicy(base_s=0.2, cap_s=0.4, max_restarts=1, window_s=60.0)
    svc = start_service(restart_policy=policy)
    try:
        first = svc.pids()[1]
        os.kill(first, signal.SIGKILL)
        assert restarted(svc, 1, first, RESTART_WITHIN_S)
        second = svc.pids()[1]
        os.kill(second, signal.SIGKILL)
        assert wait_for(lambda: process_gone(second), 5.0)
        time.sleep(1.5)  # well past the backoff: no restart comes, the budget is spent
        assert svc.pids()[1] == second and svc.recovery.restarts == 1
        with pytest.raises(RankDiedError, match="rank 1 is down: restarted 1 times"):
            svc.control("ping").result(timeout=5)
    finally:
        svc.shutdown()



def test_the_default_restart_policy_backs_off_exponentially_up_to_a_cap():
    policy = RestartPolicy()
    assert [policy.delay(n) for n in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert policy.max_restarts == 5 and policy.window_s == 300.0
