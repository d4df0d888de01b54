"""Per-request transfer records (DESIGN §4.2): what each task of a request did, stage by stage.

A task submitted with a ``request_id`` is recorded here by the ``TaskTracker`` (the one place every
task goes through): its kind, the ranks it went to, the bytes each rank reports having moved
(``RankResult.bytes_moved``), its stage times and its outcome, with the failing ranks and why.

Stage times (epoch seconds; each one at or after the one before):

* ``queued``: submitted to the tracker;
* ``started``: when the first rank started running it: that rank's answer arrived at the engine
  ``RankResult.elapsed_ms`` after it started (the answer's way back is counted as running); when no
  rank ran it (refused, dropped at its deadline, a rank died first), when it was queued;
* ``done``: its future resolved;
* ``released``: ``future.released`` resolved (no rank touches its blocks any more); never before
  ``done`` (a task whose ranks let go with their answers is released when it is done), and None
  while a late I/O still holds its blocks.

Outcomes: ``ok``, ``failed`` (ranks answered with an error, or the front door refused it),
``timeout``, ``rank_died``, ``cancelled`` (the service shut down).

Bounded: the records of the last ``capacity`` requests (by their latest task), each with at most
``tasks_per_request`` tasks (the oldest go first).  Tasks without a request id are not recorded, and
``capacity=0`` records nothing.  Thread-safe: one lock guards everything here.

Logs name a request only by ``request_tag`` (the first 12 hex digits of its SHA-256), never by the
raw id, and never with its storage keys; OpenTelemetry spans (``transfer_spans``) carry the tag too.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from cache_manager.cache_data import CacheStatus
from cache_manager.cache_tasks import RankResult

from . import transfer_spans
from .errors import RankDiedError, ServiceClosed, TaskFailedError, TaskTimeoutError
from .task_future import TaskFuture

logger = logging.getLogger(__name__)

MAX_REQUEST_ID_CHARS = 256
DEFAULT_CAPACITY = 4096  # requests kept
DEFAULT_TASKS_PER_REQUEST = 1024
OUTCOMES = ("ok", "failed", "timeout", "rank_died", "cancelled")
KINDS = {CacheStatus.SWAP2CPU: "swap_out", CacheStatus.SWAP2GPU: "swap_in", CacheStatus.GPU2STORAGE: "storage_write",
         CacheStatus.STORAGE2GPU: "storage_read", CacheStatus.PEER_PULL: "pd_pull", CacheStatus.PEER_PUSH: "pd_push",
         CacheStatus.CTRL: "control"}


def check_request_id(request_id: Any) -> str | None:
    """``request_id`` if it is None or a non-empty str of at most ``MAX_REQUEST_ID_CHARS``; else
    ``ValueError`` naming it (by type and length only: a raw id never reaches a log)."""
    if request_id is None:
        return None
    if not isinstance(request_id, str):
        raise ValueError(f"request_id must be a str, got {type(request_id).__name__}")
    if not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id must have 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
    return request_id


def request_tag(request_id: str) -> str:
    """What logs, spans and the ranks see of a request id: the first 12 hex digits of its SHA-256."""
    return hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def task_kind(task: dict) -> str:
    event = task.get("event_type")
    try:
        return KINDS[CacheStatus(event)]
    except (ValueError, KeyError):
        return f"event_{event}"


def task_blocks(task: dict) -> int:
    """Blocks the task asks for (device blocks; a P/D task's destination or source blocks)."""
    for key in ("gpu_block_ids", "dst_block_ids", "src_block_ids"):
        if isinstance(task.get(key), list):
            return len(task[key])
    return 0


def outcome_of(error: BaseException | None) -> tuple[str, dict[int, str]]:
    """(outcome, failing rank -> reason) of a resolved task from its future's exception."""
    if error is None:
        return "ok", {}
    if isinstance(error, TaskFailedError):
        return "failed", dict(error.failures)
    if isinstance(error, TaskTimeoutError):
        return "timeout", {r: "no answer in time" for r in error.missing_ranks}
    if isinstance(error, RankDiedError):
        return "rank_died", {error.rank: str(error)}
    if isinstance(error, ServiceClosed):
        return "cancelled", {}
    return "failed", {}


@dataclass
class TransferRecord:
    """One task of one request, as ``svc.transfers(request_id)`` returns it (a snapshot)."""

    request_id: str
    task_id: str
    kind: str  # swap_out, swap_in, storage_write, storage_read, pd_pull, pd_push, control
    ranks: list[int]  # the ranks it was sent to
    blocks: int  # blocks it asked for
    queued: float  # epoch seconds
    started: float | None = None
    done: float | None = None
    released: float | None = None
    outcome: str | None = None  # one of OUTCOMES; None while in flight
    failing_ranks: dict[int, str] = field(default_factory=dict)  # rank -> why
    error: str | None = None  # the future's error, when it failed
    bytes_per_rank: dict[int, int] = field(default_factory=dict)  # what each rank reports having moved

    @property
    def bytes(self) -> int:
        return sum(self.bytes_per_rank.values())

    @property
    def end(self) -> float | None:
        """When the task was over for the engine: released, else done (None while in flight)."""
        return self.released if self.released is not None else self.done

    def to_dict(self) -> dict:
        out = asdict(self)
        out["bytes"] = self.bytes
        return out


@dataclass
class RequestTransfers:
    """A request's tasks, and how long they spanned (first queued to last end)."""

    request_id: str
    seconds: float
    records: list[TransferRecord]

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "seconds": self.seconds, "tasks": [r.to_dict() for r in self.records]}


class _Live:
    """A task being recorded (mutated under ``TransferRecords``' lock only)."""

    __slots__ = ("request_id", "tag", "task_id", "kind", "ranks", "blocks", "wall0", "perf0", "first_start", "done",
                 "released", "outcome", "failing", "error", "bytes", "span", "closed")

    def __init__(self, request_id: str, task: dict, ranks: list[int]):
        self.request_id, self.task_id, self.ranks = request_id, str(task.get("task_id", "-")), ranks
        self.tag = request_tag(request_id)
        self.kind, self.blocks = task_kind(task), task_blocks(task)
        self.wall0, self.perf0 = time.time(), time.perf_counter()
        self.first_start: float | None = None  # perf_counter
        self.done: float | None = None
        self.released: float | None = None
        self.outcome: str | None = None
        self.failing: dict[int, str] = {}
        self.error: str | None = None
        self.bytes: dict[int, int] = {}
        self.span: Any = None
        self.closed = False  # its span ended and its log line written

    def wall(self, perf: float | None) -> float | None:
        return None if perf is None else self.wall0 + max(0.0, perf - self.perf0)

    def snapshot(self) -> TransferRecord:
        done = self.done
        start = self.first_start if self.first_start is not None else (self.perf0 if done is not None else None)
        if start is not None and done is not None:
            start = min(start, done)
        released = None if self.released is None or done is None else max(self.released, done)
        return TransferRecord(self.request_id, self.task_id, self.kind, list(self.ranks), self.blocks, self.wall0,
                              self.wall(start), self.wall(done), self.wall(released), self.outcome,
                              dict(self.failing), self.error, dict(sorted(self.bytes.items())))


class TransferRecords:
    def __init__(self, capacity: int = DEFAULT_CAPACITY, tasks_per_request: int = DEFAULT_TASKS_PER_REQUEST):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"transfer records capacity {capacity!r} must be a non-negative integer (0: off)")
        if not isinstance(tasks_per_request, int) or tasks_per_request < 1:
            raise ValueError(f"tasks_per_request {tasks_per_request!r} must be a positive integer")
        self.capacity = capacity
        self.tasks_per_request = tasks_per_request
        self._lock = threading.Lock()
        self._requests: collections.OrderedDict[str, collections.deque[_Live]] = collections.OrderedDict()
        self.dropped_requests = 0  # requests whose records made room for newer ones

    # ------------------------------------------------------------------ fed by the tracker
    def open(self, request_id: str, task: dict, ranks: list[int]) -> _Live | None:
        """Start recording ``task`` (stamped with its id) for ``request_id``; None when off."""
        if not self.capacity:
            return None
        live = _Live(request_id, task, ranks)
        live.span = transfer_spans.start(live.kind, live.tag, live.task_id, ranks, live.blocks, int(live.wall0 * 1e9))
        evicted: list[_Live] = []
        with self._lock:
            tasks = self._requests.get(request_id)
            if tasks is None:
                tasks = self._requests[request_id] = collections.deque(maxlen=self.tasks_per_request)
                while len(self._requests) > self.capacity:
                    evicted += self._requests.popitem(last=False)[1]
                    self.dropped_requests += 1
            else:
                self._requests.move_to_end(request_id)
                if len(tasks) == tasks.maxlen:
                    evicted.append(tasks[0])
            tasks.append(live)
        for old in evicted:
            self._close(old)
        return live

    def watch(self, live: _Live | None, future: TaskFuture) -> None:
        """Follow ``future`` (the task's): done and released are recorded before anyone waiting on
        it wakes, so a caller that got its result finds its record done."""
        if live is not None:
            future.observe(lambda error: self._done(live, error), lambda: self._released(live))

    def answered(self, live: _Live, result: RankResult, now: float) -> None:
        """Rank ``result.rank`` answered at ``now`` (perf_counter)."""
        start = now - max(0.0, result.elapsed_ms) / 1e3 if result.elapsed_ms > 0 else None
        with self._lock:
            live.bytes[result.rank] = int(result.bytes_moved)
            if start is not None and (live.first_start is None or start < live.first_start):
                live.first_start = max(start, live.perf0)

    def _done(self, live: _Live, error: BaseException | None) -> None:
        now = time.perf_counter()
        outcome, failing = outcome_of(error)
        with self._lock:
            if live.done is not None:
                return  # told twice (``TaskFuture.observe``)
            live.done, live.outcome, live.failing = now, outcome, failing
            live.error = None if error is None else str(error)
            ready = live.released is not None
        if ready:
            self._close(live)

    def _released(self, live: _Live) -> None:
        with self._lock:
            if live.released is not None:
                return
            live.released = time.perf_counter()
            ready = live.done is not None
        if ready:
            self._close(live)

    def _close(self, live: _Live) -> None:
        """The task is over (or its record goes): end its span, log it once."""
        debug = logger.isEnabledFor(logging.DEBUG)
        with self._lock:
            if live.closed:
                return
            live.closed = True
            if live.span is None and live.outcome == "ok" and not debug:
                return  # nothing to say: the common case costs no snapshot
            record = live.snapshot()
        transfer_spans.finish(live.span, record, live.tag)
        if record.outcome is None:
            return  # evicted in flight
        tag = live.tag
        if record.outcome != "ok":
            logger.warning("req=%s task %s (%s) %s on rank(s) %s", tag, record.task_id, record.kind, record.outcome,
                           sorted(record.failing_ranks) or "-")
        elif debug:
            logger.debug("req=%s task %s (%s) ok: %d bytes in %.2f ms", tag, record.task_id, record.kind,
                         record.bytes, (record.end - record.queued) * 1e3)

    # ------------------------------------------------------------------ queries
    def transfers(self, request_id: str) -> list[TransferRecord]:
        """The request's recorded tasks, oldest first (empty when none, or dropped)."""
        with self._lock:
            return [live.snapshot() for live in self._requests.get(request_id, ())]

    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._requests)

    def slowest_requests(self, n: int = 5) -> list[RequestTransfers]:
        """The ``n`` requests whose finished tasks spanned the longest time, slowest first (a request
        with a task still in flight is left out)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n {n!r} must be a non-negative integer")
        with self._lock:
            snapshots = [(rid, [live.snapshot() for live in tasks]) for rid, tasks in self._requests.items()]
        done = []
        for rid, records in snapshots:
            if records and all(r.end is not None for r in records):
                seconds = max(r.end for r in records) - min(r.queued for r in records)
                done.append(RequestTransfers(rid, seconds, records))
        done.sort(key=lambda r: r.seconds, reverse=True)
        return done[:n]
