"""Declaring a rank down and bringing it back: the one owner of the engine's restart policy.

A rank is down when its process died (the supervisor sees it) or its stream to the engine broke
(the queue server's ``on_rank_broken``: its local link closed, a frame of it was lost, a send found
its connection gone).  A rank alive but mute would let every task time out and keep each task's
blocks quarantined until a release that never comes (DESIGN §4).  So, at once:

1. its process is killed (SIGKILL, reaped within ``KILL_WAIT``) if it still runs: only a process
   that has ended can no longer touch a block;
2. every pending task fails with ``RankDiedError`` naming the rank and why, and the rank's hold on
   every task's blocks is released (DESIGN §3.8: "or the rank was restarted");
3. it is restarted (as by ``restart_rank``) on this object's thread, after a backoff that
   doubles with each restart in the policy's window; past ``max_restarts`` in that window it stays
   down, logged, until the engine calls ``restart_rank`` itself (which starts the count afresh).

A restarted rank's host swap space is new and empty: the engine core hears of it (``rank_replaced``),
so a swap-in from a slot written before the restart (and not since) fails at once
(``host_slots.HostSlots``) rather than load zeros on that rank.  Declaring a rank down and bringing
it up again go through the engine core (``engine_core.EngineCore``), as FastDeploy's façade does.

Threads: ``stream_broke`` is called by the queue under its lock and only hands off; ``process_died``
runs on the supervisor's thread; declarations of broken streams and every restart run on this
object's thread, which ``stop`` ends before the service stops its processes.  Per rank, restarts and
declarations take one lock, so a late report about a replaced process never downs its successor.
"""
from __future__ import annotations

import collections
import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

from cache_manager.queue.session import STREAM_BROKEN_EXIT

from .engine_core import EngineCore
from .launcher import KILL_WAIT, RankProcess, RankProcesses

logger = logging.getLogger(__name__)

# A rank whose stream broke is often ending by itself (it saw the break too, or was killed): this
# long it may, so its death is reported as it happened; then it is killed.
SELF_EXIT_WAIT_S = 0.1


@dataclass(frozen=True)
class RestartPolicy:
    """Restart a down rank after ``base_s``, doubling per restart in the last ``window_s`` seconds up
    to ``cap_s``; at most ``max_restarts`` automatic restarts per window (0: never restart)."""

    base_s: float = 0.5
    cap_s: float = 8.0
    max_restarts: int = 5
    window_s: float = 300.0

    def delay(self, recent_restarts: int) -> float:
        return min(self.cap_s, self.base_s * 2 ** recent_restarts)


@dataclass
class RankHooks:
    """What recovery drives of the service that owns it."""

    ranks: RankProcesses
    core: EngineCore  # tracking, supervision, the host-slot guard, the queue's view of the ranks
    registered: Callable[[], set[int]]  # the ranks the queue reaches
    reset: Callable[[int], None]  # the rank's readiness signals start over
    ready: Callable[[int], bool]  # the rank's new process serves
    ready_timeout: float
    stop_grace: float


class RankRecovery:
    def __init__(self, hooks: RankHooks, policy: RestartPolicy | None = None, auto_restart: bool = True):
        self._hooks = hooks
        self._core = hooks.core
        self._procs, self._tracker, self._forget = hooks.ranks.current, hooks.core.tracker, hooks.core.forget_rank
        # Per rank: its restarts (manual or automatic) and declarations, one at a time, so a late
        # report about a replaced process never downs its successor.
        self._rank_locks: dict[int, threading.RLock] = {}
        self._rank_locks_lock = threading.Lock()
        self.replacements = 0  # rank processes replaced so far (automatically or by restart_rank)
        self._count_lock = threading.Lock()
        self.policy = policy or RestartPolicy()
        self.auto_restart = auto_restart
        self._declare_lock = threading.Lock()  # one declaration per death, whoever sees it first
        self._cond = threading.Condition()
        self._breaks: collections.deque[tuple[int, int, str]] = collections.deque()
        self._due: dict[int, tuple[float, int]] = {}  # rank -> (when, pid of the process it replaces)
        self._history: dict[int, collections.deque[float]] = collections.defaultdict(collections.deque)
        self.stopping = threading.Event()
        self.restarts = 0  # automatic restarts that brought a rank back
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ctm-rank-recovery", daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """No declaration or restart starts from now on; waits up to ``timeout`` for one under way
        (a restart in ``wait_ready`` gives up at once).  The queue forgets every rank: they stop next."""
        self.stopping.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("the rank recovery thread did not stop within %.1fs", timeout)
        for rank in list(self._procs()):  # the ranks stop next: their streams closing is no break
            self._forget(rank)

    # ------------------------------------------------------------------ reports
    def stream_broke(self, rank: int, pid: int, why: str) -> None:
        """The queue saw rank ``rank``'s (process ``pid``) stream break (any thread; never blocks)."""
        with self._cond:
            if not self.stopping.is_set():
                self._breaks.append((rank, pid, why))
                self._cond.notify_all()

    def process_died(self, rank: int, proc: RankProcess) -> None:
        """The supervisor saw rank ``rank``'s process end.  Never waits for a restart: one under way
        for this rank replaces the process anyway (the supervisor looks again if it was not that)."""
        lock = self._lock_of(rank)
        if not lock.acquire(blocking=False):
            return
        try:
            if not self._mark_down(rank, proc.pid, "died"):
                return
            detail = f"(pid {proc.pid}) died ({proc.exit_detail()})"
            if proc.popen.returncode == STREAM_BROKEN_EXIT:
                detail += ": its stream from the engine broke"
            self._declared(rank, proc.pid, detail, released=True)
        finally:
            lock.release()

    def restart(self, rank: int) -> None:
        """The engine restarts the rank itself (``restart_rank``): the automatic count starts afresh."""
        with self._cond:
            self._history.pop(rank, None)
            self._due.pop(rank, None)
        self._replace(rank, None)

    def _replace(self, rank: int, cancel: threading.Event | None) -> None:
        """Stop the rank's process (dead or alive), fail its tasks, release its blocks, start a new
        one and wait until it serves (``StartupError`` if it does not, or ``cancel`` is set)."""
        h = self._hooks
        with self._lock_of(rank):
            self._tracker.mark_down(rank, "is restarting")  # first: the supervisor must not see the stop as a death
            old = self._procs().get(rank)
            self._forget(rank)  # first: its stream closing as it stops is no break
            stopped = h.ranks.stop(rank, h.stop_grace)
            h.reset(rank)
            self._core.rank_replaced(rank)  # the new process's swap space is empty
            with self._count_lock:
                self.replacements += 1  # a prefix cache compares this and forgets its host tier
            if old is not None:  # no answer comes from it; one that would not die still holds its blocks
                self._core.rank_down(rank, f"(pid {old.pid}) is restarting", release=stopped)
            # wait until the old connection is forgotten before the new one says hello
            deadline = time.monotonic() + 5.0
            while rank in h.registered() and time.monotonic() < deadline:
                time.sleep(0.01)
            new = h.ranks.start(rank)
            h.ranks.wait_ready([rank], h.ready, h.ready_timeout, cancel)
            self._core.rank_up(rank)  # tasks reach it; the supervisor watches the new process at once
            logger.info("rank %d restarted as pid %d", rank, new.pid)

    # ------------------------------------------------------------------ declaring
    def _lock_of(self, rank: int) -> threading.RLock:
        with self._rank_locks_lock:
            return self._rank_locks.setdefault(rank, threading.RLock())

    def _mark_down(self, rank: int, pid: int, why: str) -> bool:
        """Mark the rank down for process ``pid``; False if it is down already or ``pid`` was replaced."""
        with self._declare_lock:
            proc = self._procs().get(rank)
            if self.stopping.is_set() or proc is None or proc.pid != pid or self._tracker.is_down(rank):
                return False
            self._tracker.mark_down(rank, why)  # submissions fail at once from here on
            return True

    def _declare_broken(self, rank: int, pid: int, why: str) -> None:
        with self._lock_of(rank):  # a restart under way replaces the process: its old stream's break is stale
            proc = self._procs().get(rank)
            if proc is None or not self._mark_down(rank, pid, f"is down: its stream to the engine broke ({why})"):
                return
            ended_by_itself = proc.reap(SELF_EXIT_WAIT_S)
            if ended_by_itself:
                detail = f"(pid {pid}) died ({proc.exit_detail()}); its stream to the engine broke ({why})"
                reaped = True
            else:
                proc.send_signal(signal.SIGKILL)
                reaped = proc.reap(KILL_WAIT)
                detail = f"(pid {pid}) was declared down and killed: its stream to the engine broke ({why})"
                if not reaped:
                    logger.error("rank %d (pid %d) still runs %.1fs after SIGKILL (stuck in the kernel?): its "
                                 "tasks fail, their blocks stay held", rank, pid, KILL_WAIT)
            self._declared(rank, pid, detail, released=reaped)

    def _declared(self, rank: int, pid: int, detail: str, released: bool) -> None:
        logger.error("CTM rank %d %s; failing every pending task", rank, detail)
        self._core.rank_down(rank, detail, release=released)
        self._schedule(rank, pid)

    # ------------------------------------------------------------------ restarting
    def _schedule(self, rank: int, pid: int) -> None:
        if not self.auto_restart or self.stopping.is_set():
            return
        now = time.monotonic()
        with self._cond:
            recent = self._history[rank]
            while recent and now - recent[0] > self.policy.window_s:
                recent.popleft()
            if len(recent) >= self.policy.max_restarts:
                gave_up = len(recent)
            else:
                gave_up, delay = 0, self.policy.delay(len(recent))
                self._due[rank] = (now + delay, pid)
                self._cond.notify_all()
        if not gave_up and self.policy.max_restarts > 0:
            logger.warning("rank %d restarts in %.2gs", rank, delay)
        if gave_up or self.policy.max_restarts <= 0:
            why = (f"is down: restarted {gave_up} times in {self.policy.window_s:g}s and down again; "
                   "call restart_rank to bring it back")
            logger.error("rank %d %s", rank, why)
            self._tracker.mark_down(rank, why)

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                self._step()
            except Exception:  # the recovery of every later rank must outlive one failure
                logger.exception("rank recovery step failed; going on")
                self.stopping.wait(0.1)

    def _step(self) -> None:
        with self._cond:
            now = time.monotonic()
            if not self._breaks and not any(when <= now for when, _ in self._due.values()):
                soonest = min((when for when, _ in self._due.values()), default=None)
                self._cond.wait(None if soonest is None else max(0.0, soonest - now))
                if self.stopping.is_set():
                    return
            breaks, self._breaks = list(self._breaks), collections.deque()
            now = time.monotonic()
            due = sorted((rank, pid) for rank, (when, pid) in self._due.items() if when <= now)
            for rank, _ in due:
                del self._due[rank]
        for rank, pid, why in breaks:
            self._declare_broken(rank, pid, why)
        for rank, pid in due:
            self._restart_due(rank, pid)

    def _restart_due(self, rank: int, pid: int) -> None:
        with self._lock_of(rank):
            proc = self._procs().get(rank)
            if self.stopping.is_set() or proc is None or proc.pid != pid or not self._tracker.is_down(rank):
                return  # restarted meanwhile (restart_rank), or shutting down
            with self._cond:
                self._history[rank].append(time.monotonic())
                attempt = len(self._history[rank])
            logger.warning("restarting rank %d (automatic restart %d of at most %d in %gs)", rank, attempt,
                           self.policy.max_restarts, self.policy.window_s)
            try:
                self._replace(rank, self.stopping)
            except Exception as exc:
                if self.stopping.is_set():
                    return
                failed = self._procs().get(rank)
                logger.error("automatic restart of rank %d failed: %s", rank, exc)
                if failed is not None:
                    failed.stop(0.5)  # a half-started process must not linger while the rank is down
                    self._schedule(rank, failed.pid)
                return
            self.restarts += 1
