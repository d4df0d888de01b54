"""The host-slot guard (``engine_hooks.core.host_slots``, in the engine core both front doors share): a CTM
whose process is replaced has new, empty swap space, so a swap-in from a slot written before must fail
naming the rank and the slots, and never load wrong bytes (DESIGN §3.8, "Generations").

Before: the guard counted only swaps (a pull into host slots was never recorded: the swap-in after a
restart answered ``[10, 11]`` with rank 1's blocks zeroed), and the FastDeploy façade had no guard at all
(a swap-in after a CTM rejoined was reported done with rank 1's block zeroed)."""
import os
import signal
import time

import numpy as np
import pytest

from cache_manager.cache_data import CacheStatus
from cache_manager.cache_spec import CacheSpec
from engine_hooks.core.errors import TaskFailedError
from tests.fastdeploy_engine import FastDeployEngine
from tests.pd_helpers import instance_pair
from tests.rank_stream_helpers import restarted, wait_for
from tests.service_helpers import block_bytes, fill_distinct

SPEC = CacheSpec(num_layers=2, num_blocks=32, kv_heads=2, block_size=4, head_dim=8)


def same(a: dict, b: dict) -> list:
    """The (rank, kind, layer) keys whose bytes differ."""
    return [k for k in a if not np.array_equal(a[k], b[k])]


def test_a_pull_into_host_slots_then_a_rank_restart_fails_the_swap_in_naming_rank_and_slots():
    with instance_pair(SPEC, num_cpu_blocks=16) as (p_svc, d_svc, p, d):
        fill_distinct(p_svc, seed=61)
        fill_distinct(d_svc, seed=62)
        d.link(p.descriptor(), transport="ipc")
        handle = p.expose("req-host-guard")
        assert d.pull_blocks("prefill-0", handle, [1, 2], [10, 11], placement="host").result(timeout=20) == [10, 11]
        p.retract(handle)
        victim = d_svc.pids()[1]
        os.kill(victim, signal.SIGKILL)  # decode rank 1's swap space dies with it; the service restarts it
        assert restarted(d_svc, 1, victim, 15), "decode rank 1 was not restarted"
        before = block_bytes(d_svc, range(SPEC.num_blocks))
        with pytest.raises(TaskFailedError, match=r"rank 1: host slots \[10, 11\] lost their contents"):
            d_svc.swap_to_gpu([20, 21], [10, 11]).result(timeout=10)
        assert same(before, block_bytes(d_svc, range(SPEC.num_blocks))) == [], "a refused swap-in moved bytes"
        # written again (by a pull over a new link: the new rank has none), the slots serve bit-exact
        d.link(p.descriptor(), transport="ipc")
        want = block_bytes(p_svc, [1, 2])
        handle = p.expose("req-host-guard-2")
        assert d.pull_blocks("prefill-0", handle, [1, 2], [10, 11], placement="host").result(timeout=20) == [10, 11]
        p.retract(handle)
        d_svc.swap_to_gpu([20, 21], [10, 11]).result(timeout=10)
        assert same(want, block_bytes(d_svc, [20, 21])) == []


def test_a_facade_swap_in_after_a_ctm_rejoined_is_never_reported_done_with_wrong_bytes():
    engine = FastDeployEngine(tp=2, task_timeout=10.0)
    try:
        engine.start()
        engine.fill(seed=63)
        engine.queue.put_transfer_task((CacheStatus.SWAP2CPU, "out", [1], [3], [5]))
        assert engine.signals_for(1) == [(CacheStatus.SWAP2CPU, "out", [1], [3], [5])]
        engine.procs[1].popen.kill()  # rank 1's CTM exits; FastDeploy relaunches it, and it rejoins
        engine.procs[1].popen.wait(10)
        assert wait_for(lambda: 1 not in engine.queue.server.registered_ranks(), 5), "rank 1's exit was not seen"
        engine.launch(1)
        engine.wait_ready([1], 20)
        before = {k: v.copy() for k, v in engine.views().items()}
        engine.queue.put_transfer_task((CacheStatus.SWAP2GPU, "in", [1], [9], [5]))
        assert wait_for(lambda: "in" in engine.queue.failed_tasks(), 10), "the swap-in neither failed nor was refused"
        reason = engine.queue.failed_tasks()["in"]
        assert "rank 1" in reason and "host slots [5]" in reason, reason
        time.sleep(0.2)
        assert engine.queue.get_transfer_done_signal() is None, "a refused swap-in was reported done"
        assert engine.queue.empty()
        changed = [k for k, v in engine.views().items() if not np.array_equal(v, before[k])]
        assert changed == [], f"a refused swap-in moved bytes: {changed}"
        # swapped out again, the slot serves bit-exact on every rank
        engine.queue.put_transfer_task((CacheStatus.SWAP2CPU, "out2", [1], [3], [5]))
        engine.queue.put_transfer_task((CacheStatus.SWAP2GPU, "in2", [1], [9], [5]))
        assert [s[1] for s in engine.signals_for(2)] == ["out2", "in2"]
        assert all(np.array_equal(v[9], v[3]) for v in engine.views().values())
    finally:
        assert engine.close() == []


def test_a_facade_swap_in_after_a_sleep_that_freed_the_swap_space_is_refused_naming_the_slots():
    engine = FastDeployEngine(tp=2, fastdeploy_signals=True, task_timeout=10.0, control_timeout=10.0)
    try:
        for rank in range(2):  # FastDeploy's FD_ENABLE_SWAP_SPACE_CLEARING: a sleep frees the swap space too
            engine.launch(rank, env={"FD_ENABLE_SWAP_SPACE_CLEARING": "1"})
        engine.wait_ready([0, 1], 20)
        engine.fill(seed=64)
        engine.queue.put_transfer_task((CacheStatus.SWAP2CPU, "out", [1], [3], [5]))
        assert engine.signals_for(1) == [(CacheStatus.SWAP2CPU, "out", [1], [3], [5])]
        slept = engine.control("sleep", {"tags": "weight,kv_cache"})
        assert slept.error_code == 200 and all(r["swap_freed"] for r in slept.result), slept
        engine.free_caches()
        engine.queue.put_transfer_task((CacheStatus.CTRL, {"request_id": "wake", "method": "wakeup", "args": {}}))
        engine.recreate_caches(seed=65)
        assert engine.queue.get_control_response("wake", 20).error_code == 200
        before = {k: v.copy() for k, v in engine.views().items()}
        engine.queue.put_transfer_task((CacheStatus.SWAP2GPU, "in", [1], [9], [5]))
        assert wait_for(lambda: "in" in engine.queue.failed_tasks(), 10), "the swap-in neither failed nor was refused"
        assert "host slots [5]" in engine.queue.failed_tasks()["in"]
        time.sleep(0.2)
        assert engine.queue.get_transfer_done_signal() is None, "a refused swap-in was reported done"
        changed = [k for k, v in engine.views().items() if not np.array_equal(v, before[k])]
        assert changed == [], f"a refused swap-in moved bytes: {changed}"
    finally:
        assert engine.close() == []


def test_a_service_swap_in_after_an_rl_clear_that_freed_the_swap_space_is_refused_naming_the_slots():
    """Under ``FD_ENABLE_SWAP_SPACE_CLEARING`` an RL clear frees the ranks' swap space like a sleep does:
    the service's clear goes through the same guard (before, the swap-in loaded zeros, reported done)."""
    from tests.service_helpers import start_service

    svc = start_service(SPEC, num_cpu_blocks=8, extra_env={"FD_ENABLE_SWAP_SPACE_CLEARING": "1"})
    try:
        fill_distinct(svc, seed=71)
        svc.swap_to_cpu([3, 4], [1, 2]).result(timeout=20)
        svc.clear_caches(timeout=30)
        svc.restore_caches(timeout=60)
        fill_distinct(svc, seed=72)
        before = block_bytes(svc, [5, 6])
        with pytest.raises(TaskFailedError, match=r"host slots \[1, 2\]"):
            svc.swap_to_gpu([5, 6], [1, 2]).result(timeout=20)
        assert not same(before, block_bytes(svc, [5, 6])), "a refused swap-in changed the blocks"
        svc.swap_to_cpu([3, 4], [1, 2]).result(timeout=20)  # written again: good again
        want = block_bytes(svc, [3, 4])
        svc.swap_to_gpu([5, 6], [1, 2]).result(timeout=20)
        got = block_bytes(svc, [5, 6])
        assert all(np.array_equal(got[k], want[k]) for k in want)
    finally:
        svc.shutdown()
