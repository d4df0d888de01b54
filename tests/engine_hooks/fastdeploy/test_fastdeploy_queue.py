"""FastDeploy's EngineCacheQueue API driving real CTM processes at TP=2, the way FastDeploy's prefix
cache manager does: put_transfer_task, then poll get_transfer_done_signal."""
import hashlib
import logging
import os
import signal
import time

import numpy as np
import pytest

from cache_manager.queue import wire
from cache_manager.cache_data import CacheStatus
from cache_manager.cache_tasks import ReadStorageTask, WriteStorageTask
from engine_hooks.fastdeploy.queue import EngineCacheQueue
from engine_hooks.core.launcher import launch
from tests.fastdeploy_engine import FastDeployEngine
from tests.fastdeploy_types import FDCacheStatus, FDReadStorageTask, FDWriteStorageTask

AUTHKEY = b"an engine's own authkey"


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout}s"
        time.sleep(0.01)


@pytest.fixture
def keep_secret_env():
    before = os.environ.get(wire.SECRET_ENV)
    yield
    if before is None:
        os.environ.pop(wire.SECRET_ENV, None)
    else:
        os.environ[wire.SECRET_ENV] = before


@pytest.fixture(scope="module")
def fd(tmp_path_factory):
    before = os.environ.get(wire.SECRET_ENV)
    engine = FastDeployEngine(tp=2, authkey=AUTHKEY, storage_root=str(tmp_path_factory.mktemp("kv")),
                              storage_grace=0.5)
    try:
        engine.start()  # the CTMs inherit CTM_QUEUE_SECRET_FILE, as FastDeploy's subprocesses do
        yield engine
    finally:
        leftovers = engine.close()
        if before is None:
            os.environ.pop(wire.SECRET_ENV, None)
        else:
            os.environ[wire.SECRET_ENV] = before
    assert leftovers == []
    assert all(not p.alive() for p in engine.procs.values())


def test_the_secret_derives_from_the_authkey(fd):
    # salted per queue (test_facade_secret.py); the CTMs read it from the file the environment names
    path = os.environ[wire.SECRET_FILE_ENV]
    assert fd.queue.secret_env() == {wire.SECRET_FILE_ENV: path} and wire.SECRET_ENV not in os.environ
    assert open(path).read() == fd.queue._core.secret.hex()
    assert fd.queue.server.registered_ranks() == {0, 1}  # the CTMs launched with it joined


def test_swaps_both_ways_are_bit_exact_with_fastdeploy_done_tuples(fd):
    fd.fill(seed=1)
    v = fd.views()
    before = {k: view.copy() for k, view in v.items()}
    fd.queue.put_transfer_task((CacheStatus.SWAP2CPU, "out-1", [21, 22, 23], [1, 2, 3], [0, 1, 2]))
    assert fd.signals_for(1) == [(CacheStatus.SWAP2CPU, "out-1", [21, 22, 23], [1, 2, 3], [0, 1, 2])]
    for view in v.values():
        view[[1, 2, 3]] = 0  # the engine reuses the evicted blocks
    fd.queue.put_transfer_task((FDCacheStatus.SWAP2GPU, "in-1", [21, None, 23], np.array([9, 7, 8]), (0, 1, 2)))
    [done] = fd.signals_for(1)
    assert done == (FDCacheStatus.SWAP2GPU, "in-1", [21, None, 23], [9, 7, 8], [0, 1, 2])
    assert done[0] is FDCacheStatus.SWAP2GPU  # the engine's own enum member comes back
    for key, view in v.items():
        assert np.array_equal(view[[9, 7, 8]], before[key][[1, 2, 3]]), f"rank/kind/layer {key} differs"
    assert fd.queue.empty() and fd.queue.result_queue_empty()


def test_an_in_process_client_handle_shares_the_server(fd):
    port = fd.queue.get_server_port()
    client = EngineCacheQueue(address=("127.0.0.1", port), is_server=False, num_client=2, client_id=0)
    client.put_transfer_task((CacheStatus.SWAP2CPU, "via-client", [0], [5], [6]))
    wait_until(lambda: not client.result_queue_empty(), 20, "the done signal")
    assert client.get_transfer_done_signal() == (CacheStatus.SWAP2CPU, "via-client", [0], [5], [6])
    client.close()  # only lets go: the server keeps serving
    with pytest.raises(RuntimeError, match="Only the server"):
        client.get_server_port()
    with pytest.raises(RuntimeError, match="python -m cache_manager.cache_transfer_manager"):
        EngineCacheQueue(address=("127.0.0.1", 1), is_server=False, num_client=2, client_id=0)


def test_storage_write_then_read_are_bit_exact_with_fastdeploy_done_tuples(fd):
    fd.fill(seed=2)
    v = fd.views()
    keys = ["hash-a", "hash-b", "hash-c"]
    fd.queue.put_transfer_task((CacheStatus.GPU2STORAGE, FDWriteStorageTask(task_id="w1", keys=keys, token_ids=None,
                                                                            gpu_block_ids=[2, 3, 4])))
    assert fd.signals_for(2) == [(CacheStatus.GPU2STORAGE, "w1", keys, [2, 3, 4])] * 2  # one per rank
    stored = {k: view[[2, 3, 4]].copy() for k, view in v.items()}
    for view in v.values():
        view[10:16] = 0
    # FastDeploy's read: the 2 blocks after a 1-block prefix hit, into 3 fresh blocks (the last for a partial block)
    fd.queue.put_transfer_task((FDCacheStatus.STORAGE2GPU, FDReadStorageTask(
        task_id="r1", keys=keys[1:], token_ids=None, gpu_block_ids=[10, 11, 12], start_read_block_idx=1)))
    signals = fd.signals_for(2)  # one per rank, as FastDeploy's CTMs send and its prefix cache manager awaits
    assert signals == [(FDCacheStatus.STORAGE2GPU, "r1", keys[1:], [10, 11])] * 2
    # our ReadStorageTask: keys is the whole chain, loaded from start_read_block_idx on
    fd.queue.put_transfer_task((CacheStatus.STORAGE2GPU, ReadStorageTask("r2", keys, [], [13, 14], 1)))
    assert fd.signals_for(2) == [(CacheStatus.STORAGE2GPU, "r2", keys, [13, 14])] * 2
    for key, view in v.items():
        assert np.array_equal(view[[10, 11]], stored[key][[1, 2]]), f"{key}: read r1 differs"
        assert np.array_equal(view[[13, 14]], stored[key][[1, 2]]), f"{key}: read r2 differs"
        assert not view[12].any(), f"{key}: the spare block was written"
    # only the leading run present on every rank loads
    fd.queue.put_transfer_task((CacheStatus.STORAGE2GPU, ReadStorageTask("r3", ["hash-a", "missing", "hash-c"],
                                                                         [], [5, 6, 7], 0)))
    assert fd.signals_for(2) == [(CacheStatus.STORAGE2GPU, "r3", ["hash-a", "missing", "hash-c"], [5])] * 2
    # FastDeploy before ReadStorageTask: (event, task_id, keys, gpu_block_ids, timeout)
    fd.queue.put_transfer_task((FDCacheStatus.STORAGE2GPU, "r-old", keys[:2], [8, 9], 0.5))
    assert fd.signals_for(2) == [(FDCacheStatus.STORAGE2GPU, "r-old", keys[:2], [8, 9])] * 2
    for key, view in v.items():
        assert np.array_equal(view[[8, 9]], stored[key][[0, 1]]), f"{key}: read r-old differs"
    assert fd.queue.result_queue_empty()


def test_failed_storage_reports_no_blocks_and_a_failed_swap_is_never_reported(fd, caplog):
    fd.queue.put_transfer_task((CacheStatus.STORAGE2GPU, ReadStorageTask("bad-read", ["hash-a"], [], [99], 0)))
    assert fd.signals_for(2) == [(CacheStatus.STORAGE2GPU, "bad-read", ["hash-a"], [])] * 2
    with caplog.at_level(logging.ERROR, logger="engine_hooks.fastdeploy.queue"):
        fd.queue.put_transfer_task((CacheStatus.SWAP2GPU, "bad-swap", [1], [99], [0]))
        wait_until(lambda: "bad-swap" in fd.queue.failed_tasks(), 20, "the swap's failure")
    assert "device block id 99" in fd.queue.failed_tasks()["bad-swap"]
    assert any("bad-swap" in r.getMessage() and "NOT reported" in r.getMessage() for r in caplog.records)
    wait_until(fd.queue.empty, 5, "the queue to drain")
    assert fd.queue.result_queue_empty(), "a failed swap must never be reported done"


def test_empty_and_result_queue_empty_follow_a_task(fd):
    os.kill(fd.procs[1].pid, signal.SIGSTOP)  # rank 1 holds the task until it resumes
    try:
        assert fd.queue.empty() and fd.queue.result_queue_empty()
        fd.queue.put_transfer_task((CacheStatus.SWAP2CPU, "held", [0], [4], [4]))
        time.sleep(0.3)  # rank 0 has long answered; the task still waits for rank 1
        assert not fd.queue.empty() and fd.queue.result_queue_empty()
        assert fd.queue.get_transfer_done_signal() is None
    finally:
        os.kill(fd.procs[1].pid, signal.SIGCONT)
    wait_until(lambda: not fd.queue.result_queue_empty(), 20, "the done signal")
    assert fd.queue.empty()
    assert fd.queue.get_transfer_done_signal() == (CacheStatus.SWAP2CPU, "held", [0], [4], [4])
    assert fd.queue.result_queue_empty()


def test_clear_transfer_task_forgets_tasks_in_flight(fd):
    os.kill(fd.procs[1].pid, signal.SIGSTOP)
    try:
        fd.queue.put_transfer_task((CacheStatus.SWAP2CPU, "gone-1", [0], [1], [1]))
        fd.queue.put_transfer_task((CacheStatus.GPU2STORAGE, WriteStorageTask("gone-2", ["hash-z"], [], [1])))
        fd.queue.clear_transfer_task()
        assert not fd.queue.empty(), "cleared tasks hold their blocks until every rank let go"
    finally:
        os.kill(fd.procs[1].pid, signal.SIGCONT)
    wait_until(fd.queue.empty, 20, "the cleared tasks' release")
    time.sleep(0.2)
    assert fd.queue.result_queue_empty(), "a cleared task's done signal arrived"
    fd.queue.put_transfer_task((CacheStatus.SWAP2GPU, "gone-1", [0], [1], [1]))  # later tasks work, same id too
    assert fd.signals_for(1) == [(CacheStatus.SWAP2GPU, "gone-1", [0], [1], [1])]


def test_a_timed_out_read_reports_no_blocks_only_once_every_rank_let_go(fd):
    fd.queue.put_transfer_task((CacheStatus.GPU2STORAGE, WriteStorageTask("w-late", ["hash-late"], [], [6])))
    assert fd.signals_for(2) == [(CacheStatus.GPU2STORAGE, "w-late", ["hash-late"], [6])] * 2
    os.kill(fd.procs[1].pid, signal.SIGSTOP)
    try:  # rank 0 loads in time; rank 1 never answers within timeout + grace
        fd.queue.put_transfer_task((CacheStatus.STORAGE2GPU, ReadStorageTask("r-late", ["hash-late"], [], [15], 0,
                                                                             timeout=0.3)))
        time.sleep(1.5)
        assert fd.queue.failed_tasks().get("r-late") is None  # storage tasks are reported, never "failed"
        assert fd.queue.result_queue_empty(), "a signal handed block 15 back while rank 1 may still write it"
        assert not fd.queue.empty()
    finally:
        os.kill(fd.procs[1].pid, signal.SIGCONT)  # rank 1 sees the task past its deadline and lets go
    assert fd.signals_for(2) == [(CacheStatus.STORAGE2GPU, "r-late", ["hash-late"], [])] * 2
    wait_until(fd.queue.empty, 5, "the queue to drain")


@pytest.mark.parametrize("item, message", [
    (("x",), "5-tuple"),
    ([99, "t", [], [1], [1]], "event_type 99"),
    ((True, "t", [], [1], [1]), "event_type True"),
    ((CacheStatus.SWAP2CPU, "t", [], [1, 2], [1]), "2 gpu_block_ids but 1 cpu_block_ids"),
    ((CacheStatus.SWAP2CPU, "t", [], [1.5], [1]), "1.5 is not a non-negative integer"),
    ((CacheStatus.SWAP2CPU, "t", [], [-1], [1]), "-1 is not a non-negative integer"),
    ((CacheStatus.SWAP2CPU, None, [], [1], [1]), "transfer_task_id None"),
    ((CacheStatus.SWAP2CPU, WriteStorageTask("t", ["k"], [], [1])), "a swap task is a 5-tuple"),
    ((CacheStatus.GPU2STORAGE, object()), "has no attribute"),
    ((CacheStatus.GPU2STORAGE, WriteStorageTask("t", ["a", "b"], [], [1])), "2 keys but 1 gpu_block_ids"),
    ((CacheStatus.GPU2STORAGE, WriteStorageTask("t", ["a/b"], [], [1], timeout=0)), "timeout 0"),
    ((CacheStatus.STORAGE2GPU, ReadStorageTask("t", ["a"], [], [1], -1)), "start_read_block_idx -1"),
    ((CacheStatus.STORAGE2GPU, FDReadStorageTask(task_id="t", keys=["a", "b"], token_ids=None, gpu_block_ids=[1],
                                                 start_read_block_idx=0)), "2 keys but only 1 gpu_block_ids"),
])
def test_a_malformed_item_raises_value_error_at_once(fd, item, message):
    with pytest.raises(ValueError, match=message):
        fd.queue.put_transfer_task(item)
    assert fd.queue.empty() and fd.queue.result_queue_empty()


def test_a_ctm_with_a_wrong_secret_is_refused(fd, tmp_path):
    wrong = hashlib.sha256(b"ctm-queue-secret\0" + b"another engine's key").hexdigest()
    refused_before = fd.queue.server.drop_reasons.get("bad frame", 0)
    # rank 1 again, from a process without the secret
    intruder = launch(1, {**fd.flags(1), "log_dir": str(tmp_path)}, str(tmp_path), {wire.SECRET_ENV: wrong})
    try:
        wait_until(lambda: fd.queue.server.drop_reasons.get("bad frame", 0) > refused_before, 30,
                   "the intruder's hello to be dropped")
        assert fd.queue.server.registered_ranks() == {0, 1}
    finally:
        intruder.popen.kill()
        intruder.popen.wait(10)
    fd.queue.put_transfer_task((CacheStatus.SWAP2CPU, "after-intruder", [0], [0], [0]))
    assert fd.signals_for(1) == [(CacheStatus.SWAP2CPU, "after-intruder", [0], [0], [0])]


def test_the_default_authkey_warns_works_and_a_dead_rank_fails_its_swaps(caplog, keep_secret_env):
    """FastDeploy's public default authkey: a warning, a random secret the CTM inherits.  A task sent
    before the CTM joined waits for it; a CTM that dies fails its swaps (never reported done)."""
    with caplog.at_level(logging.WARNING, logger="engine_hooks.fastdeploy.queue"):
        engine = FastDeployEngine(tp=1)  # FastDeploy's authkey=b"cache_queue_service"
    try:
        assert any("public default" in r.getMessage() for r in caplog.records)
        assert len(bytes.fromhex(open(os.environ[wire.SECRET_FILE_ENV]).read())) == 32
        engine.launch(0)  # the first task, sent before the CTM joined, waits for it (bounded)
        assert not engine.queue.wait_ready(0)
        engine.queue.put_transfer_task((CacheStatus.SWAP2CPU, 7, [0], [1], [2]))  # an int id comes back as is
        assert engine.signals_for(1) == [(CacheStatus.SWAP2CPU, 7, [0], [1], [2])]
        os.kill(engine.procs[0].pid, signal.SIGSTOP)
        engine.queue.put_transfer_task((CacheStatus.SWAP2GPU, "in-flight", [0], [1], [2]))
        engine.procs[0].popen.kill()  # the CTM dies with the task in flight
        wait_until(lambda: "in-flight" in engine.queue.failed_tasks(), 5, "the dead rank's task to fail")
        assert "exited" in engine.queue.failed_tasks()["in-flight"]
        engine.queue.put_transfer_task((CacheStatus.SWAP2GPU, "after-death", [0], [1], [2]))
        assert "after-death" in engine.queue.failed_tasks()  # at once
        assert engine.queue.empty() and engine.queue.result_queue_empty()
    finally:
        leftovers = engine.close()
    assert leftovers == []
