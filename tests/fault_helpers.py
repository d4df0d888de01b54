"""What the fault matrix's files share (test_fault_matrix.py, test_fault_processes.py,
test_fault_queue_frames.py, test_rl_update.py): the latched store's plugin and its Latch, the
timeouts, waits and byte comparisons.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from engine_hooks import TaskTimeoutError

PLUGIN_ENV = {"CTM_STORAGE_PLUGINS": "latched=tests.latched_store:LatchedStore"}
TIMEOUT = 1.0
GRACE = 5.0  # what the service adds to a storage task's timeout for the ranks' answers to arrive


def _same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in a)


def _wait_for(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)
    return time.monotonic() - t0


class Latch:
    """The latched store's calls (tests/latched_store.py) wait while a file of their name is in ``dir``."""

    def __init__(self, path):
        self.dir = path
        path.mkdir()

    def close(self, call: str) -> None:
        (self.dir / call).touch()

    def open(self, call: str) -> None:
        (self.dir / call).unlink()

    def seen(self, call: str, what: str, tp: int = 2) -> bool:
        return all((self.dir / f"{call}.{what}.{r}").exists() for r in range(tp))


def _deadlines_still_fire(svc, rank: int) -> None:
    """A task that a stopped rank cannot answer still fails at its deadline (0.5 s), not later."""
    pid = svc.pids()[rank]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(TaskTimeoutError):
            svc.control("ping", timeout=0.5).result(timeout=5)
        assert time.monotonic() - t0 < 2.0
    finally:
        os.kill(pid, signal.SIGCONT)
