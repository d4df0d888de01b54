"""A task's time budget (DESIGN §3.8): the engine sends a duration and the time it stamped the
task; a rank on another host (or in a time namespace) counts the budget from when the task
arrives, a rank that reads the engine's clock counts it from the stamp."""
import logging
import math
import os
import shutil
import stat
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cache_manager.cache_data import CacheStatus
from cache_manager.cache_tasks import MAX_TASK_BUDGET_S, TaskFormatError, task_deadline, task_from_wire
from cache_manager.queue import clocks, wire
from cache_manager.rank.scheduler import TaskScheduler
from engine_hooks.core.task_tracker import TaskTracker
from engine_hooks.core.wire_tasks import swap_task
from tests.fault_helpers import _same
from tests.service_helpers import block_bytes, fill_distinct, start_service, write_random_blocks

LOG = logging.getLogger("test_task_budget")
HOURS = 3600.0


def sent_task(timeout):
    """A swap task as the engine stamps it and as the rank's queue decodes it off the wire."""
    tracker = TaskTracker(tp=1)
    task, _future, send = tracker.begin(swap_task(CacheStatus.SWAP2CPU, [1], [2], None), timeout)
    assert send
    secret = wire.new_secret()
    return wire.decode(wire.encode({"type": "task", "task": task}, secret), secret)["task"]


@pytest.fixture
def scheduler():
    pools = {"swap": ThreadPoolExecutor(2, thread_name_prefix="swap")}
    answers = []
    sched = TaskScheduler(pools, rank=1, send=answers.append, log=LOG)
    yield sched, answers
    pools["swap"].shutdown(wait=True)


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


def test_the_engine_sends_a_duration_and_its_stamp_not_a_deadline():
    before = time.monotonic()
    task = sent_task(7.5)
    assert task["budget_s"] == 7.5 and "deadline" not in task and before <= task["sent_at"] <= time.monotonic()
    with pytest.raises(ValueError, match="at most"):
        TaskTracker(tp=1).begin({"event_type": int(CacheStatus.CTRL), "command": "ping"}, MAX_TASK_BUDGET_S * 2)


@pytest.mark.parametrize("offset", [+5 * HOURS, -5 * HOURS])
def test_a_rank_whose_clock_is_hours_off_runs_the_task_within_its_budget(scheduler, offset):
    sched, answers = scheduler
    task = sent_task(30.0)  # stamped on the engine host's clock
    received = time.monotonic() + offset  # the rank's clock, another uptime
    stamp = {"boot_id": clocks.boot_id(), "monotonic": time.monotonic()}
    shared = clocks.shares_engine_clock(stamp, now=received)
    assert not shared
    deadline = task_deadline(task, shared, received)
    assert deadline == received + 30.0
    # With the engine's deadline, a rank 5 h ahead dropped every task unstarted, one 5 h behind
    # gave every task 5 h.  Counted from receipt, the task runs and keeps its 30 s.
    swap = task_from_wire(task)
    sched.submit(swap.task_id, 0, "swap", [("gpu", 1)], deadline - offset, lambda: "copied")
    wait_for(lambda: answers)
    assert (answers[0].ok, answers[0].value, sched.dropped) == (True, "copied", 0), answers[0].error


def test_a_budget_counted_from_receipt_still_runs_out(scheduler):
    sched, answers = scheduler
    release = threading.Event()
    task = sent_task(0.05)
    sched.submit("long", 0, "swap", [("gpu", 1)], None, lambda: release.wait(10))
    sched.submit(task["task_id"], 1, "swap", [("gpu", 1)], task_deadline(task, False, time.monotonic()),
                 lambda: "ran")
    try:
        wait_for(lambda: sched.next_deadline() is not None and time.monotonic() > sched.next_deadline())
        sched.expire_waiting()
        (dropped,) = answers
        assert not dropped.ok and "DeadlineExceeded" in dropped.error and "rank 1" in dropped.error
    finally:
        release.set()
    wait_for(lambda: len(answers) == 2)
    assert answers[1].task_id == "long" and sched.active() == 0


def test_a_rank_on_the_engines_clock_counts_from_the_stamp():
    task = sent_task(2.0)
    late = task["sent_at"] + 60.0  # the rank was stopped for a minute with the task in its socket
    assert task_deadline(task, True, late) == task["sent_at"] + 2.0  # passed: it is never started
    assert task_deadline(task, False, late) == late + 2.0


@pytest.mark.parametrize("stamp", [None, {}, {"boot_id": "", "monotonic": 1.0}, {"boot_id": "x", "monotonic": 1.0},
                                   {"boot_id": clocks.boot_id(), "monotonic": "1"}, "boot"])
def test_a_malformed_or_foreign_clock_stamp_is_not_shared(stamp):
    assert not clocks.shares_engine_clock(stamp)


def test_the_engines_own_stamp_is_shared_only_while_fresh():
    stamp = clocks.engine_clock()
    assert clocks.shares_engine_clock(stamp)
    assert not clocks.shares_engine_clock(stamp, now=stamp["monotonic"] - 1.0)  # an offset time namespace
    assert not clocks.shares_engine_clock(stamp, now=stamp["monotonic"] + clocks.SAME_CLOCK_SLACK_S + 1)
    # a time namespace 10 s ahead of the engine (within the old 30 s slack) is not the engine's clock
    assert not clocks.shares_engine_clock(stamp, now=stamp["monotonic"] + 10.0)


@pytest.mark.parametrize("field,value", [("budget_s", v) for v in (math.nan, math.inf, -0.5, MAX_TASK_BUDGET_S * 10,
                                                                    True, "30", [30])]
                         + [("sent_at", v) for v in (math.nan, -math.inf, "1", None.__class__)])
def test_a_malformed_budget_or_stamp_is_refused(field, value):
    task = {"task_id": "t", "budget_s": 1.0, "sent_at": 5.0, field: value}
    with pytest.raises(TaskFormatError, match=field):
        task_deadline(task, True, 10.0)


def test_an_absolute_deadline_from_an_older_engine_is_refused_not_ignored():
    with pytest.raises(TaskFormatError, match="'deadline'"):
        task_deadline({"task_id": "t", "deadline": time.monotonic() + 30.0}, True, time.monotonic())


def test_budget_bounds_and_a_task_without_one():
    assert task_deadline({"task_id": "t"}, True, 1.0) is None
    assert task_deadline({"budget_s": 0}, False, 100.0) == 100.0  # spent: never started
    assert task_deadline({"budget_s": MAX_TASK_BUDGET_S}, False, 1.0) == 1.0 + MAX_TASK_BUDGET_S


# ------------------------------------------------- real ranks with their clock hours ahead
@pytest.fixture
def ranks_in_a_time_namespace(tmp_path, monkeypatch):
    """Every CTM this test starts runs in a time namespace whose CLOCK_MONOTONIC is 5 h ahead of
    the engine's (as a rank on a host booted 5 h earlier)."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None or not os.path.exists("/proc/self/timens_offsets"):
        pytest.skip("a time namespace needs root, unshare(1) and a kernel with time namespaces")
    wrapper = tmp_path / "python-5h-ahead"
    wrapper.write_text(f"#!/bin/sh\nexec {unshare} --time --monotonic {int(5 * HOURS)} {sys.executable} \"$@\"\n")
    wrapper.chmod(stat.S_IRWXU)
    monkeypatch.setattr(sys, "executable", str(wrapper))  # what the launcher runs a CTM with


def test_ranks_whose_clock_is_hours_ahead_run_every_task(ranks_in_a_time_namespace):
    svc = start_service()
    try:
        assert all(open(f"/proc/{pid}/timens_offsets").read().split()[1] == str(int(5 * HOURS))
                   for pid in svc.pids().values())
        fill_distinct(svc, seed=31)
        want = block_bytes(svc, [2, 3])
        for _ in range(3):  # with the engine's deadline every one was dropped unstarted
            assert svc.swap_to_cpu([2, 3], [4, 5], timeout=5.0).result(timeout=10)
            write_random_blocks(svc, [2, 3], seed=32)
            assert svc.swap_to_gpu([2, 3], [4, 5], timeout=5.0).result(timeout=10)
            assert _same(block_bytes(svc, [2, 3]), want)
    finally:
        svc.shutdown()
