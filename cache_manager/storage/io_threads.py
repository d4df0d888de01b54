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

IO_BACKLOG = 4  # backend calls queued per direction before new ones fail at once
KIND_TAGS = {"key_caches": "k", "value_caches": "v", "key_cache_scales": "k_scale", "value_cache_scales": "v_scale"}


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
            try:
                future.set_result(fn())
            except BaseException as exc:  # the task's thread reports it; this thread lives on
                future.set_exception(exc)

    def stop(self, timeout: float) -> bool:
        """Ask the worker to finish; True if it did within ``timeout``."""
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()


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
        log.error("storage %s failed: %s: %s", what, type(exc).__name__, exc)
        return None, False


def check_block_ids(gpu_ids: Sequence[int], hashes: Sequence[str], device_blocks: int, what: str) -> None:
    """One gpu block per hash, no block twice, every id inside every layer's cache."""
    if len(gpu_ids) != len(hashes):
        raise ValueError(f"{what}: {len(hashes)} keys but {len(gpu_ids)} gpu_block_ids")
    if len(set(gpu_ids)) != len(gpu_ids):
        raise ValueError(f"{what}: gpu_block_ids repeat a block")
    for h in hashes:
        if not h or "/" in h:
            raise ValueError(f"{what}: key {h!r} must be a non-empty block hash without '/'")
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


def close_backend_within(backend: Any, timeout: float, log: logging.Logger) -> None:
    """Close ``backend`` on a daemon thread, waiting at most ``timeout``: a client stuck on a dead
    server must not hold up the CTM's exit."""
    closer = threading.Thread(target=backend.close, name="storage-close", daemon=True)
    closer.start()
    closer.join(timeout)
    if closer.is_alive():
        log.error("storage backend %s did not close within %.0fs", backend.name, timeout)
