"""The engine's TaskTracker on answers a rank sends: malformed values fail the task, never hang it."""
import pytest

from cache_manager.cache_data import CacheStatus
from cache_manager.queue.checks import rank_result_from_body
from engine_hooks.core.errors import TaskFailedError
from engine_hooks.core.task_tracker import TaskTracker


def storage_task(event=CacheStatus.STORAGE2GPU):
    return {"event_type": int(event), "keys": ["k0", "k1"], "gpu_block_ids": [3, 4], "token_ids": [], "timeout": 5.0}


def answer(tracker, task_id, rank, **fields):
    # Built as the engine's queue builds it from a result frame: ``value`` is typed Any on the
    # wire, so a None or a string for a storage task passes the queue's checks and reaches here.
    body = {"type": "result", "task_id": task_id, "rank": rank, "ok": True, **fields}
    tracker.on_result(rank_result_from_body(body, rank, tracker.tp))


@pytest.mark.parametrize("value", [None, "3,4", [3, None], {"0": 3}])
def test_storage_answer_with_a_value_of_the_wrong_type_fails_the_task_at_once(value):
    tracker = TaskTracker(tp=2)
    task, future, send = tracker.begin(storage_task(), timeout=30.0)
    assert send
    answer(tracker, task["task_id"], 0, value=value)
    # Before the fix the task left the pending table, aggregate() raised TypeError on the queue's
    # thread and this future never resolved (nor expired: it was no longer pending).
    error = future.exception(timeout=2.0)
    assert isinstance(error, TaskFailedError)
    assert list(error.failures) == [0]
    assert "malformed answer" in error.failures[0] and "rank 0" in error.failures[0]
    assert tracker.in_flight() == 0
    # Rank 1 had not answered, so it may still touch the blocks until its answer releases them.
    assert tracker.unreleased_tasks() == {task["task_id"]: [1]}
    answer(tracker, task["task_id"], 1, value=[3, 4])
    assert tracker.unreleased_tasks() == {}
    assert future.released.result(timeout=2.0) is None


def test_wrong_value_on_the_last_rank_to_answer_fails_the_task_naming_that_rank():
    tracker = TaskTracker(tp=2)
    task, future, _ = tracker.begin(storage_task(CacheStatus.GPU2STORAGE), timeout=30.0)
    answer(tracker, task["task_id"], 0, value=[3, 4])
    answer(tracker, task["task_id"], 1)  # no value: None by default
    error = future.exception(timeout=2.0)
    assert isinstance(error, TaskFailedError) and list(error.failures) == [1]
    assert "not a list of block ids" in error.failures[1]
    assert tracker.unreleased_tasks() == {} and future.released.done()


def test_well_formed_storage_answers_still_give_the_shortest_run():
    tracker = TaskTracker(tp=2)
    task, future, _ = tracker.begin(storage_task(), timeout=30.0)
    answer(tracker, task["task_id"], 0, value=[3, 4])
    answer(tracker, task["task_id"], 1, value=[3])
    assert future.result(timeout=2.0) == [3]


def test_control_task_values_are_not_checked():
    tracker = TaskTracker(tp=1)
    task, future, _ = tracker.begin({"event_type": int(CacheStatus.CTRL), "command": "ping", "args": {}}, timeout=30.0)
    answer(tracker, task["task_id"], 0)
    assert future.result(timeout=2.0) == [None]
