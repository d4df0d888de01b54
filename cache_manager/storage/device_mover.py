"""Read-storage and write-storage tasks of one CTM rank over a device-direct backend (EMS,
AttentionStore): the SDK reads and writes the registered device caches itself (DESIGN §3.8, §3.10).

The rank registers its caches once, then maps each task onto the backend's block calls:

* write: ``lookup`` the leading blocks already stored, ``save`` the rest;
* read: ``lookup`` the leading blocks present from ``start_read_block_idx`` on, ``load`` them.

Both answer the gpu block ids of the leading run done.  Every call runs on a per-direction I/O
thread with a bounded backlog and gets what is left of the task's deadline as its timeout.  A
``save`` or ``load`` that outlives its task may still touch device blocks, so the rank answers
in time (0 blocks) and reports the release when the call returns; the engine keeps those blocks
until then (two-phase completion).  A ``lookup`` touches no block and is simply abandoned.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence

from transfer_factory.device_storage import Addressing, BlockSpan, DeviceKVStorage, RankCaches

from cache_manager.cache_tasks import Outcome, ReadStorageTask, WriteStorageTask
from cache_manager.storage.io_threads import (IO_BACKLOG, ClosesOffThread, IOThread, begin_task_stats,
                                              check_block_ids, read_span, start_call, wait_call)


class DeviceStorageMover(ClosesOffThread):
    def __init__(self, backend: DeviceKVStorage, groups: Sequence[tuple[str, list[Any]]], rank: int, tp_size: int,
                 device_id: int, block_size: int, log: logging.Logger, io_backlog: int = IO_BACKLOG):
        self.backend = backend
        self.block_size = block_size
        self.log = log
        kinds = {tag: list(tensors) for tag, tensors, *_ in groups}  # the groups' storage tags
        self.device_blocks = min(int(t.shape[0]) for tensors in kinds.values() for t in tensors)
        self.caches = RankCaches(rank, tp_size, device_id, block_size, kinds, self.device_blocks)
        self._block_bytes = sum(self.caches.block_bytes(tag) * len(tensors) for tag, tensors in kinds.items())
        backend.register_caches(self.caches)
        self._io = {d: IOThread(f"storage-{d}-io", io_backlog) for d in ("read", "write")}
        log.info("storage: backend %s, device-direct, addressed by %s", backend.name, backend.addressing.value)

    # ------------------------------------------------------------------ helpers
    def _check_tokens(self, span: BlockSpan, what: str) -> None:
        if self.backend.addressing != Addressing.TOKENS:
            return
        need = (span.start_block + len(span)) * self.block_size
        if len(span.token_ids) < need:
            raise ValueError(f"{what}: {self.backend.name} addresses blocks by tokens; blocks {span.start_block}.."
                             f"{span.start_block + len(span) - 1} need {need} token_ids, the task carries "
                             f"{len(span.token_ids)}")

    def _call(self, direction: str, fn: Callable[[BlockSpan, float], int], span: BlockSpan, deadline: float,
              what: str) -> tuple[int, Future | None]:
        """(blocks the call reports, the call's future if it still runs past the deadline)."""
        def job() -> int:
            return int(fn(span, max(0.001, deadline - time.monotonic())))

        future = start_call(self._io[direction], job, deadline, what, self.log)
        if future is None:
            return 0, None
        n, running = wait_call(future, deadline, what, self.backend.name, self.log)
        if running:
            return 0, future
        if n is None:
            return 0, None
        if not 0 <= n <= len(span):
            self.log.error("storage %s: %s reported %d of %d blocks; counted as 0", what, self.backend.name, n,
                           len(span))
            return 0, None
        return n, None

    # ------------------------------------------------------------------ tasks
    def write(self, task: WriteStorageTask, deadline: float | None = None) -> Outcome:
        deadline = time.monotonic() + task.timeout if deadline is None else deadline
        stats = begin_task_stats()
        check_block_ids(task.gpu_block_ids, task.keys, self.device_blocks, "write")
        span = BlockSpan(task.keys, task.gpu_block_ids, 0, task.token_ids)
        self._check_tokens(span, "write")
        stored, _ = self._call("write", self.backend.lookup, span, deadline, f"query of {len(span)} blocks")
        saved, late = 0, None
        if stored < len(span) and time.monotonic() < deadline:
            rest = span.tail(stored)
            saved, late = self._call("write", self.backend.save, rest, deadline, f"write of {len(rest)} blocks")
        return Outcome(list(task.gpu_block_ids[:stored + saved]), saved * self._block_bytes, late, stats.calls,
                       stats.failures)

    def read(self, task: ReadStorageTask, deadline: float | None = None) -> Outcome:
        deadline = time.monotonic() + task.timeout if deadline is None else deadline
        stats = begin_task_stats()
        hashes = read_span(task.keys, task.start_read_block_idx)
        check_block_ids(task.gpu_block_ids, hashes, self.device_blocks, "read")
        span = BlockSpan(hashes, task.gpu_block_ids, task.start_read_block_idx, task.token_ids)
        self._check_tokens(span, "read")
        present, _ = self._call("read", self.backend.lookup, span, deadline, f"query of {len(span)} blocks")
        loaded, late = 0, None
        if present and time.monotonic() < deadline:
            head = BlockSpan(span.hashes[:present], span.gpu_block_ids[:present], span.start_block, span.token_ids)
            loaded, late = self._call("read", self.backend.load, head, deadline, f"read of {present} blocks")
        return Outcome(list(task.gpu_block_ids[:loaded]), loaded * self._block_bytes, late, stats.calls,
                       stats.failures)
