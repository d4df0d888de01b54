"""The ranks' barrier of a FastDeploy control request is named after a wire id of its own, not the
request id the engine chose: a request sent again under the same id (its first attempt failed: a rank
was stopped past the deadline, so its barrier failed) runs like a new one.

Before: the barrier was ``ctrl/<request id>``; the queue remembers a failed barrier (so a late rank
fails at once), so every later request under that id failed at once on every rank."""
import os
import signal
import time

from cache_manager.cache_data import CacheStatus
from tests.fastdeploy_engine import FastDeployEngine


def test_a_control_request_sent_again_under_the_same_id_runs_afresh():
    engine = FastDeployEngine(tp=2, task_timeout=5.0, control_timeout=2.0)
    try:
        engine.start()
        rank1 = engine.procs[1].pid
        os.kill(rank1, signal.SIGSTOP)  # alive, silent past the deadline: the barrier of "p1" fails
        try:
            first = engine.control("pause", request_id="p1", timeout=10)
        finally:
            os.kill(rank1, signal.SIGCONT)
        assert first.error_code == 500 and "[1]" in first.error_message, first.error_message
        time.sleep(0.3)  # rank 1 catches up with the stale request
        t0 = time.monotonic()
        again = engine.control("pause", request_id="p1", timeout=10)
        assert again.error_code == 200, f"sent again under the same id: {again.error_message}"
        assert [r["paused"] for r in again.result] == [True, True]
        assert time.monotonic() - t0 < 2.0
        resumed = engine.control("resume", request_id="p1", timeout=10)  # ids may repeat across methods too
        assert resumed.error_code == 200, resumed.error_message
        engine.queue.put_transfer_task((CacheStatus.SWAP2CPU, "after", [1], [2], [0]))
        assert engine.signals_for(1) == [(CacheStatus.SWAP2CPU, "after", [1], [2], [0])]
    finally:
        assert engine.close() == []
