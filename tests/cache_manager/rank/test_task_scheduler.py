"""The rank's task scheduler on real thread pools: inline runs, per-block order, deadlines."""
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cache_manager.rank.scheduler import TaskScheduler

LOG = logging.getLogger("test_task_scheduler")


@pytest.fixture
def sched():
    pools = {"swap": ThreadPoolExecutor(2, thread_name_prefix="swap")}
    answers = []
    scheduler = TaskScheduler(pools, rank=0, send=answers.append, log=LOG)
    scheduler.answers = answers
    yield scheduler
    for pool in pools.values():
        pool.shutdown(wait=True)


def wait_answers(sched, n, timeout=10.0):
    deadline = time.monotonic() + timeout
    while len(sched.answers) < n:
        assert time.monotonic() < deadline, f"only {len(sched.answers)} of {n} answers"
        time.sleep(0.005)


def test_inline_task_with_nothing_to_wait_for_runs_on_the_calling_thread(sched):
    ran_on = []
    sched.submit("t0", 0, "swap", [("gpu", 1)], None, lambda: ran_on.append(threading.get_ident()), inline=True)
    # Answered before submit returned: no pool thread was involved.
    assert ran_on == [threading.get_ident()]
    assert [(a.task_id, a.ok) for a in sched.answers] == [("t0", True)]
    assert sched.active() == 0


def test_inline_task_behind_a_running_task_on_its_block_waits_for_it(sched):
    release, events = threading.Event(), []

    def slow():
        release.wait(10)
        events.append("slow")

    sched.submit("t0", 0, "swap", [("gpu", 1)], None, slow)
    sched.submit("t1", 1, "swap", [("gpu", 1), ("cpu", 2)], None, lambda: events.append("inline"), inline=True)
    time.sleep(0.1)
    assert events == [], "the inline task ran before the earlier task on the same block finished"
    release.set()
    wait_answers(sched, 2)
    assert events == ["slow", "inline"]
    assert [a.task_id for a in sched.answers] == ["t0", "t1"]


def test_inline_task_on_other_blocks_does_not_wait(sched):
    release, events = threading.Event(), []
    sched.submit("t0", 0, "swap", [("gpu", 1)], None, lambda: (release.wait(10), events.append("slow")))
    sched.submit("t1", 1, "swap", [("gpu", 2)], None, lambda: events.append("inline"), inline=True)
    assert events == ["inline"]
    release.set()
    wait_answers(sched, 2)
    assert events == ["inline", "slow"]


def test_inline_task_past_its_deadline_is_answered_and_never_run(sched):
    ran = []
    sched.submit("t0", 0, "swap", [("gpu", 1)], time.monotonic() - 1.0, lambda: ran.append(1), inline=True)
    assert ran == []
    (answer,) = sched.answers
    assert not answer.ok and "DeadlineExceeded" in answer.error
    assert sched.dropped == 1 and sched.active() == 0


def test_inline_task_that_raises_fails_alone_and_the_next_runs(sched):
    def boom():
        raise ValueError("block id 99 is out of range")

    sched.submit("t0", 0, "swap", [("gpu", 1)], None, boom, inline=True)
    sched.submit("t1", 1, "swap", [("gpu", 1)], None, lambda: "fine", inline=True)
    first, second = sched.answers
    assert not first.ok and "block id 99" in first.error
    assert second.ok and second.value == "fine"
    assert sched.active() == 0


def test_thousands_of_expired_waiters_on_one_block_release_it_for_later_tasks(sched):
    # Issue 24 item 14: each expired waiter is released from its predecessor's release; done
    # recursively, a chain of a few hundred hit RecursionError (logged, swallowed) and the block
    # stayed held, so every later task on it was dropped "not started" until a restart.
    release, n = threading.Event(), 3000
    sched.submit("long", 0, "swap", [("gpu", 0), ("cpu", 0)], None, lambda: release.wait(10))
    soon = time.monotonic() + 0.05
    for i in range(1, n + 1):
        sched.submit(f"w{i}", i, "swap", [("gpu", 0), ("cpu", 0)], soon, lambda: "ran")
    time.sleep(0.1)
    sched.expire_waiting()
    assert len(sched.answers) == n and not any(a.ok for a in sched.answers)
    release.set()
    wait_answers(sched, n + 1)
    assert sched.answers[-1].task_id == "long"

    sched.submit("later", n + 1, "swap", [("gpu", 0), ("cpu", 0)], time.monotonic() + 5.0, lambda: "later ran")
    wait_answers(sched, n + 2)
    last = sched.answers[-1]
    assert (last.task_id, last.ok, last.value) == ("later", True, "later ran"), last.error
    assert sched.active() == 0 and sched.pending() == 0
