"""Pieces every storage mover shares: the per-direction I/O thread, task checks, leading runs.

A backend call never runs on a task's thread: it runs on one daemon I/O thread per direction,
and the task waits for it only until its deadline.  The backlog of each direction is bounded
and a call whose deadline passed before it started is cancelled, never started, so a stuck
backend shows up as failed tasks, never as memory growth, a hang or a late action.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from transfer_factory.log_tags import key_tag, redact

IO_BACKLOG = 4  # backend calls queued per direction before new ones fail at once


@dataclass
class CallStats:
    """Backend calls one task made, and how many failed (raised, timed out, or never started);
    the rank reports them in its result, so the engine counts them without a port on the CTM."""

    calls: int = 0
    failures: int = 0


_stats = threading.local()  # each storage task runs on one pool thread from start to answer


def begin_task_stats() -> CallStats:
    """Start counting the calls of the task running on this thread."""
    _stats.current = CallStats()
    return _stats.current


def current_task_stats() -> CallStats:
    stats = getattr(_stats, "current", None)
    return stats if stats is not None else begin_task_stats()


class StorageBusy(RuntimeError):
    """The direction's backlog is full, or every staging buffer is held by a stuck call."""


class IOThread:
    """A single daemon worker with a bounded backlog: a backend call that never returns must not
    keep the process alive, and calls queued behind it must neither pile up nor start late."""

    def __init__(self, name: str, backlog: int = IO_BACKLOG, nice: int = 0):
        self._nice = nice
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._backlog = backlog
        self._queued = 0
        self._running = False             # a call is executing now
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any], deadline: float) -> Future:
        with self._lock:
            if self._queued >= self._backlog:
                raise StorageBusy(f"{self._queued} backend calls already wait on {self._thread.name}")
            self._queued += 1
        future: Future = Future()
        self._queue.put((fn, future, deadline))
        return future

    def _run(self) -> None:
        if self._nice > 0:
            # Only this thread: Linux gives each thread its own nice value.  A backend call that
            # busy-waits for its transfer (Mooncake's polling completion) then takes the CPU only
            # when the threads doing the transfer (its TCP workers, the peers, the other ranks)
            # leave it idle.  Raising it is allowed unprivileged; it is never lowered again.
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
            except (OSError, AttributeError) as exc:
                logging.getLogger(__name__).warning("cannot renice %s to %d: %s", self._thread.name, self._nice, exc)
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, future, deadline = item
            with self._lock:
                self._queued -= 1
            if time.monotonic() >= deadline:
                future.cancel()  # its task has answered: starting now would act on what it no longer owns
            if not future.set_running_or_notify_cancel():
                continue
            self._running = True
            try:
                future.set_result(fn())
            except BaseException as exc:  # the task's thread reports it; this thread lives on
                future.set_exception(exc)
            finally:
                self._running = False

    def busy(self) -> int:
        """Calls executing or queued."""
        with self._lock:
            return self._queued + int(self._running)

    def request_stop(self) -> None:
        """The worker ends once the calls queued before this are done (or cancelled, past their deadline)."""
        self._queue.put(None)

    def join(self, timeout: float | None = None) -> bool:
        """Whether the worker ended (within ``timeout``)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self, timeout: float) -> bool:
        """Ask the worker to finish; True if it did within ``timeout``."""
        self.request_stop()
        return self.join(timeout)


class ScatterLease:
    """Lets an I/O thread write into a task's device blocks only while the task still waits for
    it: once the task revokes the lease (before it answers), nothing more is written.  Revoking
    waits for a write in progress, so a lease is only for copies that cannot stall."""

    def __init__(self, deadline: float):
        self._deadline = deadline
        self._live = True
        self._lock = threading.Lock()

    def run(self, write: Callable[[], Any]) -> bool:
        """Run ``write`` if the lease is live and its deadline has not passed; whether it ran."""
        with self._lock:
            if not self._live or time.monotonic() >= self._deadline:
                return False
            write()
            return True

    def revoke(self) -> None:
        with self._lock:
            self._live = False


def start_call(io: IOThread, fn: Callable[[], Any], deadline: float, what: str, log: logging.Logger) -> Future | None:
    """Queue ``fn`` on ``io``; None (and a log line) when the backlog is full."""
    stats = current_task_stats()
    stats.calls += 1
    try:
        return io.submit(fn, deadline)
    except StorageBusy as exc:
        stats.failures += 1
        log.error("storage %s not started: %s", what, exc)
        return None


def wait_call(future: Future, deadline: float, what: str, backend: str, log: logging.Logger) -> tuple[Any, bool]:
    """(result or None, whether the call still runs past the deadline)."""
    try:
        return future.result(timeout=max(0.0, deadline - time.monotonic())), False
    except FutureTimeout:
        current_task_stats().failures += 1
        running = not future.cancel()  # a call that had not started never will
        log.error("storage %s timed out (%s)%s", what, backend,
                  ": the call is still running" if running else ": never started")
        return None, running
    except Exception as exc:
        current_task_stats().failures += 1
        log.error("storage %s failed: %s: %s", what, type(exc).__name__, redact(exc))  # a backend's text may hold keys
        return None, False


def check_block_ids(gpu_ids: Sequence[int], hashes: Sequence[str], device_blocks: int, what: str) -> None:
    """One gpu block per hash, no block twice, every id inside every layer's cache."""
    if len(gpu_ids) != len(hashes):
        raise ValueError(f"{what}: {len(hashes)} keys but {len(gpu_ids)} gpu_block_ids")
    if len(set(gpu_ids)) != len(gpu_ids):
        raise ValueError(f"{what}: gpu_block_ids repeat a block")
    for i, h in enumerate(hashes):
        if not h or "/" in h:
            raise ValueError(f"{what}: key at position {i} ({key_tag(h)}) must be a non-empty block hash without '/'")
    for i, gid in enumerate(gpu_ids):
        if not 0 <= gid < device_blocks:
            raise ValueError(f"device block id {gid} at position {i} is out of range [0, {device_blocks})")


def read_span(keys: Sequence[str], start: int) -> Sequence[str]:
    """The keys a read loads: those from ``start`` on."""
    if start > len(keys):
        raise ValueError(f"start_read_block_idx {start} is past the {len(keys)} keys")
    return keys[start:]


def leading(ok: Sequence[bool] | None) -> int:
    """Length of the leading run of true flags."""
    n = 0
    for flag in ok or ():
        if not flag:
            break
        n += 1
    return n


class Closing:
    """A mover's close, off the caller's thread: the I/O threads are told to stop, and a daemon
    thread waits for each to end (however long its running backend call takes), then closes the
    backend.  So a backend is never closed under a running call (a client torn down under its own
    call may crash the process), and the caller (the serve thread, during an RL clear) waits only
    as long as it chooses (``wait``).  Host memory is the caller's to free once ``calls_ended``:
    a platform may free it only on a thread that set its device up."""

    def __init__(self, ios: Sequence[IOThread], backend: Any, close_backend: bool, log: logging.Logger) -> None:
        self._ios = list(ios)
        self._backend = backend
        self._close_backend = close_backend
        self._log = log
        for io in self._ios:
            io.request_stop()
        self._thread = threading.Thread(target=self._run, name="storage-close", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for io in self._ios:
            io.join()
        try:
            if self._close_backend:
                self._backend.close()
        except Exception as exc:  # nothing else to do with it: the mover is gone
            self._log.error("storage backend %s did not close cleanly: %s: %s", self._backend.name,
                            type(exc).__name__, exc)

    def calls_running(self) -> int:
        """Backend calls not yet returned (executing or queued)."""
        return sum(io.busy() for io in self._ios)

    def calls_ended(self) -> bool:
        """Every I/O thread has ended: no backend call can use a buffer any more."""
        return all(io.join(0) for io in self._ios)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float) -> bool:
        """Whether the close finished within ``timeout``."""
        self._thread.join(timeout)
        return self.done()


class ClosesOffThread:
    """The close both storage movers share, over their ``_io`` threads, ``backend`` and ``log``:
    ``begin_close`` never waits (the RL clear polls ``closed`` from the serve loop), ``close``
    waits a bounded time.  Subclasses revoke what must not commit any more (``_before_close``) and
    free their host buffers (``_free_buffers``, on the polling thread, once no call can use them)."""

    _io: dict[str, IOThread]
    backend: Any
    log: logging.Logger
    _closing: Closing | None = None

    def _before_close(self) -> None:
        """Called once, first."""

    def _free_buffers(self) -> None:
        """Called (maybe more than once) once every backend call has returned."""

    def begin_close(self, close_backend: bool = True) -> None:
        """Start closing without waiting: the I/O threads stop and, once their calls have returned,
        the backend is closed (unless told not to): never under a running call."""
        if self._closing is None:
            self._before_close()
            self._closing = Closing(list(self._io.values()), self.backend, close_backend, self.log)

    def closed(self) -> bool:
        """A close was begun, every backend call returned and the backend is closed."""
        if self._closing is None:
            return False
        if self._closing.calls_ended():
            self._free_buffers()
        return self._closing.done()

    def calls_running(self) -> int:
        """Backend calls not yet returned."""
        return sum(io.busy() for io in self._io.values())

    def close(self, timeout: float = 5.0, close_backend: bool = True) -> None:
        """``begin_close``, then wait at most ``timeout`` for it, unless a close was already begun (its
        caller chose how long to wait).  A call that never returns keeps the backend open, and its
        buffers allocated, until process exit."""
        begun = self._closing is not None
        self.begin_close(close_backend)
        assert self._closing is not None
        if not begun and not self._closing.wait(timeout):
            self.log.error("storage: %d backend calls still running %.0fs into the close; %s closes once they "
                           "return", self._closing.calls_running(), timeout, self.backend.name)
        self.closed()                             # frees the buffers if no call can use them

