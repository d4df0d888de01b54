"""Transfers that outlived their task (DESIGN §3.8, §3.11): ``LateBatches`` owns the waits for them.

A Transfer Engine batch still running at its task's deadline cannot be cancelled: its bytes may still
land in the destination, so the task's blocks are released only once it ends (``watch`` returns the
future the rank's ``Outcome.still_running`` holds).  A batch still running ``limit`` seconds later is
stuck: ``on_stuck`` ends the rank's process, the only way to be sure no byte of it lands, and the
engine restarts the rank.  ``close`` waits for every watch (each bounded the same way) before the
memory the batches move may be unregistered.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol

LATE_LIMIT_ENV = "CTM_PD_LATE_LIMIT_S"
DEFAULT_LATE_LIMIT_S = 60.0  # how long past its deadline a transfer may still run before the rank ends
STUCK_TRANSFER_EXIT = 4  # the CTM's exit status when it ends itself over a stuck transfer


class Batches(Protocol):
    batch_ids: list

    def wait(self, timeout: float) -> bool: ...


class LateBatches:
    def __init__(self, on_stuck: Callable[[str], None], limit: float | None = None):
        self.limit = float(os.environ.get(LATE_LIMIT_ENV, DEFAULT_LATE_LIMIT_S)) if limit is None else limit
        if not 0 < self.limit < 1e6:
            raise ValueError(f"{LATE_LIMIT_ENV} {self.limit!r} must be a positive number of seconds")
        self._on_stuck = on_stuck
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="pd-late")

    def watch(self, batches: Batches, then: Callable[[], None] | None = None) -> Future:
        """A future done once ``batches`` ended (then ``then()`` runs), or once they were declared stuck."""
        return self._pool.submit(self._wait, batches, then)

    def _wait(self, batches: Batches, then: Callable[[], None] | None) -> None:
        limit = time.monotonic() + self.limit
        while not batches.wait(min(1.0, max(0.0, limit - time.monotonic()))):
            if time.monotonic() >= limit:
                self._on_stuck(f"{len(batches.batch_ids)} Transfer Engine batches still running {self.limit:g}s "
                               "past their task's deadline")
                return
        if then is not None:
            then()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
