"""Read-storage and write-storage tasks of one CTM rank over an object store (DESIGN §3.1, §3.3,
§3.7, §3.8, §4): file, Mooncake.  Backends that move device blocks themselves (EMS,
AttentionStore) go through ``device_mover.DeviceStorageMover`` instead.

One storage object is one block of one rank for all layers of one cache group, keyed
``{namespace}/{block hash}/{rank}/{tag}``; which objects a task moves is ``block_objects``'s (a
sliding window's read only at the end of a run, a request's state once per write).  The bytes move
**staged** (the default: through registered staging buffers, so a backend call that outlives its
task touches only its buffer; a write runs under the task's ``CommitLease``; a late commit of a
backend that cannot refuse one stores the snapshot only and answers ``Outcome.still_storing``;
the file store is read in cache-sized pieces scattered under a ``ScatterLease``) or **direct**
(opt-in: the backend gathers and scatters the device blocks itself; a call past its deadline
keeps its blocks, ``released=False``, and later transfers stage).  docs/storage.md has the whole
story and the deviation from DESIGN §3.8 it makes for late commits.

Writes are write-through and skip the leading blocks already stored.  Reads load the leading run
of blocks present and intact for every group, then the windowed and state groups' objects of the
run's end; a run whose window or state was never stored is cut back to one whose was.  Every
backend call runs on a per-direction I/O thread with a bounded backlog; a call whose deadline
passed before it started never starts, and a full backlog or no free staging buffer fails the
chunk at once with a log line: a stuck backend shows as failed tasks, never as growth or a hang.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

import ops
from ops.platform import Platform
from transfer_factory.keys import Namespace
from transfer_factory.kvcache_storage import CommitLease, KVCacheStorage, StorageAccess, commit_lease

from cache_manager.cache_tasks import Outcome, ReadStorageTask, WriteStorageTask
from cache_manager.storage.block_objects import BlockObjects, ObjectGroup
from cache_manager.storage.io_threads import (IO_BACKLOG, ClosesOffThread, IOThread, ScatterLease, StorageBusy,
                         begin_task_stats,
                         check_block_ids, current_task_stats, leading, read_span, start_call,
                         wait_call)
from cache_manager.storage.staging import StagingBuffer, StagingBuffers
from cache_manager.storage.transfer_modes import resolve_transfer
from cache_manager.storage.write_leases import WriteLeases

STAGING_BUFFERS = 2  # per direction: one for the task at hand, one held by a call that outlived its task


@dataclass
class _Chunk:
    """What one chunk of a task achieved."""

    blocks: int = 0
    still_running: Future | None = None  # a direct call past the deadline: it still touches the blocks
    still_storing: Future | None = None  # a staged write past the deadline that may still commit (its snapshot)


class StorageMover(ClosesOffThread):
    def __init__(self, platform: Platform, backend: KVCacheStorage, groups: Sequence[tuple[str, list[Any]]],
                 namespace: Namespace, rank: int, max_blocks: int, transfer: str, log: logging.Logger,
                 staging_buffers: int = STAGING_BUFFERS, io_backlog: int = IO_BACKLOG):
        path = resolve_transfer(transfer, backend, platform)
        self.platform = platform
        self.backend = backend
        self.namespace = namespace
        self.rank = rank
        self.max_blocks = max_blocks
        self.log = log
        made = []
        for tag, tensors, *more in groups:  # tag: the storage key's kind; then its window and per_request
            t = tensors[0]
            block_bytes = int(np.prod(t.shape[1:])) * t.element_size()
            made.append(ObjectGroup(tag, tensors, block_bytes, [int(x.data_ptr()) for x in tensors], *more))
        self.objects = BlockObjects(made)
        self.groups = self.objects.groups
        # valid in every layer: the blocks, and the state slots of the state groups
        self.device_blocks = min(int(t.shape[0]) for g in self.groups if not g.per_request for t in g.tensors)
        self.state_slots = min((int(t.shape[0]) for g in self.groups if g.per_request for t in g.tensors), default=0)
        if backend.access != StorageAccess.HOST_STAGED:
            raise ValueError(f"{backend.name} moves device blocks itself: it needs a DeviceStorageMover")
        self.direct = path == "direct"
        # A backend whose calls busy-wait (Mooncake) has its calling threads yield the CPU to the
        # threads that move the bytes (io_nice, see storage_io.IOThread).
        nice = int(getattr(backend, "io_nice", 0) or 0)
        self._io = {d: IOThread(f"storage-{d}-io", io_backlog, nice) for d in ("read", "write")}
        self._leases = WriteLeases(bool(getattr(backend, "honours_commit_lease", False)), backend.name, log)
        if self.direct:
            for g in self.groups:
                for t in g.tensors:
                    backend.register_buffer(int(t.data_ptr()), int(np.prod(t.shape)) * t.element_size())
        # Backends that copy through the CPU (the file store) read a staged chunk in pieces that
        # are scattered while still in cache; a backend whose every call is a round trip reads a
        # chunk in one call.
        piece = int(getattr(backend, "staged_read_piece_bytes", 0) or 0)
        self._piece_blocks = max(1, piece // self._block_bytes()) if piece and platform.copies_cannot_stall else 0
        self._staging = StagingBuffers(platform, backend, [g.tensors for g in self.groups],
                                       [g.object_bytes for g in self.groups], max_blocks, staging_buffers,
                                       self.objects.staging_slots(max_blocks))
        if not self.direct:
            self._staging.prepare()
            self._staging.register_all()
        log.info("storage: backend %s, %s path, namespace %s", backend.name, "direct" if self.direct else "staged",
                 namespace)

    def _fall_back_to_staging(self) -> None:
        """A direct call outlived its task: stage every later transfer.  The buffers are set up
        here, on the task's thread, and registered by the I/O thread when it gets to them."""
        if not self.direct:
            return
        try:
            self._staging.prepare()
        except Exception as exc:
            self.log.error("cannot set up staging buffers (%s): storage stays on the direct path", exc)
            return
        self.direct = False
        self.log.error("a direct storage call outlived its task: this rank now stages every transfer")

    # ------------------------------------------------------------------ helpers
    def _all_keys(self, hashes: Sequence[str], mask: np.ndarray | None = None) -> list[str]:
        return self.objects.keys(self.namespace, self.rank, hashes, mask)

    def _start(self, direction: str, fn: Callable[[], Any], deadline: float, what: str) -> Future | None:
        return start_call(self._io[direction], fn, deadline, what, self.log)

    def _wait(self, future: Future, deadline: float, what: str) -> tuple[Any, bool]:
        return wait_call(future, deadline, what, self.backend.name, self.log)

    def _present(self, hashes: Sequence[str], deadline: float, direction: str, mask: np.ndarray | None) -> int:
        """Leading blocks present for every group (one batched call for all groups)."""
        def count() -> int:
            found = self.backend.exists(self._all_keys(hashes, mask))
            return leading(self.objects.per_block([f == 1 for f in found], len(hashes), mask))

        future = self._start(direction, count, deadline, "query")
        if future is None:
            return 0
        n, _ = self._wait(future, deadline, "query")
        return int(n) if n is not None else 0

    def _block_bytes(self) -> int:
        return sum(g.object_bytes for g in self.groups if not g.per_request)

    # ------------------------------------------------------------------ write
    def write(self, task: WriteStorageTask, deadline: float | None = None) -> Outcome:
        """Store the blocks; the value is the gpu ids of the leading run now stored."""
        deadline = time.monotonic() + task.timeout if deadline is None else deadline
        stats = begin_task_stats()
        check_block_ids(task.gpu_block_ids, task.keys, self.device_blocks, "write")
        state = self._check_state(task.state_slot)
        n = len(task.keys)
        stored = self._present(task.keys, deadline, "write", self.objects.write_mask(0, n, n, state))
        total, written, chunk = stored, 0, _Chunk()
        for start in range(stored, n, self.max_blocks):
            if time.monotonic() >= deadline:
                break
            end = min(start + self.max_blocks, n)
            mask = self.objects.write_mask(start, end - start, n, state)
            chunk = self._write_chunk(task.keys[start:end], task.gpu_block_ids[start:end], deadline, mask, state)
            total += chunk.blocks
            written += self.objects.nbytes(mask, chunk.blocks)
            if chunk.blocks < end - start:
                break
        return Outcome(list(task.gpu_block_ids[:total]), written, chunk.still_running,
                       stats.calls, stats.failures, still_storing=chunk.still_storing)

    def _check_state(self, slot: int | None) -> int | None:
        if slot is not None and not self.state_slots:
            raise ValueError(f"state_slot {slot}: this cache layout has no state group")
        if slot is not None and slot >= self.state_slots:
            raise ValueError(f"state_slot {slot} is out of range [0, {self.state_slots})")
        return slot

    def _write_chunk(self, hashes: Sequence[str], gpu_ids: Sequence[int], deadline: float,
                     mask: np.ndarray | None, state: int | None = None) -> _Chunk:
        keys = self._all_keys(hashes, mask)
        what = f"write of {len(hashes)} blocks"
        if self.direct:
            ptrs, sizes = self.objects.direct(gpu_ids, mask, state)
            future = self._start("write", lambda: self.backend.batch_set_multi(keys, ptrs, sizes), deadline, what)
            return self._finish_direct(future, deadline, what, lambda res: [r == 0 for r in res], len(hashes), mask)
        try:
            buf = self._staging.take("write")
        except StorageBusy as exc:
            self.log.error("storage %s not started: %s", what, exc)
            return _Chunk()
        try:
            # The snapshot is taken here, while the task is live; the I/O thread only reads it.
            for column, plan in enumerate(buf.plans):
                rows, slots = self.objects.rows(column, gpu_ids, state), self.objects.slots(column, len(gpu_ids))
                if mask is not None:
                    on = np.flatnonzero(mask[:, column])
                    rows, slots = [rows[i] for i in on], [slots[i] for i in on]
                if rows:
                    self.platform.run_plan(plan, rows, slots, ops.DEVICE_TO_HOST)
        except BaseException:
            self._staging.give_back("write", buf)
            raise
        ptrs, sizes = self.objects.staged(buf.ptrs, len(gpu_ids), mask)
        lease = CommitLease(deadline)

        def job() -> list[int]:
            self._staging.register(buf)
            with commit_lease(lease):
                return self.backend.batch_set(keys, ptrs, sizes)

        future = self._start("write", job, deadline, what)
        if future is None:
            self._staging.give_back("write", buf)
            return _Chunk()
        self._leases.track(lease, future)
        future.add_done_callback(lambda _f: self._staging.give_back("write", buf))  # also on cancel
        res, running = self._wait(future, deadline, what)
        if running:  # it reads only its own snapshot: the device blocks are free whatever it does
            return _Chunk(still_storing=self._leases.late(future, lease, what))
        if res is None:
            return _Chunk()
        return _Chunk(leading(self.objects.per_block([r == 0 for r in res], len(hashes), mask)))

    def _finish_direct(self, future: Future | None, deadline: float, what: str,
                       ok: Callable[[list[int]], list[bool]], n: int, mask: np.ndarray | None) -> _Chunk:
        if future is None:
            return _Chunk()
        res, running = self._wait(future, deadline, what)
        if running:
            self._fall_back_to_staging()
            return _Chunk(still_running=future)
        if res is None:
            return _Chunk()
        return _Chunk(leading(self.objects.per_block(ok(res), n, mask)))

    # ------------------------------------------------------------------ read
    def read(self, task: ReadStorageTask, deadline: float | None = None) -> Outcome:
        """Load the leading run of present blocks; the value is their gpu ids."""
        deadline = time.monotonic() + task.timeout if deadline is None else deadline
        stats = begin_task_stats()
        hashes = read_span(task.keys, task.start_read_block_idx)
        check_block_ids(task.gpu_block_ids, hashes, self.device_blocks, "read")
        state = self._check_state(task.state_slot)
        # No exists() first: a get of an absent object is a miss as cheap as asking, and asking
        # cost every read one more backend round trip.  The first short chunk ends the read.
        loaded, late = 0, None
        for start in range(0, len(hashes), self.max_blocks):
            if time.monotonic() >= deadline:
                break
            end = min(start + self.max_blocks, len(hashes))
            chunk = self._read_chunk(hashes[start:end], task.gpu_block_ids[start:end], deadline,
                                     self.objects.without_windows(end - start))
            loaded += chunk.blocks
            late = chunk.still_running
            if chunk.blocks < end - start:
                break
        moved = self.objects.nbytes(self.objects.without_windows(loaded), loaded)
        if loaded and self.objects.windowed and late is None:
            loaded, window_bytes = self._read_windows(hashes[:loaded], task.gpu_block_ids[:loaded], deadline, state)
            moved += window_bytes
        return Outcome(list(task.gpu_block_ids[:loaded]), moved, late, stats.calls, stats.failures)

    def _read_windows(self, hashes: Sequence[str], gpu_ids: Sequence[int], deadline: float,
                      state: int | None) -> tuple[int, int]:
        """The windowed groups' objects of the run's last blocks, and the state groups' of its last
        block into the state slot: (the run they complete, bytes).  A run whose window was never
        stored (it ended inside a longer write) is cut back to the longest one whose window was; 0
        when there is none."""
        end = len(hashes)
        if not self.objects.window_mask(1, state).any():  # no window to load (state groups, no slot)
            return end, 0
        for attempt in range(2):
            need = self.objects.window_mask(end, state)
            first = int(np.flatnonzero(need.any(axis=1))[0]) if need.any() else end
            mask = need[first:]
            if self._read_chunk(hashes[first:end], gpu_ids[first:end], deadline, mask,
                                state).blocks == end - first:
                return end, self.objects.nbytes(mask, end - first)
            if attempt:
                break
            everywhere = np.broadcast_to(~self.objects.without_windows(1)[0], (end, len(self.groups))).copy()
            future = self._start("read", lambda: self.backend.exists(self._all_keys(hashes[:end], everywhere)),
                                 deadline, "window query")
            found, _ = self._wait(future, deadline, "window query") if future is not None else (None, False)
            if found is None:
                break
            end = self.objects.window_end(self.objects.per_group([f == 1 for f in found], everywhere), end, state)
            if end == 0:
                break
        return 0, 0

    def _read_chunk(self, hashes: Sequence[str], gpu_ids: Sequence[int], deadline: float,
                    mask: np.ndarray | None, state: int | None = None) -> _Chunk:
        keys = self._all_keys(hashes, mask)
        what = f"read of {len(hashes)} blocks"
        want = self.objects.sizes(len(hashes), mask)
        full = lambda res: (np.array(res, dtype=np.int64) == want).tolist()  # noqa: E731
        if self.direct:
            ptrs, sizes = self.objects.direct(gpu_ids, mask, state)
            future = self._start("read", lambda: self.backend.batch_get_multi(keys, ptrs, sizes), deadline, what)
            return self._finish_direct(future, deadline, what, full, len(hashes), mask)
        try:
            buf = self._staging.take("read")
        except StorageBusy as exc:
            self.log.error("storage %s not started: %s", what, exc)
            return _Chunk()
        uniform = mask is None or bool((mask == mask[:1]).all())  # pieces need as many objects per block
        if uniform and self._piece_blocks and len(gpu_ids) > self._piece_blocks:  # one piece would gain nothing
            return self._read_pieces(buf, keys, gpu_ids, deadline, what, mask)
        ptrs, sizes = self.objects.staged(buf.ptrs, len(gpu_ids), mask)

        def job() -> list[int]:
            self._staging.register(buf)
            return self.backend.batch_get(keys, ptrs, sizes)

        future = self._start("read", job, deadline, what)
        if future is None:
            self._staging.give_back("read", buf)
            return _Chunk()
        res, running = self._wait(future, deadline, what)
        if running:  # the buffer comes back when the call does
            future.add_done_callback(lambda _f: self._staging.give_back("read", buf))
            return _Chunk()
        try:
            loaded = leading(self.objects.per_block(full(res), len(hashes), mask)) if res is not None else 0
            if loaded and time.monotonic() >= deadline:
                self.log.error("storage %s finished after its deadline: nothing scattered", what)
                loaded = 0
            if loaded:  # only the good prefix, only in time
                self._scatter(buf, gpu_ids[:loaded], range(loaded), mask=mask, state=state)
        finally:
            self._staging.give_back("read", buf)
        return _Chunk(loaded)

    def _scatter(self, buf: StagingBuffer, gpu_ids: Sequence[int], slots: Sequence[int], bulk: bool = False,
                 mask: np.ndarray | None = None, state: int | None = None) -> None:
        """Staging slots ``slots`` into device blocks ``gpu_ids`` (a state group: the state slot),
        each group where ``mask`` (rows of the slots) asked for it."""
        for column, plan in enumerate(buf.plans):
            ids = self.objects.rows(column, gpu_ids, state)
            at = [0] * len(ids) if self.groups[column].per_request else list(slots)
            if mask is not None:
                on = np.flatnonzero(mask[:len(ids), column])
                ids, at = [ids[i] for i in on], [at[i] for i in on]
            if ids:
                self.platform.run_plan(plan, ids, at, ops.HOST_TO_DEVICE, bulk=bulk)

    def _read_pieces(self, buf: StagingBuffer, keys: list[str], gpu_ids: Sequence[int], deadline: float,
                     what: str, mask: np.ndarray | None) -> _Chunk:
        """A staged read in pieces that stay in the CPU cache: the I/O thread reads a piece into
        the first slots of the staging buffer and scatters it at once, under a lease the task
        revokes before it answers.  The bytes then cross main memory once each way, as a raw
        read's do, instead of three times (read, checksum, scatter of the whole chunk).  Only
        on platforms whose copies cannot stall: revoking waits for a scatter in progress."""
        lease = ScatterLease(deadline)
        kinds = len(self.groups) if mask is None else int(mask[0].sum())  # objects per block (uniform)
        step = self._piece_blocks
        ptrs, sizes = self.objects.staged(buf.ptrs, min(step, len(gpu_ids)), None if mask is None else mask[:step])

        def job() -> tuple[int, int]:
            self._staging.register(buf)
            loaded = calls = 0
            for start in range(0, len(gpu_ids), step):
                n = min(step, len(gpu_ids) - start)
                res = self.backend.batch_get(keys[start * kinds:(start + n) * kinds], ptrs[:n * kinds],
                                             sizes[:n * kinds])
                calls += 1
                piece_mask = None if mask is None else mask[:n]
                good = leading(self.objects.per_block([r == size for r, size in zip(res, sizes)], n, piece_mask))
                piece = gpu_ids[start:start + good]
                if good and not lease.run(lambda: self._scatter(buf, piece, range(len(piece)), True, piece_mask)):
                    break
                loaded += good
                if good < n:
                    break
            return loaded, calls

        future = self._start("read", job, deadline, what)
        if future is None:
            self._staging.give_back("read", buf)
            return _Chunk()
        res, running = self._wait(future, deadline, what)
        lease.revoke()  # from here on the job scatters nothing: the task may answer
        if running:
            future.add_done_callback(lambda _f: self._staging.give_back("read", buf))
            return _Chunk()
        self._staging.give_back("read", buf)
        if res is None:
            return _Chunk()
        loaded, calls = res
        current_task_stats().calls += calls - 1
        return _Chunk(loaded)

    # ------------------------------------------------------------------ close (ClosesOffThread)
    def _before_close(self) -> None:
        """A write call still running commits nothing from now on (the RL clear, the CTM's exit)."""
        self._leases.revoke_all()

    def _free_buffers(self) -> None:
        self._staging.free_all()                  # idempotent
