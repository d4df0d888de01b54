"""Order and lifetime of one rank's tasks (DESIGN §3.8).

The CTM's serve thread hands every task here in receive order (= the engine's submission
order).  Contracts:

* **Per-block order.** Tasks that touch the same device block or host slot take effect in
  submission order, whatever their kinds: a task waits for every earlier task that shares a
  resource with it, and only then goes to its kind's thread pool.  Unrelated tasks run in
  parallel.  Waiting costs no thread: a task is submitted from its last predecessor's
  completion.  A small host copy with nothing to wait for runs on the serve thread itself.
* **Deadlines.** A task whose deadline (``time.monotonic()``, CLOCK_MONOTONIC, one clock for
  every process of the host) has passed is never started.  A task still waiting for a
  predecessor at its deadline is answered then ("never started"); it keeps its place in the
  order until its predecessors are done, so a later task on the same blocks still waits for
  them.
* **Answers and releases.** A task's answer leaves once its body returned, so nothing of it
  touches its blocks afterwards.  A body may return an ``Outcome`` with ``still_running``: an
  I/O that touches the task's blocks and outlived the deadline.  The answer then leaves at
  once with ``released=False``, and a release note follows when that I/O ends; the task's
  blocks stay ordered behind it until then.  An ``Outcome`` with ``still_storing`` names an
  I/O that outlived the deadline but touches none of the task's blocks (a staged storage
  write storing its own snapshot): the answer leaves with ``released=True`` and the blocks go
  to the next task at once, but the task counts as ``active`` until that I/O ends, so a
  drain (pause, sleep, RL clear) still waits for it.
* **Nothing kills the caller.** A body's exception becomes an error answer; a failure to send
  is logged.
"""
from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable

from cache_manager.cache_tasks import Outcome, RankResult

logger = logging.getLogger(__name__)

Resource = Hashable
@dataclass(frozen=True)
class Fail:
    """A ``drop_value``: a dropped task is an error, naming ``what`` it was (a P/D transfer names its
    peer).  Swaps fail so (``FAIL``); storage tasks drop to 0 blocks instead."""

    what: str = ""


FAIL = Fail()
_RELEASING = threading.local()  # .queue: the callbacks the outermost release on this thread still runs


class _Released:
    """Whether nothing of a task touches its resources any more, and who waits for that.

    What the scheduler needed of a ``concurrent.futures.Future`` (``done``,
    ``add_done_callback``, ``set_result``) without its condition variable and re-entrant lock,
    which cost a few microseconds on every task's path."""

    __slots__ = ("_lock", "_done", "_callbacks")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = False
        self._callbacks: list[Callable[[Any], None]] = []

    def done(self) -> bool:
        return self._done

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(self)`` once released: now, on this thread, if it already is."""
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        self._call(fn)

    def set_result(self, _result: Any) -> None:
        with self._lock:
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
        if not callbacks:
            return
        # A callback may release another task (a dropped waiter's release is its successor's
        # unblock), which would nest one call per task of a chain: thousands of expired waiters
        # on one block hit RecursionError and left the block held for good.  So the outermost
        # release on this thread runs every callback from a work list; nested ones only append.
        queue = getattr(_RELEASING, "queue", None)
        if queue is not None:
            queue.extend((self, fn) for fn in callbacks)
            return
        _RELEASING.queue = queue = deque((self, fn) for fn in callbacks)
        try:
            while queue:
                released, fn = queue.popleft()
                released._call(fn)
        finally:
            _RELEASING.queue = None

    def _call(self, fn: Callable[[Any], None]) -> None:
        try:
            fn(self)
        except Exception:  # as a Future's callbacks: one that raises costs itself, not the others
            logger.exception("a callback of a task's release failed")


@dataclass(eq=False, slots=True)
class _Entry:
    task_id: str
    seq: int
    pool: str
    fn: Callable[[], Any]
    resources: frozenset
    deadline: float | None
    drop_value: Any  # the answer's value when the task is dropped; a ``Fail``: an error answer
    done: _Released = field(default_factory=_Released)  # once nothing of the task touches its resources
    state: str = "waiting"  # waiting -> queued -> running; or dropped (answered, never started)
    blockers: int = 0


class TaskScheduler:
    def __init__(self, pools: dict[str, ThreadPoolExecutor], rank: int,
                 send: Callable[[RankResult], None], log: logging.Logger):
        self._pools = pools
        self._rank = rank
        self._send = send
        self._log = log
        self._lock = threading.Lock()
        self._last: dict[Resource, _Entry] = {}  # resource -> latest task that touches it
        self._waiting: set[_Entry] = set()
        self._deadlines: list[tuple[float, int, _Entry]] = []  # heap over waiting tasks; stale heads are skipped
        self.dropped = 0  # tasks answered without being started (deadline passed)
        self._active = 0  # tasks submitted and not finished (waiting, running, or with a late I/O running)
        self._active_by_pool: dict[str, int] = {}  # the same, per pool: a drain leaves the control pool out

    # ------------------------------------------------------------------ intake (serve thread)
    def submit(self, task_id: str, seq: int, pool: str, resources: Iterable[Resource], deadline: float | None,
               fn: Callable[[], Any], drop_value: Any = FAIL, inline: bool = False) -> None:
        """Queue ``fn`` behind every earlier task that shares a resource with it.  ``inline``: the
        body is short and cannot block (a small host copy), so when nothing blocks it, it runs
        here, on the calling thread, without the hand-off to its pool (a round trip's largest cost)."""
        entry = _Entry(task_id, seq, pool, fn, frozenset(resources), deadline, drop_value)
        with self._lock:
            self._active += 1
            self._active_by_pool[pool] = self._active_by_pool.get(pool, 0) + 1
            # A load names a resource per block and slot (128 for 64 blocks): looked up and
            # claimed with C-level map and update, not a Python step per resource.
            earlier = set(map(self._last.get, entry.resources))
            earlier.discard(None)
            blockers = {b for b in earlier if not b.done.done()}
            self._last.update(dict.fromkeys(entry.resources, entry))
            if inline and not blockers:
                entry.state = "queued"
            else:
                entry.blockers = len(blockers) + 1  # +1: released below, once every callback is attached
                self._waiting.add(entry)
                if deadline is not None and blockers:
                    heapq.heappush(self._deadlines, (deadline, seq, entry))
        if entry.state == "queued":
            self._run(entry)
            return
        for b in blockers:
            b.done.add_done_callback(lambda _f, e=entry: self._unblock(e))
        self._unblock(entry)

    def expire_waiting(self) -> None:
        """Answer the waiting tasks whose deadline passed (they will never start)."""
        if not self._deadlines:  # the serve loop asks after every poll; usually nothing waits
            return
        now = time.monotonic()
        expired = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                _, _, e = heapq.heappop(self._deadlines)
                if e in self._waiting:
                    self._waiting.discard(e)
                    e.state = "dropped"
                    expired.append(e)
        for e in expired:
            self._drop(e, "waited for earlier tasks on the same blocks past its deadline")

    def next_deadline(self) -> float | None:
        if not self._deadlines:
            return None
        with self._lock:
            while self._deadlines and self._deadlines[0][2] not in self._waiting:
                heapq.heappop(self._deadlines)  # started or dropped since: no longer a deadline to watch
            return self._deadlines[0][0] if self._deadlines else None

    def pending(self) -> int:
        with self._lock:
            return len(self._waiting)

    def active(self, excluding: Iterable[str] = ()) -> int:
        """Tasks not finished: waiting, running, or with a late I/O still running; ``excluding``
        leaves those of the named pools out (a pause drains every task but the control tasks)."""
        with self._lock:
            return self._active - sum(self._active_by_pool.get(p, 0) for p in excluding)

    # ------------------------------------------------------------------ internals
    def _unblock(self, entry: _Entry) -> None:
        with self._lock:
            entry.blockers -= 1
            if entry.blockers > 0:
                return
            if entry.state == "dropped":
                ready = False  # answered already; it only held its place in the order
            else:
                self._waiting.discard(entry)
                entry.state = "queued"
                ready = True
        if not ready:
            self._finish(entry)
            return
        try:
            self._pools[entry.pool].submit(self._run, entry)
        except RuntimeError as exc:  # the pool is shut down: the CTM is stopping
            self._answer(entry, RankResult(entry.task_id, self._rank, False, error=f"not run: {exc}",
                                           recv_seq=entry.seq))
            self._finish(entry)

    def _run(self, entry: _Entry) -> None:
        if entry.deadline is not None and time.monotonic() > entry.deadline:
            entry.state = "dropped"
            self._drop(entry, "its deadline passed before it could start")
            self._finish(entry)
            return
        entry.state = "running"
        t0 = time.perf_counter()
        late: Future | None = None
        storing: Future | None = None
        try:
            out = entry.fn()
            if not isinstance(out, Outcome):
                out = Outcome(value=out)
            late, storing = out.still_running, out.still_storing
            if out.error is not None:
                self._log.error("task %s failed: %s", entry.task_id, out.error)
            # a pull with failed blocks (digests) still says which blocks it did load
            result = RankResult(entry.task_id, self._rank, out.error is None, error=out.error,
                                value=out.value if out.error is None or out.digest_mismatches else None,
                                recv_seq=entry.seq, bytes_moved=int(out.bytes_moved), released=late is None,
                                storage_calls=out.storage_calls, storage_failures=out.storage_failures,
                                digest_mismatches=out.digest_mismatches)
        except Exception as exc:  # the task fails; the CTM keeps serving
            self._log.error("task %s failed: %s: %s", entry.task_id, type(exc).__name__, exc)
            result = RankResult(entry.task_id, self._rank, False, error=f"{type(exc).__name__}: {exc}",
                                recv_seq=entry.seq)
        result.elapsed_ms = (time.perf_counter() - t0) * 1e3
        self._answer(entry, result)
        if storing is not None:
            self._outlive(entry, late, storing)
        elif late is None:
            self._finish(entry)
        else:
            late.add_done_callback(lambda _f: self._release_late(entry))

    def _outlive(self, entry: _Entry, late: Future | None, storing: Future) -> None:
        """A task whose late I/O ``storing`` touches none of its blocks: they go at once (or once
        ``late``, an I/O that does touch them, is done); the task stays active until both are."""
        pending = [f for f in (late, storing) if f is not None]
        left, lock = [len(pending)], threading.Lock()

        def ended(_f: Future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._log.info("task %s: the storage call that outlived its deadline has returned", entry.task_id)
                self._retire(entry)

        if late is None:
            self._release(entry)
        else:
            late.add_done_callback(lambda _f: self._release_late(entry, retire=False))
        for future in pending:
            future.add_done_callback(ended)

    def _release_late(self, entry: _Entry, retire: bool = True) -> None:
        self._log.warning("task %s: the I/O that outlived its deadline has ended; its blocks are released",
                          entry.task_id)
        self._answer(entry, RankResult(entry.task_id, self._rank, True, recv_seq=entry.seq, released=True))
        if retire:
            self._finish(entry)
        else:
            self._release(entry)

    def _drop(self, entry: _Entry, why: str) -> None:
        self.dropped += 1
        self._log.warning("task %s not started: %s", entry.task_id, why)
        if isinstance(entry.drop_value, Fail):
            what = f"{entry.drop_value.what} " if entry.drop_value.what else ""
            result = RankResult(entry.task_id, self._rank, False, recv_seq=entry.seq,
                                error=f"DeadlineExceeded: {what}not started on rank {self._rank}: {why}")
        else:
            result = RankResult(entry.task_id, self._rank, True, value=entry.drop_value, recv_seq=entry.seq)
        self._answer(entry, result)

    def _answer(self, entry: _Entry, result: RankResult) -> None:
        try:
            self._send(result)
        except Exception as exc:  # the queue is closing; the engine's deadline covers the lost answer
            self._log.error("cannot send the answer to task %s: %s", entry.task_id, exc)

    def _finish(self, entry: _Entry) -> None:
        """``_release`` and ``_retire`` at once (one lock)."""
        with self._lock:
            self._active -= 1
            self._active_by_pool[entry.pool] -= 1
            for r in entry.resources:
                if self._last.get(r) is entry:
                    del self._last[r]
        entry.done.set_result(None)

    def _release(self, entry: _Entry) -> None:
        """Nothing of the task touches its resources any more: the tasks waiting for them go on."""
        with self._lock:
            for r in entry.resources:
                if self._last.get(r) is entry:
                    del self._last[r]
        entry.done.set_result(None)

    def _retire(self, entry: _Entry) -> None:
        """Nothing of the task runs any more: it no longer counts as active."""
        with self._lock:
            self._active -= 1
            self._active_by_pool[entry.pool] -= 1
