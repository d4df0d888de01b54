"""The engine's service over real CTM processes at TP=2: exact bytes, order, bad input, faults."""
import os
import signal
import time

import numpy as np
import pytest

from cache_manager.cache_data import CacheStatus
from engine_hooks import RankDiedError, ServiceClosed, TaskFailedError, TaskTimeoutError
from tests.service_helpers import NUM_CPU_BLOCKS, SMALL, fill_distinct, process_gone, segments_of, start_service, views


@pytest.fixture(scope="module")
def svc():
    service = start_service()
    yield service
    port = service.port
    service.shutdown()
    assert segments_of(port) == []
    assert all(process_gone(pid) for pid in service.pids().values())


def test_random_swap_sequences_are_bit_exact_on_every_rank(svc):
    fill_distinct(svc, seed=1)
    v = views(svc)
    assert not np.array_equal(v[(0, "key_caches", 0)], v[(1, "key_caches", 0)]), "ranks must hold distinct shards"
    rng = np.random.default_rng(2)
    host = {key: np.zeros((NUM_CPU_BLOCKS, view.shape[1]), np.uint8) for key, view in v.items()}  # expected host tier
    for step in range(40):
        n = int(rng.integers(1, 6))
        gpu = rng.permutation(SMALL.num_blocks)[:n]
        cpu = rng.permutation(NUM_CPU_BLOCKS)[:n]
        if step % 2 == 0:
            svc.swap_to_cpu(gpu, cpu).result(timeout=20)
            for key, view in v.items():
                host[key][cpu] = view[gpu]
            for view in v.values():  # the engine reuses the evicted device blocks
                view[gpu] = rng.integers(0, 256, (n, view.shape[1]), dtype=np.uint8)
        else:
            before = {key: view.copy() for key, view in v.items()}
            svc.swap_to_gpu(gpu, cpu).result(timeout=20)
            for key, view in v.items():
                expected = before[key]
                expected[gpu] = host[key][cpu]
                assert np.array_equal(view, expected), f"step {step}: rank/kind/layer {key} differs"


def test_swap_result_has_the_design_shape(svc):
    result = svc.swap_to_cpu([3, 4], [5, 6], swap_node_ids=[11, 12]).result(timeout=20)
    event, task_id, nodes, gpu, cpu = result
    assert (event, nodes, gpu, cpu) == (CacheStatus.SWAP2CPU, [11, 12], [3, 4], [5, 6])
    assert isinstance(task_id, str)


def test_swaps_of_both_kinds_in_flight_together_are_exact(svc):
    # That unrelated tasks really overlap, and related ones wait, is shown in
    # tests/faults/test_fault_matrix.py::test_unrelated_tasks_overlap_while_related_ones_wait.
    fill_distinct(svc, seed=3)
    v = views(svc)
    svc.swap_to_cpu([8, 9, 10], [4, 5, 6]).result(timeout=20)
    snapshot = {key: view.copy() for key, view in v.items()}
    out_f = svc.swap_to_cpu([0, 1, 2, 3], [0, 1, 2, 3])
    in_f = svc.swap_to_gpu([12, 13, 14], [4, 5, 6])
    out_f.result(timeout=20), in_f.result(timeout=20)
    for view in v.values():
        view[[0, 1, 2, 3]] = 0
    svc.swap_to_gpu([0, 1, 2, 3], [0, 1, 2, 3]).result(timeout=20)
    for key, view in v.items():
        assert np.array_equal(view[[0, 1, 2, 3]], snapshot[key][[0, 1, 2, 3]])
        assert np.array_equal(view[[12, 13, 14]], snapshot[key][[8, 9, 10]])


def test_a_thousand_tasks_at_once_run_once_each_in_the_same_order(svc):
    futures = []
    for i in range(1000):
        if i % 2:
            futures.append(svc.swap_to_gpu([i % 16], [i % 8]))
        else:
            futures.append(svc.swap_to_cpu([i % 16], [i % 8]))
    for f in futures:
        f.result(timeout=60)
    seqs = {rank: [f.rank_results[rank].recv_seq for f in futures] for rank in range(2)}
    assert seqs[0] == seqs[1], "ranks received the tasks in different orders"
    assert all(b == a + 1 for a, b in zip(seqs[0], seqs[0][1:])), "a task was skipped, repeated or reordered"


def test_bad_block_ids_fail_the_task_and_change_nothing(svc):
    fill_distinct(svc, seed=4)
    v = views(svc)
    svc.swap_to_cpu([0, 1], [0, 1]).result(timeout=20)  # host canaries
    device_before = {key: view.copy() for key, view in v.items()}
    with pytest.raises(TaskFailedError, match="device block id 99") as err:
        svc.swap_to_gpu([2, 99], [0, 1]).result(timeout=20)
    assert sorted(err.value.failures) == [0, 1]
    with pytest.raises(TaskFailedError, match="host block id 8 .* out of range"):
        svc.swap_to_cpu([2, 3], [1, NUM_CPU_BLOCKS]).result(timeout=20)
    with pytest.raises(TaskFailedError, match="differ in length|has 2 ids but"):
        svc.swap_to_cpu([2, 3], [1]).result(timeout=20)
    with pytest.raises(ValueError, match="block id 1.5 is not an integer"):
        svc.swap_to_cpu([1.5], [0])
    with pytest.raises(ValueError, match="block id True is not an integer"):
        svc.swap_to_cpu([2, True], [0, 1])  # a bool is an int to Python, never a block id
    for key, view in v.items():
        assert np.array_equal(view, device_before[key]), "a refused task changed device bytes"
    svc.swap_to_gpu([5, 6], [0, 1]).result(timeout=20)  # the host canaries are intact, and the CTMs still serve
    for key, view in v.items():
        assert np.array_equal(view[[5, 6]], device_before[key][[0, 1]])


def test_unknown_or_malformed_tasks_fail_with_a_clear_error(svc):
    with pytest.raises(TaskFailedError, match="unknown event type 42"):
        svc.submit({"event_type": 42}).result(timeout=20)
    with pytest.raises(TaskFailedError, match="'gpu_block_ids' must be a list of integers"):
        svc.submit({"event_type": 1, "swap_node_ids": [], "gpu_block_ids": "0,1", "cpu_block_ids": [0]}).result(20)
    for bad in ([0, True], [0, "1"], [0, [1]], [0, 1.0]):  # submit() sends them as given: the ranks refuse them
        with pytest.raises(TaskFailedError, match="'cpu_block_ids' must be a list of integers"):
            svc.submit({"event_type": 1, "swap_node_ids": [], "gpu_block_ids": [0, 1], "cpu_block_ids": bad}).result(20)
    with pytest.raises(TaskFailedError, match="unknown control command 'reboot'"):
        svc.control("reboot").result(timeout=20)
    assert [r["rank"] for r in svc.control("ping").result(timeout=20)] == [0, 1]


def test_timeout_names_the_rank_that_did_not_answer(svc):
    t0 = time.monotonic()
    with pytest.raises(TaskTimeoutError, match=r"no answer from ranks \[1\]") as err:
        svc.control("sleep", seconds=3, rank=1, timeout=0.5).result(timeout=20)
    assert err.value.missing_ranks == [1]
    assert time.monotonic() - t0 < 2.5, "the future waited for the slow rank instead of its own timeout"
    svc.control("ping").result(timeout=20)  # the late answer is ignored; the service goes on


def test_a_sooner_deadline_wakes_the_sleeping_supervisor_and_fails_on_time(svc):
    """The supervisor sleeps until the soonest deadline (or the next heartbeat), not on a fixed
    tick.  A task submitted while it sleeps towards a later time, with a sooner deadline, still
    fails at that deadline: the submission wakes it."""
    svc.control("ping").result(timeout=20)
    slow = svc.control("sleep", seconds=2.0, rank=0, timeout=10.0)  # a late deadline first
    for attempt in range(3):  # a heartbeat could fall inside the window once, not three times
        time.sleep(0.1)  # the supervisor is asleep until the heartbeat, up to a second away
        t0 = time.monotonic()
        with pytest.raises(TaskTimeoutError):
            svc.control("sleep", seconds=1.0, rank=1, timeout=0.2).result(timeout=5)
        waited = time.monotonic() - t0
        assert 0.2 <= waited < 0.35, f"attempt {attempt}: failed after {waited:.3f}s for a 0.2s timeout"
    assert slow.result(timeout=20) == [None, None]


def test_an_idle_service_supervisor_wakes_about_once_a_second(svc):
    svc.control("ping").result(timeout=20)
    loops = svc.supervisor_loops
    time.sleep(2.0)
    assert svc.supervisor_loops - loops <= 5  # the heartbeat's, not 20 a second


def test_killed_rank_fails_pending_futures_and_can_be_restarted():
    svc = start_service()
    port = svc.port
    try:
        fill_distinct(svc, seed=5)
        held = svc.control("sleep", seconds=30, timeout=60)  # in flight on both ranks
        victim = svc.pids()[1]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(RankDiedError, match="rank 1 .*died.*signal 9"):
            held.result(timeout=10)
        with pytest.raises(RankDiedError, match="rank 1"):
            svc.swap_to_cpu([0], [0]).result(timeout=10)  # fails at once while the rank is down
        svc.restart_rank(1)
        assert svc.pids()[1] != victim
        v = views(svc)
        expected = {key: view[[3]].copy() for key, view in v.items()}
        svc.swap_to_cpu([3], [2]).result(timeout=20)
        for view in v.values():
            view[[3]] = 0
        svc.swap_to_gpu([3], [2]).result(timeout=20)
        for key, view in v.items():
            assert np.array_equal(view[[3]], expected[key])
    finally:
        pending = svc.control("sleep", seconds=30, timeout=60)
        svc.shutdown()
    with pytest.raises(ServiceClosed):
        pending.result(timeout=5)
    assert segments_of(port) == []
