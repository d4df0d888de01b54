"""The prefill side's lease reaper (DESIGN §3.11): exposed handles expire unless renewed.

``LeaseReaper`` owns one thread that sleeps until the soonest lease on an ``ExposureBoard`` ends,
retracts every handle whose lease ended (``ExposureBoard.expire_due``, soonest first) and tells the
engine through ``on_expire(handle)``, so it frees the request's blocks: a decode instance that was
lost, or a router that forgot to retract, never pins them for good.  Expiry is a retraction: a pull
reading under the handle at that moment counts nothing (the board word is read after the bytes).
The ``PrefillDecode`` that creates the reaper stops it at ``close``.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from transfer_factory.peer.handles import ExposureBoard, TransferHandle

logger = logging.getLogger(__name__)

MAX_SLEEP_S = 1.0  # the reaper looks again at least this often (a lease shortened by a renewal)


class LeaseReaper:
    def __init__(self, board: ExposureBoard, on_expire: Callable[[TransferHandle], None] | None, name: str):
        self._board = board
        self._on_expire = on_expire
        self._cond = threading.Condition()
        self._stopping = False
        self.expired = 0  # handles retracted because their lease ended
        self._thread = threading.Thread(target=self._run, name=f"pd-leases-{name}"[:15], daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """A lease may now end sooner than the reaper planned (a handle was exposed)."""
        with self._cond:
            self._cond.notify_all()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the lease reaper did not stop within %.1fs", timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    return
                soonest = self._board.next_expiry()
                pause = MAX_SLEEP_S if soonest is None else min(MAX_SLEEP_S, max(0.0, soonest - time.monotonic()))
                if pause > 0:
                    self._cond.wait(pause)
                if self._stopping:
                    return
            try:
                self._expire()
            except Exception:  # a later lease must still expire
                logger.exception("expiring handle leases failed; going on")

    def _expire(self) -> None:
        for handle in self._board.expire_due():
            self.expired += 1
            logger.warning("handle of request %s (slot %d) expired: its lease was not renewed; retracted",
                           handle.req_id, handle.slot)
            if self._on_expire is not None:
                try:
                    self._on_expire(handle)
                except Exception:
                    logger.exception("on_expire for request %s failed", handle.req_id)
