"""Transfers that outlive their task (``cache_manager.rank.peer.late``): a late batch keeps its blocks
unreleased until it ends, and one stuck past the limit ends the rank (then the engine restarts it).
Before: a late Transfer Engine batch was waited for without bound, and at a rank's stop its memory
was unregistered with the batch still in flight."""
import threading
import time

import pytest

from cache_manager.rank.peer.late import LateBatches


class Batches:
    """Stands for the Transfer Engine's ``Inflight``: runs until ``end()``."""

    def __init__(self):
        self.batch_ids = [7, 8]
        self._ended = threading.Event()

    def end(self) -> None:
        self._ended.set()

    def wait(self, timeout: float) -> bool:
        return self._ended.wait(timeout)


def test_a_late_batch_releases_only_once_it_ended_then_runs_what_follows():
    stuck: list = []
    late = LateBatches(stuck.append, limit=30.0)
    batches, followed = Batches(), threading.Event()
    try:
        released = late.watch(batches, followed.set)
        time.sleep(0.3)
        assert not released.done() and not followed.is_set()
        batches.end()
        released.result(timeout=5)
        assert followed.is_set() and not stuck
    finally:
        late.close()


def test_a_batch_stuck_past_the_limit_ends_the_rank_and_close_waits_for_it_first():
    stuck: list = []
    late = LateBatches(stuck.append, limit=0.4)
    batches = Batches()
    t0 = time.monotonic()
    released = late.watch(batches)
    late.close()  # returns only once the watch ended: here, declared stuck
    assert released.done() and time.monotonic() - t0 >= 0.4
    assert len(stuck) == 1 and "still running 0.4s past" in stuck[0]


def test_the_limit_must_be_a_positive_number_of_seconds(monkeypatch):
    monkeypatch.setenv("CTM_PD_LATE_LIMIT_S", "-1")
    with pytest.raises(ValueError, match="CTM_PD_LATE_LIMIT_S"):
        LateBatches(lambda why: None)
