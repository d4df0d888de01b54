"""The engine core both front doors share (``engine_hooks.core.engine_core``): a CTM relaunched during a
FastDeploy pause (by FastDeploy, or restarted by the service) is paused again before anything reaches
it, so it never runs what the other ranks hold.

Before: a rank's pause lived only in its process; a CTM relaunched during a pause started unpaused, and
a swap-in put during the pause ran at once on it (its device block zeroed while the others held it)."""
import os
import signal

import numpy as np

from cache_manager.cache_data import CacheStatus
from tests.fastdeploy_engine import FastDeployEngine
from tests.rank_stream_helpers import restarted, wait_for
from tests.service_helpers import block_bytes, fill_distinct, start_service


def ok(response) -> list:
    assert response.error_code == 200, response.error_message
    return response.result


def test_a_ctm_relaunched_during_a_pause_holds_tasks_like_the_others_until_the_resume():
    engine = FastDeployEngine(tp=2, task_timeout=10.0, control_timeout=5.0)
    try:
        engine.start()
        engine.fill(seed=71)
        ok(engine.control("pause"))
        engine.procs[1].popen.kill()  # rank 1's CTM exits during the pause; FastDeploy relaunches it
        engine.procs[1].popen.wait(10)
        assert wait_for(lambda: 1 not in engine.queue.server.registered_ranks(), 5), "rank 1's exit was not seen"
        engine.launch(1)
        engine.wait_ready([1], 20)
        before = {k: v[9].copy() for k, v in engine.views().items()}
        assert all(b.any() for b in before.values())
        # slot 6 was never written: a swap-in from it is let through, and must wait for the resume
        engine.queue.put_transfer_task((CacheStatus.SWAP2GPU, "held", [1], [9], [6]))
        assert not wait_for(lambda: engine.queue.get_transfer_done_signal() is not None, 1.0)
        moved = [k for k, v in engine.views().items() if not np.array_equal(v[9], before[k])]
        assert moved == [], f"a task put during the pause ran on the relaunched rank: {moved}"
        assert not engine.queue.empty() and engine.queue.failed_tasks() == {}
        ok(engine.control("resume"))
        assert engine.signals_for(1) == [(CacheStatus.SWAP2GPU, "held", [1], [9], [6])]
        assert engine.queue.failed_tasks() == {}
    finally:
        assert engine.close() == []


def test_a_service_rank_restarted_during_a_pause_is_paused_again_too():
    svc = start_service()
    try:
        fill_distinct(svc, seed=72)
        svc.control("ctrl_pause").result(timeout=10)
        victim = svc.pids()[1]
        os.kill(victim, signal.SIGKILL)  # the service restarts it
        assert restarted(svc, 1, victim, 15), "rank 1 was not restarted"
        before = block_bytes(svc, [9])
        held = svc.swap_to_gpu([9], [6])  # slot 6 was never written: let through, held by the pause
        assert not wait_for(held.done, 1.0), "a task sent during the pause completed"
        assert same(before, block_bytes(svc, [9])) == [], "a task sent during the pause ran on the restarted rank"
        svc.control("ctrl_resume").result(timeout=10)
        assert held.result(timeout=10)[0] == CacheStatus.SWAP2GPU
    finally:
        svc.shutdown()


def same(a: dict, b: dict) -> list:
    return [k for k in a if not np.array_equal(a[k], b[k])]
