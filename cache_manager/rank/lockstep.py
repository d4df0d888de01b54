"""The ranks of an RL weight update take each step of ``kv_cache_status`` together: a queue
barrier per step, on a thread of its own so the serve loop never blocks on it (DESIGN §3.6, §3.9).

A rank arrives once it has done its part (detached its caches for CLEARED, re-attached them for
NORMAL); when the barrier completes every rank that arrived sets the status (compare, then set:
idempotent).  A barrier that times out fails on every rank alike: each logs the ranks that never
arrived, sets nothing, and arrives at the next barrier of the step, so the engine's own timeout
reports the rank that is behind, and the step completes once it catches up.

Barrier names must match on every rank, a rank restarted in the middle of an update included,
which knows nothing of the attempts before it.  So a step's barriers are named by attempt,
``rl/<step>/<attempt>``, and every rank starts at attempt 0 whenever it arrives: the queue server
remembers a barrier that failed and fails a late arrival at once, so a rank that is behind runs
through the failed attempts in a round trip each, to the open one the others wait at (the server
keeps the last 4096 failed names: a step stuck for 4096 timeouts cannot be caught up with).  A
completed barrier is forgotten by the server, so the next update starts over at attempt 0.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Protocol

from cache_manager.queue.client import BarrierAnswer

STOP_JOIN_TIMEOUT = 2.0  # seconds close() waits for a barrier thread (it is a daemon: exit does not wait)


class BarrierQueue(Protocol):
    def arrive(self, name: str, value: int = 0, timeout: float = 30.0) -> BarrierAnswer: ...


class StatusLockstep:
    def __init__(self, queue: BarrierQueue, rank: int, timeout: float, log: logging.Logger,
                 on_passed: Callable[[str], None]):
        self._queue = queue
        self._rank = rank
        self._timeout = timeout
        self._log = log
        self._on_passed = on_passed  # (step) once the step's barrier completed on every rank
        self._wanted: str | None = None
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="rl-lockstep", daemon=True)
        self._thread.start()

    def request(self, step: str) -> None:
        """Arrive at ``step``'s barriers until one completes (no-op while already at them)."""
        with self._cond:
            if self._wanted != step:
                self._wanted = step
                self._cond.notify()

    def cancel(self) -> None:
        """The status moved on: arrive no more (a barrier being waited at still ends by itself)."""
        with self._cond:
            self._wanted = None

    @property
    def waiting_for(self) -> str | None:
        return self._wanted

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._wanted = None
            self._cond.notify()

    def join(self) -> None:
        self._thread.join(STOP_JOIN_TIMEOUT)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._wanted is None and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                step = self._wanted
            try:
                self._arrive_until_passed(step)
            except Exception:  # the thread must outlive one bad attempt: the next request retries
                self._log.exception("[RL] barrier of %s failed", step)
                with self._cond:
                    if self._wanted == step:
                        self._wanted = None

    def _arrive_until_passed(self, step: str) -> None:
        attempt = 0
        while self._still_wanted(step):
            name = f"rl/{step}/{attempt}"
            answer = self._queue.arrive(name, 0, self._timeout)
            if answer.ok:
                self._log.info("[RL] every rank is %s (barrier %s)", step, name)
                self._on_passed(step)  # first: the status it sets keeps the serve loop from asking again
                with self._cond:
                    if self._wanted == step:
                        self._wanted = None
                return
            if answer.missing:
                self._log.warning("[RL] barrier %s timed out after %gs: rank(s) %s not %s yet; still waiting",
                                  name, self._timeout, answer.missing, step)
            attempt += 1

    def _still_wanted(self, step: str) -> bool:
        with self._cond:
            return self._wanted == step and not self._stopped
