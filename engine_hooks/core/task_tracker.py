"""TaskTracker: the engine side of every task in flight, between submission and the last rank's answer.

It owns the futures the engine holds (``task_future.TaskFuture``) and resolves them from the ranks'
``RankResult``s:

* with the task's result (DESIGN §3.3) when every rank succeeded: a swap's tuple, for a storage
  task the gpu block ids of the shortest (minimum over ranks) leading run;
* with ``TaskFailedError`` naming each failing rank and its reason;
* with ``TaskTimeoutError`` (``expire``) naming the ranks that did not answer in time;
* with ``RankDiedError`` when a rank dies (``rank_died``), and at once for tasks submitted while a
  rank is down.

Two-phase completion (DESIGN §3.8): every future has ``released``, done once every rank has let
go of the task's blocks (it answered with ``released``, died, or was restarted).  Until then a
failed or timed-out task stays in ``unreleased_tasks()``.

Observers (metrics) are called once per task with its outcome, after its future resolves; an
observer that raises is logged and never disturbs the task.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from cache_manager.cache_data import CacheStatus
from cache_manager.cache_tasks import MAX_TASK_BUDGET_S, RankResult

from .errors import RankDiedError, ServiceClosed, TaskFailedError, TaskTimeoutError
from .task_future import TaskFuture
from .transfer_records import TransferRecords

logger = logging.getLogger(__name__)

OUTCOMES = ("ok", "failed", "timed_out", "rank_died", "closed")
# A task expires this long after its deadline: a rank that gives up at the deadline (a layer-wise
# store whose layers never came) answers then, and its own error is worth more than a timeout.
ANSWER_SLACK_S = 0.05
# observer(task, outcome, seconds from submission, the ranks' results so far)
Observer = Callable[[dict, str, float, dict], None]


@dataclass
class Pending:
    task: dict
    future: TaskFuture
    deadline: float
    timeout: float
    unreleased: set[int]  # ranks that may still touch the task's blocks
    results: dict[int, RankResult] = field(default_factory=dict)
    submitted: float = field(default_factory=time.perf_counter)
    record: Any = None  # its transfer record, when it carries a request id (``transfer_records``)


# Tasks whose answer is the list of blocks the rank moved; the task's result is the shortest.
BLOCK_LIST_EVENTS = (CacheStatus.STORAGE2GPU, CacheStatus.GPU2STORAGE, CacheStatus.PEER_PULL, CacheStatus.PEER_PUSH)


def value_problem(task: dict, result: RankResult) -> str | None:
    """Why a successful answer's value cannot be ``aggregate``d for ``task``, or None.  Checked
    before the task leaves the pending table: a TypeError there would leave its future unresolved
    with no deadline left to fail it."""
    if not result.ok or task.get("event_type") not in BLOCK_LIST_EVENTS:
        return None  # a swap's result comes from the task; a control task's values are anything
    value = result.value
    if type(value) is list and all(type(v) is int for v in value):
        return None
    return f"malformed answer: rank {result.rank} answered a storage task with {value!r:.80}, not a list of block ids"


def aggregate(task: dict, results: dict[int, RankResult], tp: int) -> Any:
    """The task's result from every rank's answer (DESIGN §3.3)."""
    event = task.get("event_type")
    if event in (CacheStatus.SWAP2CPU, CacheStatus.SWAP2GPU):
        return (event, task["task_id"], task["swap_node_ids"], task["gpu_block_ids"], task["cpu_block_ids"])
    if event in BLOCK_LIST_EVENTS:
        return min((results[r].value for r in range(tp)), key=len)
    return [results[r].value for r in range(tp)]


def partly_loaded(task: dict, results: dict[int, RankResult], tp: int) -> tuple[list[int] | None, int]:
    """A failed P/D pull whose ranks each said which blocks they loaded (failed blocks were digest
    mismatches): the destination blocks loaded on every rank, and the mismatches counted."""
    mismatches = sum(r.digest_mismatches for r in results.values())
    values = [r.value for r in results.values()]
    if not mismatches or task.get("event_type") != CacheStatus.PEER_PULL or len(values) != tp \
            or not all(type(v) is list for v in values):
        return None, mismatches
    have = [set(v) for v in values]
    return [b for b in task.get("dst_block_ids", []) if all(b in h for h in have)], mismatches


class TaskTracker:
    def __init__(self, tp: int, record_latencies: bool = False,
                 on_sooner_deadline: Callable[[], None] | None = None, records: TransferRecords | None = None):
        """``on_sooner_deadline``: called (outside the lock) when a submission's deadline comes before
        the supervisor's planned wake (``plan_wake``), to wake it.  ``records``: where the tasks that
        carry a request id are recorded (default: a ``TransferRecords`` of its default size)."""
        self.tp = tp
        self.records = records if records is not None else TransferRecords()
        self.lock = threading.Lock()
        self._pending: dict[str, Pending] = {}
        self._unreleased: dict[str, Pending] = {}  # failed or timed out, some rank not yet released
        self._dead: dict[int, str] = {}  # rank -> why it is down
        self._ids = itertools.count()
        self._closed = False
        self.observers: list[Observer] = []
        # Every completed task's latency, submit to last rank's answer: for replays and benchmarks
        # only (record_latencies), since the list grows with every task; an engine that runs for
        # days gets its latencies from the metrics' histograms instead.
        self.latencies_ms: list[float] = []
        self._record_latencies = record_latencies
        self._busy_total = 0.0  # seconds with a task pending, up to _busy_since
        self._busy_since: float | None = None  # perf_counter when the pending set last became non-empty
        # Deadlines of pending tasks, soonest first (entries of finished tasks are dropped when they
        # reach the top), so the supervisor sleeps until the next one instead of polling.
        self._deadline_heap: list[tuple[float, str]] = []
        self._wake_by = math.inf  # when the supervisor looks next (plan_wake)
        self._on_sooner_deadline = on_sooner_deadline

    # ------------------------------------------------------------------ submission
    def new_task_id(self) -> str:
        return f"t{next(self._ids)}"

    def begin(self, task: dict, timeout: float, grace: float = 0.0,
              request_id: str | None = None) -> tuple[dict, TaskFuture, bool]:
        """Stamp ``task`` (id, time budget) and track it.  Returns (the task, its future, whether it
        should be sent): a closed tracker or a dead rank fails the future at once.  A ``request_id``
        (checked by the caller) has the task recorded in ``records``."""
        if not 0 < timeout <= MAX_TASK_BUDGET_S:
            raise ValueError(f"timeout {timeout!r} must be positive and at most {MAX_TASK_BUDGET_S:g} s")
        task = dict(task)
        task.setdefault("task_id", self.new_task_id())
        now = time.monotonic()
        # A duration and the time it starts on this clock: a rank on another host counts the
        # budget from when the task arrives, one on this host from now (cache_tasks.task_deadline).
        task["budget_s"] = float(timeout)
        task["sent_at"] = now
        with self.lock:
            if self._closed:
                future = TaskFuture(released=True)
                future.set_exception(ServiceClosed("the CTM service is not running"))
                return task, future, False
            if task["task_id"] in self._pending or task["task_id"] in self._unreleased:
                raise ValueError(f"task id {task['task_id']!r} is already pending")
            down = min(self._dead.items()) if self._dead else None
            if down is None:
                future = TaskFuture()
                deadline = now + timeout + grace
                pending = self._pending[task["task_id"]] = Pending(task, future, deadline, timeout + grace,
                                                                   set(range(self.tp)))
                self._prune_deadlines_locked()
                heapq.heappush(self._deadline_heap, (deadline, task["task_id"]))
                self._busy_locked()
                sooner = deadline + ANSWER_SLACK_S < self._wake_by
        live = self.records.open(request_id, task, list(range(self.tp))) if request_id is not None else None
        if live is not None and down is None:
            pending.record = live  # before it is sent: no answer can come sooner
        if down is None:
            self.records.watch(live, future)
            if sooner and self._on_sooner_deadline is not None:
                self._on_sooner_deadline()
            return task, future, True
        future = TaskFuture(released=True)
        future.set_exception(RankDiedError(task["task_id"], *down))
        self.records.watch(live, future)
        self._notify(task, "rank_died", 0.0, {})
        return task, future, False

    def plan_wake(self, latest: float) -> float:
        """When the supervisor should next look (``time.monotonic()``): the soonest deadline of a
        pending task, or ``latest``.  A task submitted later with a sooner deadline calls
        ``on_sooner_deadline``."""
        with self.lock:
            self._prune_deadlines_locked()
            heap = self._deadline_heap
            self._wake_by = min(latest, heap[0][0] + ANSWER_SLACK_S) if heap else latest
            return self._wake_by

    def _prune_deadlines_locked(self) -> None:
        """Drop the soonest deadlines of tasks no longer pending.  Called on every submission too,
        so the heap holds only what was submitted since the oldest pending task, whoever drives it."""
        heap, pending = self._deadline_heap, self._pending
        while heap and (heap[0][1] not in pending or pending[heap[0][1]].deadline != heap[0][0]):
            heapq.heappop(heap)

    def unreachable(self, task_id: str, ranks: list[int]) -> None:
        """The task never reached ``ranks``: they hold nothing of it, and it fails."""
        with self.lock:
            pending = self._pending.get(task_id)
            if pending is not None:
                pending.unreleased.difference_update(ranks)
        # broadcast's answer names why (``Unreachable.reasons``): not connected, or not reading its tasks
        detail = getattr(ranks, "reasons", {}).get(ranks[0], "is not connected to the queue")
        self.fail(task_id, RankDiedError(task_id, ranks[0], detail), "rank_died")

    # ------------------------------------------------------------------ results
    def on_result(self, result: RankResult) -> None:
        with self.lock:
            pending = self._pending.get(result.task_id)
            if pending is None:
                self._late_result_locked(result)  # the future failed already; the answer may release blocks
                return
            if result.released:
                pending.unreleased.discard(result.rank)
            if result.rank in pending.results:
                return  # a release note after the rank's answer
            problem = value_problem(pending.task, result)
            if problem is not None:
                # The rank's answer counts as its failure, and the task fails now: waiting for
                # the other ranks would only trade this reason for a timeout.
                logger.error("task %s: %s", result.task_id, problem)
                result = RankResult(result.task_id, result.rank, False, error=problem, recv_seq=result.recv_seq,
                                    elapsed_ms=result.elapsed_ms, released=result.released)
            pending.results[result.rank] = result
            if pending.record is not None:
                self.records.answered(pending.record, result, time.perf_counter())
            if len(pending.results) < self.tp and problem is None:
                return
            del self._pending[result.task_id]
            self._busy_locked()
            if pending.unreleased:
                self._unreleased[result.task_id] = pending
        if not pending.unreleased:
            pending.future.let_go()
        now = time.perf_counter()
        if self._record_latencies:
            self.latencies_ms.append((now - pending.submitted) * 1e3)
        pending.future.set_rank_results(pending.results)
        failures = {r: res.error or "failed" for r, res in pending.results.items() if not res.ok}
        if failures:
            pending.future.set_exception(TaskFailedError(result.task_id, failures, *partly_loaded(pending.task,
                                                                                                 pending.results,
                                                                                                 self.tp)))
        else:
            pending.future.set_result(aggregate(pending.task, pending.results, self.tp))
        self._notify(pending.task, "failed" if failures else "ok", now - pending.submitted, pending.results)

    def _late_result_locked(self, result: RankResult) -> None:
        pending = self._unreleased.get(result.task_id)
        if pending is None or not result.released:
            return
        pending.unreleased.discard(result.rank)
        if not pending.unreleased:
            del self._unreleased[result.task_id]
            pending.future.let_go()

    def fail(self, task_id: str, error: Exception, outcome: str = "failed") -> None:
        with self.lock:
            pending = self._pending.pop(task_id, None)
            self._busy_locked()
            if pending is not None and pending.unreleased:
                self._unreleased[task_id] = pending
        if pending is not None:
            pending.future.set_exception(error)
            if not pending.unreleased:
                pending.future.let_go()
            self._notify(pending.task, outcome, time.perf_counter() - pending.submitted, pending.results)

    def expire(self, now: float) -> None:
        """Fail every task whose deadline (plus grace, plus ``ANSWER_SLACK_S``) has passed, naming the
        ranks that did not answer."""
        with self.lock:
            expired = [(tid, p) for tid, p in self._pending.items() if p.deadline + ANSWER_SLACK_S <= now]
            for tid, p in expired:
                del self._pending[tid]
                self._unreleased[tid] = p  # every rank that has not answered may still act on it
            self._busy_locked()
        for tid, p in expired:
            missing = sorted(set(range(self.tp)) - set(p.results))
            p.future.set_rank_results(p.results)
            peer = p.task.get("peer")
            p.future.set_exception(TaskTimeoutError(tid, missing, p.timeout, peer if isinstance(peer, str) else None))
            self._notify(p.task, "timed_out", time.perf_counter() - p.submitted, p.results)

    # ------------------------------------------------------------------ ranks
    def rank_died(self, rank: int, detail: str, release: bool = True) -> None:
        """Fail every pending task; the dead rank holds nothing any more (``release``), unless its
        process outlived SIGKILL (stuck in the kernel: its I/O may still land)."""
        with self.lock:
            self._dead[rank] = detail
            failed = list(self._pending.items())
            self._pending.clear()
            self._busy_locked()
            for task_id, pending in failed:
                if release:
                    pending.unreleased.discard(rank)
                if pending.unreleased:  # the live ranks may still be working on it
                    self._unreleased[task_id] = pending
        for task_id, pending in failed:
            pending.future.set_exception(RankDiedError(task_id, rank, detail))
            if not pending.unreleased:
                pending.future.let_go()
            self._notify(pending.task, "rank_died", time.perf_counter() - pending.submitted, pending.results)
        if release:
            self.release_rank(rank)

    def mark_down(self, rank: int, detail: str) -> None:
        with self.lock:
            self._dead[rank] = detail

    def mark_up(self, rank: int) -> None:
        with self.lock:
            self._dead.pop(rank, None)

    def is_down(self, rank: int) -> bool:
        with self.lock:
            return rank in self._dead

    def ranks_up(self) -> int:
        with self.lock:
            return self.tp - len(self._dead)

    def release_rank(self, rank: int) -> None:
        """A dead or restarted rank touches nothing any more."""
        done = []
        with self.lock:
            for task_id, pending in list(self._unreleased.items()):
                pending.unreleased.discard(rank)
                if not pending.unreleased:
                    del self._unreleased[task_id]
                    done.append(pending)
        for pending in done:
            pending.future.let_go()

    # ------------------------------------------------------------------ shutdown and inspection
    def close(self) -> None:
        """Fail every pending task with ``ServiceClosed`` and release everything: the caches go away."""
        with self.lock:
            self._closed = True
            pending = list(self._pending.values())
            self._pending.clear()
            self._busy_locked()
            unreleased = list(self._unreleased.values())
            self._unreleased.clear()
        for p in pending:
            p.future.set_exception(ServiceClosed(f"task {p.task.get('task_id')} cancelled: the service shut down"))
            self._notify(p.task, "closed", time.perf_counter() - p.submitted, p.results)
        for p in pending + unreleased:
            p.future.let_go()

    def unreleased_tasks(self) -> dict[str, list[int]]:
        """Failed or timed-out tasks that some rank may still act on: task id -> those ranks."""
        with self.lock:
            return {tid: sorted(p.unreleased) for tid, p in self._unreleased.items()}

    def in_flight(self) -> int:
        with self.lock:
            return len(self._pending)

    def queue_depth(self) -> int:
        """Pending tasks that no rank has answered yet (still queued, or running on every rank)."""
        with self.lock:
            return sum(1 for p in self._pending.values() if not p.results)

    def busy_seconds(self) -> float:
        """Wall time during which at least one task was in flight (overlapping tasks count once),
        kept as a running sum: nothing per task is kept for it."""
        with self.lock:
            since = self._busy_since
            return self._busy_total + (time.perf_counter() - since if since is not None else 0.0)

    def _busy_locked(self) -> None:
        """After the pending set changed (under the lock): start or stop the busy clock."""
        if self._pending and self._busy_since is None:
            self._busy_since = time.perf_counter()
        elif not self._pending and self._busy_since is not None:
            self._busy_total += time.perf_counter() - self._busy_since
            self._busy_since = None

    def _notify(self, task: dict, outcome: str, seconds: float, results: dict) -> None:
        for observer in self.observers:
            try:
                observer(task, outcome, seconds, results)
            except Exception:
                logger.exception("task observer failed for %s", task.get("task_id"))
