"""A transfer cut mid-way (a peer stopped, a link down or blackholed) fails in time naming the peer
and its address (``Outcome.error``), while the I/O still in flight keeps the task's blocks held
(``released`` False) until no byte can land.  Before: the rank answered a successful ``[]``, so
the engine could not tell a cut transfer from an empty one."""
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from cache_manager.cache_tasks import Outcome
from cache_manager.rank.scheduler import TaskScheduler

LOG = logging.getLogger("test_cut_transfers")


def _wait(cond, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_a_cut_transfer_fails_naming_the_peer_and_holds_its_blocks_until_the_batch_ends():
    pools = {"peer": ThreadPoolExecutor(2)}
    answers: list = []
    sched = TaskScheduler(pools, rank=0, send=answers.append, log=LOG)
    try:
        batch = Future()
        why = "PeerError: prefill-0 rank 0 at 10.77.1.1:17001: the pull was still running at its deadline"
        sched.submit("pull", 0, "peer", [("gpu", 5)], None,
                     lambda: Outcome(value=[], still_running=batch, error=why))
        _wait(lambda: answers, "the answer")
        (answer,) = answers
        assert not answer.ok and answer.error == why and answer.value is None and not answer.released
        ran = threading.Event()
        sched.submit("next", 1, "peer", [("gpu", 5)], None, ran.set)
        assert not ran.wait(0.2), "a task on the block ran while the cut batch could still land in it"
        batch.set_result(None)
        assert ran.wait(5)
        _wait(lambda: len([a for a in answers if a.task_id == "pull"]) == 2, "the release note")
        assert [a for a in answers if a.task_id == "pull"][1].released
    finally:
        pools["peer"].shutdown(wait=True)
