"""EngineCore: the one engine core behind both front doors (DESIGN §3.8, "One engine core serves both
front doors").

``CacheTransferService`` (which launches and restarts its CTMs) and FastDeploy's ``EngineCacheQueue``
façade (whose CTMs FastDeploy launches, and which rejoin the queue) each own one, and only translate
their callers' calls into it.  What it holds, so that a guard written here holds for both:

* the ``TaskTracker`` (every task in flight, its future and its release) and the ``Supervisor``
  (deadlines, the heartbeat, rank deaths), and the queue server it sends through (``serve``);
* the submission path (``submit``): a refusal of the front door (closed, caches cleared), then the
  host-slot guard (``HostSlots``: a swap-in from slots a rank's replacement emptied fails before it is
  sent, naming the rank and the slots), then tracking, the broadcast, and the ranks it did not reach;
* what happens when a rank goes down (``rank_down``: the queue forgets it, its tasks fail and its
  blocks are released) and when a new process of it joins (``rank_joined``: its swap space is new,
  so the slots written before are lost on it) and serves (``rank_up``); a FastDeploy sleep that
  freed the ranks' swap space (``swap_freed``) loses the slots the same way;
* FastDeploy's pause (``ctrl_pause`` .. ``ctrl_resume``, or a kv-cache ``ctrl_wakeup`` that succeeded on
  every rank, which ends the pause its sleep began): a rank's pause lives in its process, so a
  rank whose process was replaced during a pause would start unpaused and run what the others hold.
  The core remembers the pause and which ranks' current processes heard it; before anything else
  reaches a rank that did not, that rank is paused again (a ``ctrl_pause`` to every rank: the ranks
  that are paused already only drain and meet at its barrier), both when it comes up and before the
  next task is sent.

Threads: ``submit`` runs on the engine's threads; ``rank_joined`` on the queue's I/O thread (it never
blocks); ``rank_down`` on the supervisor's or the rank recovery's thread.
"""
from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import Future
from typing import Callable, Mapping

from cache_manager.cache_data import CONTROL_COMMAND_PREFIX, DEFAULT_SLEEP_TAGS, KV_CACHE_TAG, CacheStatus
from cache_manager.cache_tasks import MAX_TASK_BUDGET_S
from cache_manager.queue.server import EngineCacheQueueServer

from .host_slots import HostSlots
from .supervisor import RankProcessView, Supervisor
from .task_future import TaskFuture
from .task_tracker import TaskTracker
from .transfer_records import DEFAULT_CAPACITY, TransferRecords

logger = logging.getLogger(__name__)

PAUSE, RESUME, SLEEP, WAKEUP = (CONTROL_COMMAND_PREFIX + m for m in ("pause", "resume", "sleep", "wakeup"))
REPAUSE_PREFIX = "~repause-"  # the task ids of the core's own re-pauses (no engine id starts so)


def failed_future(error: BaseException) -> TaskFuture:
    """A future that failed at once, before anything was sent (so nothing holds its blocks)."""
    future = TaskFuture(released=True)
    future.set_exception(error)
    return future


class PauseRecord:
    """Whether the ranks are paused (a pause was sent and no resume since), and which ranks' current
    processes heard it.  Callers hold the core's pause lock."""

    def __init__(self, tp: int):
        self.tp = tp
        self.paused = False
        self.heard: set[int] = set()
        self.pauses = 0  # pauses sent: a wakeup ends the pause only if none was sent after it

    def sent(self, command: object, reached: set[int]) -> None:
        if command == PAUSE:
            self.paused, self.heard, self.pauses = True, self.heard | reached, self.pauses + 1
        elif command == RESUME:
            self.paused, self.heard = False, set()

    def woken(self, pauses: int) -> None:
        """A kv-cache wakeup sent when ``pauses`` pauses had been sent succeeded on every rank: the ranks
        ended the pause (``cache_manager.rank.control``), unless a pause was sent since."""
        if pauses == self.pauses:
            self.paused, self.heard = False, set()

    def unheard(self) -> list[int]:
        """The ranks that must be paused again before anything else reaches them."""
        return sorted(set(range(self.tp)) - self.heard) if self.paused else []


class EngineCore:
    def __init__(self, tp: int, num_cpu_blocks: int | None, procs: Callable[[], Mapping[int, RankProcessView]],
                 on_beat: Callable[[], None], on_rank_died: Callable[[int, RankProcessView], None], *,
                 control_timeout: float = 60.0, record_latencies: bool = False,
                 supervisor_name: str = "ctm-supervisor", transfer_records: int = DEFAULT_CAPACITY):
        """``procs``: the ranks' current processes (what the supervisor watches); ``on_beat``: every
        second on the supervisor's thread; ``on_rank_died``: the supervisor saw a rank's process end
        (the front door decides: restart it, or wait for it to rejoin); ``control_timeout``: the
        budget of the core's own control tasks (a re-pause); ``transfer_records``: the requests whose
        tasks' records are kept (``transfer_records``; 0: none)."""
        self.tp = tp
        self.control_timeout = control_timeout
        self.tracker = TaskTracker(tp, record_latencies, on_sooner_deadline=lambda: self.supervisor.ring(),
                                   records=TransferRecords(transfer_records))
        self.host_slots = HostSlots(num_cpu_blocks)
        self.supervisor = Supervisor(procs, self.tracker, on_beat, on_rank_died, name=supervisor_name)
        self.server: EngineCacheQueueServer | None = None
        self._send_lock = threading.Lock()  # one broadcast at a time, so a re-pause goes before the rest
        self._pause_lock = threading.Lock()  # the pause record; taken alone, or inside the send lock
        self._pause = PauseRecord(tp)
        self._up_watchers: list[Callable[[int], None]] = []  # told when a rank's new process serves
        self._ids = itertools.count()

    def serve(self, server: EngineCacheQueueServer) -> None:
        """The queue server the core sends through (created by the front door with the core's
        ``tracker.on_result`` and ``rank_joined`` as its callbacks)."""
        self.server = server

    # ------------------------------------------------------------------ submission
    def submit(self, task: dict, timeout: float, grace: float = 0.0,
               refusal: BaseException | None = None, request_id: str | None = None) -> TaskFuture:
        """Track ``task`` and broadcast it to every rank; the future resolves when all have answered.
        It fails at once, and nothing is sent, with ``refusal`` (the front door's reason), or when the
        host-slot guard refuses it, or a rank is down.  ``ValueError`` (nothing sent) for a task id
        already pending or a timeout out of range.  ``request_id`` (checked by the front door): the
        task is recorded for that request (``tracker.records``), refused or not."""
        if refusal is None and self.server is None:
            refusal = RuntimeError("the engine core has no queue server yet")
        refusal = refusal or self.host_slots.refusal(task)
        if refusal is not None:
            future = failed_future(refusal)
            if request_id is not None:
                records = self.tracker.records
                records.watch(records.open(request_id, {"task_id": self.tracker.new_task_id(), **task},
                                           list(range(self.tp))), future)
            return future
        task, future, send = self.tracker.begin(task, timeout, grace, request_id)
        if send and task.get("event_type") == CacheStatus.CTRL and task.get("command") == SLEEP:
            future.add_done_callback(self._slept)
        if send and task.get("event_type") == CacheStatus.CTRL and task.get("command") == WAKEUP \
                and KV_CACHE_TAG in task.get("args", {}).get("tags", DEFAULT_SLEEP_TAGS):
            with self._pause_lock:
                pauses = self._pause.pauses
            future.add_done_callback(lambda f: self._woken(f, pauses))
        if send:
            self._send(task)
        return future

    def _woken(self, future: Future, pauses: int) -> None:
        if future.exception() is None:
            with self._pause_lock:
                self._pause.woken(pauses)

    def _slept(self, future: Future) -> None:
        """A FastDeploy sleep answered: the ranks that freed their swap space (``swap_freed``, under
        ``FD_ENABLE_SWAP_SPACE_CLEARING``) get a new one at the wakeup, so the slots written before are
        lost on them; so on those that did not answer, when any did."""
        results = future.rank_results
        freed = [r for r, res in results.items() if res.ok and isinstance(res.value, dict) and res.value.get("swap_freed")]
        if not freed:
            return
        unknown = [r for r in range(self.tp) if r not in results or not results[r].ok]
        self.swap_freed(freed + unknown, "a FastDeploy sleep" + (f" (maybe on {unknown}, which failed it)"
                                                                  if unknown else ""))

    def swap_freed(self, ranks: list[int], why: str) -> None:
        """The swap space of ``ranks`` was freed (``why``: a sleep or an RL clear under
        ``FD_ENABLE_SWAP_SPACE_CLEARING``): the host slots written before are lost on them."""
        logger.warning("%s freed the swap space of rank(s) %s: host slots written before are lost", why, ranks)
        for rank in ranks:
            self.host_slots.rank_restarted(rank)

    def _send(self, task: dict) -> None:
        with self._send_lock:
            self._repause_locked()
            unreachable = self.server.broadcast(task)
            if task.get("event_type") == CacheStatus.CTRL:
                with self._pause_lock:
                    self._pause.sent(task.get("command"), set(range(self.tp)) - set(unreachable))
        if unreachable:
            self.tracker.unreachable(task["task_id"], unreachable)

    def _repause_locked(self) -> None:
        """Pause the ranks whose current process never heard the pause in force, before anything else
        reaches them (under the send lock).  A rank still down refuses it: the next send tries again."""
        with self._pause_lock:
            unheard = self._pause.unheard()
        if not unheard:
            return
        task = {"event_type": int(CacheStatus.CTRL), "task_id": f"{REPAUSE_PREFIX}{next(self._ids)}",
                "command": PAUSE, "args": {}}
        task, future, send = self.tracker.begin(task, min(self.control_timeout, MAX_TASK_BUDGET_S))
        future.add_done_callback(lambda f, ranks=unheard: self._repaused(f, ranks))
        if not send:
            return
        logger.warning("rank(s) %s joined during a pause: pausing them again before anything else reaches them",
                       unheard)
        unreachable = self.server.broadcast(task)
        with self._pause_lock:
            self._pause.sent(PAUSE, set(range(self.tp)) - set(unreachable))
        if unreachable:
            self.tracker.unreachable(task["task_id"], unreachable)

    @staticmethod
    def _repaused(future: Future, ranks: list[int]) -> None:
        error = future.exception()
        if error is not None:
            logger.warning("re-pausing rank(s) %s failed (tried again before the next task): %s", ranks, error)

    # ------------------------------------------------------------------ ranks
    def rank_joined(self, rank: int, pid: int) -> None:
        """A new process of ``rank`` joined the queue (its I/O thread; never blocks): its swap space
        is new and empty, and it has not heard a pause sent before."""
        logger.debug("rank %d (pid %d) joined: host slots written before are lost on it", rank, pid)
        self.rank_replaced(rank)

    def rank_replaced(self, rank: int) -> None:
        """``rank``'s process was (or is being) replaced: its swap space goes with it, and the new
        process has not heard a pause sent before."""
        self.host_slots.rank_restarted(rank)
        with self._pause_lock:
            self._pause.heard.discard(rank)

    def rank_up(self, rank: int) -> None:
        """``rank``'s new process serves: tasks reach it from now on (paused again first, during a
        pause, on a thread of its own), and the supervisor watches it at once."""
        self.tracker.mark_up(rank)
        self.supervisor.ring()
        with self._pause_lock:
            repause = rank in self._pause.unheard()
        if repause:
            threading.Thread(target=self._repause_now, name=f"ctm-repause-{rank}", daemon=True).start()
        for watcher in list(self._up_watchers):
            try:
                watcher(rank)
            except Exception:
                logger.exception("a watcher of rank %d coming up failed", rank)

    def watch_rank_up(self, watcher: Callable[[int], None]) -> Callable[[], None]:
        """Call ``watcher(rank)`` whenever a new process of a rank serves (it must not block: it runs
        on the thread that brought the rank up); returns the call that stops it."""
        self._up_watchers.append(watcher)
        return lambda: self._up_watchers.remove(watcher) if watcher in self._up_watchers else None

    def _repause_now(self) -> None:
        try:
            with self._send_lock:
                if self.server is not None:
                    self._repause_locked()
        except Exception:
            logger.exception("re-pausing a rank that joined during a pause failed")

    def forget_rank(self, rank: int) -> None:
        """The queue stops sending to ``rank`` and lets a new process of it register."""
        with self._pause_lock:
            self._pause.heard.discard(rank)
        if self.server is not None:
            self.server.forget_rank(rank)

    def rank_down(self, rank: int, detail: str, release: bool = True) -> None:
        """``rank``'s process is gone (``detail`` says how): the queue forgets it, every pending task
        fails naming it, and it holds no block any more (``release``, unless it outlived SIGKILL)."""
        self.forget_rank(rank)
        self.tracker.rank_died(rank, detail, release=release)

    # ------------------------------------------------------------------ lifetime
    def start(self) -> None:
        self.supervisor.start()

    def stop_supervisor(self, timeout: float) -> None:
        self.supervisor.stop(timeout)
