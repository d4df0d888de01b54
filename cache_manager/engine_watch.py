"""Whether the engine a CTM serves is still there.

The CTM exits once the engine *process* is gone: ``--engine_pid`` watched through a pidfd (which
names the process itself, so a reused pid cannot fool it), else the parent.  A
``worker_healthy_live_signal`` that stops changing for ``FD_CACHE_PROC_EXIT_TIMEOUT`` seconds
(on this process's monotonic clock, so wall-clock steps do not matter) is logged and nothing more:
a paused engine (SIGSTOP, a debugger, swapped out) still owns its caches.
"""
from __future__ import annotations

import logging
import os
import select
import time

from ops.procs import pid_alive

from cache_manager.ipc_signal import IPCSignal

EXIT_TIMEOUT_ENV = "FD_CACHE_PROC_EXIT_TIMEOUT"


class EngineGone(Exception):
    """The engine is gone: the CTM stops, and removes what the engine can no longer unlink."""


class EngineWatch:
    def __init__(self, engine_pid: int | None, log: logging.Logger):
        self.engine_pid = engine_pid
        self.parent_pid = os.getppid()
        self.exit_timeout = float(os.environ.get(EXIT_TIMEOUT_ENV, "30"))
        self._log = log
        self._fd: int | None = None  # the engine's pidfd; -1 where pidfds are not available
        self._beat_value: int | None = None
        self._beat_seen = time.monotonic()
        self._beat_stale_logged = False

    def engine_exited(self) -> bool:
        """True once the engine process is gone."""
        if self.engine_pid is None:
            return os.getppid() != self.parent_pid
        if self._fd is None and hasattr(os, "pidfd_open"):
            try:
                self._fd = os.pidfd_open(self.engine_pid)
            except ProcessLookupError:
                return True
            except OSError:
                self._fd = -1  # no pidfd here: fall back to the pid
        if self._fd is not None and self._fd >= 0:
            return bool(select.select([self._fd], [], [], 0)[0])
        return not pid_alive(self.engine_pid)

    def check(self, heartbeat: IPCSignal | None) -> None:
        """Raise ``EngineGone`` if the engine process is gone; log a heartbeat that stopped or resumed."""
        if self.engine_exited():
            who = f"engine process {self.engine_pid}" if self.engine_pid else f"parent {self.parent_pid}"
            raise EngineGone(f"{who} is gone")
        if heartbeat is None:
            return
        value, now = int(heartbeat.value[0]), time.monotonic()
        if value != self._beat_value:
            if self._beat_stale_logged:
                self._log.warning("worker_healthy_live_signal moves again: the engine is back")
            self._beat_value, self._beat_seen, self._beat_stale_logged = value, now, False
        elif now - self._beat_seen > self.exit_timeout and not self._beat_stale_logged:
            # A live engine that stopped beating is paused: its caches are still its own, so
            # nothing is removed and the CTM keeps serving.
            self._log.warning("worker_healthy_live_signal has not changed for %.0fs (> %s=%g) but the engine "
                              "process is alive: keeping its caches and serving on", now - self._beat_seen,
                              EXIT_TIMEOUT_ENV, self.exit_timeout)
            self._beat_stale_logged = True
