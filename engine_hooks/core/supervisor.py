"""The engine's one supervisor thread: deadlines, rank deaths and the heartbeat.

The engine core (``engine_core``), the service's or FastDeploy's queue façade's, runs one.  It
sleeps until a rank's process dies (a pidfd per rank), the soonest deadline of a pending task, the
next heartbeat, or the bell: a submission with a sooner deadline, a restarted or newly joined rank,
or stop.  It does not poll (it did, every 50 ms, taking the GIL from the engine's threads); while a
live rank has no pidfd (none on this kernel) it looks every ``TICK``.  An exception in one of its
iterations is logged and counted (``errors``), and it carries on: deadlines and the heartbeat must
outlive one bad iteration.  Its owner stops it (``stop``), which also closes its bell and pidfds.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Mapping, Protocol

from ops.procs import wait_readable

from .task_tracker import TaskTracker

logger = logging.getLogger(__name__)

TICK = 0.05  # how often a supervisor without pidfds looks whether its ranks are alive
BEAT_S = 1.0  # the heartbeat's period, and the longest a supervisor with pidfds sleeps


class RankProcessView(Protocol):
    """What the supervisor needs of a rank's process."""

    @property
    def pid(self) -> int: ...

    def alive(self) -> bool: ...


class Supervisor:
    def __init__(self, procs: Callable[[], Mapping[int, RankProcessView]], tracker: TaskTracker,
                 on_beat: Callable[[], None], on_rank_died: Callable[[int, RankProcessView], None],
                 name: str = "ctm-supervisor"):
        self._procs = procs  # the ranks' current processes (a restart or a rejoin replaces one)
        self._name = name
        self._tracker = tracker
        self._on_beat = on_beat  # every BEAT_S: the heartbeat signal, metrics, the queue's pump
        self._on_rank_died = on_rank_died
        self.errors = 0
        self.loops = 0  # wake-ups (it sleeps until it has something to do)
        self._stop = threading.Event()
        self._bell = -1  # an eventfd from start() on
        self._bell_lock = threading.Lock()  # a ring never writes to the number of a closed bell
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def ring(self) -> None:
        """Wake the supervisor before its planned time (any thread)."""
        with self._bell_lock:
            if self._bell >= 0:
                try:
                    os.eventfd_write(self._bell, 1)
                except BlockingIOError:  # the counter is full: the supervisor wakes anyway
                    pass

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self.ring()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("the supervisor did not stop within %.1fs", timeout)
                return  # it may still poll the bell: leave it open
        with self._bell_lock:
            if self._bell >= 0:
                os.close(self._bell)
                self._bell = -1

    def _run(self) -> None:
        last_beat = 0.0
        watched: dict[int, tuple[int, int]] = {}  # rank -> (pid, pidfd), kept across looks
        try:
            while not self._stop.is_set():
                try:
                    last_beat = self._look(last_beat, watched)
                except Exception:
                    self.errors += 1
                    logger.exception("supervisor iteration failed; supervising on")
                    self._stop.wait(TICK)
        finally:
            for _, fd in watched.values():
                os.close(fd)

    def _look(self, last_beat: float, watched: dict[int, tuple[int, int]]) -> float:
        """One look at the ranks and the deadlines, after sleeping until there is a reason to."""
        self.loops += 1
        tracker = self._tracker
        live = self._watch_pidfds(self._procs(), watched)
        exited: set[int] = set()  # ranks whose watched process has ended
        if all(rank in watched for rank in live):
            wake = tracker.plan_wake(last_beat + BEAT_S)
            timeout = min(BEAT_S, max(0.0, wake - time.monotonic()))
            bell = self._bell
            ready = wait_readable([fd for _, fd in watched.values()] + [bell], timeout)  # poll(2): no FD_SETSIZE
            if bell in ready:
                try:
                    os.eventfd_read(bell)
                except BlockingIOError:
                    pass
            exited = {rank for rank, (_, fd) in watched.items() if fd in ready}
        else:  # keeps the tracker's planned wake current, so submissions do not ring a bell nobody polls
            tracker.plan_wake(last_beat + BEAT_S)
            self._stop.wait(TICK)
        now = time.monotonic()
        if now - last_beat >= BEAT_S:
            self._on_beat()
            last_beat = now
        for rank, proc in list(self._procs().items()):  # as they are now: a restart may have replaced one
            gone = (rank in exited and watched[rank][0] == proc.pid) or not proc.alive()
            if gone and not tracker.is_down(rank):
                self._on_rank_died(rank, proc)
        tracker.expire(now)
        return last_beat

    def _watch_pidfds(self, procs: Mapping[int, RankProcessView], watched: dict[int, tuple[int, int]]) -> dict[int, int]:
        """One pidfd per live rank's current process, opened once (a restarted rank gets a new one).
        Returns the live ranks' pids."""
        live = {rank: proc.pid for rank, proc in list(procs.items()) if not self._tracker.is_down(rank)}
        for rank, (pid, fd) in list(watched.items()):
            if live.get(rank) != pid:
                os.close(fd)
                del watched[rank]
        if not hasattr(os, "pidfd_open"):
            return live
        for rank, pid in live.items():
            if rank not in watched:
                try:
                    watched[rank] = (pid, os.pidfd_open(pid))
                except OSError:
                    pass  # already reaped: the alive() check sees it
        return live
