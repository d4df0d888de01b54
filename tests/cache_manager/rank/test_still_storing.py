"""``Outcome.still_storing`` in the rank's scheduler (issue 33 item 3): a late I/O that touches none
of the task's blocks (a staged storage write storing its own snapshot) lets the blocks go with the
answer, yet keeps the task ``active`` until it returns, so a drain (pause, sleep, RL clear) waits."""
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from cache_manager.cache_tasks import Outcome
from cache_manager.rank.scheduler import TaskScheduler

LOG = logging.getLogger("test_still_storing")


@pytest.fixture
def sched():
    pools = {"storage": ThreadPoolExecutor(2, thread_name_prefix="storage")}
    answers = []
    scheduler = TaskScheduler(pools, rank=0, send=answers.append, log=LOG)
    scheduler.answers = answers
    yield scheduler
    for pool in pools.values():
        pool.shutdown(wait=True)


def _wait(cond, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _answers_of(sched, task_id: str) -> list:
    return [a for a in sched.answers if a.task_id == task_id]


def test_a_task_still_storing_answers_released_and_the_next_task_on_its_blocks_runs_at_once(sched):
    call = Future()
    sched.submit("w", 0, "storage", [("gpu", 1), ("gpu", 2)], None, lambda: Outcome(value=[], still_storing=call))
    _wait(lambda: _answers_of(sched, "w"), "the write's answer")
    (answer,) = _answers_of(sched, "w")
    assert answer.ok and answer.value == [] and answer.released, answer
    ran = threading.Event()
    sched.submit("swap", 1, "storage", [("gpu", 2), ("cpu", 0)], None, ran.set)
    assert ran.wait(5), "the next task on the block waited for the late storage call"
    _wait(lambda: _answers_of(sched, "swap"), "the swap's answer")
    assert sched.active() == 1, "the late call no longer counts: a drain would not wait for it"
    call.set_result([0, 0])
    _wait(lambda: sched.active() == 0, "the late call to be retired")
    assert len(_answers_of(sched, "w")) == 1, "a release note for a task that was released with its answer"


def test_a_late_call_on_the_blocks_still_holds_them_when_another_is_only_storing(sched):
    touching, storing = Future(), Future()
    sched.submit("t", 0, "storage", [("gpu", 3)], None,
                 lambda: Outcome(value=[], still_running=touching, still_storing=storing))
    _wait(lambda: _answers_of(sched, "t"), "the answer")
    assert not _answers_of(sched, "t")[0].released
    ran = threading.Event()
    sched.submit("next", 1, "storage", [("gpu", 3)], None, ran.set)
    assert not ran.wait(0.2), "the next task ran while an I/O still touched the block"
    touching.set_result(None)
    assert ran.wait(5)
    _wait(lambda: len(_answers_of(sched, "t")) == 2, "the release note")
    assert _answers_of(sched, "t")[1].released
    _wait(lambda: _answers_of(sched, "next"), "the next task's answer")
    assert sched.active() == 1
    storing.set_result(None)
    _wait(lambda: sched.active() == 0, "the task to be retired")


def test_a_storing_call_that_returned_before_the_answer_retires_the_task_at_once(sched):
    call = Future()
    call.set_result([0])
    sched.submit("w", 0, "storage", [("gpu", 4)], None, lambda: Outcome(value=[], still_storing=call))
    _wait(lambda: _answers_of(sched, "w") and sched.active() == 0, "the task to finish")
    assert _answers_of(sched, "w")[0].released
