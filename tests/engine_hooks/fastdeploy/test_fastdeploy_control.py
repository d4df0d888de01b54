"""FastDeploy's control requests, ``(CacheStatus.CTRL, ControlRequest)``, driving real CTMs at TP=2 through
the ``EngineCacheQueue`` façade as FastDeploy's engine does (common_engine's pause, resume, update_weights,
sleep and wakeup), each answered by a ``ControlResponse``.

Before: ``put_transfer_task`` raised ``ValueError`` for CTRL, so a FastDeploy sleep/wakeup left the CTMs on
the freed segments (a storage read after the wakeup put 4 of 4 blocks of wrong KV in front of the engine)
and an update_weights left old keys hitting."""
import os
import signal
import time

import numpy as np
import pytest

from cache_manager.cache_data import CACHE_TASK_INFLIGHT_SIGNAL, CACHE_TASK_IS_PAUSED_SIGNAL, CacheStatus
from cache_manager.cache_tasks import ReadStorageTask, WriteStorageTask
from cache_manager.queue import wire
from tests.fastdeploy_engine import FastDeployEngine
from tests.fastdeploy_types import FDCacheStatus, FDControlRequest

AUTHKEY = b"an engine's own authkey"
KEYS = ["blk-a", "blk-b", "blk-c", "blk-d"]


@pytest.fixture(autouse=True)
def keep_secret_env():
    before = os.environ.get(wire.SECRET_ENV)
    yield
    if before is None:
        os.environ.pop(wire.SECRET_ENV, None)
    else:
        os.environ[wire.SECRET_ENV] = before


@pytest.fixture(scope="module")
def fd(tmp_path_factory):
    model = tmp_path_factory.mktemp("model")  # FastDeploy's --model_path; no version.yaml until an update
    engine = FastDeployEngine(tp=2, authkey=AUTHKEY, storage_root=str(tmp_path_factory.mktemp("kv")),
                              model_path=str(model), fastdeploy_signals=True, storage_grace=0.5,
                              control_timeout=10.0)
    try:
        engine.start()
        yield engine
    finally:
        assert engine.close() == [], "segments left behind"


def ok(response) -> list:
    assert response.error_code == 200, response.error_message
    assert len(response.result) == 2, response.result  # one answer per rank
    return response.result


def write_and_read(fd, task: str, src: list[int], dst: list[int]) -> list[int]:
    """Store ``src`` under KEYS, then read KEYS into ``dst``: the blocks loaded (on every rank)."""
    fd.queue.put_transfer_task((CacheStatus.GPU2STORAGE, WriteStorageTask(f"{task}-w", KEYS, [], src)))
    assert fd.signals_for(2) == [(CacheStatus.GPU2STORAGE, f"{task}-w", KEYS, src)] * 2
    return read(fd, task, dst)


def read(fd, task: str, dst: list[int]) -> list[int]:
    fd.queue.put_transfer_task((CacheStatus.STORAGE2GPU, ReadStorageTask(f"{task}-r", KEYS, [], dst, 0)))
    answers = fd.signals_for(2)
    assert answers[0] == answers[1]
    return answers[0][3]


def test_after_sleep_and_wakeup_a_storage_read_lands_in_the_new_caches(fd):
    fd.fill(seed=1)
    stored = {k: v[[2, 3, 4, 5]].copy() for k, v in fd.views().items()}
    assert write_and_read(fd, "before", [2, 3, 4, 5], [8, 9, 10, 11]) == [8, 9, 10, 11]
    assert [r["kv_cache"] for r in ok(fd.control("sleep", {"tags": "weight,kv_cache"}))] == ["released"] * 2
    fd.free_caches()  # the worker frees its KV caches
    fd.queue.put_transfer_task((CacheStatus.SWAP2CPU, "asleep", [1], [2], [0]))  # no caches: refused at once
    deadline = time.monotonic() + 10
    while "asleep" not in fd.queue.failed_tasks():
        assert time.monotonic() < deadline, "a task put during the sleep was not refused"
        time.sleep(0.01)
    assert "released (FastDeploy sleep)" in fd.queue.failed_tasks()["asleep"]
    # the engine sends the wakeup to the worker and the CTMs at once: the CTMs wait for the worker's caches
    fd.queue.put_transfer_task((CacheStatus.CTRL, FDControlRequest("wake", "wakeup", {"tags": "weight,kv_cache"})))
    time.sleep(0.3)
    fd.recreate_caches(seed=2)  # NEW caches, other bytes, same names
    assert [r["kv_cache"] for r in ok(fd.queue.get_control_response("wake", 20))] == ["attached"] * 2
    new = fd.views()
    untouched = {k: v[[12, 13]].copy() for k, v in new.items()}
    assert read(fd, "after", [8, 9, 10, 11]) == [8, 9, 10, 11]
    for key, view in fd.views().items():  # the blocks read are the stored bytes, in the caches the engine uses now
        assert np.array_equal(view[[8, 9, 10, 11]], stored[key]), f"{key}: wrong KV after the wakeup"
        assert np.array_equal(view[[12, 13]], untouched[key])
    # swaps use the new caches too
    fd.queue.put_transfer_task((CacheStatus.SWAP2CPU, "out", [1], [8], [0]))
    fd.queue.put_transfer_task((CacheStatus.SWAP2GPU, "in", [1], [14], [0]))
    fd.signals_for(2)
    for key, view in fd.views().items():
        assert np.array_equal(view[14], stored[key][0]), key


def test_update_weights_reads_the_new_version_so_old_keys_miss(fd):
    fd.fill(seed=3)
    assert write_and_read(fd, "v0", [1, 2, 3, 4], [5, 6, 7, 8]) == [5, 6, 7, 8]
    with open(os.path.join(fd.model_path, "version.yaml"), "w") as f:
        f.write("version: RL-STEP7-20260501-0a1b2c\n")
    refused = fd.control("update_weights")  # FastDeploy's engine pauses first; unpaused CTMs refuse
    assert refused.error_code == 500 and "paused" in refused.error_message
    ok(fd.control("pause"))
    assert [r["version"] for r in ok(fd.control("update_weights"))] == ["RL-STEP7"] * 2
    ok(fd.control("resume"))
    assert read(fd, "v1", [5, 6, 7, 8]) == []  # 4 hit before: KV of the old weights is never served
    assert write_and_read(fd, "v1b", [1, 2, 3, 4], [5, 6, 7, 8]) == [5, 6, 7, 8]  # the new namespace serves


def test_pause_holds_tasks_until_resume_and_control_tasks_still_answer(fd):
    fd.fill(seed=4)
    before = {k: v[[1, 2]].copy() for k, v in fd.views().items()}
    paused, inflight = fd.signals[CACHE_TASK_IS_PAUSED_SIGNAL], fd.signals[CACHE_TASK_INFLIGHT_SIGNAL]
    ok(fd.control("pause"))
    assert paused.value[0] == 1
    fd.queue.put_transfer_task((CacheStatus.SWAP2CPU, "held", [7, 8], [1, 2], [3, 4]))
    time.sleep(0.5)
    assert fd.queue.get_transfer_done_signal() is None and not fd.queue.empty()  # it has not run
    assert list(inflight.value[:2]) == [1, 1]  # FastDeploy's cache_task_inflight: the held task is pending
    ok(fd.control("pause"))  # control tasks still run while paused
    assert fd.queue.get_transfer_done_signal() is None
    for view in fd.views().values():
        view[[1, 2]] = 0  # the engine rewrites the blocks: a swap that ran at its put copied the old bytes
    ok(fd.control("resume"))
    assert paused.value[0] == 0
    assert fd.signals_for(1) == [(CacheStatus.SWAP2CPU, "held", [7, 8], [1, 2], [3, 4])]
    fd.queue.put_transfer_task((CacheStatus.SWAP2GPU, "back", [7, 8], [9, 10], [3, 4]))
    fd.signals_for(1)
    for key, view in fd.views().items():  # it ran after the resume, on the blocks as they were then
        assert before[key].any() and not view[[9, 10]].any(), key
    assert list(inflight.value[:2]) == [0, 0]


def test_unknown_method_is_answered_naming_it_and_fastdeploys_request_object_works(fd):
    fd.queue.put_transfer_task((FDCacheStatus.CTRL, FDControlRequest("bad", "frobnicate")))
    bad = fd.queue.get_control_response("bad", 5)
    assert (bad.request_id, bad.error_code, bad.result) == ("bad", 400, None)
    assert "frobnicate" in bad.error_message
    fd.queue.put_transfer_task((FDCacheStatus.CTRL, FDControlRequest("tags", "sleep", {"tags": 5})))
    assert "tags" in fd.queue.get_control_response("tags", 5).error_message
    fd.queue.put_transfer_task((FDCacheStatus.CTRL, FDControlRequest("r", "resume")))  # FastDeploy's own shapes
    assert ok(fd.queue.get_control_response("r", 10))[1] == {"paused": False, "rank": 1}
    with pytest.raises(ValueError, match="request_id"):
        fd.queue.put_transfer_task((CacheStatus.CTRL, {"method": "pause"}))
    with pytest.raises(KeyError):
        fd.queue.get_control_response("never-put", 0.1)


def test_a_rank_that_stalls_or_dies_during_a_control_task_fails_the_response_naming_it():
    engine = FastDeployEngine(tp=2, authkey=AUTHKEY, control_timeout=2.0, task_timeout=0.5)
    try:
        engine.start()
        ok(engine.control("pause"))  # a task held past its deadline is answered then: nothing waits for ever
        engine.queue.put_transfer_task((CacheStatus.SWAP2CPU, "late", [1], [1], [0]))
        deadline = time.monotonic() + 5
        while not engine.queue.empty():  # every rank answered the swap it never started
            assert time.monotonic() < deadline, "a held task was never answered"
            time.sleep(0.01)
        assert "late" in engine.queue.failed_tasks()
        ok(engine.control("resume"))
        rank1 = engine.procs[1].pid
        os.kill(rank1, signal.SIGSTOP)  # alive, silent
        try:
            t0 = time.monotonic()
            engine.queue.put_transfer_task((CacheStatus.CTRL, FDControlRequest("p1", "pause")))
            stalled = engine.queue.get_control_response("p1", 10)
            assert time.monotonic() - t0 < 3.0
        finally:
            os.kill(rank1, signal.SIGCONT)
        assert stalled.error_code == 500 and "no answer from ranks [1]" in stalled.error_message, stalled.error_message
        ok(engine.control("resume"))  # the rank caught up: the ranks agree again
        os.kill(rank1, signal.SIGSTOP)
        t0 = time.monotonic()
        engine.queue.put_transfer_task((CacheStatus.CTRL, FDControlRequest("p2", "pause")))
        time.sleep(0.3)
        engine.procs[1].popen.kill()  # dies with the control task in flight
        died = engine.queue.get_control_response("p2", 10)
        assert time.monotonic() - t0 < 1.5, "a dead rank must fail the request at once, not at its deadline"
        assert died.error_code == 500 and "rank 1" in died.error_message, died.error_message
    finally:
        assert engine.close() == []
