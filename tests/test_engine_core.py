"""The engine core both front doors share (``engine_hooks.engine_core``): a CTM relaunched during a
FastDeploy pause is paused again before anything reaches it, so it never runs what the other ranks hold.

Before: a rank's pause lived only in its process; a CTM relaunched during a pause started unpaused, and
a swap-in put during the pause ran at once on it (its device block zeroed while the others held it)."""
import numpy as np

from cache_manager.cache_data import CacheStatus
from tests.fastdeploy_engine import FastDeployEngine
from tests.rank_stream_helpers import wait_for


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
